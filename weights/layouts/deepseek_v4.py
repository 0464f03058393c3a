"""DeepSeek V4's attention (transformers' deepseek_v4, 5.23.0) read into the contract's config.compressed layer.

v4_config(hf_config, layer) gives one layer's AttentionConfig; v4_tensors(config, state, prefix) its canonical
tensors from a state dict (the layer's `self_attn.` module names); read_v4 is the hf-deepseek layout's reader of a
deepseek_v4 checkpoint (weights.layouts.to_canonical("hf-deepseek", state, hf_config=..., layer=...)). Writing
one back (from_canonical) is not done yet (issue 41); docs/spec-frontier.md#deepseek-v4 names each source line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from weights.config import AttentionConfig
from weights.format import WeightsFormatError, validate_tensors

# transformers' layer_types -> Compressed.kind (configuration_deepseek_v4.py:21-25)
V4_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
            "heavily_compressed_attention": "hca"}


def _rope(cfg: Mapping[str, Any], table: str, rotary_dim: int) -> dict[str, Any]:
    """config.rope from rope_parameters[table] ("main" for sliding layers, "compress" for csa / hca:
    modeling_deepseek_v4.py:788). YaRN's truncate is read from the table itself; transformers reads it from the
    top-level dict (modeling_rope_utils.py:475), so a table that sets it false is refused (the two disagree)."""
    params = (cfg.get("rope_parameters") or {}).get(table)
    if not isinstance(params, Mapping):
        raise ValueError(f"hf_config: rope_parameters.{table} must be an object (transformers' DeepseekV4Config "
                         f"nests main / compress): got {params!r}")
    rope: dict[str, Any] = {"theta": float(params["rope_theta"]), "rotary_dim": rotary_dim, "interleaved": True}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "yarn":
        if params.get("truncate", True) is not True:
            raise ValueError(f"hf_config: rope_parameters.{table}.truncate must be true or absent: transformers reads "
                             f"truncate from the top-level rope_parameters (modeling_rope_utils.py:475), not from the "
                             f"{table} table, so it computes with true: got {params['truncate']!r}")
        rope["scaling"] = {"type": "yarn", "factor": params["factor"],
                           "original_max_position_embeddings": params["original_max_position_embeddings"],
                           "beta_fast": params.get("beta_fast") or 32.0, "beta_slow": params.get("beta_slow") or 1.0,
                           # configuration_deepseek_v4.py:318-319 forces 1.0 where the config has none
                           "attention_factor": params.get("attention_factor", 1.0)}
    elif kind != "default":
        raise ValueError(f"hf_config: rope_parameters.{table}.rope_type must be default or yarn for deepseek_v4: "
                         f"got {kind!r}")
    return rope


def v4_config(cfg: Mapping[str, Any], layer: int) -> AttentionConfig:
    """Layer `layer`'s attention of a deepseek_v4 config.json (or DeepseekV4Config.to_dict())."""
    if cfg.get("model_type") != "deepseek_v4":
        raise ValueError(f"hf_config: model_type must be deepseek_v4: got {cfg.get('model_type')!r}")
    if cfg.get("attention_bias"):
        raise ValueError("hf_config: attention_bias must be false for deepseek_v4 (its projections have no bias): "
                         "got true")
    layer_type = cfg["layer_types"][layer]
    if layer_type not in V4_KINDS:
        raise ValueError(f"hf_config: layer_types[{layer}] must be one of {', '.join(V4_KINDS)}: got {layer_type!r}")
    kind = V4_KINDS[layer_type]
    head_dim = cfg["head_dim"]
    rotary_dim = int(head_dim * cfg["partial_rotary_factor"])  # configuration_deepseek_v4.py:291
    compressed: dict[str, Any] = {"kind": kind, "query_rank": cfg["q_lora_rank"], "output_groups": cfg["o_groups"],
                                  "output_rank": cfg["o_lora_rank"], "eps": cfg["rms_norm_eps"]}
    if kind != "sliding":
        compressed.update(ratio=cfg["compress_rates"][layer_type], overlap=kind == "csa")
    if kind == "csa":
        compressed.update(index_heads=cfg["index_n_heads"], index_head_dim=cfg["index_head_dim"],
                          index_topk=cfg["index_topk"])
    return AttentionConfig(
        num_heads=cfg["num_attention_heads"], query_dim=cfg["hidden_size"], head_dim=head_dim, num_kv_heads=1,
        use_query_bias=False, use_key_bias=False, use_value_bias=False, use_output_bias=False, use_sinks=True,
        window_left=cfg["sliding_window"] - 1, rope=_rope(cfg, "main" if kind == "sliding" else "compress", rotary_dim),
        compressed=compressed)


