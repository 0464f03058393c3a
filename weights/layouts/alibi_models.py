"""The ALiBi checkpoints: hf-bloom, hf-mpt, hf-falcon (Falcon's RoPE variants too), and their config.json readers.

| layout     | foreign key                                          | canonical                      | form   |
|------------|------------------------------------------------------|--------------------------------|--------|
| hf-bloom   | [P]h.{L}.self_attention.query_key_value (N, 3, H)    | query+key+value, per head      | linear |
|            | [P]h.{L}.self_attention.dense.weight, .bias          | output                         | linear |
| hf-mpt     | [P]blocks.{L}.attn.Wqkv.weight = [q; k; v]           | query+key+value                | linear |
|            | [P]blocks.{L}.attn.out_proj.weight                   | output                         | linear |
| hf-falcon  | [P]h.{L}.self_attention.query_key_value (K, N/K+2, H)| query+key+value, per kv group  | linear |
|            | [P]h.{L}.self_attention.dense.weight, .bias          | output                         | linear |

`alibi.slopes` is never stored: each reader computes it from config.json
(weights.alibi's rules, in float64) and stores it in the checkpoint's dtype;
writing checks the given slopes are the ones the destination's config.json
gives. Where each model adds its bias, read from transformers 5.23's
modeling files:

- BLOOM: `alibi.baddbmm(q, k^T, beta=1, alpha=1/sqrt(H))`: the bias sits
  outside the scale, so the slopes are BLOOM's rule as they stand. It adds
  slope * j (the key's position) and relies on softmax ignoring a constant
  per row: under a causal mask that is -slope * (i - j).
- MPT: `q k^T * softmax_scale + slope * (j - (S - 1))`: outside the scale
  (softmax_scale, or 1/sqrt(H)); MPT's rule with `alibi_bias_max` (MosaicML's
  attention.py honours it; transformers' MptModel builds its bias with the
  default 8 whatever config.json says); `clip_qkv` clamps the fused
  projection: the contract's qkv_clip.
- Falcon with `alibi`: `(q k^T + alibi) * 1/sqrt(H)` (eager), `alibi / sqrt(H)`
  in the mask (sdpa): inside the scale, so the slopes are stored times
  1/sqrt(H). Falcon builds its bias in bfloat16 whatever the model's dtype,
  bf16(bf16(slope) * bf16(j)) with j the key's position
  (modeling_falcon.py build_alibi_tensor: `slopes[..., None].bfloat16() *
  arange_tensor`), so positions past 256 come in steps of 2, 4, 8 and the
  product rounds to 8 significant bits: the reader sets alibi_bias_dtype
  "bfloat16", which states exactly that (the scaled slopes' roundings equal
  Falcon's where 1/sqrt(H) is a power of two, H = 64 in Falcon-RW 1B and 7B;
  for another H the exact bias where every rounding is exact, 8 heads or
  fewer and max_position_embeddings <= 256, else refused).
  Without `alibi`, half-split RoPE from config.json.

Falcon's fused rows: `new_decoder_architecture` groups them by kv head,
(num_kv_heads, N/K + 2, H): the group's query heads, then its key and its
value; `multi_query` is the same with one group ([q heads; k; v]); neither is
(N, 3, H), BLOOM's order (modeling_falcon.py, `_split_heads`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from ..alibi import bloom_slopes, mpt_slopes
from .hf_rope import _hf_rope
from .table import _HIDDEN_TIES, LINEAR, Layout, R, Table, Tie


def _first(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """The first key config.json holds (transformers 5.x names first, then the older ones)."""
    return next((cfg[key] for key in keys if cfg.get(key) is not None), default)


def _sizes(cfg: Mapping[str, Any], model: str, heads_keys: tuple[str, ...], hidden_keys: tuple[str, ...],
           defaults: tuple[int, int]) -> tuple[int, int, int]:
    # save_pretrained writes only the fields that differ from the config class's defaults: those are the defaults
    heads, hidden = _first(cfg, *heads_keys, default=defaults[0]), _first(cfg, *hidden_keys, default=defaults[1])
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads < 1 or hidden % heads:
        raise ValueError(f"hf_config: {model}'s {heads_keys[0]} must divide {hidden_keys[0]}: got "
                         f"{heads_keys[0]}={heads!r}, {hidden_keys[0]}={hidden!r}")
    return heads, hidden, hidden // heads


def _check_type(cfg: Mapping[str, Any], layout: str, types: tuple[str, ...]) -> None:
    if cfg.get("model_type") not in types:
        raise ValueError(f"hf_config: model_type must be {' or '.join(map(repr, types))} for {layout}: "
                         f"got {cfg.get('model_type')!r}")


def _bloom_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of BLOOM (BloomConfig defaults: n_head 8, hidden_size 64; 4.x configs may say n_embed)."""
    _check_type(cfg, "hf-bloom", ("bloom",))
    heads, hidden, head_dim = _sizes(cfg, "BLOOM", ("n_head", "num_attention_heads"), ("hidden_size", "n_embed"),
                                     (8, 64))
    return {"num_heads": heads, "hidden": hidden, "head_dim": head_dim, "dropout": cfg.get("attention_dropout"),
            "scale": None, "scale_by_layer": False, "modern": {"alibi": True}, "model_type": "bloom",
            "derived": {"alibi.slopes": bloom_slopes(heads)}}


