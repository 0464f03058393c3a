"""The hf-llama layout: a Llama-family decoder's attention, and its config.json reader.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| hf-llama          | [P]layers.{L}.self_attn.q_proj.weight (N*H, D)... | query, key, value, output  | linear |
|   (phi3)          | [P]layers.{L}.self_attn.qkv_proj.weight           | query+key+value            | linear |
|                   | q_norm.weight, k_norm.weight (H,) or (N*H,), sinks| query/key.norm.scale, sinks| 1-D    |
|   (cohere)        | q_norm.weight (N, H), k_norm.weight (K, H)        | query/key.norm.scale       | 2-D    |
|   (qwen3_next, qwen3_5, qwen3_5_moe, gemma4: a gated q_proj, k = v: llama_gated.py's rows)                    |
|   (qwen2_vl, qwen2_5_vl, qwen3_vl: qwen2's / qwen3's rows, multimodal RoPE from config.json: qwen_vl.py)      |

A decoder: its config file is required (write.py says what that brings);
half-split RoPE pairs, except llama4, cohere, cohere2 (interleaved: config.json's model_type says which,
and from_canonical writes that pairing). Gemma's norm weights are w of (1 + w): the canonical
multiplier is 1 + w, the one conversion that is an addition (exact to one
rounding, not bit-exact).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import llama_gated, llama_knobs, qwen_vl
from .hf_rope import _hf_rope
from .table import LINEAR, Extra, Layout, R, Table, Tie

# -- Hugging Face decoder configs (config.json of transformers 4.x and 5.x) ------------------

# Which layers use the sliding window when config.json has no `layer_types` (transformers 4.x
# wrote none for most models): each model's own rule, as its 4.x modeling file applied it.
_SLIDING_RULES: dict[str, Callable[[Mapping[str, Any], int], bool]] = {
    "mistral": lambda cfg, layer: True,  # every layer (MistralModel: one sliding mask for all)
    "phi3": lambda cfg, layer: True,
    "qwen2": lambda cfg, layer: bool(cfg.get("use_sliding_window")) and layer >= cfg.get("max_window_layers", 28),
    "qwen3": lambda cfg, layer: bool(cfg.get("use_sliding_window")) and layer >= cfg.get("max_window_layers", 28),
    "gemma2": lambda cfg, layer: layer % 2 == 0,
    "gemma3_text": lambda cfg, layer: (layer + 1) % cfg.get("sliding_window_pattern",
                                                            cfg.get("_sliding_window_pattern", 6)) != 0,
    "gpt_oss": lambda cfg, layer: layer % 2 == 0,
    "ministral3": lambda cfg, layer: True,  # Ministral3Model: one sliding mask for all when sliding_window is set
    "smollm3": lambda cfg, layer: bool(cfg.get("use_sliding_window")) and not _uses_rope(cfg, layer),
    "cohere2": lambda cfg, layer: (layer + 1) % cfg.get("sliding_window_pattern", 4) != 0,
}
HF_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "olmo2", "gpt_oss",
                  "phi3", "llama4", "llama4_text", "smollm3", "ministral3", "granite", "cohere", "cohere2",
                  *llama_gated.TYPES, *qwen_vl.TYPES, *llama_knobs.TYPES)
HF_LLAMA_TYPES += ("diffllama",)  # differential attention (its reader: _diffllama below)


def _llama_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of a Llama-family decoder -> sizes, behaviour and the modern fields of block `layer`."""
    model_type = cfg.get("model_type")
    inner = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else {}
    # Gemma 2 and 3 (EmbeddingGemma) say True; Gemma 4 says "vision" or "all" (llama_gated.py reads that)
    if cfg.get("use_bidirectional_attention") is True or inner.get("use_bidirectional_attention") is True:
        raise ValueError("hf_config: use_bidirectional_attention=True (Gemma's encoder use: no causal mask, and "
                         "sliding windows on both sides) is not read by hf-llama, a causal layout: got True")
    if model_type in llama_gated.TYPES:  # Qwen3-Next, Qwen3.5, Gemma 4: gates, k = v (llama_gated.py)
        facts = llama_gated.layer_facts(cfg, layer)
        return {**facts, "table": FAMILY[0].tables.index(_GATED_TABLES[facts["table"]]) if facts["table"] else 0}
    if model_type in llama_knobs.TYPES:  # MiMo-V2-Flash, Falcon-H1: issue 42's knobs (llama_knobs.py)
        facts = llama_knobs.layer_facts(cfg, layer)
        return {**facts, "table": FAMILY[0].tables.index(_KNOB_TABLES[facts["table"]]) if facts["table"] else 0}
    if model_type == "gemma3" and isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}  # the multimodal wrapper's language model
        model_type = "gemma3_text"
    if model_type == "llama4" and isinstance(cfg.get("text_config"), Mapping):
        cfg, model_type = {**cfg["text_config"], "model_type": "llama4_text"}, "llama4_text"
    if model_type in qwen_vl.TYPES:  # Qwen2-VL, Qwen2.5-VL, Qwen3-VL: qwen2 / qwen3 with multimodal RoPE
        return qwen_vl.layer_facts(cfg, layer, _llama_config)
    if model_type not in HF_LLAMA_TYPES:
        raise ValueError(f"hf_config: model_type must be one of {', '.join(HF_LLAMA_TYPES)} for hf-llama: "
                         f"got {model_type!r}")
    layer = 0 if layer is None else layer
    heads = cfg.get("num_attention_heads")
    hidden = cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (hidden // heads if hidden and heads else None)
    if head_dim is None:
        raise ValueError("hf_config: needs num_attention_heads and hidden_size (or head_dim)")
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, Sequence) and not isinstance(layer_types, str):
        if layer >= len(layer_types):
            raise ValueError(f"layer={layer} is past config.json's {len(layer_types)} layer_types")
        layer_type = layer_types[layer]
    else:
        rule = _SLIDING_RULES.get(model_type)
        layer_type = "sliding_attention" if rule is not None and rule(cfg, layer) else "full_attention"
    window = cfg.get("sliding_window") if layer_type == "sliding_attention" else None
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None  # Qwen keeps sliding_window in config.json even when the window is off
    gemma = model_type.startswith("gemma")
    modern: dict[str, Any] = {
        "rope": _hf_rope(cfg, layer_type, head_dim),
        "logit_softcap": cfg.get("attn_logit_softcapping") if gemma else None,
        # transformers' sliding_window_overlay: key j visible iff j > i - W, so W keys with the query
        # itself, window_left = W - 1 (measured against each model's own mask: tests/test_layouts_modern.py)
        "window_left": int(window) - 1 if window else -1,
        "use_sinks": model_type == "gpt_oss",
    }
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    norm_offset = 0.0
    if model_type in ("qwen3", "gemma3_text"):
        modern["qk_norm"] = {"type": "rms", "eps": eps, "scope": "head"}
        norm_offset = 1.0 if gemma else 0.0  # Gemma3RMSNorm multiplies by (1 + weight)
    elif model_type == "olmo2":
        modern["qk_norm"] = {"type": "rms", "eps": eps, "scope": "all"}
    facts = {
        "num_heads": heads, "num_kv_heads": cfg.get("num_key_value_heads") or heads, "head_dim": head_dim,
        "hidden": hidden, "dropout": cfg.get("attention_dropout"),
        "scale": cfg["query_pre_attn_scalar"] ** -0.5 if gemma and cfg.get("query_pre_attn_scalar") else None,
        "scale_by_layer": False, "modern": modern, "norm_offset": norm_offset,
        "table": 1 if model_type == "phi3" else 0, "model_type": model_type,
    }
    if model_type in _FRONTIER_TYPES:
        _frontier(cfg, model_type, layer, layer_type, facts)
    if model_type == "diffllama":
        _diffllama(cfg, layer, facts)
    return facts


