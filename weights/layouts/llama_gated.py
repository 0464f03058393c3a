"""hf-llama's gated and k = v decoders: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (an output gate packed in q_proj), Gemma 4
(keys and values from one projection on its global layers, a weightless value norm, proportional RoPE,
per-layer head sizes): their config.json reader and table rows. llama.py dispatches these model types here.

| model_type           | foreign key (layers.{L}.self_attn.)  | canonical                          | form   |
|----------------------|--------------------------------------|------------------------------------|--------|
| qwen3_next, qwen3_5, | q_proj.weight (N*2H, D): per head    | query.kernel + gate.kernel, head   | linear |
| qwen3_5_moe          | [query | gate]; q_proj.bias likewise | by head; query.bias + gate.bias    |        |
| gemma4, global layer | k_proj.weight (K*H, D), no v_proj    | key.kernel, and value.kernel as    | linear |
| with attention_k_eq_v|                                      | its copy (biases likewise)         |        |

Qwen3.5's (and Qwen3.5-MoE's) full-attention layers turn by multimodal RoPE: rope.mrope_section from its rope_parameters (default
11, 11, 10), always interleaved, as Qwen3-VL's (_qwen3_5_sections); Qwen3-Next's by plain RoPE.

The other rows are hf-llama's (k_proj, v_proj, o_proj, q_norm, k_norm). Qwen's norms multiply by (1 + w)
(Gemma's norm_offset); Gemma 4's multiply by w itself. Qwen's linear-attention layers (Gated DeltaNet)
and Gemma 4's layers that reuse an earlier layer's keys and values (num_kv_shared_layers) have no
softmax attention of their own: refused, naming the layer. Writing a Gemma 4 k = v layer needs its
value.kernel equal to key.kernel (it is stored once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .hf_rope import _hf_rope
from .table import LINEAR, R, Table, Tie

TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "gemma4", "gemma4_text")
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma4": "gemma4_text"}  # multimodal config -> its text_config's type

# What transformers reads when config.json leaves a field out: the config classes' defaults
# (configuration_qwen3_next.py, configuration_qwen3_5.py, configuration_qwen3_5_moe.py, configuration_gemma4.py,
# 5.23).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_next": {"head_dim": 256, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "attention_bias": False,
                   "partial_rotary_factor": 0.25},
    "qwen3_5_text": {"head_dim": 256, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "attention_bias": False,
                     "partial_rotary_factor": 0.25},
    "qwen3_5_moe_text": {"head_dim": 256, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "attention_bias": False,
                         "partial_rotary_factor": 0.25},
    "gemma4_text": {"head_dim": 256, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "attention_bias": False,
                    "sliding_window": 512, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                           "rope_theta": 1_000_000.0}}},
}


def tables(ties: tuple[Tie, ...]) -> dict[str, Table]:
    """The two tables these models add to hf-llama's, by the name layer_facts answers in "table"."""
    gated = Table((
        R("q_proj.weight", "query.kernel gate.kernel", LINEAR, head_major=True),  # (N*(H+V), D)
        R("q_proj.bias", "query.bias gate.bias", LINEAR, head_major=True),
        R("k_proj.weight", "key.kernel", LINEAR), R("k_proj.bias", "key.bias", LINEAR),
        R("v_proj.weight", "value.kernel", LINEAR), R("v_proj.bias", "value.bias", LINEAR),
        R("o_proj.weight", "output.kernel", LINEAR), R("o_proj.bias", "output.bias", LINEAR),
    ), ties=ties, when=lambda c: c.output_gate is not None and c.output_gate.scope == "element",
        note="qwen3_next, qwen3_5: q_proj holds each head's query, then its gate")
    k_eq_v = Table((
        R("q_proj.weight", "query.kernel", LINEAR), R("q_proj.bias", "query.bias", LINEAR),
        R("k_proj.weight", "key.kernel", LINEAR), R("k_proj.bias", "key.bias", LINEAR),
        R("o_proj.weight", "output.kernel", LINEAR), R("o_proj.bias", "output.bias", LINEAR),
    ), ties=ties, shared=(("value.kernel", "key.kernel"), ("value.bias", "key.bias")),
        note="gemma4 attention_k_eq_v: k_proj gives the keys and the values")
    return {"gated": gated, "k_eq_v": k_eq_v}


