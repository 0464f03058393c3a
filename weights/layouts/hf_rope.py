"""config.json's RoPE fields (transformers 4.x and 5.x) -> the canonical rope: hf-llama's and hf-gpt-neox's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
              "mscale", "mscale_all_dim", "truncate")


def _hf_rope(cfg: Mapping[str, Any], layer_type: str | None, head_dim: int, *, interleaved: bool = False,
             theta_key: str = "rope_theta", default_theta: float = 10000.0) -> dict[str, Any]:
    """The canonical rope of one layer from config.json: transformers 5.x's `rope_parameters` (one
    dict, or one per layer type as Gemma 3 writes it) or 4.x's `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and layer_type in params and isinstance(params[layer_type], Mapping):
        params = params[layer_type]
    if not isinstance(params, Mapping):  # 4.x
        params = dict(cfg.get("rope_scaling") or {})
        theta = cfg.get(theta_key, default_theta)
        if layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
            # Gemma 3 (4.x): sliding layers rotate with the local base and without the scaling
            params, theta = {}, cfg["rope_local_base_freq"]
        params["rope_theta"] = theta
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg.get(theta_key, default_theta)))
    fraction = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * fraction)  # transformers' int(head_dim * partial_rotary_factor)
    if kind == "default":
        scaling = None
    elif kind == "linear":
        scaling = {"type": "linear", "factor": params.get("factor")}
    elif kind == "llama3":
        scaling = {"type": "llama3", **{k: params.get(k) for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}}
    elif kind == "yarn":
        scaling = {"type": "yarn", **{k: params[k] for k in _YARN_KEYS if params.get(k) is not None}}
        if scaling.get("factor") is None and "original_max_position_embeddings" in scaling:
            # transformers: the context extension ratio when the factor is left out (DeepSeek-V3)
            scaling["factor"] = cfg.get("max_position_embeddings") / scaling["original_max_position_embeddings"]
        for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):  # transformers: `get(...) or default`
            scaling[key] = scaling.get(key) or default
    elif kind in ("longrope", "su"):  # "su": Phi-3's name for it before 4.x settled on longrope
        scaling = _longrope(cfg, params)
    else:
        raise ValueError(f"hf_config: rope_type={kind!r} is not expressible in the canonical config "
                         "(default, linear, llama3, yarn and longrope are)")
    return {"theta": theta, "rotary_dim": rotary_dim, "interleaved": interleaved, "scaling": scaling}


def _longrope(cfg: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE. transformers' standardize_rope_params lets a top-level
    original_max_position_embeddings (Phi-3 keeps one) win over the one inside the rope parameters; a
    missing factor is max_position_embeddings / original_max_position_embeddings, as
    _compute_longrope_parameters computes it (5.23)."""
    original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("hf_config: rope_type 'longrope' needs original_max_position_embeddings: got none")
    factor = params.get("factor")
    if factor is None:
        if not cfg.get("max_position_embeddings"):
            raise ValueError("hf_config: rope_type 'longrope' without a factor needs max_position_embeddings: got "
                             f"{cfg.get('max_position_embeddings')!r}")
        factor = cfg["max_position_embeddings"] / original
    scaling = {"type": "longrope", "factor": factor, "original_max_position_embeddings": original,
               "short_factor": params.get("short_factor"), "long_factor": params.get("long_factor")}
    if params.get("attention_factor") is not None:
        scaling["attention_factor"] = params["attention_factor"]
    return scaling