# -- diffllama: differential attention ------------------------------------------------------------

def diffllama_lambda_init(layer: int) -> float:
    """modeling_diffllama.py's lambda_init_fn (transformers 5.23): 0.8 - 0.6 exp(-0.3 layer_idx), the layer
    index counted from 0. The contract stores the number (config.differential.lambda_init), never the index."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


def _diffllama(cfg: Mapping[str, Any], layer: int, facts: dict[str, Any]) -> None:
    """DiffLlamaAttention (modeling_diffllama.py, 5.23): a Llama block (q/k/v/o_proj, RoPE, no window) whose
    heads pair as n and n + N/2 with lambda_q1, lambda_k1, lambda_q2, lambda_k2 (head_dim,) each, lambda_init
    of its layer, a weightless RMSNorm(2 head_dim, eps=rms_norm_eps) and the (1 - lambda_init) scale."""
    facts["modern"]["differential"] = {"lambda_init": diffllama_lambda_init(layer),
                                       "eps": float(cfg.get("rms_norm_eps", 1e-5))}  # DiffLlamaConfig's default




# -- the frontier model types: NoPE layers, local chunks, the query temperature, Cohere's norm and pairing ---

_FRONTIER_TYPES = ("llama4_text", "smollm3", "ministral3", "granite", "cohere", "cohere2")


def _uses_rope(cfg: Mapping[str, Any], layer: int) -> bool:
    """Llama 4 and SmolLM3: no_rope_layers[layer] is 1 on a RoPE layer and 0 on a NoPE one (despite its
    name); without the list both configs make every no_rope_layer_interval-th layer (4) a NoPE one."""
    flags = cfg.get("no_rope_layers")
    if flags:
        if layer >= len(flags):
            raise ValueError(f"layer={layer} is past config.json's {len(flags)} no_rope_layers")
        return bool(flags[layer])
    return (layer + 1) % cfg.get("no_rope_layer_interval", 4) != 0


def _frontier(cfg: Mapping[str, Any], model_type: str, layer: int, layer_type: str, facts: dict[str, Any]) -> None:
    """The fields these model types add to a Llama block (facts updated in place), as transformers 5.23's
    modeling files compute them; defaults are each config class's own."""
    modern = facts["modern"]
    if model_type == "cohere2":  # Cohere2Config sets head_dim = hidden_size // heads whatever the file says
        facts["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    # Llama 4 rotates (2i, 2i+1) as complex numbers; Cohere repeat_interleaves its frequencies
    interleaved = model_type in ("llama4_text", "cohere", "cohere2")
    if interleaved:
        facts["pairing"] = "interleaved"
    rope_on = {"llama4_text": lambda: _uses_rope(cfg, layer), "smollm3": lambda: _uses_rope(cfg, layer),
               "cohere2": lambda: layer_type == "sliding_attention"}.get(model_type, lambda: True)()
    modern["rope"] = _hf_rope(cfg, layer_type, facts["head_dim"], interleaved=interleaved) if rope_on else None
    if model_type == "llama4_text":
        has_types = isinstance(cfg.get("layer_types"), Sequence) and not isinstance(cfg.get("layer_types"), str)
        chunk = cfg.get("attention_chunk_size", 8192)
        # 5.x names the chunked layers in layer_types, derived from no_rope_layers as below when absent
        chunked = layer_type == "chunked_attention" if has_types else rope_on and chunk is not None
        if chunked and chunk is None:
            raise ValueError(f"hf_config: layer {layer} is a chunked_attention layer: attention_chunk_size "
                             "must be a positive integer: got None")
        modern["local_chunk"] = int(chunk) if chunked else None
        if rope_on and cfg.get("use_qk_norm", True):  # Llama4TextL2Norm: x / sqrt(mean(x^2) + eps), after RoPE
            modern["qk_norm"] = {"type": "rms", "eps": float(cfg.get("rms_norm_eps", 1e-5)), "scope": "head",
                                 "weight": False, "after_rope": True}
        if not rope_on and cfg.get("attn_temperature_tuning", True):  # 1 + attn_scale ln(1 + floor((p + 1) / f))
            # p: the query's cache index, arange(T) + the past length, left pads included, not position_ids
            # (modeling_llama4.py:360-361, transformers 5.23)
            modern["query_temperature"] = {"beta": float(cfg.get("attn_scale", 0.1)),
                                           "floor": float(cfg.get("floor_scale", 8192)), "offset": 1,
                                           "position": "cache_index"}
    elif model_type == "smollm3" and not cfg.get("use_sliding_window", False):
        modern["window_left"] = -1  # SmolLM3Attention slides only with use_sliding_window
    elif model_type == "ministral3":  # get_llama_4_attn_scale: 1 + beta ln(1 + floor(position / original))
        params = cfg.get("rope_parameters")
        params = params if isinstance(params, Mapping) else cfg.get("rope_scaling") or {}
        beta, floor = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
        if beta is None or floor is None:
            raise ValueError("hf_config: ministral3 needs rope_parameters.llama_4_scaling_beta and "
                             f"original_max_position_embeddings: got {beta!r} and {floor!r}")
        modern["query_temperature"] = {"beta": float(beta), "floor": float(floor), "offset": 0}
    elif model_type == "granite":
        facts["scale"] = float(cfg.get("attention_multiplier", 1.0))  # GraniteAttention.scaling, not 1/sqrt(H)
    elif model_type == "cohere" and cfg.get("use_qk_norm", False):
        # CohereLayerNorm over each head's H features, one weight row per head and no bias (zeros here)
        modern["qk_norm"] = {"type": "layer", "eps": float(cfg.get("layer_norm_eps", 1e-5)), "scope": "head",
                             "per_head": True}
        heads, kv_heads = facts["num_heads"], facts["num_kv_heads"]
        facts["derived"] = {"query.norm.bias": np.zeros((heads, facts["head_dim"])),
                            "key.norm.bias": np.zeros((kv_heads, facts["head_dim"]))}


_DECODER_TIES = (
    Tie("value_head_dim", "head_dim", "v_proj splits into heads of head_dim"),
    Tie("key_dim", "query_dim", "keys are projected from the hidden states"),
    Tie("value_dim", "query_dim", "values are projected from the hidden states"),
    Tie("out_dim", "query_dim", "o_proj maps back to hidden_size"),
)
_GATED_TABLES = llama_gated.tables(_DECODER_TIES)
_KNOB_TABLES = llama_knobs.tables(_DECODER_TIES)


FAMILY = (
    Layout(
        "hf-llama", "a Llama-family decoder's attention (llama, mistral, qwen2, qwen3, gemma2, gemma3, olmo2, "
        "gpt_oss, phi3, llama4, smollm3, ministral3, granite, cohere, cohere2, qwen3_next, qwen3_5, qwen3_5_moe, "
        "gemma4, "
        "qwen2_vl, qwen2_5_vl, qwen3_vl): "
        "[prefix]layers.{L}.self_attn."
        "{q,k,v,o}_proj (phi3: fused qkv_proj), q_norm/k_norm, sinks; config.json gives rope (its pairing: "
        "interleaved for llama4 and cohere), windows, chunks, norms, temperature; causal",
        sep=".", scope="layers.{layer}.self_attn.", select=True, hf=_llama_config, pairing="half",
        needs_hf_config=True,
        extras=(Extra("q_norm.weight", "query.norm.scale"), Extra("k_norm.weight", "key.norm.scale"),
                Extra("sinks", "sinks"),
                *(Extra(f"lambda_{n}", f"differential.lambda_{n}") for n in ("q1", "k1", "q2", "k2"))),
        derived=("query.norm.bias", "key.norm.bias"),  # Cohere's LayerNorm has none: zeros
        tables=(
            Table((
                R("q_proj.weight", "query.kernel", LINEAR), R("q_proj.bias", "query.bias", LINEAR),  # (N*H, D)
                R("k_proj.weight", "key.kernel", LINEAR), R("k_proj.bias", "key.bias", LINEAR),  # (K*H, D)
                R("v_proj.weight", "value.kernel", LINEAR), R("v_proj.bias", "value.bias", LINEAR),
                R("o_proj.weight", "output.kernel", LINEAR), R("o_proj.bias", "output.bias", LINEAR),  # (D, N*H)
            ), ties=_DECODER_TIES, note="separate q/k/v projections"),
            Table((
                R("qkv_proj.weight", "query.kernel key.kernel value.kernel", LINEAR),  # ((N+2K)*H, D)
                R("qkv_proj.bias", "query.bias key.bias value.bias", LINEAR),
                R("o_proj.weight", "output.kernel", LINEAR), R("o_proj.bias", "output.bias", LINEAR),
            ), ties=_DECODER_TIES, note="phi3: fused qkv_proj = [q; k; v]"),
            *_GATED_TABLES.values(),  # picked by config.json (their q_proj is table 0's key)
            *_KNOB_TABLES.values(),  # mimo_v2_flash's v_head_dim, gemma3n's kv_shared layers (llama_knobs.py)
        ),
    ),
)