def layer_facts(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of a Qwen3-Next / Qwen3.5 / Gemma 4 decoder -> block `layer`'s facts, as llama.py's
    reader answers them ("table": None for hf-llama's plain table, else a name of tables())."""
    model_type = cfg.get("model_type")
    if model_type in _WRAPPERS:
        if not isinstance(cfg.get("text_config"), Mapping):
            raise ValueError(f"hf_config: model_type {model_type!r} keeps its language model in text_config: "
                             f"got text_config={cfg.get('text_config')!r}")
        model_type = _WRAPPERS[model_type]
        cfg = {**cfg["text_config"], "model_type": model_type}
    cfg = {**_DEFAULTS[model_type], **cfg}
    layer = 0 if layer is None else layer
    for name in ("num_attention_heads", "hidden_size"):
        if not isinstance(cfg.get(name), int):
            raise ValueError(f"hf_config: {model_type} needs {name}: got {cfg.get(name)!r}")
    layer_type = _layer_type(cfg, model_type, layer)
    if model_type == "gemma4_text":
        return _gemma4(cfg, layer, layer_type)
    if layer_type != "full_attention":
        raise ValueError(f"hf_config: layer {layer} of {model_type} is {layer_type!r} (not softmax attention): "
                         "hf-llama converts its full_attention layers")
    head_dim, eps = cfg["head_dim"], float(cfg["rms_norm_eps"])
    rope = _hf_rope(cfg, layer_type, head_dim)
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text"):  # Qwen3_5(Moe)TextRotaryEmbedding: multimodal, interleaved
        rope = {**rope, "mrope_section": _qwen3_5_sections(cfg, rope["rotary_dim"]), "mrope_interleaved": True}
    modern = {
        "rope": rope,
        "qk_norm": {"type": "rms", "eps": eps, "scope": "head"},
        # modeling_qwen3_next.py: attn_output * sigmoid(gate), the gate from q_proj (its bias included)
        "output_gate": {"scope": "element", "bias": bool(cfg["attention_bias"])},
    }
    return _facts(cfg, model_type, head_dim, cfg["num_key_value_heads"], modern, scale=None, norm_offset=1.0,
                  table="gated")  # Qwen3NextRMSNorm multiplies by (1 + weight)


def _qwen3_5_sections(cfg: Mapping[str, Any], rotary_dim: int) -> list[int]:
    """Qwen3.5's mrope_section as the sections its rotary embedding reaches over rotary_dim / 2 pairs.
    Qwen3_5TextRotaryEmbedding (modeling_qwen3_5.py, 5.23) reads rope_parameters.get("mrope_section",
    [11, 11, 10]) and always interleaves (mrope_interleaved is not read): pair i turns by the height position
    where i % 3 == 1 and i < 3 h, by the width where i % 3 == 2 and i < 3 w, by the temporal one otherwise.
    The temporal section itself is never read, and pairs past rotary_dim / 2 do not exist, so the sections
    written are (the rest, the height pairs, the width pairs) that this rule turns: [11, 11, 10] on 32 pairs
    (Qwen3.5's head_dim 256 x 0.25) as written, [1, 1, 0] on 2 pairs."""
    params = cfg.get("rope_parameters")
    params = params if isinstance(params, Mapping) else (cfg.get("rope_scaling") or {})  # the older name, as _hf_rope
    section = params.get("mrope_section", [11, 11, 10])
    if (not isinstance(section, Sequence) or isinstance(section, str) or len(section) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in section)):
        raise ValueError(f"hf_config: qwen3_5 mrope_section must be 3 integers >= 0: got {section!r}")
    pairs = rotary_dim // 2
    height = len(range(1, min(3 * section[1], pairs), 3))
    width = len(range(2, min(3 * section[2], pairs), 3))
    return [pairs - height - width, height, width]


def _layer_type(cfg: Mapping[str, Any], model_type: str, layer: int) -> str:
    """config.json's layer_types[layer], or the config class's rule when it has none."""
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, Sequence) and not isinstance(layer_types, str):
        if layer >= len(layer_types):
            raise ValueError(f"layer={layer} is past config.json's {len(layer_types)} layer_types")
        return layer_types[layer]
    if model_type == "gemma4_text":  # five sliding layers, then a global one; the last layer always global
        last = cfg.get("num_hidden_layers")
        return "full_attention" if (layer + 1) % 6 == 0 or layer + 1 == last else "sliding_attention"
    interval = cfg.get("full_attention_interval", 4)  # Qwen: three linear-attention layers, then a full one
    return "full_attention" if (layer + 1) % interval == 0 else "linear_attention"