def _mpt_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of MPT: sizes at the top, the attention's fields in attn_config (MptAttentionConfig defaults)."""
    _check_type(cfg, "hf-mpt", ("mpt",))
    heads, hidden, head_dim = _sizes(cfg, "MPT", ("n_heads", "num_attention_heads"), ("d_model", "hidden_size"),
                                     (16, 2048))
    attn = cfg.get("attn_config") or {}
    if not isinstance(attn, Mapping):
        raise ValueError(f"hf_config: MPT's attn_config must be an object: got {type(attn).__name__}")
    if attn.get("attn_type", "multihead_attention") != "multihead_attention":
        raise ValueError(f"hf_config: attn_config.attn_type must be 'multihead_attention' for hf-mpt (transformers' "
                         f"MptAttention has no other): got {attn['attn_type']!r}")
    if attn.get("qk_ln"):
        raise ValueError("hf_config: attn_config.qk_ln=True is not read by hf-mpt (transformers' MptAttention has no "
                         "q_ln / k_ln): got True")
    for key, what in (("prefix_lm", "a bidirectional prefix"), ("attn_uses_sequence_id", "a mask by sequence id")):
        if attn.get(key):  # MosaicML's attention honours them; transformers' MptAttention has neither
            raise ValueError(f"hf_config: attn_config.{key}=True ({what}) is not read by hf-mpt (transformers' "
                             f"MptAttention has no such mask): got {attn[key]!r}")
    alibi = bool(attn.get("alibi", True))
    modern: dict[str, Any] = {"alibi": alibi, "qkv_clip": attn.get("clip_qkv") or None}
    out = {"num_heads": heads, "hidden": hidden, "head_dim": head_dim, "dropout": attn.get("attn_pdrop"),
           "scale": attn.get("softmax_scale"), "scale_by_layer": False, "modern": modern, "model_type": "mpt"}
    if alibi:
        out["derived"] = {"alibi.slopes": mpt_slopes(heads, attn.get("alibi_bias_max", 8))}
    return out


FALCON_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel")  # the last two: TII's configs before transformers had Falcon


def falcon_kv_heads(cfg: Mapping[str, Any], heads: int) -> int:
    """The key/value heads of Falcon's fused projection: FalconAttention's qkv_out_dim, variant by variant."""
    if cfg.get("new_decoder_architecture", False):
        return int(_first(cfg, "num_kv_heads", "n_head_kv", default=heads))
    return 1 if cfg.get("multi_query", True) else heads


