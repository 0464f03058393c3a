"""The lightning indexer's field and tensors from transformers' Indexer modules (NumPy only).

Not a layout of its own: the checkpoint readers (hf-deepseek for deepseek_v32 and glm_moe_dsa, hf-minimax for
MiniMax M3) call these two functions for a layer's `indexer` (DeepseekV32Indexer, GlmMoeDsaIndexer:
`self_attn.indexer.*`; MiniMaxM3VLIndexer: `self_attn.indexer.*`). What each model computes, with the
transformers file:line it is read from: docs/sparse-attention.md.

    indexer_layers(model_type, hf_config) -> per layer "full" (its own indexer), "shared" (GLM-5: the
        previous full layer's selection, fed as topk_indices) or None (a dense layer)
    indexer_field(model_type, hf_config, rope) -> the config's `indexer` (a dict)
    indexer_tensors(model_type, state) -> {"indexer.query.kernel": ..., ...}
    index_keys_from_hf(model_type, keys, rotary_dim) -> the contract's present_index_keys
    with_indexer_scoring(config, "plain" | "fp8_e4m3" | "fp8_e4m3:ue8m0") -> config with the indexer's scoring
        precision set or cleared (`mha convert --indexer-scoring`)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..config import AttentionConfig, Rope

DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")
# the indexer's scoring precisions by name (`mha convert --indexer-scoring`): (scoring_precision, fp8_scale_format)
INDEXER_SCORINGS = {"plain": (None, "float"), "fp8_e4m3": ("fp8_e4m3", "float"),
                    "fp8_e4m3:float": ("fp8_e4m3", "float"), "fp8_e4m3:ue8m0": ("fp8_e4m3", "ue8m0")}
M3_TYPES = ("minimax_m3", "minimax_m3_vl", "minimax_m3_vl_text")
INDEXER_TYPES = DSA_TYPES + M3_TYPES


def _type(model_type: str) -> str:
    if model_type not in INDEXER_TYPES:
        raise ValueError(f"model_type must be one of {', '.join(INDEXER_TYPES)} (a model with a lightning "
                         f"indexer): got {model_type!r}")
    return "dsa" if model_type in DSA_TYPES else "m3"


def _get(hf: Mapping[str, Any], name: str):
    if name not in hf:
        raise ValueError(f"config.json has no {name} (the indexer needs it)")
    return hf[name]


def indexer_layers(model_type: str, hf: Mapping[str, Any]) -> list[str | None]:
    """What each layer of a `model_type` checkpoint does, from its config.json: "full" runs its own indexer,
    "shared" (GLM-5) reuses the previous full layer's selection (it has no indexer field: it takes
    topk_indices), None is a dense layer (MiniMax M3's full_attention layers). The rules, as transformers 5.23
    reads them: deepseek_v32, every layer full; glm_moe_dsa, `indexer_types`, else `index_topk_pattern`
    ("F"/"S"), else full where max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0 (defaults 2 and
    1: every layer full; configuration_glm_moe_dsa.py:136-148); MiniMax M3, `layer_types` ("minimax_m3_sparse")
    else sparse_attention_config.sparse_attention_freq (configuration_minimax_m3_vl.py:141-146)."""
    kind = _type(model_type)
    n = int(_get(hf, "num_hidden_layers"))
    if model_type == "deepseek_v32":
        return ["full"] * n
    if kind == "dsa":
        types = hf.get("indexer_types")
        if types is None:
            pattern = hf.get("index_topk_pattern")
            if pattern is not None:
                if isinstance(pattern, str) and set(pattern) - set("FS"):
                    raise ValueError(f"index_topk_pattern must be a string of F (full) and S (shared), one a layer: "
                                     f"got {_shown(pattern)}")
                types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else pattern
            else:
                freq, offset = max(int(hf.get("index_topk_freq", 1)), 1), int(hf.get("index_skip_topk_offset", 2))
                types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
        types = list(types)
        if len(types) != n or any(t not in ("full", "shared") for t in types) or (types and types[0] != "full"):
            raise ValueError(f"indexer_types must give full or shared for each of the {n} layers, the first full "
                             f"(a shared layer reuses an earlier full layer's selection): got {_shown(types)}")
        return types
    types = hf.get("layer_types")
    if types is None:
        freq = (hf.get("sparse_attention_config") or {}).get("sparse_attention_freq")
        types = ["full_attention"] * n if freq is None else ["minimax_m3_sparse" if f else "full_attention"
                                                              for f in freq]
    return ["full" if t == "minimax_m3_sparse" else None for t in types]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def indexer_field(model_type: str, hf: Mapping[str, Any], rope: Rope | Mapping | None) -> dict:
    """The `indexer` field of a layer of `model_type` from its config.json `hf`; rope: the layer's canonical
    rope (its theta and scaling: transformers hands the indexer the layer's own cos and sin tables).

    deepseek_v32 / glm_moe_dsa: index_n_heads, index_head_dim, index_topk; the query from the normed query
    latent; a LayerNorm (eps 1e-6) on the key; RoPE on the first qk_rope_head_dim features, half-split in V3.2,
    interleaved in GLM-5 (config.json's indexer_rope_interleave where given; transformers 5.23 always
    interleaves); head weights scaled by index_n_heads**-0.5, scores by index_head_dim**-0.5, ReLU.
    MiniMax M3: index_n_heads (= num_key_value_heads) heads selecting per kv head, index_topk_blocks blocks of
    index_block_size keys, index_local_blocks local blocks; per-head RMS norms (Gemma's 1 + w, rms_norm_eps);
    RoPE half-split on the first head_dim * partial_rotary_factor features (transformers reads
    partial_rotary_factor, not rotary_dim); no head weights, no ReLU, no scale."""
    kind = _type(model_type)
    rope = Rope.from_value(dict(rope) if isinstance(rope, Mapping) else rope)
    if rope is None:
        raise ValueError("rope is null: the indexer turns its query and key with the layer's RoPE tables")
    if kind == "dsa":
        R = int(_get(hf, "qk_rope_head_dim"))
        interleaved = bool(hf.get("indexer_rope_interleave", True)) if model_type == "glm_moe_dsa" else False
        return {"heads": int(_get(hf, "index_n_heads")), "head_dim": int(_get(hf, "index_head_dim")),
                "topk": int(_get(hf, "index_topk")), "query_source": "latent",
                "key_norm": {"type": "layer", "eps": 1e-6},
                "rope": {"theta": rope.theta, "rotary_dim": R, "interleaved": interleaved,
                         "scaling": None if rope.scaling is None else rope.scaling.to_dict()},
                "rope_end": "first"}
    J = int(_get(hf, "index_head_dim"))
    head_dim = int(hf.get("head_dim") or _get(hf, "hidden_size") // _get(hf, "num_attention_heads"))
    params = hf.get("rope_parameters") or {}
    R = int(head_dim * params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if R > J:
        raise ValueError(f"index_head_dim must be at least the rotary features head_dim * partial_rotary_factor: got "
                         f"index_head_dim={J}, {R} rotary features (transformers slices the RoPE table to "
                         "index_head_dim, which breaks its half-split pairs)")
    eps = float(hf.get("rms_norm_eps", 1e-6))
    return {"heads": int(_get(hf, "index_n_heads")), "head_dim": J, "topk": int(_get(hf, "index_topk_blocks")),
            "query_source": "input", "query_norm": {"type": "rms", "eps": eps},
            "key_norm": {"type": "rms", "eps": eps},
            "rope": {"theta": rope.theta, "rotary_dim": R, "interleaved": False,
                     "scaling": None if rope.scaling is None else rope.scaling.to_dict()},
            "rope_end": "first", "head_weights": False, "relu": False, "score_scale": 1.0, "per_kv_head": True,
            "block_size": int(_get(hf, "index_block_size")), "local_blocks": int(hf.get("index_local_blocks", 1))}


def indexer_tensors(model_type: str, state: Mapping[str, Any], *, heads: int) -> dict[str, np.ndarray]:
    """The contract's indexer.* tensors from one Indexer module's state (names relative to the module:
    wq_b.weight, wk.weight, k_norm.weight / .bias, weights_proj.weight for DSA; q_proj.weight, k_proj.weight,
    q_norm.weight, k_norm.weight for MiniMax M3). Linear weights (out, in) become kernels (in, ...); M3's
    Gemma norms multiply by 1 + w, so their canonical scale is 1 + w. Exact (a transpose, a reshape, one
    addition)."""
    kind = _type(model_type)
    need = (("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight") if kind == "dsa"
            else ("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight"))
    missing = [name for name in need if name not in state]
    if missing:
        raise ValueError(f"the {model_type} indexer's state is missing {', '.join(missing)}")
    w = {name: np.asarray(state[name]) for name in need}
    q = w["wq_b.weight" if kind == "dsa" else "q_proj.weight"]  # (I*J, Qsrc)
    J = q.shape[0] // heads
    out = {"indexer.query.kernel": q.T.reshape(q.shape[1], heads, J),
           "indexer.key.kernel": w["wk.weight" if kind == "dsa" else "k_proj.weight"].T}
    if kind == "dsa":
        out.update({"indexer.key.norm.scale": w["k_norm.weight"], "indexer.key.norm.bias": w["k_norm.bias"],
                    "indexer.weights.kernel": w["weights_proj.weight"].T})
    else:
        one = np.ones((), dtype=w["q_norm.weight"].dtype)
        out.update({"indexer.query.norm.scale": one + w["q_norm.weight"],
                    "indexer.key.norm.scale": one + w["k_norm.weight"]})
    return {name: np.ascontiguousarray(t) for name, t in out.items()}


def index_keys_from_hf(model_type: str, keys, rotary_dim: int) -> np.ndarray:
    """transformers' indexer cache -> present_index_keys (B, P, J). GLM-5's port rotates the interleaved pairs
    and stores them de-interleaved (the even features' results, then the odd ones':
    apply_rotary_pos_emb_interleave), the same reordering on q and k, so its scores are unchanged; the
    contract keeps each pair in place, so the first rotary_dim features are re-interleaved. MiniMax M3's
    cache is (B, 1, P, J): its one key head is dropped."""
    keys = np.asarray(keys)
    kind = _type(model_type)
    if kind == "m3":
        return keys[:, 0] if keys.ndim == 4 else keys
    if model_type != "glm_moe_dsa":
        return keys
    half = rotary_dim // 2
    turned = np.empty_like(keys[..., :rotary_dim])
    turned[..., 0::2], turned[..., 1::2] = keys[..., :half], keys[..., half:rotary_dim]
    return np.concatenate([turned, keys[..., rotary_dim:]], axis=-1)


def scoring_name(precision: str | None, scale_format: str = "float") -> str:
    """The name (INDEXER_SCORINGS) of an indexer's scoring precision: plain, fp8_e4m3 or fp8_e4m3:ue8m0."""
    if precision is None:
        return "plain"
    return precision if scale_format == "float" else f"{precision}:{scale_format}"


def parse_indexer_scoring(value: str, argument: str = "indexer_scoring") -> tuple[str | None, str]:
    """(scoring_precision, fp8_scale_format) of a name of INDEXER_SCORINGS; else a one-line ValueError."""
    if not isinstance(value, str) or value not in INDEXER_SCORINGS:
        raise ValueError(f"{argument} must be one of {', '.join(INDEXER_SCORINGS)}: got {value!r}")
    return INDEXER_SCORINGS[value]


def with_indexer_scoring(config: AttentionConfig, value: str, argument: str = "indexer_scoring") -> AttentionConfig:
    """config with its indexer scoring as `value` says: "plain" (scoring_precision null: the storage dtype's,
    transformers' ports), "fp8_e4m3" (DeepSeek's fp8 scoring, scales amax / 448) or "fp8_e4m3:ue8m0" (its
    scales rounded up to a power of two: DeepSeek's scale_fmt). A config without an indexer comes back as it is.
    A bad value, or an indexer the fp8 scoring cannot run (index head_dim not a power of two <= 128), is a
    one-line ValueError naming `argument`."""
    precision, scale_format = parse_indexer_scoring(value, argument)
    if config.indexer is None:
        return config
    data = {**config.indexer.to_dict(), "scoring_precision": precision, "fp8_scale_format": scale_format}
    try:
        return config.replace(indexer=data)
    except ValueError as err:
        raise ValueError(f"{argument} {value}: {err}") from None
