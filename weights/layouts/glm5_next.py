"""GLM-5.3-Flash's indexed attention (transformers' glm5_next, 5.23) read into the contract (NumPy only): the
reader hf-deepseek hands a glm5_next config.json (weights.layouts.deepseek.to_canonical).

What the layer computes, each stage with its modeling_glm5_next.py line: docs/spec-frontier.md
("GLM-5.3-Flash's k-pool"). In short: DeepSeek's MLA without RoPE (qk_rope_head_dim must be 0,
configuration_glm5_next.py:223-226) over the keys a DSA indexer selects, the indexer scoring pooled keys
(index_kpool tokens each, a softmax gate per feature) instead of tokens: the contract's indexer with
block_size index_kpool, topk index_topk // index_kpool blocks, block_pool "gated" and open_block
(index_kpool_always_select_tail).

| glm5_next key (layers.{L}.self_attn.)  | canonical                                                    |
|----------------------------------------|--------------------------------------------------------------|
| q_a_proj / q_a_layernorm / q_b_proj    | query.down.kernel / query.down.norm.scale / query.kernel     |
| kv_a_proj_with_mqa / kv_a_layernorm    | latent.kernel (two zero rotary columns after C) / .norm.scale|
| kv_b_proj / o_proj                     | key.kernel + value.kernel / output.kernel                    |
| indexer.wq_b, wk, k_norm, weights_proj | indexer.query.kernel, key.kernel, key.norm.*, weights.kernel |
| indexer.index_kpool_compress_gate      | indexer.pool.gate.kernel (D, J) (the weight transposed)      |
| indexer.index_kpool_compress_ape       | indexer.pool.position (index_kpool, J)                       |

The contract's latent has rope_dim >= 2 (latent.rope_dim is a positive even integer): glm5_next's NoPE heads
are read with two extra rotary features whose query rows and latent columns are zero, so they add exactly 0
to every logit (0 * x = 0 in every float format), and the softmax scale is set to glm5_next's own
qk_head_dim ** -0.5 = qk_nope_head_dim ** -0.5 (modeling_glm5_next.py:1148). The cost: the latent cache
carries two zero features per token. Read only: hf-deepseek does not write a gated indexer (its
_indexer_problems refuses block_size). A "shared" layer (indexer_types) reads without an indexer: it takes
the previous full layer's selection as topk_indices, as GLM-5's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..config import AttentionConfig
from ..format import WeightsFormatError, validate_tensors
from .indexer import indexer_layers

GLM5_NEXT_TYPES = ("glm5_next", "glm5_next_text")
NOPE_PAD = 2  # the zero rotary features the NoPE heads are read with (the contract's smallest rope_dim)
INDEX_KEYS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
              "index_kpool_compress_gate", "index_kpool_compress_ape")
ATTENTION_KEYS = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                  "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight")


def is_glm5_next_config(cfg: Mapping[str, Any]) -> bool:
    return isinstance(cfg, Mapping) and cfg.get("model_type") in GLM5_NEXT_TYPES


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """glm5_next's text fields: its text_config, or the top level of a flat text-only config
    (configuration_glm5_next.py:307-312)."""
    text = cfg.get("text_config") if cfg.get("model_type") == "glm5_next" else None
    return text if isinstance(text, Mapping) else cfg


def _need(cfg: Mapping[str, Any], keys) -> None:
    missing = [key for key in keys if cfg.get(key) is None]
    if missing:
        raise ValueError(f"hf_config: glm5_next needs {', '.join(missing)}: got none")


def glm5_next_fields(cfg: Mapping[str, Any], layer: int) -> tuple[str, dict[str, Any]]:
    """config.json -> (what layer `layer` is: "full" or "shared", the AttentionConfig fields). Refuses what the
    layer is not (a linear_attention (KDA) layer) and what glm5_next itself refuses (RoPE dims, index_topk not
    a multiple of index_kpool: configuration_glm5_next.py:214-226)."""
    cfg = text_config(cfg)
    _need(cfg, ("hidden_size", "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                "v_head_dim", "num_hidden_layers", "index_n_heads", "index_head_dim", "index_topk"))
    n = int(cfg["num_hidden_layers"])
    if not 0 <= layer < n:
        raise ValueError(f"layer must be in [0, {n}) (num_hidden_layers): got {layer}")
    layer_types = cfg.get("layer_types") or ["indexed_attention" if i % 4 == 3 else "linear_attention"
                                              for i in range(n)]  # configuration_glm5_next.py:164-169
    kind = "indexed_attention" if layer_types[layer] == "full_attention" else layer_types[layer]
    if kind != "indexed_attention":
        raise ValueError(f"layer {layer} of glm5_next is a {kind} layer (Kimi delta attention): only its "
                         "indexed_attention layers are attention blocks the contract holds")
    if int(cfg.get("qk_rope_head_dim") or 0):
        raise ValueError(f"hf_config: glm5_next's attention has no RoPE: got qk_rope_head_dim="
                         f"{cfg['qk_rope_head_dim']} (configuration_glm5_next.py:223-226)")
    kpool, topk = int(cfg.get("index_kpool", 16)), int(cfg["index_topk"])
    if kpool < 1 or topk % kpool:
        raise ValueError(f"hf_config: index_topk must be a multiple of index_kpool: got index_topk={topk}, "
                         f"index_kpool={kpool} (configuration_glm5_next.py:214-218)")
    types = cfg.get("indexer_types")
    kinds = indexer_layers("glm_moe_dsa", {**cfg, "indexer_types": types, "num_hidden_layers": n})
    nope = int(cfg["qk_nope_head_dim"])
    eps = float(cfg.get("rms_norm_eps", 1e-5))  # Glm5NextTextRMSNorm(eps=config.rms_norm_eps): :1128, :1136
    bias = bool(cfg.get("attention_bias", False))
    fields = {
        "num_heads": int(cfg["num_attention_heads"]), "query_dim": int(cfg["hidden_size"]),
        "head_dim": nope + NOPE_PAD, "value_head_dim": int(cfg["v_head_dim"]),
        "use_query_bias": False, "use_key_bias": bias, "use_value_bias": False, "use_output_bias": bias,
        "dropout": float(cfg.get("attention_dropout") or 0.0), "scale": nope ** -0.5,
        "rope": {"theta": 10000.0, "rotary_dim": NOPE_PAD, "interleaved": True},  # turns zeros only
        "latent": {"query_rank": int(cfg["q_lora_rank"]), "kv_rank": int(cfg["kv_lora_rank"]),
                   "rope_dim": NOPE_PAD, "eps": eps},
        "indexer": None,
    }
    if kinds[layer] == "full":
        fields["indexer"] = {
            "heads": int(cfg["index_n_heads"]), "head_dim": int(cfg["index_head_dim"]), "topk": topk // kpool,
            "query_source": "latent", "key_norm": {"type": "layer", "eps": 1e-6},  # nn.LayerNorm(eps=1e-6): :800
            "rope": None, "block_size": kpool, "block_pool": "gated",
            "open_block": bool(cfg.get("index_kpool_always_select_tail", True))}
    return kinds[layer], fields


def read_glm5_next(layout: str, cfg: Mapping[str, Any], state: Mapping[str, Any], base: str, layer: int
                   ) -> tuple[AttentionConfig, dict[str, np.ndarray]]:
    """One indexed_attention block of a glm5_next checkpoint: state keys `base` + ATTENTION_KEYS (+ the
    indexer's on a full layer) -> (config, tensors). Every missing or unexpected key of the block in one
    WeightsFormatError; shapes are checked by the contract's validation after the conversion."""
    kind, fields = glm5_next_fields(cfg, layer)
    try:
        config = AttentionConfig(**fields)
    except ValueError as err:
        raise ValueError(f"hf_config: {err}") from None
    want = list(ATTENTION_KEYS) + [f"indexer.{k}" for k in INDEX_KEYS] * (kind == "full")
    if config.use_key_bias:
        want += ["kv_a_proj_with_mqa.bias", "o_proj.bias"]
    missing = [base + k for k in want if base + k not in state]
    unexpected = sorted(k for k in state if k.startswith(base) and k[len(base):] not in want)
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unexpected {', '.join(unexpected)} (this layer's indexer: {kind})"] if unexpected else [])
        raise WeightsFormatError(f"{layout}: " + "; ".join(parts))
    w = {k: np.asarray(state[base + k]) for k in want}
    N, H, V, L = config.num_heads, config.head_dim, config.value_head_dim, config.latent
    nope, C = H - NOPE_PAD, L.kv_rank
    q = w["q_b_proj.weight"].T.reshape(L.query_rank, N, nope)  # (Qr, N, nope)
    query = np.zeros((L.query_rank, N, H), q.dtype)
    query[..., :nope] = q  # the NoPE heads, then two zero rotary features
    latent = np.zeros((config.query_dim, C + NOPE_PAD), q.dtype)
    latent[:, :C] = w["kv_a_proj_with_mqa.weight"].T  # (D, C): glm5_next's R is 0
    kv = w["kv_b_proj.weight"].T.reshape(C, N, nope + V)  # (C, N, nope + V): expand_kv's split, :1163-1166
    t = {"query.down.kernel": w["q_a_proj.weight"].T, "query.down.norm.scale": w["q_a_layernorm.weight"],
         "query.kernel": query, "latent.kernel": latent, "latent.norm.scale": w["kv_a_layernorm.weight"],
         "key.kernel": kv[..., :nope], "value.kernel": kv[..., nope:],
         "output.kernel": w["o_proj.weight"].T.reshape(N, V, -1)}
    if config.use_key_bias:
        t["latent.bias"] = np.concatenate([w["kv_a_proj_with_mqa.bias"], np.zeros(NOPE_PAD, q.dtype)])
        t["output.bias"] = w["o_proj.bias"]
    if kind == "full":
        ix = config.indexer
        t.update({"indexer.query.kernel": w["indexer.wq_b.weight"].T.reshape(L.query_rank, ix.heads, ix.head_dim),
                  "indexer.key.kernel": w["indexer.wk.weight"].T, "indexer.key.norm.scale": w["indexer.k_norm.weight"],
                  "indexer.key.norm.bias": w["indexer.k_norm.bias"],
                  "indexer.weights.kernel": w["indexer.weights_proj.weight"].T,
                  "indexer.pool.gate.kernel": w["indexer.index_kpool_compress_gate"].T,
                  "indexer.pool.position": w["indexer.index_kpool_compress_ape"]})
    tensors = {name: np.array(a, order="C", copy=True) for name, a in t.items()}
    validate_tensors(config, tensors, source=layout)
    return config, tensors


def index_cache_from_hf(packed) -> np.ndarray:
    """transformers' indexer cache (B, P, 2J + 1): [key | gate logits | valid] (modeling_glm5_next.py:840)
    -> the contract's present_index_keys (B, P, 2J): the valid channel dropped (the contract's validity is
    the call's mask)."""
    packed = np.asarray(packed)
    return packed[..., :-1]