def v4_tensors(config: AttentionConfig, state: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """The canonical tensors of one V4 attention from a state dict (arrays or tensors with .numpy()) whose
    keys are `prefix` + transformers' module names (q_a_proj.weight, ...). nn.Linear weights are (out, in):
    the kernels are their transposes."""
    def get(name):
        value = state[prefix + name]
        value = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
        return value

    c, N, H, D = config.compressed, config.num_heads, config.head_dim, config.query_dim
    G, R, Qr = c.output_groups, c.output_rank, c.query_rank
    t = {"query.down.kernel": get("q_a_proj.weight").T, "query.down.norm.scale": get("q_a_norm.weight"),
         "query.kernel": get("q_b_proj.weight").T.reshape(Qr, N, H),
         "key.kernel": get("kv_proj.weight").T.reshape(D, 1, H), "key.norm.scale": get("kv_norm.weight"),
         # o_a_proj.weight (G*R, N*H/G) is G blocks of (R, N*H/G) (DeepseekV4GroupedLinear, :340)
         "output.group.kernel": get("o_a_proj.weight").reshape(G, R, N * H // G).transpose(0, 2, 1),
         "output.kernel": get("o_b_proj.weight").T, "sinks": get("sinks")}
    modules = [("compressor", "compressor.")] + ([("indexer.compressor", "compressor.indexer.")]
                                                 if c.kind == "csa" else [])
    if c.kind != "sliding":
        for ours, theirs in modules:
            t.update({f"{ours}.kernel": get(theirs + "kv_proj.weight").T,
                      f"{ours}.gate.kernel": get(theirs + "gate_proj.weight").T,
                      f"{ours}.position_bias": get(theirs + "position_bias"),
                      f"{ours}.norm.scale": get(theirs + "kv_norm.weight")})
    if c.kind == "csa":
        t["indexer.query.kernel"] = get("compressor.indexer.q_b_proj.weight").T.reshape(Qr, c.index_heads,
                                                                                      c.index_head_dim)
        t["indexer.weights.kernel"] = get("compressor.indexer.scorer.weights_proj.weight").T
    return {name: np.ascontiguousarray(value) for name, value in t.items()}


def v4_keys(config: AttentionConfig) -> list[str]:
    """The module keys (under the layer's self_attn.) that v4_tensors reads for this config."""
    keys = ["q_a_proj.weight", "q_a_norm.weight", "q_b_proj.weight", "kv_proj.weight", "kv_norm.weight",
            "o_a_proj.weight", "o_b_proj.weight", "sinks"]
    kind = config.compressed.kind
    scopes = [] if kind == "sliding" else ["compressor."] + (["compressor.indexer."] if kind == "csa" else [])
    for scope in scopes:
        keys += [f"{scope}{name}" for name in ("kv_proj.weight", "gate_proj.weight", "position_bias",
                                                "kv_norm.weight")]
    if kind == "csa":
        keys += ["compressor.indexer.q_b_proj.weight", "compressor.indexer.scorer.weights_proj.weight"]
    return keys


def read_v4(layout: str, cfg: Mapping[str, Any], state: Mapping[str, Any], base: str, layer: int):
    """(config, canonical tensors) of layer `layer` whose keys start with `base`; one WeightsFormatError lists
    every missing or unexpected key (and validate_tensors every mis-shaped one)."""
    try:
        config = v4_config(cfg, layer)
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(f"hf_config: deepseek_v4 needs {err} for layer {layer}") from None
    expected = [base + key for key in v4_keys(config)]
    problems = []
    missing = [key for key in expected if key not in state]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    unexpected = sorted(k for k in state if k.startswith(base) and k not in expected)
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected)} (config file: layer {layer} is "
                        f"{cfg['layer_types'][layer]})")
    if problems:
        raise WeightsFormatError(f"{layout}: " + "; ".join(problems))
    try:
        tensors = v4_tensors(config, state, base)
    except ValueError as err:  # a reshape of a mis-shaped weight
        raise WeightsFormatError(f"{layout}: {err}") from None
    validate_tensors(config, tensors, source=layout)
    return config, tensors
