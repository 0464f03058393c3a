"""The latent-attention (MLA) layouts: transformers' DeepSeek V2 / V3 (and Kimi K2), and DeepSeek's own checkpoint.

| layout       | foreign key ([P]layers.{L}.<scope>)      | canonical                                   | form   |
|--------------|------------------------------------------|---------------------------------------------|--------|
| hf-deepseek  | self_attn.q_a_proj.weight / .bias        | query.down.kernel / query.down.bias         | linear |
|  (deepseek:  | self_attn.q_a_layernorm.weight           | query.down.norm.scale                       | 1-D    |
|   attn.wq_a, | self_attn.q_b_proj.weight                | query.kernel (Qr, N, H)                     | linear |
|   q_norm,    | self_attn.q_proj.weight (q_lora_rank null)| query.kernel (D, N, H)                     | linear |
|   wq_b, wq,  | self_attn.kv_a_proj_with_mqa.weight/.bias| latent.kernel / latent.bias (C + R)         | linear |
|   wkv_a,     | self_attn.kv_a_layernorm.weight          | latent.norm.scale                           | 1-D    |
|   kv_norm,   | self_attn.kv_b_proj.weight               | key.kernel + value.kernel, per head [H-R|V] | linear |
|   wkv_b, wo) | self_attn.o_proj.weight / .bias          | output.kernel / output.bias                 | linear |

The table engine (read.py, write.py) knows the plain projections only, so this family converts with its own
to_canonical / from_canonical (registry.py hands them these layouts); the tables below serve locate.py
(prefix, layer, detect_layout) and describe. Every conversion is transposes, reshapes and slicing: bit-exact.

DeepSeek V4 (deepseek_v4, issue 41): hf-deepseek (transformers' names) and deepseek (DeepSeek's own, with its
ModelArgs JSON) read and write its attention as config.compressed (weights.layouts.deepseek_v4: the names of both).

hf-deepseek reads config.json (transformers 4.x `rope_scaling` + `rope_theta` or 5.x `rope_parameters`) of
model types deepseek_v2, deepseek_v3, kimi_k2 (Kimi K2's released config: DeepSeek V3's architecture) and
kimi_k25 (its `text_config`). Facts, from transformers 5.23's modeling_deepseek_v2.py / modeling_deepseek_v3.py:
- RoPE pairing: V2's apply_rotary_emb views consecutive features (2i, 2i+1) as one complex number:
  interleaved. V3 rotates interleaved pairs when `rope_interleave` (default true) and half-split pairs
  (rotate_half) otherwise. The canonical config keeps the checkpoint's pairing, so its tensors are the
  checkpoint's own; V3's interleaved path writes its rotated features evens first, then odds, so its cached
  rotary key is the contract's `past_value` with the features in that order (a permutation, q . k unchanged).
- The softmax scale: (qk_nope_head_dim + qk_rope_head_dim)^-1/2, times mscale(factor, mscale_all_dim)^2
  (mscale(f, m) = 0.1 m ln f + 1 for f > 1, else 1) when the rope type is not "default" and mscale_all_dim is
  set (yarn_apply_mscale); `mscale` only enters RoPE's cos/sin factor (the contract's yarn attention_factor).
- Both latent norms (q_a_layernorm, kv_a_layernorm) are built without an eps: their class default, 1e-6, not
  rms_norm_eps.
- Biases: q_a_proj, kv_a_proj_with_mqa and o_proj carry one when attention_bias; q_proj, q_b_proj and
  kv_b_proj never. kv_b_proj expands the latent to num_attention_heads heads (num_key_value_heads is unused).

Sparse attention (DSA): deepseek_v32 (DeepSeek V3.2) and glm_moe_dsa (GLM-5) are V3's attention, RoPE always
interleaved (modeling_deepseek_v32.py:424, modeling_glm_moe_dsa.py:393), q_lora_rank required, plus a lightning
indexer on each "full" layer: self_attn.indexer.{wq_b,wk,k_norm,weights_proj} -> indexer.* (weights.layouts.indexer:
the field, the tensors; V3.2's indexer RoPE half-split, GLM-5's interleaved). GLM-5's "shared" layers
(indexer_types) hold no indexer: they convert without one and take the previous full layer's selection as their
topk_indices input.

deepseek: DeepSeek-V3's inference/convert.py renames transformers' keys (model. dropped, self_attn -> attn,
q_a_proj -> wq_a, q_a_layernorm -> q_norm, q_b_proj -> wq_b, q_proj -> wq, kv_a_proj_with_mqa -> wkv_a,
kv_a_layernorm -> kv_norm, kv_b_proj -> wkv_b, o_proj -> wo); its inference/model.py (MLA) holds no biases,
norms of eps 1e-6, and rotates interleaved pairs (torch.view_as_complex). Its config is ModelArgs' JSON
(inference/configs/config_*.json: dim, n_heads, q_lora_rank (0: none), kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim, rope_theta, and YaRN when max_seq_len > original_seq_len: rope_factor, beta_fast,
beta_slow, mscale; softmax scale times (0.1 mscale ln rope_factor + 1)^2); a transformers config.json of the
same model reads as hf-deepseek's. DeepSeek-V3.2-Exp's ModelArgs adds index_n_heads, index_head_dim, index_topk
(inference/model.py:89-91) and its MLA an Indexer under attn.indexer.{wq_b,wk,k_norm,weights_proj} (:431-444,
convert.py:30-33); the indexer's RoPE is read half-split (DeepSeek's fix after release; the release's code rotated
interleaved pairs: "indexer_rope_interleave": true in the config selects that). DeepSeek's Indexer always scores
in fp8 (Hadamard, act_quant, fp8_index: model.py:465-473, whatever `dtype`), so the ModelArgs reader sets
indexer.scoring_precision "fp8_e4m3", and fp8_scale_format "ue8m0" when `scale_fmt` is set (act_quant rounds its
scales for any scale_fmt: kernel.py:109), "float" when null (_deepseek_scoring). transformers' ports (hf-deepseek,
and deepseek with a transformers config.json) score in float32 without either (modeling_deepseek_v32.py:191-194,
:227): the field is left unset; `mha convert --indexer-scoring` sets or clears it on any source.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..config import AttentionConfig
from ..format import WeightsFormatError, validate_tensors
from .deepseek_v4 import is_v4_config, read_v4, v4_cannot_express, v4_names, write_v4
from .glm5_next import is_glm5_next_config, read_glm5_next
from .hf_rope import _hf_rope
from .indexer import indexer_field, indexer_layers, indexer_tensors, scoring_name
from .locate import _locate
from .read import shape_and_dtype_problems
from .table import (
    FROM_HINTS,
    HEADS,
    LINEAR,
    TO_HINTS,
    Catalogue,
    Layout,
    R,
    Table,
    Tie,
    _check_hints,
    _check_int,
    _load_hf_config,
    _names_hint,
)
from .write import _behaviour_differences

OWN_CONVERTER = True  # registry.py: this module converts its layouts (to_canonical, from_canonical, ...)
HF_DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v32", "glm_moe_dsa")
# the types with a lightning indexer (DSA): their full layers read self_attn.indexer.* (attn.indexer.* in deepseek)
DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")
# glm5_next (GLM-5.3-Flash) reads through its own reader (weights.layouts.glm5_next), as V4 does
# the indexer's keys under the attention scope (transformers' DeepseekV32Indexer / GlmMoeDsaIndexer and DeepSeek's
# own Indexer name them alike: DeepSeek-V3.2-Exp inference/model.py:441-444, convert.py:30-33)
INDEXER_KEYS = ("indexer.wq_b.weight", "indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
                "indexer.weights_proj.weight")
LATENT_EPS = 1e-6  # DeepseekV2/V3RMSNorm's default eps, which q_a_layernorm and kv_a_layernorm keep

# -- config files ----------------------------------------------------------------------------


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_params(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    params = cfg.get("rope_parameters")
    return params if isinstance(params, Mapping) else (cfg.get("rope_scaling") or {})


def _mla_scale(params: Mapping[str, Any], head_dim: int) -> float | None:
    """transformers' yarn_apply_mscale: None (the contract's default 1/sqrt(head_dim)) unless it changes it."""
    kind = params.get("rope_type", params.get("type", "default"))
    m_all = params.get("mscale_all_dim") or 0
    if kind == "default" or not m_all:
        return None
    if params.get("factor") is None:
        raise ValueError(f"hf_config: rope scaling with mscale_all_dim needs factor: got {dict(params)!r}")
    m = _yarn_mscale(float(params["factor"]), float(m_all))
    return head_dim ** -0.5 * m * m


def _latent_eps(cfg: Mapping[str, Any]) -> float:
    return LATENT_EPS


def _interleaved(model_type: str, cfg: Mapping[str, Any]) -> bool:
    if model_type in ("deepseek_v2",) + DSA_TYPES:
        # V2: complex multiplication of consecutive pairs; V3.2 and GLM-5's attention call
        # apply_rotary_pos_emb_interleave whatever the config says (modeling_deepseek_v32.py:424,
        # modeling_glm_moe_dsa.py:393)
        return True
    return bool(cfg.get("rope_interleave", True))  # DeepseekV3Config's default


def _text_config(cfg: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    model_type = cfg.get("model_type")
    if model_type == "kimi_k25":
        text = cfg.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError("hf_config: a kimi_k25 config.json needs text_config (its DeepSeek V3 language model)")
        cfg, model_type = text, text.get("model_type", "deepseek_v3")
    if model_type not in HF_DEEPSEEK_TYPES or model_type == "kimi_k25":
        raise ValueError(f"hf_config: model_type must be one of {', '.join(HF_DEEPSEEK_TYPES)} for hf-deepseek: "
                         f"got {model_type!r}")
    return ("deepseek_v3" if model_type == "kimi_k2" else model_type), cfg


def _need(cfg: Mapping[str, Any], keys, where: str) -> None:
    missing = [key for key in keys if cfg.get(key) is None]
    if missing:
        raise ValueError(f"hf_config: {where} needs {', '.join(missing)}: got none")


def _hf_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of a DeepSeek V2 / V3 / Kimi K2 model -> the block's AttentionConfig fields (every layer alike)."""
    model_type, cfg = _text_config(cfg)
    _need(cfg, ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim"), model_type)
    nope, rope_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    head_dim = nope + rope_dim
    bias = bool(cfg.get("attention_bias", False))
    query_rank = cfg.get("q_lora_rank")
    rope = _hf_rope(cfg, None, rope_dim, interleaved=_interleaved(model_type, cfg))
    kind, indexer = _dsa_layer(model_type, cfg, layer, rope, query_rank)
    return {
        "model_type": model_type,
        "indexer_kind": kind,
        "fields": {
            "num_heads": int(cfg["num_attention_heads"]), "query_dim": int(cfg["hidden_size"]), "head_dim": head_dim,
            "value_head_dim": int(cfg["v_head_dim"]), "use_query_bias": bias and query_rank is not None,
            "use_key_bias": bias, "use_value_bias": False, "use_output_bias": bias,
            "dropout": float(cfg.get("attention_dropout") or 0.0),
            "scale": _mla_scale(_rope_params(cfg), head_dim),
            "rope": rope,
            "latent": {"query_rank": query_rank, "kv_rank": int(cfg["kv_lora_rank"]), "rope_dim": rope_dim,
                       "eps": _latent_eps(cfg)},
            "indexer": indexer,
        },
    }


def _dsa_layer(model_type: str, cfg: Mapping[str, Any], layer: int | None, rope, query_rank,
               interleaved: bool | None = None) -> tuple[str | None, dict | None]:
    """(what block `layer` does, its indexer field): ("full", the field) for a layer with its own indexer,
    ("shared", None) for GLM-5's shared layer (no indexer: the previous full layer's selection is its
    topk_indices input), (None, None) for a model without an indexer. interleaved: the indexer's RoPE
    pairing when the reader knows it (deepseek); None: indexer_field's rule for model_type."""
    if model_type not in DSA_TYPES:
        return None, None
    if query_rank is None:
        raise ValueError(f"hf_config: {model_type} needs q_lora_rank (its indexer reads the normed query latent): "
                         "got none")
    kinds = indexer_layers(model_type, cfg)
    index = 0 if layer is None else layer
    if not 0 <= index < len(kinds):
        raise ValueError(f"layer must be in [0, {len(kinds)}) (num_hidden_layers): got {layer}")
    if kinds[index] != "full":
        return kinds[index], None
    field = indexer_field(model_type, cfg, rope)
    if interleaved is not None:
        field["rope"]["interleaved"] = interleaved
    return "full", field


# DeepSeek-V3's inference/model.py ModelArgs defaults for the fields its config files may leave out
_ARGS_DEFAULTS = {"q_lora_rank": 0, "rope_theta": 10000.0, "max_seq_len": 4096 * 4, "original_seq_len": 4096,
                  "rope_factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0}
# DeepSeek-V3.2-Exp's ModelArgs indexer fields and their defaults (inference/model.py:89-91)
_INDEX_ARGS = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}


def _deepseek_scoring(cfg: Mapping[str, Any]) -> dict[str, str]:
    """The indexer's scoring precision under DeepSeek's own V3.2 code (DeepSeek-V3.2-Exp at 3b99a53): its
    Indexer.forward quantises q and k with act_quant and scores them with fp8_index on every call
    (inference/model.py:465-473), whatever ModelArgs' `dtype` says (`dtype` picks the Linear weights' storage
    alone, model.py:865); `scale_fmt` is handed to act_quant (model.py:446, :467-468), which rounds its scales up
    to a power of two for any scale_fmt set and keeps amax / 448 for null (inference/kernel.py:109:
    round_scale=scale_fmt is not None). So: fp8_e4m3 always, ue8m0 for any scale_fmt string, float for null."""
    fmt = cfg.get("scale_fmt")
    if fmt is not None and not isinstance(fmt, str):
        raise ValueError(f"hf_config: scale_fmt must be null or a string (DeepSeek's config_671B_v3.2.json: "
                         f"\"ue8m0\"): got {fmt!r}")
    return {"scoring_precision": "fp8_e4m3", "fp8_scale_format": "float" if fmt is None else "ue8m0"}


def _deepseek_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """DeepSeek's ModelArgs JSON (or a transformers config.json of the same model) -> the block's fields."""
    if "model_type" in cfg:
        return _hf_config(cfg, layer)
    _need(cfg, ("dim", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
          "DeepSeek's ModelArgs config")
    args = {**_ARGS_DEFAULTS, **cfg}
    rope_dim = int(args["qk_rope_head_dim"])
    head_dim = int(args["qk_nope_head_dim"]) + rope_dim
    scaling, scale = None, None
    if args["max_seq_len"] > args["original_seq_len"]:  # MLA.__init__ and precompute_freqs_cis turn YaRN on
        factor, mscale = float(args["rope_factor"]), float(args["mscale"])
        scaling = {"type": "yarn", "factor": factor, "original_max_position_embeddings": int(args["original_seq_len"]),
                   "beta_fast": float(args["beta_fast"]), "beta_slow": float(args["beta_slow"]),
                   "attention_factor": 1.0}  # its cos and sin are not scaled
        scale = head_dim ** -0.5 * _yarn_mscale(factor, mscale) ** 2
    query_rank = int(args["q_lora_rank"]) or None
    rope = {"theta": float(args["rope_theta"]), "rotary_dim": rope_dim, "interleaved": True, "scaling": scaling}
    kind, indexer = None, None
    if any(key in cfg for key in _INDEX_ARGS):  # V3.2's ModelArgs (V3's JSON names no index_* field)
        index_args = {**_INDEX_ARGS, **cfg}
        hf_like = {"num_hidden_layers": 1, "qk_rope_head_dim": rope_dim, **{k: index_args[k] for k in _INDEX_ARGS}}
        kind, indexer = _dsa_layer("deepseek_v32", hf_like, None, rope, query_rank,
                                   interleaved=bool(cfg.get("indexer_rope_interleave", False)))
        indexer = {**indexer, **_deepseek_scoring(cfg)}
    return {
        "model_type": "deepseek",
        "indexer_kind": kind,
        "fields": {
            "num_heads": int(args["n_heads"]), "query_dim": int(args["dim"]), "head_dim": head_dim,
            "value_head_dim": int(args["v_head_dim"]), "use_query_bias": False, "use_key_bias": False,
            "use_value_bias": False, "use_output_bias": False, "scale": scale,
            "rope": rope,
            "latent": {"query_rank": query_rank, "kv_rank": int(args["kv_lora_rank"]), "rope_dim": rope_dim,
                       "eps": LATENT_EPS},
            "indexer": indexer,
        },
    }


# -- the tables (for locate.py and describe; the conversion is below) ---------------------------

# role -> key (without .weight / .bias) in each layout
_KEYS = {
    "hf-deepseek": {"q_down": "q_a_proj", "q_norm": "q_a_layernorm", "q_up": "q_b_proj", "q": "q_proj",
                    "latent": "kv_a_proj_with_mqa", "latent_norm": "kv_a_layernorm", "kv_up": "kv_b_proj",
                    "out": "o_proj"},
    "deepseek": {"q_down": "wq_a", "q_norm": "q_norm", "q_up": "wq_b", "q": "wq", "latent": "wkv_a",
                 "latent_norm": "kv_norm", "kv_up": "wkv_b", "out": "wo"},
}
_TIES = (Tie("value_dim", "key_dim", "keys and values both come from the key input's latent"),)


def _tables(keys: Mapping[str, str], biases: bool) -> tuple[Table, ...]:
    def rows(*entries):  # (key, canonical, is a bias)
        return tuple(R(key, parts, HEADS if ".norm." in parts else LINEAR) for key, parts, bias in entries
                     if biases or not bias)

    tail = rows((f"{keys['latent']}.weight", "latent.kernel", False), (f"{keys['latent']}.bias", "latent.bias", True),
                (f"{keys['latent_norm']}.weight", "latent.norm.scale", False),
                (f"{keys['kv_up']}.weight", "key.kernel value.kernel", False),
                (f"{keys['out']}.weight", "output.kernel", False), (f"{keys['out']}.bias", "output.bias", True))
    note = f"{keys['kv_up']}'s rows, per head: H - R key features, then V value features"
    return (
        Table(rows((f"{keys['q_down']}.weight", "query.down.kernel", False),
                   (f"{keys['q_down']}.bias", "query.down.bias", True),
                   (f"{keys['q_norm']}.weight", "query.down.norm.scale", False),
                   (f"{keys['q_up']}.weight", "query.kernel", False)) + tail, ties=_TIES,
              note=f"query_rank set; {note}"),
        Table(rows((f"{keys['q']}.weight", "query.kernel", False)) + tail, ties=_TIES,
              note=f"query_rank null; {note}"),
    )


FAMILY = (
    Layout(
        "hf-deepseek", "transformers' DeepSeek V2 / V3 latent attention (deepseek_v2, deepseek_v3, Kimi K2's "
        "kimi_k2, kimi_k25's text_config) and their sparse successors (deepseek_v32, glm_moe_dsa: plus "
        "indexer.{wq_b,wk,k_norm,weights_proj} on layers with an indexer): [prefix]layers.{L}.self_attn.{q_a_proj,"
        "q_a_layernorm,q_b_proj | q_proj,kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_proj}; config.json gives rope, "
        "scale, biases, the indexer; causal. DeepSeek V4 (deepseek_v4): its sliding, csa and hca layers "
        "(config.compressed: q_a_proj,q_a_norm,q_b_proj,kv_proj,kv_norm,o_a_proj,o_b_proj,sinks,compressor.*)",
        sep=".", scope="layers.{layer}.self_attn.", select=True, hf=_hf_config, needs_hf_config=True,
        tables=_tables(_KEYS["hf-deepseek"], biases=True),
    ),
    Layout(
        "deepseek", "DeepSeek's own inference checkpoint (DeepSeek-V3 inference/convert.py names): "
        "[prefix]layers.{L}.attn.{wq_a,q_norm,wq_b | wq,wkv_a,kv_norm,wkv_b,wo}.weight (V3.2: and "
        "indexer.{wq_b,wk,k_norm,weights_proj}; V4: wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink,compressor.*,"
        "indexer.*); its ModelArgs config.json beside it; interleaved RoPE pairs; no biases; causal",
        sep=".", scope="layers.{layer}.attn.", select=True, hf=_deepseek_config, needs_hf_config=True,
        pairing="interleaved", tables=_tables(_KEYS["deepseek"], biases=False),
    ),
)

# -- the rotary features' pairing ----------------------------------------------------------------


def _repair_latent_pairing(config: AttentionConfig, tensors: Mapping[str, np.ndarray], interleaved: bool):
    """(config, tensors) rotating in pairing `interleaved`, computing the same numbers: the last R features of
    every query head and of the latent projection (the shared rotary key) permuted alike."""
    if config.rope.interleaved == interleaved:
        return config, dict(tensors)
    R_ = config.latent.rope_dim
    half = np.concatenate([np.arange(0, R_, 2), np.arange(1, R_, 2)])  # interleaved -> half-split
    perm = np.argsort(half) if interleaved else half
    out = dict(tensors)
    for name in ("query.kernel", "query.bias", "latent.kernel", "latent.bias"):
        if name in out:
            array = np.array(out[name], copy=True)
            array[..., -R_:] = array[..., -R_:][..., perm]
            out[name] = np.ascontiguousarray(array)
    return config.replace(rope=dataclasses.replace(config.rope, interleaved=interleaved)), out


def _repair_indexer_pairing(config: AttentionConfig, tensors: Mapping[str, np.ndarray], interleaved: bool):
    """(config, tensors) whose indexer rotates in pairing `interleaved`, computing the same index scores: the
    first R features of every index query head, of the index key and of its LayerNorm's scale and bias
    permuted alike (the norm is taken over all J features, so a permutation of them commutes with it)."""
    ix = config.indexer
    if ix is None or ix.rope is None or ix.rope.interleaved == interleaved:
        return config, dict(tensors)
    if ix.rope_end != "first":
        raise ValueError(f"indexer.rope_end={ix.rope_end!r}: a DSA indexer turns its first features")
    R_ = ix.rope.rotary_dim
    half = np.concatenate([np.arange(0, R_, 2), np.arange(1, R_, 2)])  # interleaved -> half-split
    perm = np.argsort(half) if interleaved else half
    out = dict(tensors)
    for name in ("indexer.query.kernel", "indexer.key.kernel", "indexer.key.norm.scale", "indexer.key.norm.bias"):
        array = np.array(out[name], copy=True)
        array[..., :R_] = array[..., :R_][..., perm]
        out[name] = np.ascontiguousarray(array)
    rope = dataclasses.replace(ix.rope, interleaved=interleaved)
    return config.replace(indexer=dataclasses.replace(ix, rope=rope)), out


# -- canonical <-> state -----------------------------------------------------------------------


def _state_of(config: AttentionConfig, tensors: Mapping[str, np.ndarray], keys: Mapping[str, str], base: str
              ) -> dict[str, tuple[np.ndarray, tuple[str, ...]]]:
    """Canonical tensors -> {foreign key: (array, the canonical tensors it holds)}."""
    N, H, V = config.num_heads, config.head_dim, config.value_head_dim
    R_ = config.latent.rope_dim
    out: dict[str, tuple[np.ndarray, tuple[str, ...]]] = {}

    def put(role, suffix, array, *names):
        out[f"{base}{keys[role]}.{suffix}"] = (np.ascontiguousarray(array), names)

    if config.latent.query_rank is not None:
        put("q_down", "weight", tensors["query.down.kernel"].T, "query.down.kernel")
        if "query.down.bias" in tensors:
            put("q_down", "bias", tensors["query.down.bias"], "query.down.bias")
        put("q_norm", "weight", tensors["query.down.norm.scale"], "query.down.norm.scale")
        put("q_up", "weight", tensors["query.kernel"].reshape(-1, N * H).T, "query.kernel")  # (N*H, Qr)
    else:
        put("q", "weight", tensors["query.kernel"].reshape(-1, N * H).T, "query.kernel")  # (N*H, D)
        if "query.bias" in tensors:
            put("q", "bias", tensors["query.bias"].reshape(-1), "query.bias")
    put("latent", "weight", tensors["latent.kernel"].T, "latent.kernel")  # (C + R, D)
    if "latent.bias" in tensors:
        put("latent", "bias", tensors["latent.bias"], "latent.bias")
    put("latent_norm", "weight", tensors["latent.norm.scale"], "latent.norm.scale")
    kv = np.concatenate([tensors["key.kernel"], tensors["value.kernel"]], axis=-1)  # (C, N, H - R + V)
    put("kv_up", "weight", kv.reshape(kv.shape[0], N * (H - R_ + V)).T, "key.kernel", "value.kernel")
    put("out", "weight", tensors["output.kernel"].reshape(N * V, -1).T, "output.kernel")  # (O, N*V)
    if "output.bias" in tensors:
        put("out", "bias", tensors["output.bias"], "output.bias")
    if config.indexer is not None:  # nn.Linear weights (out, in); the LayerNorm's scale and bias as they are
        I_, J_ = config.indexer.heads, config.indexer.head_dim
        for key, array, name in (
                ("indexer.wq_b.weight", tensors["indexer.query.kernel"].reshape(-1, I_ * J_).T, "indexer.query.kernel"),
                ("indexer.wk.weight", tensors["indexer.key.kernel"].T, "indexer.key.kernel"),
                ("indexer.k_norm.weight", tensors["indexer.key.norm.scale"], "indexer.key.norm.scale"),
                ("indexer.k_norm.bias", tensors["indexer.key.norm.bias"], "indexer.key.norm.bias"),
                ("indexer.weights_proj.weight", tensors["indexer.weights.kernel"].T, "indexer.weights.kernel")):
            out[f"{base}{key}"] = (np.ascontiguousarray(array), (name,))
    return out


def _gather(config: AttentionConfig, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{role.suffix: foreign array} -> canonical tensors (the inverse of _state_of)."""
    N, H, V = config.num_heads, config.head_dim, config.value_head_dim
    R_ = config.latent.rope_dim
    t: dict[str, np.ndarray] = {}
    if config.latent.query_rank is not None:
        t["query.down.kernel"] = arrays["q_down.weight"].T
        if "q_down.bias" in arrays:
            t["query.down.bias"] = arrays["q_down.bias"]
        t["query.down.norm.scale"] = arrays["q_norm.weight"]
        t["query.kernel"] = arrays["q_up.weight"].T.reshape(-1, N, H)  # (Qr, N, H)
    else:
        t["query.kernel"] = arrays["q.weight"].T.reshape(-1, N, H)  # (D, N, H)
        if "q.bias" in arrays:
            t["query.bias"] = arrays["q.bias"].reshape(N, H)
    t["latent.kernel"] = arrays["latent.weight"].T  # (D, C + R)
    if "latent.bias" in arrays:
        t["latent.bias"] = arrays["latent.bias"]
    t["latent.norm.scale"] = arrays["latent_norm.weight"]
    kv = arrays["kv_up.weight"].T.reshape(-1, N, H - R_ + V)  # (C, N, H - R + V)
    t["key.kernel"], t["value.kernel"] = kv[..., :H - R_], kv[..., H - R_:]
    t["output.kernel"] = arrays["out.weight"].T.reshape(N, V, -1)  # (N, V, O)
    if "out.bias" in arrays:
        t["output.bias"] = arrays["out.bias"]
    if config.indexer is not None:
        state = {key[len("indexer."):]: arrays[key] for key in INDEXER_KEYS}
        t.update(indexer_tensors("deepseek_v32", state, heads=config.indexer.heads))
    shapes = config.tensor_shapes()
    return {name: np.array(t[name], order="C", copy=True) for name in shapes if name in t}


def to_canonical(catalogue: Catalogue, layout: str, state: Mapping[str, Any], /,
                 **hints: Any) -> tuple[AttentionConfig, dict[str, np.ndarray]]:
    """weights.layouts.to_canonical for hf-deepseek and deepseek: the sizes come from the config file, every
    missing, unexpected, mis-shaped or mis-typed key of the block is listed in one WeightsFormatError."""
    lay = catalogue.get(layout)
    _check_hints("to_canonical", lay, hints, TO_HINTS)
    hints = {k: v for k, v in hints.items() if v is not None}
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a mapping of names to numpy arrays: got {type(state).__name__}")
    _names_hint(catalogue, lay, hints.get("names"))  # fixed names: a names hint is refused there
    cfg = _load_hf_config(hints.get("hf_config"))
    if cfg is None:
        raise ValueError(f"hf_config: {lay.id} reads the sizes, RoPE and scale from the checkpoint's config file "
                         "(a dict or the path of config.json; CLI: beside SRC): got None")
    ignore = hints.get("ignore") or ()
    ignore = (ignore,) if isinstance(ignore, str) else tuple(ignore)
    visible = {k: v for k, v in state.items()
               if isinstance(k, str) and not any(fnmatch.fnmatchcase(k, p) for p in ignore)}
    place = _locate(lay, visible, None, hints.get("prefix"), hints.get("layer"))
    if is_v4_config(cfg):  # issue 41: DeepSeek V4's layer, its own reader (transformers' or DeepSeek's names)
        return read_v4(lay.id, cfg, visible, place.base(lay), place.layer,
                       names="deepseek" if lay.id == "deepseek" else "hf")
    if is_glm5_next_config(cfg) and lay.id == "hf-deepseek":  # GLM-5.3-Flash: NoPE MLA, k-pool indexer
        return read_glm5_next(lay.id, cfg, visible, place.base(lay), place.layer or 0)
    facts = lay.hf(cfg, place.layer)
    fields = dict(facts["fields"])
    heads = hints.get("num_heads")
    if heads is not None and heads != fields["num_heads"]:
        raise ValueError(f"num_heads={heads} disagrees with the checkpoint's config file ({fields['num_heads']})")
    fields.update({k: hints[k] for k in ("scale", "dropout", "masked_row") if k in hints})
    try:
        config = AttentionConfig(**fields)
    except ValueError as err:
        raise ValueError(f"hf_config: {err}") from None
    base = place.base(lay)
    keys = _KEYS[lay.id]
    expected = {key: tuple(int(d) for d in array.shape)
                for key, (array, _) in _state_of(config, _zeros(config), keys, base).items()}
    problems = []
    missing = [key for key in expected if key not in visible]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    unexpected = sorted(k for k in visible if k.startswith(base) and k not in expected)
    if unexpected:
        kind = facts.get("indexer_kind")
        shown = f", this layer's indexer: {kind}" if kind else ""
        problems.append(f"unexpected {', '.join(unexpected)} (config file: q_lora_rank="
                        f"{config.latent.query_rank}, biases {config.use_key_bias}{shown})")
    problems += shape_and_dtype_problems(expected, visible)
    if problems:
        raise WeightsFormatError(f"{lay.id}: " + "; ".join(problems))
    role_of = {f"{base}{key}.{suffix}": f"{role}.{suffix}" for role, key in keys.items() for suffix in ("weight", "bias")}
    role_of.update({f"{base}{key}": key for key in INDEXER_KEYS})
    tensors = _gather(config, {role_of[key]: visible[key] for key in expected})
    validate_tensors(config, tensors, source=lay.id)  # internal invariant: every tensor read
    return config, tensors


def cannot_express(catalogue: Catalogue, layout: str, config: AttentionConfig, /, *, table=None) -> list[str]:
    """Why the layout cannot hold config's tensors, one line per field (behaviour fields never refuse)."""
    lay = catalogue.get(layout)
    if config.compressed is not None:
        return v4_cannot_express(lay.id, config)
    if config.latent is None:
        return [f"latent=None ({lay.id} holds latent attention (MLA) or DeepSeek V4's layer (compressed) only)"]
    problems = []
    for field, equals, why in (("num_kv_heads", "num_heads", "kv_b_proj expands the latent to every query head"),
                               ("key_dim", "query_dim", "the latent is projected from the hidden states"),
                               ("out_dim", "query_dim", "the output projection maps back to hidden_size")):
        if getattr(config, field) != getattr(config, equals):
            problems.append(f"{field}={getattr(config, field)} (needs {field} == {equals}={getattr(config, equals)}: "
                            f"{why})")
    flags = {"use_query_bias": config.use_query_bias, "use_key_bias": config.use_key_bias,
             "use_output_bias": config.use_output_bias}
    if lay.id == "deepseek":
        problems += [f"{flag}=True (DeepSeek's MLA has no biases)" for flag, on in flags.items() if on]
    else:
        if config.latent.query_rank is None:  # q_proj has no bias; attention_bias reaches q_a_proj only
            if flags.pop("use_query_bias"):
                problems.append("use_query_bias=True (q_proj has no bias in transformers' DeepSeek attention)")
        if len(set(flags.values())) > 1:
            shown = ", ".join(f"{flag}={on}" for flag, on in flags.items())
            problems.append(f"{shown} (one attention_bias flag sets them all)")
    for field, on in (("use_sinks", config.use_sinks), ("alibi", config.alibi),
                      ("output_gate", config.output_gate is not None)):
        if on:
            problems.append(f"{field}={getattr(config, field)!r} ({lay.id} holds no such tensor)")
    if config.indexer is not None:
        problems += _indexer_problems(config)
    return problems


def _indexer_problems(config: AttentionConfig) -> list[str]:
    """Why a DSA indexer.{wq_b,wk,k_norm,weights_proj} cannot hold config.indexer (DeepSeek V3.2's and GLM-5's
    indexer: from the normed query latent, a LayerNorm on the key, RoPE on the first features, head weights,
    ReLU, one selection of keys per query)."""
    ix, problems = config.indexer, []
    wanted = (("query_source", "latent", "wq_b reads the normed query latent"),
              ("query_norm", None, "no norm on the index query"),
              ("rope_end", "first", "the rotary features come first"),
              ("head_weights", True, "weights_proj gives the head weights"), ("relu", True, "a ReLU per head"),
              ("per_kv_head", False, "one selection per query"), ("block_size", None, "keys, not blocks"))
    for field, want, why in wanted:
        if getattr(ix, field) != want:
            problems.append(f"indexer.{field}={getattr(ix, field)!r} (needs {want!r}: {why})")
    if ix.key_norm is None or ix.key_norm.type != "layer":
        problems.append(f"indexer.key_norm={ix.key_norm!r} (needs a layer norm: k_norm is a LayerNorm with a bias)")
    if config.latent.query_rank is None:
        problems.append("latent.query_rank=None (the indexer reads the query latent: q_lora_rank is needed)")
    return problems


def from_canonical(catalogue: Catalogue, layout: str, config: AttentionConfig, tensors: Mapping[str, np.ndarray], /,
                   **hints: Any) -> dict[str, np.ndarray]:
    """weights.layouts.from_canonical for hf-deepseek and deepseek. The rotary rows are written in the
    destination's pairing: deepseek's interleaved; hf-deepseek's from hf_config when given (V2: interleaved;
    V3: rope_interleave), else config's own. The indexer's likewise: deepseek's half-split (DeepSeek's fixed
    V3.2), hf-deepseek's the model type's (V3.2 half-split, GLM-5 interleaved) when hf_config is given. With hf_config the block is read back under it and must mean
    what config says."""
    lay = catalogue.get(layout)
    _check_hints("from_canonical", lay, hints, FROM_HINTS)
    hints = {k: v for k, v in hints.items() if v is not None}
    if not isinstance(config, AttentionConfig):
        raise ValueError(f"config must be an AttentionConfig: got {type(config).__name__}")
    _names_hint(catalogue, lay, hints.get("names"))
    prefix = hints.get("prefix") or ""
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a string: got {prefix!r}")
    layer = _check_int("layer", hints.get("layer", 0))
    cfg = _load_hf_config(hints.get("hf_config"))
    if config.compressed is not None:  # issue 41: DeepSeek V4's layer
        return write_v4(catalogue, lay, config, tensors, prefix, layer, cfg)
    problems = cannot_express(catalogue, lay.id, config)
    if problems:
        raise ValueError(f"{lay.id} cannot express " + "; ".join(problems))
    validate_tensors(config, tensors, source="canonical tensors")
    if lay.pairing:
        target = lay.pairing == "interleaved"
    elif cfg is not None:
        target = lay.hf(cfg, layer)["fields"]["rope"]["interleaved"]
    else:
        target = config.rope.interleaved
    config, tensors = _repair_latent_pairing(config, tensors, target)
    if config.indexer is not None:  # the indexer's pairing: the destination's rule (deepseek: DeepSeek's fixed,
        # half-split form unless its config says otherwise; hf-deepseek: the model type's), else config's own
        if cfg is not None:
            index_rope = lay.hf(cfg, layer)["fields"]["indexer"]
            index_target = config.indexer.rope.interleaved if index_rope is None else index_rope["rope"]["interleaved"]
        else:
            index_target = False if lay.id == "deepseek" else config.indexer.rope.interleaved
        config, tensors = _repair_indexer_pairing(config, tensors, index_target)
    base = prefix + lay.scope.format(layer=layer)
    state = {key: array for key, (array, _) in _state_of(config, tensors, _KEYS[lay.id], base).items()}
    if cfg is not None:
        read, _ = to_canonical(catalogue, lay.id, state, hf_config=cfg, layer=layer, prefix=prefix)
        differ = _behaviour_differences(config, read)
        if differ:
            scoring = [(ix.scoring_precision, ix.fp8_scale_format) for ix in (config.indexer, read.indexer)
                       if ix is not None]
            if len(scoring) == 2 and scoring[0] != scoring[1]:  # DeepSeek's fp8 scoring vs transformers' plain one
                differ.append(f"the indexer scores as {scoring_name(*scoring[0])}, the destination's code as "
                              f"{scoring_name(*scoring[1])} (mha convert --indexer-scoring sets it)")
            raise ValueError(f"hf_config disagrees with config for {lay.id} block {layer}: " + "; ".join(differ))
    return state



def mapping(catalogue: Catalogue, layout: str, config: AttentionConfig, /, **hints: Any) -> dict[str, tuple[str, ...]]:
    """Which canonical tensors each key of from_canonical's state holds."""
    lay = catalogue.get(layout)
    state = from_canonical(catalogue, layout, config, _zeros(config), **hints)
    hints = {k: v for k, v in hints.items() if v is not None}
    base = (hints.get("prefix") or "") + lay.scope.format(layer=hints.get("layer", 0))
    if config.compressed is not None:
        names = "deepseek" if lay.id == "deepseek" else "hf"
        return {base + key: (name,) for name, key in v4_names(config, names).items()}
    held = _state_of(config, _zeros(config), _KEYS[lay.id], base)
    return {key: held[key][1] for key in state}


def _zeros(config: AttentionConfig) -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, np.float32) for name, shape in config.tensor_shapes().items()}
