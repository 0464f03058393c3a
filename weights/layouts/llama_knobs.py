"""hf-llama's decoders with issue 42's knobs and cross-layer KV sharing: MiMo-V2-Flash (a value scale, value
heads narrower than the query/key heads, partial RoPE, sinks and twice the kv heads on its sliding layers),
Falcon-H1's attention layers (a key multiplier) and Gemma 3n (its last num_kv_shared_layers layers have no
k_proj, v_proj: kv_shared): their config.json reader and table rows. llama.py dispatches these model types here.

| model_type    | foreign key (layers.{L}.self_attn.) | canonical                           | form   |
|---------------|-------------------------------------|-------------------------------------|--------|
| mimo_v2_flash | v_proj.weight (K*V, D), V = v_head_dim | value.kernel (V != H: no tie)     | linear |
|               | o_proj.weight (D, N*V)               | output.kernel                      | linear |
|               | attention_sink_bias (N,), sliding    | sinks                              | as is  |
| falcon_h1     | hf-llama's rows                      | hf-llama's                         | linear |
| gemma3n, a    | q_proj, o_proj (and q_norm) alone    | query.*, output.* (kv_shared: no   | linear |
| reuse layer   |                                      | key or value tensors)              |        |

What the models compute (transformers 5.23):
- modeling_mimo_v2_flash.py:378: value_states = v_proj(x) * v_scale, v_scale = attention_value_scale (None: 1),
  before the cache: value_scale. :339-341: a sliding layer has 2 * num_key_value_heads kv heads and sinks
  (:360); :106-108: rotary_dim = int(head_dim * partial_rotary_factor), 0.334 when rope_parameters leaves it
  out; :354-357: v_proj and o_proj use v_head_dim, o_proj has no bias.
- modeling_falcon_h1.py:208: key_states = k_proj(x) * key_multiplier, before RoPE and the cache:
  key_multiplier. :924 and :932 multiply the attention block's input by attention_in_multiplier and its
  output by attention_out_multiplier in the decoder layer, outside self_attn: they are not the block's (a
  caller folds them into the hidden states, or into q/k/v_proj and o_proj).
- modeling_gemma3n.py:1176-1177, configuration_gemma3n.py:207-232: kv_sharing_modes: the last
  num_kv_shared_layers layers "reuse", the last earlier layer of each layer type "store"s its keys and values
  (after k_norm, RoPE and v_norm, the cache's update included: :1232-1235); a reuse layer has no k_proj, v_proj,
  k_norm, v_norm (:1185) and attends to the stored ones without updating any cache (:1220-1232): kv_shared, its
  cache the storing layer's present cache. scaling = 1.0 (:1172); Gemma3nRMSNorm multiplies by w itself (:146);
  v_norm has no scale (:1193).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .hf_rope import _hf_rope
from .table import LINEAR, R, Table, Tie

TYPES = ("mimo_v2_flash", "falcon_h1", "gemma3n", "gemma3n_text")

# What transformers reads when config.json leaves a field out (configuration_mimo_v2_flash.py,
# configuration_falcon_h1.py, 5.23).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mimo_v2_flash": {"head_dim": 192, "v_head_dim": 128, "num_key_value_heads": 4, "sliding_window": 129,
                      "attention_value_scale": 0.707, "attention_bias": False,
                      "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}},
    "falcon_h1": {"num_key_value_heads": 8, "key_multiplier": 1.0, "attention_bias": False},
    "gemma3n_text": {"head_dim": 256, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "sliding_window": 512,
                     "num_kv_shared_layers": 15, "attention_bias": False,
                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}},
}
_MIMO_PARTIAL_ROTARY = 0.334  # MiMoV2FlashRotaryEmbedding's default partial_rotary_factor


def tables(ties: tuple[Tie, ...]) -> dict[str, Table]:
    """The table these models add to hf-llama's, by the name layer_facts answers in "table": hf-llama's rows
    without the tie of value_head_dim to head_dim (MiMo-V2's v_head_dim)."""
    narrow = Table((
        R("q_proj.weight", "query.kernel", LINEAR), R("q_proj.bias", "query.bias", LINEAR),
        R("k_proj.weight", "key.kernel", LINEAR), R("k_proj.bias", "key.bias", LINEAR),
        R("v_proj.weight", "value.kernel", LINEAR), R("v_proj.bias", "value.bias", LINEAR),
        R("o_proj.weight", "output.kernel", LINEAR), R("o_proj.bias", "output.bias", LINEAR),
    ), ties=tuple(t for t in ties if t.field != "value_head_dim"), when=lambda c: c.value_head_dim != c.head_dim,
        note="mimo_v2_flash: v_proj and o_proj in heads of v_head_dim")
    shared = Table((
        R("q_proj.weight", "query.kernel", LINEAR), R("q_proj.bias", "query.bias", LINEAR),
        R("o_proj.weight", "output.kernel", LINEAR), R("o_proj.bias", "output.bias", LINEAR),
    ), ties=ties, when=lambda c: c.kv_shared, note="gemma3n reuse layer: no k_proj, v_proj (kv_shared)")
    return {"v_head_dim": narrow, "kv_shared": shared}


def layer_facts(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of a MiMo-V2-Flash / Falcon-H1 decoder -> block `layer`'s facts, as llama.py's reader
    answers them ("table": None for hf-llama's plain table, else a name of tables())."""
    model_type = cfg.get("model_type")
    if model_type == "gemma3n":  # the multimodal wrapper: its language model's config is text_config
        if not isinstance(cfg.get("text_config"), Mapping):
            raise ValueError(f"hf_config: model_type 'gemma3n' keeps its language model in text_config: got "
                             f"text_config={cfg.get('text_config')!r}")
        model_type, cfg = "gemma3n_text", {**cfg["text_config"], "model_type": "gemma3n_text"}
    cfg = {**_DEFAULTS[model_type], **{k: v for k, v in cfg.items() if v is not None}}
    layer = 0 if layer is None else layer
    for name in ("num_attention_heads", "hidden_size"):
        if not isinstance(cfg.get(name), int):
            raise ValueError(f"hf_config: {model_type} needs {name}: got {cfg.get(name)!r}")
    heads = cfg["num_attention_heads"]
    if model_type == "gemma3n_text":
        return _gemma3n(cfg, layer)
    if model_type == "falcon_h1":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        modern = {"rope": _hf_rope(cfg, None, head_dim), "key_multiplier": float(cfg["key_multiplier"])}
        return _facts(cfg, model_type, head_dim, cfg["num_key_value_heads"], modern, table=None)
    layer_type = _mimo_layer_type(cfg, layer)
    sliding = layer_type == "sliding_attention"
    head_dim = cfg["head_dim"]
    params = (cfg.get("rope_parameters") or {}).get(layer_type) or {}
    rope_cfg = {**cfg, "rope_parameters": {layer_type: {"partial_rotary_factor": _MIMO_PARTIAL_ROTARY, **params}}}
    scale = cfg.get("attention_value_scale")
    modern = {
        "rope": _hf_rope(rope_cfg, layer_type, head_dim),
        # sliding_window W: W keys with the query itself (window_left = W - 1), as llama.py's
        "window_left": int(cfg["sliding_window"]) - 1 if sliding and cfg.get("sliding_window") else -1,
        "use_sinks": sliding,
        "value_scale": 1.0 if scale is None else float(scale),
    }
    kv_heads = cfg["num_key_value_heads"] * (2 if sliding else 1)
    facts = _facts(cfg, model_type, head_dim, kv_heads, modern,
                   table="v_head_dim" if cfg["v_head_dim"] != head_dim else None)
    # the checkpoint's name for the sinks (transformers' conversion_mapping.py:2263 renames it to sinks on load)
    facts["extra_keys"] = {"sinks": "attention_sink_bias"}
    return facts


def _gemma3n(cfg: Mapping[str, Any], layer: int) -> dict[str, Any]:
    """Gemma3nTextAttention of block `layer`; a reuse layer (kv_sharing_modes) is kv_shared."""
    total = cfg.get("num_hidden_layers")
    if not isinstance(total, int):
        raise ValueError(f"hf_config: gemma3n_text needs num_hidden_layers: got {total!r}")
    layer_types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                             for i in range(total)]  # Gemma3nTextConfig's rule
    if layer >= len(layer_types):
        raise ValueError(f"layer={layer} is past config.json's {len(layer_types)} layer_types")
    layer_type = layer_types[layer]
    shared = layer >= total - int(cfg["num_kv_shared_layers"] or 0)  # kv_sharing_modes: "reuse"
    head_dim, eps = cfg["head_dim"], float(cfg["rms_norm_eps"])
    window = cfg["sliding_window"] if layer_type == "sliding_attention" else None
    modern: dict[str, Any] = {
        "rope": _hf_rope(cfg, layer_type, head_dim),
        "window_left": int(window) - 1 if window else -1,  # W keys with the query itself, as llama.py's
        "qk_norm": {"type": "rms", "eps": eps, "scope": "head"},
    }
    if shared:
        modern["kv_shared"] = True
    else:
        modern["value_norm"] = {"type": "rms", "eps": eps, "scope": "head", "weight": False}
    facts = _facts(cfg, "gemma3n_text", head_dim, cfg["num_key_value_heads"], modern,
                   table="kv_shared" if shared else None)
    facts["scale"] = 1.0  # Gemma3nTextAttention: scaling = 1.0 (the query norm sets the logits' size)
    return facts


def shared_cache_layer(cfg: Mapping[str, Any], layer: int) -> int | None:
    """Gemma 3n: the layer whose stored keys and values a reuse layer reads (the last layer of its type before
    the shared ones: Gemma3nTextConfig.kv_sharing_modes' "store"); None for a layer with its own."""
    if cfg.get("model_type") == "gemma3n":
        cfg = cfg["text_config"]
    cfg = {**_DEFAULTS["gemma3n_text"], **{k: v for k, v in cfg.items() if v is not None}}
    total = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                             for i in range(total)]
    first = total - int(cfg["num_kv_shared_layers"] or 0)
    if layer < first:
        return None
    return max(i for i in range(first) if layer_types[i] == layer_types[layer])


def _mimo_layer_type(cfg: Mapping[str, Any], layer: int) -> str:
    """config.json's layer_types[layer], else MiMoV2FlashConfig's rule: full attention on layer 0 and every
    sixth layer, sliding on the others."""
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, Sequence) and not isinstance(layer_types, str):
        if layer >= len(layer_types):
            raise ValueError(f"layer={layer} is past config.json's {len(layer_types)} layer_types")
        return layer_types[layer]
    return "full_attention" if layer == 0 or (layer + 1) % 6 == 0 else "sliding_attention"


def _facts(cfg: Mapping[str, Any], model_type: str, head_dim: int, kv_heads: int, modern: dict[str, Any], *,
           table: str | None) -> dict[str, Any]:
    return {"num_heads": cfg["num_attention_heads"], "num_kv_heads": kv_heads, "head_dim": head_dim,
            "hidden": cfg["hidden_size"], "dropout": cfg.get("attention_dropout"), "scale": None,
            "scale_by_layer": False, "modern": modern, "norm_offset": 0.0, "table": table, "model_type": model_type}