def _falcon_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of Falcon (FalconConfig defaults: multi_query true, alibi, bias and new_decoder_architecture
    false, 71 heads, hidden_size 4544): ALiBi inside the 1/sqrt(H) scale, or half-split RoPE."""
    _check_type(cfg, "hf-falcon", FALCON_TYPES)
    heads, hidden, head_dim = _sizes(cfg, "Falcon", ("num_attention_heads", "n_head"), ("hidden_size", "n_embed"),
                                     (71, 4544))
    kv = falcon_kv_heads(cfg, heads)
    if kv < 1 or heads % kv:
        raise ValueError(f"hf_config: Falcon's num_kv_heads must divide num_attention_heads={heads}: got {kv}")
    out = {"num_heads": heads, "num_kv_heads": kv, "hidden": hidden, "head_dim": head_dim,
           "dropout": cfg.get("attention_dropout"), "scale": None, "scale_by_layer": False, "model_type": "falcon"}
    if cfg.get("alibi", False):
        out["modern"] = {"alibi": True, "alibi_bias_dtype": _falcon_rounding(heads, head_dim, cfg)}
        out["derived"] = {"alibi.slopes": _falcon_slopes(heads, head_dim)}
    else:
        out["modern"] = {"rope": _hf_rope(cfg, None, head_dim)}
    return out


def _falcon_rounding(heads: int, head_dim: int, cfg: Mapping[str, Any]) -> str | None:
    """Falcon-RW's bias is bf16(bf16(m) * bf16(j)) (build_alibi_tensor), then times 1/sqrt(H); the contract
    rounds the scaled slopes' product (alibi_bias_dtype), the same where 1/sqrt(H) is a power of two (H = 4,
    16, 64: Falcon-RW 1B's and 7B's 64). For another H the exact bias is Falcon's only while every rounding
    is exact: 8 heads or fewer (BLOOM's slopes then powers of two) and positions up to 256 (integers
    exact in bfloat16); past that the conversion would be wrong by as much as the rounding, refused."""
    if not math.log2(head_dim) % 2:
        return "bfloat16"
    longest = cfg.get("max_position_embeddings") or 2048  # FalconConfig's default
    if heads <= 8 and longest <= 256:
        return None
    raise ValueError(f"hf_config: Falcon-RW rounds its ALiBi bias to bfloat16 before the 1/sqrt(H) scale, which "
                     f"the contract states only where sqrt(H) is a power of two (H = 4, 16, 64) or every rounding is "
                     f"exact (8 heads or fewer, max_position_embeddings <= 256): got head_dim={head_dim}, "
                     f"num_attention_heads={heads}, max_position_embeddings={longest} (the exact bias misses "
                     f"Falcon-RW by margin 3.3 at 32 heads and 64 tokens)")


def _falcon_slopes(heads: int, head_dim: int) -> np.ndarray:
    """Falcon-RW's slopes as the contract adds them: BLOOM's rule rounded to bfloat16 (build_alibi_tensor's
    .bfloat16()), times the 1/sqrt(H) Falcon applies to the bias with the logits."""
    return bloom_slopes(heads).astype(ml_dtypes.bfloat16).astype(np.float64) / math.sqrt(head_dim)


_FALCON_TIES = (
    Tie("value_head_dim", "head_dim", "value heads are hidden_size // num_heads wide"),
    Tie("query_dim", "num_heads*head_dim", "hidden_size = num_heads * head_dim"),
    Tie("key_dim", "num_heads*head_dim", "keys are projected from hidden states"),
    Tie("value_dim", "num_heads*head_dim", "values are projected from hidden states"),
    Tie("out_dim", "num_heads*head_dim", "dense maps hidden_size to hidden_size"),
)
_SLOPES = ("alibi.slopes",)

FAMILY = (
    Layout(
        "hf-bloom", "a BLOOM checkpoint's attention: [prefix]h.{L}.self_attention.query_key_value (3*N*H, D) with "
        "rows (N, 3, H), self_attention.dense, biases always; config.json gives n_head; ALiBi slopes by BLOOM's "
        "rule (computed); causal",
        sep=".", scope="h.{layer}.self_attention.", select=True, hf=_bloom_config, needs_hf_config=True,
        qkv_per_head=("query_key_value.weight", "query_key_value.bias"), bias="required",
        bias_why="BloomAttention's query_key_value and dense always have biases", derived=_SLOPES,
        tables=(Table((
            R("query_key_value.weight", "query.kernel key.kernel value.kernel", LINEAR),  # read as (3, N, H) rows
            R("query_key_value.bias", "query.bias key.bias value.bias", LINEAR),
            R("dense.weight", "output.kernel", LINEAR), R("dense.bias", "output.bias", LINEAR),
        ), ties=_HIDDEN_TIES),),
    ),
    Layout(
        "hf-mpt", "an MPT checkpoint's attention: [prefix]blocks.{L}.attn.Wqkv (3*N*H, D) = [q; k; v], "
        "attn.out_proj; config.json's attn_config gives clip_qkv (qkv_clip), softmax_scale, alibi and "
        "alibi_bias_max (slopes by MPT's rule, computed); causal",
        sep=".", scope="blocks.{layer}.attn.", select=True, hf=_mpt_config, needs_hf_config=True, bias="all",
        bias_why="MosaicML's no_bias covers Wqkv and out_proj (transformers' MptAttention has none)",
        derived=_SLOPES,
        tables=(Table((
            R("Wqkv.weight", "query.kernel key.kernel value.kernel", LINEAR),
            R("Wqkv.bias", "query.bias key.bias value.bias", LINEAR),
            R("out_proj.weight", "output.kernel", LINEAR), R("out_proj.bias", "output.bias", LINEAR),
        ), ties=_HIDDEN_TIES),),
    ),
    Layout(
        "hf-falcon", "a Falcon checkpoint's attention: [prefix]h.{L}.self_attention.query_key_value with rows "
        "(K, N/K + 2, H) (new_decoder_architecture: K = num_kv_heads; multi_query: K = 1; else (N, 3, H)), "
        "self_attention.dense; config.json gives alibi (slopes by BLOOM's rule in bfloat16, times 1/sqrt(H), "
        "computed; the bias rounded to bfloat16 as Falcon builds it: alibi_bias_dtype) or half-split RoPE; causal",
        sep=".", scope="h.{layer}.self_attention.", select=True, hf=_falcon_config, needs_hf_config=True,
        pairing="half", qkv_per_head=("query_key_value.weight", "query_key_value.bias"), bias="all",
        bias_why="config.json's bias covers query_key_value and dense", derived=_SLOPES,
        tables=(Table((
            R("query_key_value.weight", "query.kernel key.kernel value.kernel", LINEAR),  # read as [q; k; v] blocks
            R("query_key_value.bias", "query.bias key.bias value.bias", LINEAR),
            R("dense.weight", "output.kernel", LINEAR), R("dense.bias", "output.bias", LINEAR),
        ), ties=_FALCON_TIES),),
    ),
)