def _shares_kv(cfg: Mapping[str, Any], layer_type: str) -> bool:
    """Gemma4TextAttention: v_proj is None and the values are k_proj's output where attention_k_eq_v
    and the layer is not a sliding one."""
    return bool(cfg["attention_k_eq_v"]) and layer_type != "sliding_attention"


def _gemma4_layer(cfg: Mapping[str, Any], layer: int, layer_type: str) -> Mapping[str, Any]:
    """cfg with block `layer`'s overrides: per_layer_config (5.x writes it), else what
    Gemma4TextConfig.__post_init__ builds it from: global_head_dim and num_global_key_value_heads."""
    overrides = cfg.get("per_layer_config")
    if isinstance(overrides, Mapping):  # 5.23 zero-pads the keys ("05" beside "29") and reads them with int()
        mine = [value for key, value in overrides.items() if int(key) == layer]
        return {**cfg, **(mine[0] if mine else {})}
    if layer_type != "full_attention":
        return cfg
    out = {**cfg, "head_dim": cfg.get("global_head_dim", 512)}
    if cfg["attention_k_eq_v"] and cfg.get("num_global_key_value_heads") is not None:
        out["num_key_value_heads"] = cfg["num_global_key_value_heads"]
    return out


def _gemma4(cfg: Mapping[str, Any], layer: int, layer_type: str) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("hf_config: gemma4_text with use_bidirectional_attention='all' is not causal: hf-llama "
                         "converts causal decoders")
    shared_from = (cfg.get("num_hidden_layers") or 0) - int(cfg["num_kv_shared_layers"] or 0)
    if cfg["num_kv_shared_layers"] and layer >= shared_from:  # Gemma4TextConfig.kv_sharing_modes: "reuse"
        raise ValueError(f"hf_config: layer {layer} of gemma4_text reuses an earlier layer's keys and values "
                         f"(num_kv_shared_layers={cfg['num_kv_shared_layers']}: layers {shared_from} on have no "
                         "k_proj, v_proj): not a block of its own")
    if layer_type not in ("full_attention", "sliding_attention"):
        raise ValueError(f"hf_config: layer {layer} of gemma4_text is {layer_type!r}: expected full_attention "
                         "or sliding_attention")
    cfg = _gemma4_layer(cfg, layer, layer_type)
    head_dim, eps = cfg["head_dim"], float(cfg["rms_norm_eps"])
    window = cfg["sliding_window"] if layer_type == "sliding_attention" else None
    modern = {
        "rope": _gemma4_rope(cfg, layer_type, head_dim),
        "window_left": int(window) - 1 if window else -1,  # W keys with the query itself, as llama.py's
        "qk_norm": {"type": "rms", "eps": eps, "scope": "head"},
        "value_norm": {"type": "rms", "eps": eps, "scope": "head", "weight": False},  # v_norm: with_scale=False
    }
    # Gemma4TextAttention: scaling = 1.0 (the query norm sets the logits' size); Gemma4RMSNorm multiplies by w
    return _facts(cfg, "gemma4_text", head_dim, cfg["num_key_value_heads"], modern, scale=1.0, norm_offset=0.0,
                  table="k_eq_v" if _shares_kv(cfg, layer_type) else None)


def _gemma4_rope(cfg: Mapping[str, Any], layer_type: str, head_dim: int) -> dict[str, Any]:
    """Gemma 4's rope_parameters[layer_type]; "proportional" (modeling_rope_utils.py's
    _compute_proportional_rope_parameters): the pairs span the whole head, the first
    int(partial_rotary_factor * head_dim // 2) turn."""
    params = (cfg.get("rope_parameters") or {}).get(layer_type) or {}
    if params.get("rope_type") != "proportional":
        return _hf_rope(cfg, layer_type, head_dim)
    return {"theta": float(params["rope_theta"]), "rotary_dim": head_dim, "interleaved": False,
            "scaling": {"type": "proportional", "partial_rotary_factor": params.get("partial_rotary_factor", 1.0),
                        "factor": params.get("factor", 1.0)}}


def _facts(cfg: Mapping[str, Any], model_type: str, head_dim: int, kv_heads: int, modern: dict[str, Any], *,
           scale: float | None, norm_offset: float, table: str | None) -> dict[str, Any]:
    return {"num_heads": cfg["num_attention_heads"], "num_kv_heads": kv_heads, "head_dim": head_dim,
            "hidden": cfg["hidden_size"], "dropout": cfg.get("attention_dropout"), "scale": scale,
            "scale_by_layer": False, "modern": modern, "norm_offset": norm_offset, "table": table,
            "model_type": model_type}
