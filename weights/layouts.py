"""Foreign weight layouts <-> the canonical tensors: one named table per layout.

NumPy only, never a framework: a layout's `state` maps its own tensor names to
NumPy arrays (the impl_*/native.py modules and conformance/files.py turn live
objects and files into such dicts).

    to_canonical(layout, state, **hints) -> (AttentionConfig, tensors)
    from_canonical(layout, config, tensors, **hints) -> state

How to read a table
-------------------
Every canonical tensor has a *flat view*: a projection kernel (in, heads, width)
is the matrix (in, heads*width), heads outermost (exactly what
impl_numpy's split_heads undoes); the output kernel (N, V, O) is (N*V, O); a
bias is its flat vector. A row names one foreign tensor, the canonical
tensor(s) it holds, and its *form*:

    linear  torch nn.Linear, HF BERT:       weight = flat.T (out, in); bias = flat
    dense   Keras Dense, HF GPT-2 Conv1D:   kernel = flat (in, out); bias = flat
    heads   Keras EinsumDense, Flax         the canonical shape itself
            DenseGeneral, canonical:

A row naming several canonical tensors holds them concatenated along the
feature (out) axis in that order: torch `in_proj_weight` = [Wq; Wk; Wv], GPT-2
`c_attn` = [q | k | v]. A key with `{i}` repeats for each head i and holds that
head's slice (kernel[:, i, :], bias[i]). Conversion is transposes, reshapes,
concatenation and slicing only, so every round trip is bit-exact in every dtype.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| canonical         | query.kernel, query.bias, ... output.bias         | the same                   | heads  |
| torch-mha         | in_proj_weight (3E, E), in_proj_bias (3E)         | query+key+value            | linear |
|   (kdim/vdim != E)| q_proj_weight, k_proj_weight, v_proj_weight       | query / key / value.kernel | linear |
|                   | out_proj.weight (E, E), out_proj.bias             | output                     | linear |
| torch-linears     | {query}.weight/.bias  W_query  (N*H, D)           | query                      | linear |
|                   | {key} W_key, {value} W_value, {output} out_proj   | key, value, output         | linear |
| torch-fused-qkv   | {qkv}.weight (3*N*H, D) qkv (or qkv_proj), .bias  | query+key+value            | linear |
|                   | {output}.weight (O, N*H) proj (or out_proj)       | output                     | linear |
| torch-per-head    | heads.{i}.W_q.weight (H, D), .bias; W_k; W_v      | head i of query/key/value  | linear |
|                   | fc_out.weight (O, N*V), fc_out.bias               | output                     | linear |
| keras-split-heads | WQ/kernel (D, N*H), WQ/bias; WK; WV               | query, key, value          | dense  |
|                   | WO/kernel (N*V, O), WO/bias                       | output                     | dense  |
| keras-mha         | query/kernel (D, N, H), query/bias; key; value    | query, key, value          | heads  |
|                   | attention_output/kernel (N, V, O), .../bias       | output                     | heads  |
| flax-linen-mha    | query/kernel (D, N, H) ...; out/kernel (N, H, O)  | query ... output           | heads  |
| flax-nnx-mha      | the same keys as flax-linen-mha (GQA allowed)     | query ... output           | heads  |
| hf-bert           | [P]encoder.layer.{L}.attention.self.query.weight  | query (key, value alike)   | linear |
|                   | [P]encoder.layer.{L}.attention.output.dense.weight| output                     | linear |
| hf-gpt2           | [P]h.{L}.attn.c_attn.weight (E, 3E), .bias        | query+key+value            | dense  |
|                   | [P]h.{L}.attn.c_proj.weight (E, E), .bias         | output                     | dense  |
| hf-llama          | [P]layers.{L}.self_attn.q_proj.weight (N*H, D)... | query, key, value, output  | linear |
|   (phi3)          | [P]layers.{L}.self_attn.qkv_proj.weight           | query+key+value            | linear |
|                   | q_norm.weight, k_norm.weight (H,) or (N*H,), sinks| query/key.norm.scale, sinks| 1-D    |
| hf-gpt-neox       | [P]layers.{L}.attention.query_key_value (N, 3, H) | query+key+value, per head  | linear |
|                   | [P]layers.{L}.attention.dense.weight, .bias       | output                     | linear |
| hf-gptj           | [P]h.{L}.attn.{q,k,v,out}_proj.weight             | query ... output           | linear |
| meta-llama        | [P]layers.{L}.attention.{wq,wk,wv,wo}.weight      | query ... output           | linear |

What a layout cannot express (from_canonical raises ValueError naming the
field and value; the same rules shape-check to_canonical):
- torch-mha: num_kv_heads == num_heads, value_head_dim == head_dim,
  query_dim == out_dim == num_heads*head_dim, and with kdim == vdim ==
  embed_dim the packed in_proj_weight (else q/k/v_proj_weight); one `bias`
  flag for all four projections.
- torch-fused-qkv: one input (key_dim == value_dim == query_dim), equal q/k/v
  widths (no GQA, value_head_dim == head_dim); q, k, v biases together.
- torch-per-head: no GQA (each head owns its key and value projection).
- keras-mha: no GQA; one use_bias. flax-linen-mha: no GQA, value_head_dim ==
  head_dim, one use_bias. flax-nnx-mha: value_head_dim == head_dim, key_dim ==
  value_dim (in_kv_features), one use_bias; GQA allowed (num_kv_heads).
- hf-bert, hf-gpt2: every dimension is hidden_size = num_heads*head_dim, no
  GQA, all four biases present.
- torch-linears, keras-split-heads and canonical express every config.
- hf-llama, hf-gpt-neox, hf-gptj, meta-llama (the decoders): their config file
  is required (hf_config: config.json, Meta's params.json): RoPE, windows,
  softcap, QK-norm and sinks live only there (docs/porting-modern.md says what
  each model's fields mean). Each stores RoPE for one pairing (half-split:
  hf-llama, hf-gpt-neox; interleaved: hf-gptj, meta-llama); from_canonical
  permutes the q and k features of each head of a config in the other
  pairing (repair_pairing), so the written block computes the same numbers.
  Gemma's norm weights are w of (1 + w): the canonical multiplier is 1 + w,
  the one conversion that is an addition (exact to one rounding, not bit-exact).
  from_canonical with hf_config writes what that config file's model stores
  (Gemma's w, phi3's fused qkv_proj) and checks the block reads back under
  it with the same config.
Behaviour fields (scale, dropout, masked_row) live in no state dict: they come
from hints (`scale=`, `dropout=`, `masked_row=`), and for hf-* from the
checkpoint's config.json (`hf_config=`: attention dropout, GPT-2's
scale_attn_weights and scale_attn_by_inverse_layer_idx). from_canonical drops
them. GPT-2 is causal: call the converted weights with is_causal=True.

Hints
-----
num_heads   for layouts that flatten the heads (torch-*, keras-split-heads,
            hf-*); checked against the heads a layout stores visibly.
names       role -> module name ({"query": "W_q", ...}) or the names in role
            order (torch-linears, torch-fused-qkv, torch-per-head,
            keras-split-heads; see ROLES).
prefix      what precedes the table's keys ("attn.", "params/",
            "layers/multi_head_attention/", "bert."). Detected when left out:
            a unique prefix under which the first row's key exists. Keys
            outside the prefix belong to other modules and are ignored; keys
            inside it that the table does not name are errors (hf-* read
            their rows out of a whole checkpoint and ignore the rest).
ignore      fnmatch patterns of keys to skip (buffers, optimizer state).
layer       hf-*, meta-llama: which block; needed when the checkpoint has several.
hf_config   hf-*, meta-llama: the checkpoint's config.json (params.json), as a dict or a path.
config      canonical only: the AttentionConfig to check the tensors against.

Every problem with a state is collected and raised as ONE WeightsFormatError:
missing keys, unexpected keys, wrong shapes, wrong or mixed dtypes, NaN/Inf.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .config import AttentionConfig
from .dtypes import DTYPES, resolve_dtype
from .format import WeightsFormatError, validate_tensors

LINEAR, DENSE, HEADS = "linear", "dense", "heads"

# Shape letters (impl_numpy's) <-> AttentionConfig fields. D, Dk, Dv are the
# query, key and value input features.
FIELDS = {
    "N": "num_heads", "K": "num_kv_heads", "H": "head_dim", "V": "value_head_dim",
    "D": "query_dim", "Dk": "key_dim", "Dv": "value_dim", "O": "out_dim",
}
LETTER = {field: letter for letter, field in FIELDS.items()}

# A size is a sum of products of letters: (("N", "H"),) is N*H.
# Canonical axes, the flat view, and one head's slice, per tensor.
AXES = {
    "query.kernel": ("D", "N", "H"), "query.bias": ("N", "H"),
    "key.kernel": ("Dk", "K", "H"), "key.bias": ("K", "H"),
    "value.kernel": ("Dv", "K", "V"), "value.bias": ("K", "V"),
    "output.kernel": ("N", "V", "O"), "output.bias": ("O",),
}
FLAT = {
    "query.kernel": (("D",), ("N", "H")), "query.bias": (("N", "H"),),
    "key.kernel": (("Dk",), ("K", "H")), "key.bias": (("K", "H"),),
    "value.kernel": (("Dv",), ("K", "V")), "value.bias": (("K", "V"),),
    "output.kernel": (("N", "V"), ("O",)), "output.bias": (("O",),),
}
HEAD = {
    "query.kernel": (("D",), ("H",)), "query.bias": (("H",),),
    "key.kernel": (("Dk",), ("H",)), "key.bias": (("H",),),
    "value.kernel": (("Dv",), ("V",)), "value.bias": (("V",),),
}
BIAS_FLAG = {
    "query.bias": "use_query_bias", "key.bias": "use_key_bias",
    "value.bias": "use_value_bias", "output.bias": "use_output_bias",
}

TO_HINTS = frozenset({"num_heads", "names", "prefix", "ignore", "layer", "hf_config", "config",
                      "scale", "dropout", "masked_row"})
FROM_HINTS = frozenset({"names", "prefix", "layer", "hf_config"})


# -- the table vocabulary --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Row:
    key: str  # foreign name relative to the prefix; {role} and {i} (head index) are filled in
    parts: tuple[str, ...]  # canonical tensors, concatenated along the feature axis
    form: str  # LINEAR | DENSE | HEADS

    @property
    def is_bias(self) -> bool:
        return self.parts[0].endswith(".bias")

    @property
    def per_head(self) -> bool:
        return "{i}" in self.key


@dataclasses.dataclass(frozen=True)
class Tie:
    field: str  # a config field this layout cannot set freely ...
    equals: str  # ... because it always equals this product of fields
    why: str

    @property
    def letter(self) -> str:
        return LETTER[self.field]

    @property
    def product(self) -> tuple[str, ...]:
        return tuple(LETTER[f] for f in self.equals.split("*"))


@dataclasses.dataclass(frozen=True)
class Table:
    rows: tuple[Row, ...]
    ties: tuple[Tie, ...] = ()
    when: Callable[[AttentionConfig], bool] | None = None  # from_canonical picks the first table this accepts
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Layout:
    id: str
    description: str
    tables: tuple[Table, ...]
    sep: str  # what joins module names in this layout's keys
    roles: tuple[dict[str, str], ...] = ({},)  # default module names; alternatives accepted on read
    bias: str = "each"  # "each": any bias may be absent; "all": all or none; "required": always present
    bias_why: str = ""
    scope: str = ""  # hf-*: the block's path, with {layer}
    select: bool = False  # hf-*: read the table's keys out of a whole checkpoint, ignore the rest
    ignored: tuple[str, ...] = ()  # keys (relative to the prefix) that are buffers, not weights
    hf: Callable[[Mapping[str, Any], int | None], dict[str, Any]] | None = None  # config file, layer -> facts
    heads_visible: bool = False  # the number of heads can be read off the tensors
    extras: tuple[Extra, ...] = ()  # 1-D tensors beside the projections (norm scales, sinks)
    pairing: str = ""  # "half" | "interleaved": the RoPE pairing the layout's weights are written for
    needs_hf_config: bool = False  # RoPE, windows and norms live only in the config file
    qkv_per_head: tuple[str, ...] = ()  # keys whose rows are (N, 3, H): each head's q, k, v together (GPT-NeoX)


@dataclasses.dataclass(frozen=True)
class Extra:
    key: str  # foreign name relative to the block's scope: a 1-D vector
    canonical: str  # the canonical tensor it holds, reshaped (e.g. OLMo 2's (N*H,) -> (N, H))


def R(key: str, parts: str, form: str) -> Row:
    return Row(key, tuple(parts.split()), form)


NO_GQA = "num_heads"  # Tie target for "no grouped-query attention"


def _bert_config(cfg: Mapping[str, Any], layer: int | None = None) -> dict[str, Any]:
    position = cfg.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise ValueError(
            f"hf_config: position_embedding_type={position!r} adds relative-position terms to the logits, "
            "which the canonical config cannot express; only 'absolute' converts"
        )
    return {"num_heads": cfg.get("num_attention_heads"), "hidden": cfg.get("hidden_size"),
            "dropout": cfg.get("attention_probs_dropout_prob"), "scale": None, "scale_by_layer": False}


def _gpt2_config(cfg: Mapping[str, Any], layer: int | None = None) -> dict[str, Any]:
    return {"num_heads": cfg.get("n_head"), "hidden": cfg.get("n_embd"), "dropout": cfg.get("attn_pdrop"),
            "scale": None if cfg.get("scale_attn_weights", True) else 1.0,
            "scale_by_layer": bool(cfg.get("scale_attn_by_inverse_layer_idx", False))}


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
}
HF_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "olmo2", "gpt_oss",
                  "phi3")
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
    else:
        raise ValueError(f"hf_config: rope_type={kind!r} is not expressible in the canonical config "
                         "(default, linear, llama3 and yarn are)")
    return {"theta": theta, "rotary_dim": rotary_dim, "interleaved": interleaved, "scaling": scaling}


def _llama_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of a Llama-family decoder -> sizes, behaviour and the modern fields of block `layer`."""
    model_type = cfg.get("model_type")
    if model_type == "gemma3" and isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}  # the multimodal wrapper's language model
        model_type = "gemma3_text"
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
    return {
        "num_heads": heads, "num_kv_heads": cfg.get("num_key_value_heads") or heads, "head_dim": head_dim,
        "hidden": hidden, "dropout": cfg.get("attention_dropout"),
        "scale": cfg["query_pre_attn_scalar"] ** -0.5 if gemma and cfg.get("query_pre_attn_scalar") else None,
        "scale_by_layer": False, "modern": modern, "norm_offset": norm_offset,
        "table": 1 if model_type == "phi3" else 0, "model_type": model_type,
    }


def _neox_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of GPT-NeoX / Pythia: half-split RoPE on the first rotary_pct of each head."""
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    if not heads or not hidden:
        raise ValueError("hf_config: GPT-NeoX's config.json needs num_attention_heads and hidden_size")
    head_dim = hidden // heads
    if not isinstance(cfg.get("rope_parameters"), Mapping):  # 4.x: rotary_pct, rotary_emb_base
        cfg = {**cfg, "partial_rotary_factor": cfg.get("rotary_pct", cfg.get("partial_rotary_factor", 1.0))}
    rope = _hf_rope(cfg, None, head_dim, theta_key="rotary_emb_base")
    return {"num_heads": heads, "hidden": hidden, "dropout": cfg.get("attention_dropout"), "scale": None,
            "scale_by_layer": False, "modern": {"rope": rope}, "model_type": "gpt_neox"}


def _gptj_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of GPT-J: interleaved RoPE (rotate_every_two) on the first rotary_dim features, base 10000."""
    heads, hidden = cfg.get("n_head"), cfg.get("n_embd")
    if not heads or not hidden:
        raise ValueError("hf_config: GPT-J's config.json needs n_head and n_embd")
    if cfg.get("rotary_dim") is None:
        raise ValueError("hf_config: rotary_dim=None (GPT-J then builds its frequencies over n_embd, not over a "
                         "head; only a whole rotary_dim converts)")
    rope = {"theta": 10000.0, "rotary_dim": int(cfg["rotary_dim"]), "interleaved": True, "scaling": None}
    return {"num_heads": heads, "hidden": hidden, "dropout": cfg.get("attn_pdrop"), "scale": None,
            "scale_by_layer": False, "modern": {"rope": rope}, "model_type": "gptj"}


def _meta_config(params: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """Meta's params.json (Llama 1-3) -> sizes and rope; Meta rotates interleaved pairs."""
    heads, dim = params.get("n_heads"), params.get("dim")
    if not heads or not dim:
        raise ValueError("hf_config: Meta's params.json needs n_heads and dim")
    scaling = None
    if params.get("use_scaled_rope"):  # Llama 3.1's apply_scaling: factor 8 (3.2: rope_scaling_factor), 1, 4, 8192
        scaling = {"type": "llama3", "factor": float(params.get("rope_scaling_factor", 8.0)), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    rope = {"theta": float(params.get("rope_theta", 10000.0)), "rotary_dim": None, "interleaved": True,
            "scaling": scaling}
    return {"num_heads": heads, "num_kv_heads": params.get("n_kv_heads") or heads, "head_dim": dim // heads,
            "hidden": dim, "dropout": None, "scale": None, "scale_by_layer": False, "modern": {"rope": rope},
            "norm_offset": 0.0, "table": 0, "model_type": "meta-llama"}


_DECODER_TIES = (
    Tie("value_head_dim", "head_dim", "v_proj splits into heads of head_dim"),
    Tie("key_dim", "query_dim", "keys are projected from the hidden states"),
    Tie("value_dim", "query_dim", "values are projected from the hidden states"),
    Tie("out_dim", "query_dim", "o_proj maps back to hidden_size"),
)


_HIDDEN_TIES = (
    Tie("num_kv_heads", NO_GQA, "no grouped-query attention"),
    Tie("value_head_dim", "head_dim", "value heads are hidden_size // num_heads wide"),
    Tie("query_dim", "num_heads*head_dim", "hidden_size = num_heads * head_dim"),
    Tie("key_dim", "num_heads*head_dim", "keys are projected from hidden states"),
    Tie("value_dim", "num_heads*head_dim", "values are projected from hidden states"),
    Tie("out_dim", "num_heads*head_dim", "the output projection maps hidden_size to hidden_size"),
)

_TORCH_MHA_TIES = (
    Tie("num_kv_heads", NO_GQA, "nn.MultiheadAttention has no grouped-query attention"),
    Tie("value_head_dim", "head_dim", "nn.MultiheadAttention's value heads are embed_dim // num_heads wide"),
    Tie("query_dim", "num_heads*head_dim", "nn.MultiheadAttention's embed_dim = num_heads * head_dim"),
    Tie("out_dim", "num_heads*head_dim", "nn.MultiheadAttention's output width is embed_dim"),
)

LAYOUT_LIST = (
    Layout(
        "canonical", "the common format's own tensors: query.kernel (D, N, H) ... output.bias (O,)",
        sep=".", heads_visible=True,
        tables=(Table((
            R("query.kernel", "query.kernel", HEADS), R("query.bias", "query.bias", HEADS),
            R("key.kernel", "key.kernel", HEADS), R("key.bias", "key.bias", HEADS),
            R("value.kernel", "value.kernel", HEADS), R("value.bias", "value.bias", HEADS),
            R("output.kernel", "output.kernel", HEADS), R("output.bias", "output.bias", HEADS),
        )),),
    ),
    Layout(
        "torch-mha", "torch nn.MultiheadAttention state dict: in_proj_weight (3E, E) = [Wq; Wk; Wv] "
        "(q/k/v_proj_weight when kdim/vdim != E), out_proj; hint num_heads",
        sep=".", bias="all", bias_why="nn.MultiheadAttention(bias=...) gives all four projections a bias or none",
        tables=(
            Table((
                R("in_proj_weight", "query.kernel key.kernel value.kernel", LINEAR),  # (3E, E)
                R("in_proj_bias", "query.bias key.bias value.bias", LINEAR),  # (3E,)
                R("out_proj.weight", "output.kernel", LINEAR),  # (E, E)
                R("out_proj.bias", "output.bias", LINEAR),  # (E,)
            ), ties=_TORCH_MHA_TIES + (
                Tie("key_dim", "num_heads*head_dim", "kdim == embed_dim uses the packed in_proj_weight"),
                Tie("value_dim", "num_heads*head_dim", "vdim == embed_dim uses the packed in_proj_weight"),
            ), when=lambda c: c.key_dim == c.query_dim == c.value_dim, note="packed (kdim == vdim == embed_dim)"),
            Table((
                R("q_proj_weight", "query.kernel", LINEAR),  # (E, E)
                R("k_proj_weight", "key.kernel", LINEAR),  # (E, kdim)
                R("v_proj_weight", "value.kernel", LINEAR),  # (E, vdim)
                R("in_proj_bias", "query.bias key.bias value.bias", LINEAR),  # (3E,)
                R("out_proj.weight", "output.kernel", LINEAR),
                R("out_proj.bias", "output.bias", LINEAR),
            ), ties=_TORCH_MHA_TIES, note="separate (kdim or vdim != embed_dim)"),
        ),
    ),
    Layout(
        "torch-linears", "separate q/k/v/out nn.Linear modules {query}.weight (N*H, D) ... (seed 004: "
        "W_query, W_key, W_value, out_proj; its `mask` buffer is skipped); hint num_heads",
        sep=".", roles=({"query": "W_query", "key": "W_key", "value": "W_value", "output": "out_proj"},),
        ignored=("mask",),  # seed 004's causal-mask buffer (triu of ones): call with is_causal=True
        tables=(Table((
            R("{query}.weight", "query.kernel", LINEAR), R("{query}.bias", "query.bias", LINEAR),
            R("{key}.weight", "key.kernel", LINEAR), R("{key}.bias", "key.bias", LINEAR),
            R("{value}.weight", "value.kernel", LINEAR), R("{value}.bias", "value.bias", LINEAR),
            R("{output}.weight", "output.kernel", LINEAR), R("{output}.bias", "output.bias", LINEAR),
        )),),
    ),
    Layout(
        "torch-fused-qkv", "one nn.Linear {qkv}.weight (3*N*H, D) with q, k, v stacked, then {output} "
        "(seed 002: qkv/proj; seed 000: qkv_proj/out_proj); hint num_heads",
        sep=".", roles=({"qkv": "qkv", "output": "proj"}, {"qkv": "qkv_proj", "output": "out_proj"}),
        tables=(Table((
            R("{qkv}.weight", "query.kernel key.kernel value.kernel", LINEAR),  # (3*N*H, D)
            R("{qkv}.bias", "query.bias key.bias value.bias", LINEAR),  # (3*N*H,)
            R("{output}.weight", "output.kernel", LINEAR),  # (O, N*H)
            R("{output}.bias", "output.bias", LINEAR),
        ), ties=(
            Tie("num_kv_heads", NO_GQA, "qkv is reshaped (B, T, 3, N, H): q, k, v have the same heads"),
            Tie("value_head_dim", "head_dim", "qkv is reshaped (B, T, 3, N, H): one head width"),
            Tie("key_dim", "query_dim", "one input x feeds q, k and v"),
            Tie("value_dim", "query_dim", "one input x feeds q, k and v"),
        )),),
    ),
    Layout(
        "torch-per-head", "a ModuleList of single-head modules {heads}.{i}.W_q/W_k/W_v (H, D) and {output} "
        "fc_out (O, N*V) (seed 001); N is the number of heads found",
        sep=".", heads_visible=True,
        roles=({"heads": "heads", "query": "W_q", "key": "W_k", "value": "W_v", "output": "fc_out"},),
        tables=(Table((
            R("{heads}.{i}.{query}.weight", "query.kernel", LINEAR),  # (H, D), head i
            R("{heads}.{i}.{query}.bias", "query.bias", LINEAR),
            R("{heads}.{i}.{key}.weight", "key.kernel", LINEAR),  # (H, Dk)
            R("{heads}.{i}.{key}.bias", "key.bias", LINEAR),
            R("{heads}.{i}.{value}.weight", "value.kernel", LINEAR),  # (V, Dv)
            R("{heads}.{i}.{value}.bias", "value.bias", LINEAR),
            R("{output}.weight", "output.kernel", LINEAR), R("{output}.bias", "output.bias", LINEAR),
        ), ties=(Tie("num_kv_heads", NO_GQA, "each head owns its key and value projections"),)),),
    ),
    Layout(
        "keras-split-heads", "Keras Dense layers {query}/kernel (D, N*H) ... {output}/kernel (N*V, O) "
        "(seed 003: WQ, WK, WV, WO); hint num_heads",
        sep="/", roles=({"query": "WQ", "key": "WK", "value": "WV", "output": "WO"},),
        tables=(Table((
            R("{query}/kernel", "query.kernel", DENSE), R("{query}/bias", "query.bias", DENSE),
            R("{key}/kernel", "key.kernel", DENSE), R("{key}/bias", "key.bias", DENSE),
            R("{value}/kernel", "value.kernel", DENSE), R("{value}/bias", "value.bias", DENSE),
            R("{output}/kernel", "output.kernel", DENSE), R("{output}/bias", "output.bias", DENSE),
        )),),
    ),
    Layout(
        "keras-mha", "keras.layers.MultiHeadAttention variables: query/kernel (D, N, H) ... "
        "attention_output/kernel (N, V, O)",
        sep="/", heads_visible=True, bias="all", bias_why="MultiHeadAttention(use_bias=...) covers every projection",
        tables=(Table((
            R("query/kernel", "query.kernel", HEADS), R("query/bias", "query.bias", HEADS),
            R("key/kernel", "key.kernel", HEADS), R("key/bias", "key.bias", HEADS),
            R("value/kernel", "value.kernel", HEADS), R("value/bias", "value.bias", HEADS),
            R("attention_output/kernel", "output.kernel", HEADS), R("attention_output/bias", "output.bias", HEADS),
        ), ties=(Tie("num_kv_heads", NO_GQA, "keras MultiHeadAttention has no grouped-query attention "
                                            "(keras.layers.GroupedQueryAttention is another layer)"),)),),
    ),
    Layout(
        "flax-linen-mha", "flax.linen.MultiHeadDotProductAttention params flattened with '/': "
        "query/kernel (D, N, H) ... out/kernel (N, H, O)",
        sep="/", heads_visible=True, bias="all", bias_why="use_bias covers every projection",
        tables=(Table((
            R("query/kernel", "query.kernel", HEADS), R("query/bias", "query.bias", HEADS),
            R("key/kernel", "key.kernel", HEADS), R("key/bias", "key.bias", HEADS),
            R("value/kernel", "value.kernel", HEADS), R("value/bias", "value.bias", HEADS),
            R("out/kernel", "output.kernel", HEADS), R("out/bias", "output.bias", HEADS),
        ), ties=(
            Tie("num_kv_heads", NO_GQA, "linen MultiHeadDotProductAttention has no grouped-query attention"),
            Tie("value_head_dim", "head_dim", "qkv_features sets the query, key and value head width"),
        )),),
    ),
    Layout(
        "flax-nnx-mha", "flax.nnx.MultiHeadAttention Params flattened with '/': the same keys as "
        "flax-linen-mha, with num_kv_heads allowed",
        sep="/", heads_visible=True, bias="all", bias_why="use_bias covers every projection",
        tables=(Table((
            R("query/kernel", "query.kernel", HEADS), R("query/bias", "query.bias", HEADS),
            R("key/kernel", "key.kernel", HEADS), R("key/bias", "key.bias", HEADS),
            R("value/kernel", "value.kernel", HEADS), R("value/bias", "value.bias", HEADS),
            R("out/kernel", "output.kernel", HEADS), R("out/bias", "output.bias", HEADS),
        ), ties=(
            Tie("value_head_dim", "head_dim", "qkv_features sets the query, key and value head width"),
            Tie("value_dim", "key_dim", "in_kv_features sets both the key and the value input width"),
        )),),
    ),
    Layout(
        "hf-bert", "a BERT-family checkpoint's self-attention: [prefix]encoder.layer.{L}.attention."
        "self.{query,key,value} and output.dense nn.Linears; hints layer, num_heads or hf_config",
        sep=".", bias="required", bias_why="BERT's Linear layers always have biases",
        scope="encoder.layer.{layer}.attention.", select=True, hf=_bert_config,
        tables=(Table((
            R("self.query.weight", "query.kernel", LINEAR), R("self.query.bias", "query.bias", LINEAR),
            R("self.key.weight", "key.kernel", LINEAR), R("self.key.bias", "key.bias", LINEAR),
            R("self.value.weight", "value.kernel", LINEAR), R("self.value.bias", "value.bias", LINEAR),
            R("output.dense.weight", "output.kernel", LINEAR), R("output.dense.bias", "output.bias", LINEAR),
        ), ties=_HIDDEN_TIES),),
    ),
    Layout(
        "hf-gpt2", "a GPT-2 checkpoint's attention: [prefix]h.{L}.attn.c_attn Conv1D weight (E, 3E) = "
        "[q | k | v], c_proj (E, E); hints layer, num_heads or hf_config; causal",
        sep=".", bias="required", bias_why="GPT-2's Conv1D layers always have biases",
        scope="h.{layer}.attn.", select=True, hf=_gpt2_config,
        tables=(Table((
            R("c_attn.weight", "query.kernel key.kernel value.kernel", DENSE),  # (E, 3E), y = x W + b
            R("c_attn.bias", "query.bias key.bias value.bias", DENSE),  # (3E,)
            R("c_proj.weight", "output.kernel", DENSE),  # (E, E)
            R("c_proj.bias", "output.bias", DENSE),
        ), ties=_HIDDEN_TIES),),
    ),
    Layout(
        "hf-llama", "a Llama-family decoder's attention (llama, mistral, qwen2, qwen3, gemma2, gemma3, olmo2, "
        "gpt_oss, phi3): [prefix]layers.{L}.self_attn.{q,k,v,o}_proj (phi3: fused qkv_proj), q_norm/k_norm, "
        "sinks; config.json gives rope, windows, norms; causal",
        sep=".", scope="layers.{layer}.self_attn.", select=True, hf=_llama_config, pairing="half",
        needs_hf_config=True,
        extras=(Extra("q_norm.weight", "query.norm.scale"), Extra("k_norm.weight", "key.norm.scale"),
                Extra("sinks", "sinks")),
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
        ),
    ),
    Layout(
        "hf-gpt-neox", "a GPT-NeoX / Pythia checkpoint's attention: [prefix]layers.{L}.attention.query_key_value "
        "(3*N*H, D) with rows (N, 3, H) (each head's q, k, v together), attention.dense; config.json gives "
        "rotary_pct / partial_rotary_factor and the base; half-split RoPE; causal",
        sep=".", scope="layers.{layer}.attention.", select=True, hf=_neox_config, pairing="half",
        needs_hf_config=True, qkv_per_head=("query_key_value.weight", "query_key_value.bias"), bias="all",
        bias_why="attention_bias covers query_key_value and dense",
        tables=(Table((
            R("query_key_value.weight", "query.kernel key.kernel value.kernel", LINEAR),  # read as (3, N, H) rows
            R("query_key_value.bias", "query.bias key.bias value.bias", LINEAR),
            R("dense.weight", "output.kernel", LINEAR), R("dense.bias", "output.bias", LINEAR),
        ), ties=_HIDDEN_TIES),),
    ),
    Layout(
        "hf-gptj", "a GPT-J checkpoint's attention: [prefix]h.{L}.attn.{q,k,v,out}_proj (no biases); "
        "config.json gives rotary_dim; interleaved RoPE (rotate_every_two), base 10000; causal",
        sep=".", scope="h.{layer}.attn.", select=True, hf=_gptj_config, pairing="interleaved",
        needs_hf_config=True,
        tables=(Table((
            R("q_proj.weight", "query.kernel", LINEAR), R("k_proj.weight", "key.kernel", LINEAR),
            R("v_proj.weight", "value.kernel", LINEAR), R("out_proj.weight", "output.kernel", LINEAR),
        ), ties=_HIDDEN_TIES),),
    ),
    Layout(
        "meta-llama", "Meta's Llama checkpoint (consolidated.*.pth): layers.{L}.attention.{wq,wk,wv,wo}.weight; "
        "params.json beside it gives the sizes and rope; interleaved RoPE pairs; causal",
        sep=".", scope="layers.{layer}.attention.", select=True, hf=_meta_config, pairing="interleaved",
        needs_hf_config=True,
        tables=(Table((
            R("wq.weight", "query.kernel", LINEAR), R("wk.weight", "key.kernel", LINEAR),
            R("wv.weight", "value.kernel", LINEAR), R("wo.weight", "output.kernel", LINEAR),
        ), ties=(
            Tie("value_head_dim", "head_dim", "wv splits into heads of head_dim"),
            Tie("query_dim", "num_heads*head_dim", "Meta's head_dim is dim // n_heads"),
            Tie("key_dim", "num_heads*head_dim", "keys are projected from the hidden states"),
            Tie("value_dim", "num_heads*head_dim", "values are projected from the hidden states"),
            Tie("out_dim", "num_heads*head_dim", "wo maps back to dim"),
        )),),
    ),
)

_BY_ID = {layout.id: layout for layout in LAYOUT_LIST}
LAYOUTS: dict[str, str] = {layout.id: layout.description for layout in LAYOUT_LIST}
ROLES: dict[str, tuple[str, ...]] = {layout.id: tuple(layout.roles[0]) for layout in LAYOUT_LIST if layout.roles[0]}


# -- small helpers -----------------------------------------------------------------

Size = tuple[tuple[str, ...], ...]  # a sum of products of letters


def spec(layout: str) -> Layout:
    """The Layout (its tables, ties and bias rule) for a layout id."""
    return _get(layout)


def _get(layout: str) -> Layout:
    if isinstance(layout, Layout):
        return layout
    try:
        return _BY_ID[layout]
    except (KeyError, TypeError):
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}: got {layout!r}") from None


def _substitute(size: Size, ties: Mapping[str, tuple[str, ...]]) -> Size:
    """Replace tied letters by the product they equal (ties are written in free letters)."""
    out = []
    for term in size:
        expanded: list[str] = []
        for letter in term:
            expanded.extend(ties.get(letter, (letter,)))
        out.append(tuple(expanded))
    return tuple(out)


def _evaluate(size: Size, dims: Mapping[str, int | None]) -> int | None:
    total = 0
    for term in size:
        value = 1
        for letter in term:
            if dims.get(letter) is None:
                return None
            value *= dims[letter]
        total += value
    return total


def _row_size(row: Row) -> tuple[Size, ...]:
    """The foreign tensor's shape: one size (a sum of products of letters) per axis."""
    if row.form == HEADS:
        return tuple(((letter,),) for letter in AXES[row.parts[0]])
    if row.per_head:
        axes = tuple((product,) for product in HEAD[row.parts[0]])
    else:  # the parts are concatenated along the last (feature) axis and share the others
        flats = [FLAT[p] for p in row.parts]
        axes = tuple((product,) for product in flats[0][:-1]) + (tuple(f[-1] for f in flats),)
    return axes[::-1] if row.form == LINEAR else axes


def _fmt_shape(shape: Sequence[int | None]) -> str:
    inner = ", ".join("?" if d is None else str(d) for d in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


def _ties(table: Table) -> dict[str, tuple[str, ...]]:
    return {tie.letter: tie.product for tie in table.ties}


def _fill(template: str, roles: Mapping[str, str], i: int | None = None) -> str:
    return template.format(**roles, i="{i}" if i is None else i)


def _names_hint(layout: Layout, names) -> dict[str, str] | None:
    if names is None:
        return None
    roles = layout.roles[0]
    if not roles:
        raise ValueError(f"names: layout {layout.id} has fixed names; names apply to {', '.join(ROLES)}: got {names!r}")
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
        if all("=" in n for n in names):
            names = dict(n.split("=", 1) for n in names)
    if isinstance(names, Mapping):
        unknown = sorted(set(names) - set(roles))
        if unknown:
            raise ValueError(f"names: {layout.id} has roles {', '.join(roles)}: got unknown {', '.join(unknown)}")
        chosen = {**roles, **{k: str(v) for k, v in names.items()}}
    else:
        names = list(names)
        if len(names) != len(roles):
            raise ValueError(
                f"names: {layout.id} needs {len(roles)} names ({', '.join(roles)}) in that order, "
                f"or role=name pairs: got {len(names)}: {', '.join(map(str, names))}"
            )
        chosen = dict(zip(roles, map(str, names)))
    for role, name in chosen.items():
        if not name or name.startswith(layout.sep) or name.endswith(layout.sep):
            raise ValueError(f"names: {role} must be a module name like {roles[role]!r}: got {name!r}")
    return chosen


def _check_hints(where: str, layout: Layout, hints: Mapping[str, Any], allowed: frozenset) -> None:
    unknown = sorted(set(hints) - allowed)
    if unknown:
        raise ValueError(
            f"{where}({layout.id}): unknown hints {', '.join(unknown)}; accepted: {', '.join(sorted(allowed))}"
        )
    inapplicable = []
    if layout.hf is None:
        inapplicable += [h for h in ("layer", "hf_config") if hints.get(h) is not None]
    if layout.id != "canonical" and hints.get("config") is not None:
        inapplicable.append("config")
    if inapplicable:
        raise ValueError(f"{where}({layout.id}): hints {', '.join(inapplicable)} do not apply to this layout")


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer: got {value!r}")
    return int(value)


def _load_hf_config(value) -> Mapping[str, Any] | None:
    if value is None or isinstance(value, Mapping):
        return value
    if isinstance(value, (str, os.PathLike)):
        try:
            with open(value, encoding="utf-8") as handle:
                data = json.load(handle)
        except OSError as err:
            raise ValueError(f"hf_config: cannot read {value}: {err.strerror or err}") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"hf_config: {value} is not JSON: {err.msg} at line {err.lineno}") from None
        if not isinstance(data, dict):
            raise ValueError(f"hf_config: {value} must hold a JSON object")
        return data
    raise ValueError(f"hf_config must be a dict or the path of config.json: got {type(value).__name__}")


def load_config_file(path) -> Mapping[str, Any]:
    """A config.json / params.json as a dict (ValueError naming the file when unreadable)."""
    return _load_hf_config(path)

# -- locating the table in a state dict ----------------------------------------------

@dataclasses.dataclass
class _Place:
    table: Table
    roles: dict[str, str]
    prefix: str
    layer: int | None

    def base(self, layout: Layout) -> str:
        return self.prefix + layout.scope.format(layer=self.layer)


def _anchor_pattern(layout: Layout, table: Table, roles: Mapping[str, str]) -> re.Pattern:
    anchor = _fill(table.rows[0].key, roles, 0)
    scope = re.escape(layout.scope).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
    return re.compile(r"(?P<prefix>.*?)" + scope + re.escape(anchor))


def _candidates(layout: Layout, state: Mapping[str, Any], names: dict[str, str] | None):
    """Every (table, roles, prefix) under which the first row's key exists, with the layers found."""
    found: dict[tuple[int, int, str], set] = {}
    role_sets = [names] if names is not None else list(layout.roles)
    for t_index, table in enumerate(layout.tables):
        for r_index, roles in enumerate(role_sets):
            pattern = _anchor_pattern(layout, table, roles)
            for key in state:
                match = pattern.fullmatch(key)
                if not match:
                    continue
                prefix = match.group("prefix")
                if prefix and not prefix.endswith(layout.sep):
                    continue
                layer = int(match.group("layer")) if layout.scope else None
                found.setdefault((t_index, r_index, prefix), set()).add(layer)
    return found, role_sets


def _locate(layout: Layout, state: Mapping[str, Any], names, prefix, layer) -> _Place:
    found, role_sets = _candidates(layout, state, names)
    if prefix is not None:
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a string: got {prefix!r}")
        found = {k: v for k, v in found.items() if k[2] == prefix}
    if layer is not None:
        layer = _check_int("layer", layer)
        found = {k: v for k, v in found.items() if layer in v}
    if not found:  # nothing matches: read the default table, so the error lists what is missing
        return _Place(layout.tables[0], role_sets[0], prefix or "", layer if layer is not None else 0)
    if len(found) > 1:
        prefixes = sorted({k[2] for k in found})
        if len(prefixes) > 1:
            raise WeightsFormatError(
                f"{layout.id}: the state holds several candidates, under prefixes "
                f"{', '.join(repr(p) for p in prefixes)}: pass prefix= (CLI --prefix)"
            )
        keys = sorted(_fill(layout.tables[k[0]].rows[0].key, role_sets[k[1]], 0) for k in found)
        raise WeightsFormatError(
            f"{layout.id}: the state matches several variants ({', '.join(keys)}): pass names= (CLI --names)"
        )
    ((t_index, r_index, chosen_prefix), layers) = next(iter(found.items()))
    if layout.scope and layer is None:
        if len(layers) > 1:
            raise ValueError(
                f"{layout.id}: the checkpoint has layers {_ranges(sorted(layers))}: pass layer=I "
                "(CLI --layer I, or --layer all for one file per layer)"
            )
        layer = next(iter(layers))
    return _Place(layout.tables[t_index], role_sets[r_index], chosen_prefix, layer)


def _ranges(values: Sequence[int]) -> str:
    if values and values == list(range(values[0], values[-1] + 1)) and len(values) > 2:
        return f"{values[0]}..{values[-1]}"
    return ", ".join(map(str, values))


def layers(layout: str, state: Mapping[str, Any], *, prefix: str | None = None) -> list[int]:
    """hf-*: the block indices a checkpoint holds (sorted)."""
    lay = _get(layout)
    if not lay.scope:
        raise ValueError(f"layers() applies to layouts with blocks ({', '.join(i for i, x in _BY_ID.items() if x.scope)}): "
                         f"got layout {lay.id}")
    found, _ = _candidates(lay, state, None)
    if prefix is not None:
        found = {k: v for k, v in found.items() if k[2] == prefix}
    prefixes = sorted({k[2] for k in found})
    if len(prefixes) > 1:
        raise WeightsFormatError(
            f"{lay.id}: the state holds several candidates, under prefixes "
            f"{', '.join(repr(p) for p in prefixes)}: pass prefix= (CLI --prefix)"
        )
    return sorted({layer for v in found.values() for layer in v})


def detect_layout(state: Mapping[str, Any]) -> str | None:
    """The first layout whose kernel keys all exist under one prefix, or None.

    flax-linen-mha and flax-nnx-mha have the same keys; this answers
    flax-linen-mha, and either converts the same tensors.
    """
    order = ("hf-bert", "hf-gpt2", "hf-llama", "hf-gpt-neox", "hf-gptj", "meta-llama", "torch-mha", "torch-per-head", "torch-fused-qkv", "torch-linears",
             "keras-split-heads", "keras-mha", "flax-linen-mha", "canonical")
    for layout_id in order:
        layout = _BY_ID[layout_id]
        found, role_sets = _candidates(layout, state, None)
        for (t_index, r_index, prefix), found_layers in found.items():
            table, roles = layout.tables[t_index], role_sets[r_index]
            for layer in found_layers:
                base = prefix + layout.scope.format(layer=layer)
                kernels = [_fill(row.key, roles, 0) for row in table.rows if not row.is_bias]
                if all(base + key in state for key in kernels):
                    return layout_id
    return None


# -- state -> canonical ----------------------------------------------------------------

def _expand(layout: Layout, place: _Place, num_heads: int) -> list[tuple[str, Row, int | None]]:
    """(key, row, head) for every tensor of the table; per-head rows grouped by head, as torch orders them."""
    base = place.base(layout)
    out: list[tuple[str, Row, int | None]] = []
    head_rows = [row for row in place.table.rows if row.per_head]
    for row in place.table.rows:
        if row is (head_rows[0] if head_rows else None):
            out += [(base + _fill(r.key, place.roles, i), r, i) for i in range(num_heads) for r in head_rows]
        elif not row.per_head:
            out.append((base + _fill(row.key, place.roles), row, None))
    return out


def _array_problem(key: str, array: Any) -> str | None:
    if not isinstance(array, np.ndarray):
        return f"{key} is a {type(array).__name__}, not a numpy array"
    try:
        resolve_dtype(array.dtype)
    except (TypeError, ValueError):
        return f"{key} has dtype {array.dtype}, expected one of {', '.join(DTYPES)}"
    if array.size and not np.isfinite(array.astype(np.float64)).all():
        return f"{key} contains NaN or Inf"
    return None


def to_canonical(layout: str, state: Mapping[str, Any], **hints: Any) -> tuple[AttentionConfig, dict[str, np.ndarray]]:
    """Read a layout's state dict: (config, canonical tensors), bit-exact.

    Raises one WeightsFormatError listing every missing, unexpected,
    mis-shaped or mis-typed key; ValueError for a bad hint.
    """
    lay = _get(layout)
    _check_hints("to_canonical", lay, hints, TO_HINTS)
    hints = {k: v for k, v in hints.items() if v is not None}
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a mapping of names to numpy arrays: got {type(state).__name__}")
    bad_keys = [k for k in state if not isinstance(k, str)]
    if bad_keys:
        raise ValueError(f"state keys must be strings: got {', '.join(map(repr, bad_keys[:5]))}")
    names = _names_hint(lay, hints.get("names"))
    ignore = hints.get("ignore") or ()
    ignore = (ignore,) if isinstance(ignore, str) else tuple(ignore)
    hint_heads = hints.get("num_heads")
    if hint_heads is not None and (isinstance(hint_heads, bool) or not isinstance(hint_heads, (int, np.integer))
                                   or hint_heads < 1):
        raise ValueError(f"num_heads must be a positive integer: got {hint_heads!r}")

    visible = {k: v for k, v in state.items() if not any(fnmatch.fnmatchcase(k, p) for p in ignore)}
    place = _locate(lay, visible, names, hints.get("prefix"), hints.get("layer"))
    base = place.base(lay)
    problems: list[str] = []

    # Config-level facts: hints, config.json.
    known: dict[str, int] = {}
    heads_source = "the num_heads hint"
    if hint_heads is not None:
        known["N"] = int(hint_heads)
    hf = {}
    if lay.hf is not None:
        hf_config = _load_hf_config(hints.get("hf_config"))
        if hf_config is None and lay.needs_hf_config:
            raise ValueError(f"hf_config: {lay.id} reads RoPE, windows and norms from the checkpoint's config file "
                             "(a dict or the path of config.json / params.json; CLI: beside SRC): got None")
        if hf_config is not None:
            hf = lay.hf(hf_config, place.layer)
            for letter, entry in (("K", "num_kv_heads"), ("H", "head_dim")):
                if hf.get(entry) is not None:
                    known[letter] = int(hf[entry])
            n_cfg = hf.get("num_heads")
            if n_cfg is not None:
                if "N" in known and known["N"] != n_cfg:
                    raise ValueError(f"num_heads={known['N']} disagrees with the checkpoint's config.json ({n_cfg})")
                known["N"] = int(n_cfg)
                heads_source = heads_source if hint_heads is not None else "config.json"
    if lay.qkv_per_head:
        visible = _qkv_rows(visible, [base + key for key in lay.qkv_per_head], known.get("N"), to_blocks=True)
    per_head = any(row.per_head for row in place.table.rows)
    if per_head:
        heads_re = re.compile(re.escape(base + place.roles["heads"] + lay.sep) + r"(\d+)" + re.escape(lay.sep))
        indices = {int(m.group(1)) for k in visible if (m := heads_re.match(k))}
        counted = max(indices) + 1 if indices else None
        if counted is not None:
            if "N" in known and known["N"] != counted:
                problems.append(f"num_heads={known['N']} was given but the state holds {counted} heads")
            known["N"] = counted
            heads_source = f"the {counted} heads found"

    expanded = _expand(lay, place, known.get("N", 1))
    by_key = {key: (row, i) for key, row, i in expanded}

    # Presence: kernels always; biases by the layout's rule.
    present = {key for key in by_key if key in visible}
    missing = [key for key, row, _ in expanded if not row.is_bias and key not in present]
    bias_keys = [key for key, row, _ in expanded if row.is_bias]
    if lay.bias == "required":
        missing += [key for key in bias_keys if key not in present]
    elif lay.bias == "all" and any(key in present for key in bias_keys):
        missing += [f"{key} (biases come all or none: {lay.bias_why})" for key in bias_keys if key not in present]
    elif per_head:  # one bias flag per projection: every head or none
        for row in place.table.rows:
            if row.is_bias and row.per_head:
                keys = [k for k, r, _ in expanded if r is row]
                if any(k in present for k in keys):
                    missing += [f"{k} (other heads have this bias)" for k in keys if k not in present]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if not lay.select:
        in_scope = [k for k in visible if k.startswith(base)]
        unexpected = [k for k in in_scope if k not in by_key and k[len(base):] not in lay.ignored]
        if unexpected:
            problems.append(f"unexpected {', '.join(sorted(unexpected))}")
        if unexpected and missing and lay.roles[0]:
            problems.append(f"(modules named otherwise? pass names=, roles {', '.join(lay.roles[0])}; CLI --names)")

    # Arrays and dtypes.
    dtypes: dict[str, list[str]] = {}
    for key in sorted(present, key=list(by_key).index):
        issue = _array_problem(key, visible[key])
        if issue:
            problems.append(issue)
        else:
            dtypes.setdefault(resolve_dtype(visible[key].dtype).name, []).append(key)
    if len(dtypes) > 1:
        problems.append("mixed dtypes (one dtype for all tensors): "
                        + "; ".join(f"{d}: {', '.join(keys)}" for d, keys in dtypes.items()))

    # Sizes: solve the letters from the present tensors, then check every shape.
    ties = _ties(place.table)
    if "hidden" in hf and hf["hidden"] is not None:
        facts = [(_substitute((("D",),), ties), int(hf["hidden"]))]
    else:
        facts = []
    for key, (row, _) in by_key.items():
        array = visible.get(key)
        size = _row_size(row)
        if isinstance(array, np.ndarray) and array.ndim == len(size):
            facts += [(_substitute(s, ties), int(d)) for s, d in zip(size, array.shape)]
    dims = _solve(facts, dict(known))
    for letter, product in ties.items():
        dims[letter] = _evaluate((product,), dims)
    shape_problems = []
    for key, row, _ in expanded:
        if key not in present or not isinstance(visible[key], np.ndarray):
            continue
        size = _row_size(row)
        expected = tuple(_evaluate(_substitute(s, ties), dims) for s in size)
        got = visible[key].shape
        if len(got) != len(expected) or any(e is not None and e != g for e, g in zip(expected, got)):
            shape_problems.append(f"{key} has shape {_fmt_shape(got)}, expected {_fmt_shape(expected)}")
    if shape_problems and "N" in known and not per_head:
        shape_problems[-1] += f" (num_heads={known['N']} from {heads_source})"
    problems += shape_problems

    config = None
    unknown = [FIELDS[letter] for letter in FIELDS if dims.get(letter) is None]
    if "num_heads" in unknown and not missing:
        problems.append(f"num_heads is not stored in a {lay.id} state: pass num_heads (CLI --num-heads)")
    elif unknown and not problems:
        reason = f" with num_heads={known['N']} from {heads_source}" if "N" in known else ""
        sizes = ", ".join(f"{k} {_fmt_shape(visible[k].shape)}" for k in sorted(present))
        problems.append(f"cannot determine {', '.join(unknown)}{reason}: the tensors' sizes do not divide into "
                        f"that many heads ({sizes})")
    if not problems:
        flags = {flag: any(name in by_key[k][0].parts for k in present) for name, flag in BIAS_FLAG.items()}
        behaviour = {"scale": hf.get("scale"), "dropout": hf.get("dropout")}
        if hf.get("scale_by_layer"):
            unit = 1.0 / math.sqrt(dims["H"]) if behaviour["scale"] is None else behaviour["scale"]
            behaviour["scale"] = unit / (place.layer + 1)
        behaviour = {k: v for k, v in behaviour.items() if v is not None}
        behaviour.update({k: hints[k] for k in ("scale", "dropout", "masked_row") if hints.get(k) is not None})
        try:
            config = AttentionConfig(**{FIELDS[letter]: dims[letter] for letter in FIELDS}, **flags, **behaviour,
                                     **hf.get("modern", {}))
        except ValueError as err:
            problems.append(f"hf_config: {err}" if hf.get("modern") else str(err))
    extra_tensors: dict[str, np.ndarray] = {}
    if config is not None and lay.extras:
        dtype = next((visible[k].dtype for k in sorted(present) if isinstance(visible[k], np.ndarray)), None)
        extra_tensors = _read_extras(lay, config, visible, base, hf, dtype, problems)
    if config is not None and hints.get("config") is not None:
        given = hints["config"]
        if not isinstance(given, AttentionConfig):
            raise ValueError(f"config must be an AttentionConfig: got {type(given).__name__}")
        structural = [f for f in given.to_dict() if f not in ("scale", "dropout", "masked_row")]
        differ = [f"{f}={getattr(given, f)!r} (tensors say {getattr(config, f)!r})"
                  for f in structural if getattr(given, f) != getattr(config, f)]
        if differ:
            problems.append("the tensors do not match config: " + ", ".join(differ))
        config = given
    if problems:
        raise WeightsFormatError(f"{lay.id}: " + "; ".join(problems))

    tensors = _gather(config, [(key, *by_key[key], visible[key]) for key in by_key if key in present])
    tensors.update(extra_tensors)
    tensors = {name: tensors[name] for name in config.tensor_shapes() if name in tensors}
    validate_tensors(config, tensors, source=lay.id)  # internal invariant: the table is complete
    return config, tensors


def _read_extras(lay: Layout, config: AttentionConfig, visible: Mapping[str, Any], base: str,
                 hf: Mapping[str, Any], dtype, problems: list[str]) -> dict[str, np.ndarray]:
    """The 1-D tensors beside the projections (QK-norm scales, sinks) that config.json's model uses;
    one it does not use but the state holds is an error, not a silent drop."""
    shapes = config.tensor_shapes()
    out: dict[str, np.ndarray] = {}
    for extra in lay.extras:
        key = base + extra.key
        if extra.canonical not in shapes:
            if key in visible:
                problems.append(f"unexpected {key}: config.json (model_type {hf.get('model_type')!r}) uses no "
                                f"{extra.canonical}")
            continue
        array = visible.get(key)
        if array is None:
            problems.append(f"missing {key} (config.json's model_type {hf.get('model_type')!r} uses "
                            f"{extra.canonical})")
            continue
        issue = _array_problem(key, array)
        shape = shapes[extra.canonical]
        if issue is None and (array.ndim != 1 or array.size != math.prod(shape)):
            issue = f"{key} has shape {_fmt_shape(array.shape)}, expected ({math.prod(shape)},)"
        if issue is None and dtype is not None and array.dtype != dtype:
            issue = f"mixed dtypes (one dtype for all tensors): {key} is {array.dtype}, the projections {dtype}"
        if issue:
            problems.append(issue)
            continue
        value = array.reshape(shape)
        if hf.get("norm_offset") and ".norm." in extra.canonical:
            value = value + value.dtype.type(hf["norm_offset"])  # Gemma stores w of (1 + w): the multiplier is 1 + w
        out[extra.canonical] = np.array(value, order="C", copy=True)
    return out


def _qkv_rows(state: Mapping[str, Any], keys: Sequence[str], heads: int | None, *, to_blocks: bool):
    """GPT-NeoX's fused rows (N, 3, H) <-> the table's [q; k; v] blocks (3, N, H): a permutation of the
    first axis, exact. Left alone when the row count does not divide (the shape check then reports it)."""
    out = dict(state)
    for key in keys:
        array = out.get(key)
        if not isinstance(array, np.ndarray) or heads is None or array.ndim < 1 or array.shape[0] % (3 * heads):
            continue
        width = array.shape[0] // (3 * heads)
        grid = (heads, 3, width) if to_blocks else (3, heads, width)
        moved = array.reshape(*grid, *array.shape[1:]).swapaxes(0, 1)  # (3, N, H, ...) or (N, 3, H, ...)
        out[key] = np.array(moved.reshape(array.shape), order="C", copy=True)
    return out


def _pairing_permutation(head_dim: int, rotary_dim: int, to_interleaved: bool) -> np.ndarray:
    """Feature order that moves RoPE's pairs between the two conventions inside each head.

    new[..., j] = old[..., perm[j]]. Interleaved -> half-split takes the even features of the rotary
    part, then the odd ones (pair (2i, 2i+1) becomes (i, i + R/2), the same frequency i): the
    permutation Hugging Face's convert_llama_weights_to_hf applies to Meta's wq and wk rows. The
    features past rotary_dim stay where they are."""
    half = np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2),
                           np.arange(rotary_dim, head_dim)])
    return np.argsort(half) if to_interleaved else half


def repair_pairing(config: AttentionConfig, tensors: Mapping[str, np.ndarray], interleaved: bool):
    """(config, tensors) with RoPE in the pairing `interleaved`, computing the same numbers: q and k
    features (kernels, biases, norm tensors) permuted alike inside each head, which leaves every
    q . k unchanged, and the pairs RoPE turns become the other convention's pairs."""
    if config.rope is None or config.rope.interleaved == interleaved:
        return config, dict(tensors)
    perm = _pairing_permutation(config.head_dim, config.rope.rotary_dim, interleaved)
    out = dict(tensors)
    for name in ("query.kernel", "query.bias", "key.kernel", "key.bias", "query.norm.scale", "query.norm.bias",
                 "key.norm.scale", "key.norm.bias"):
        if name in out:
            out[name] = np.array(np.asarray(out[name])[..., perm], order="C", copy=True)  # last axis: H
    rope = dataclasses.replace(config.rope, interleaved=interleaved)
    return config.replace(rope=rope), out


def _solve(facts: list[tuple[Size, int]], known: dict[str, int]) -> dict[str, int | None]:
    """Fill letters from facts `size == value` that have one unknown letter,
    appearing linearly. The first consistent fact wins; the shape check after
    it reports every tensor that disagrees."""
    changed = True
    while changed:
        changed = False
        for size, value in facts:
            unknown = {letter for term in size for letter in term if letter not in known}
            if len(unknown) != 1:
                continue
            (x,) = unknown
            coeff = rest = 0
            for term in size:
                product = math.prod(known[letter] for letter in term if letter != x)
                count = term.count(x)
                if count > 1:
                    break
                coeff, rest = (coeff + product, rest) if count else (coeff, rest + product)
            else:
                if coeff and (value - rest) > 0 and (value - rest) % coeff == 0:
                    known[x] = (value - rest) // coeff
                    changed = True
    return {letter: known.get(letter) for letter in FIELDS}


def _gather(config: AttentionConfig, items) -> dict[str, np.ndarray]:
    """Foreign arrays -> canonical tensors: undo the transpose, split the
    concatenation, reshape (or place one head's slice)."""
    shapes = config.tensor_shapes()
    dims = {letter: getattr(config, field) for letter, field in FIELDS.items()}
    tensors: dict[str, np.ndarray] = {}
    for _key, row, head, array in items:
        if row.form == HEADS:
            tensors[row.parts[0]] = np.array(array, order="C", copy=True)
            continue
        flat = array.T if (row.form == LINEAR and array.ndim == 2) else array  # (in, out) or (out,)
        if head is not None:
            name = row.parts[0]
            target = tensors.setdefault(name, np.empty(shapes[name], dtype=array.dtype))
            if name.endswith(".kernel"):
                target[:, head, :] = flat  # (in, width)
            else:
                target[head] = flat  # (width,)
            continue
        widths = [_evaluate((FLAT[p][-1],), dims) for p in row.parts]
        pieces = np.split(flat, np.cumsum(widths)[:-1], axis=-1)
        for name, piece in zip(row.parts, pieces):
            tensors[name] = np.array(piece.reshape(shapes[name]), order="C", copy=True)
    return {name: tensors[name] for name in shapes if name in tensors}


# -- canonical -> state ----------------------------------------------------------------

def cannot_express(layout: str, config: AttentionConfig, *, table: Table | None = None) -> list[str]:
    """Why `layout` cannot hold `config`'s tensors: one line per offending field, or [].

    Behaviour fields (scale, RoPE, windows, softcap: config.json's business for hf-*) are not
    tensors and never make a layout refuse; a RoPE pairing other than the layout's is permuted
    (repair_pairing), not refused."""
    lay = _get(layout)
    table = table or _pick_table(lay, config)
    problems = []
    extras = {extra.canonical for extra in lay.extras}
    if not (lay.extras or lay.pairing):
        pass  # the plain layouts predate the modern tensors; they write the projections they hold
    elif config.qk_norm is not None and "query.norm.scale" not in extras:
        problems.append(f"qk_norm={config.qk_norm.to_dict()} ({lay.id} holds no QK-norm tensors)")
    elif config.qk_norm is not None and config.qk_norm.type != "rms":
        problems.append(f"qk_norm.type={config.qk_norm.type!r} ({lay.id} stores RMS-norm scales only, no norm bias)")
    if (lay.extras or lay.pairing) and config.use_sinks and "sinks" not in extras:
        problems.append(f"use_sinks=True ({lay.id} holds no sinks tensor)")
    for tie in table.ties:
        value = getattr(config, tie.field)
        target = math.prod(getattr(config, f) for f in tie.equals.split("*"))
        if value != target:
            shown = f"{tie.equals} = {target}" if "*" in tie.equals else f"{tie.equals}={target}"
            problems.append(f"{tie.field}={value} (needs {tie.field} == {shown}: {tie.why})")
    flags = {name: getattr(config, flag) for name, flag in BIAS_FLAG.items()}
    if lay.bias == "required":
        problems += [f"{BIAS_FLAG[n]}=False ({lay.bias_why})" for n, on in flags.items() if not on]
    elif lay.bias == "all" and len(set(flags.values())) > 1:
        off = [BIAS_FLAG[n] for n, on in flags.items() if not on]
        problems.append(f"{', '.join(f'{f}=False' for f in off)} with other biases on ({lay.bias_why})")
    for row in table.rows:
        if row.is_bias and len(row.parts) > 1 and len({flags[p] for p in row.parts}) > 1:
            shown = ", ".join(f"{BIAS_FLAG[p]}={flags[p]}" for p in row.parts)
            problems.append(f"{shown} ({row.key} holds the {' and '.join(p.split('.')[0] for p in row.parts)} "
                            "biases together)")
    return problems


def _pick_table(layout: Layout, config: AttentionConfig) -> Table:
    for table in layout.tables:
        if table.when is None or table.when(config):
            return table
    raise AssertionError(f"{layout.id}: no table accepts the config")  # the last table has no `when`


def from_canonical(layout: str, config: AttentionConfig, tensors: Mapping[str, np.ndarray],
                   **hints: Any) -> dict[str, np.ndarray]:
    """Write canonical tensors in a layout: state dict name -> array, bit-exact.

    ValueError naming each field and value the layout cannot express.
    Hints: names, prefix, layer (hf-*; default 0).
    """
    lay = _get(layout)
    _check_hints("from_canonical", lay, hints, FROM_HINTS)
    hints = {k: v for k, v in hints.items() if v is not None}
    if not isinstance(config, AttentionConfig):
        raise ValueError(f"config must be an AttentionConfig: got {type(config).__name__}")
    validate_tensors(config, tensors, source="canonical tensors")
    if lay.pairing:
        config, tensors = repair_pairing(config, tensors, lay.pairing == "interleaved")
    prefix = hints.get("prefix") or ""
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a string: got {prefix!r}")
    layer = _check_int("layer", hints["layer"]) if hints.get("layer") is not None else (0 if lay.scope else None)
    hf_config = _load_hf_config(hints.get("hf_config"))
    hf = lay.hf(hf_config, layer) if hf_config is not None else {}
    table = lay.tables[hf["table"]] if "table" in hf else _pick_table(lay, config)
    problems = cannot_express(lay.id, config, table=table)
    if problems:
        raise ValueError(f"{lay.id} cannot express " + "; ".join(problems))
    roles = _names_hint(lay, hints.get("names")) or lay.roles[0]
    place = _Place(table, roles, prefix, layer)
    state: dict[str, np.ndarray] = {}
    for key, row, head in _expand(lay, place, config.num_heads):
        if not all(part in tensors for part in row.parts):
            continue  # a bias the config does not have
        state[key] = _scatter(row, head, [tensors[p] for p in row.parts])
    if lay.qkv_per_head:
        state = _qkv_rows(state, [place.base(lay) + key for key in lay.qkv_per_head], config.num_heads,
                          to_blocks=False)
    for extra in lay.extras:
        if extra.canonical in tensors:
            value = np.asarray(tensors[extra.canonical]).reshape(-1)
            if hf.get("norm_offset") and ".norm." in extra.canonical:
                value = value - value.dtype.type(hf["norm_offset"])  # Gemma stores w of its (1 + w)
            state[place.base(lay) + extra.key] = np.array(value, order="C", copy=True)
    if hf_config is not None:  # the file must mean, under its config file, what config says
        read, _ = to_canonical(lay.id, state, hf_config=hf_config, layer=layer, prefix=prefix)
        differ = _behaviour_differences(config, read)
        if differ:
            raise ValueError(f"hf_config disagrees with config for {lay.id} block {layer}: " + "; ".join(differ))
    return state


def _behaviour_differences(want: AttentionConfig, got: AttentionConfig) -> list[str]:
    out = []
    for field, value in want.to_dict().items():
        if field in ("dropout", "masked_row", "scale"):
            continue
        if got.to_dict()[field] != value:
            out.append(f"{field}={value!r} (config file gives {got.to_dict()[field]!r})")
    if not math.isclose(want.effective_scale, got.effective_scale, rel_tol=1e-12):
        out.append(f"scale={want.effective_scale!r} (config file gives {got.effective_scale!r})")
    return out


def _scatter(row: Row, head: int | None, arrays: list[np.ndarray]) -> np.ndarray:
    """Canonical tensors -> one foreign array: flatten, concatenate, transpose
    (or take one head's slice)."""
    if row.form == HEADS:
        return np.array(arrays[0], order="C", copy=True)
    name = row.parts[0]
    if head is not None:
        flat = arrays[0][:, head, :] if name.endswith(".kernel") else arrays[0][head]  # (in, width) / (width,)
    else:
        flats = []
        for part, array in zip(row.parts, arrays):
            if part == "output.kernel":
                flats.append(array.reshape(-1, array.shape[-1]))  # (N*V, O)
            elif part.endswith(".kernel"):
                flats.append(array.reshape(array.shape[0], -1))  # (in, heads*width)
            else:
                flats.append(array.reshape(-1))  # (heads*width,)
        flat = flats[0] if len(flats) == 1 else np.concatenate(flats, axis=-1)
    if row.form == LINEAR and flat.ndim == 2:
        flat = flat.T  # (out, in)
    return np.array(flat, order="C", copy=True)


def mapping(layout: str, config: AttentionConfig, **hints: Any) -> dict[str, tuple[str, ...]]:
    """Which canonical tensors each key of from_canonical's state holds (hints as from_canonical's)."""
    state = from_canonical(layout, config, _zeros(config), **hints)
    lay = _get(layout)
    hints = {k: v for k, v in hints.items() if v is not None}
    roles = _names_hint(lay, hints.get("names")) or lay.roles[0]
    layer = hints.get("layer", 0 if lay.scope else None)
    place = _Place(_pick_table(lay, config), roles, hints.get("prefix", ""), layer)
    return {key: row.parts for key, row, _ in _expand(lay, place, config.num_heads) if key in state}


def _zeros(config: AttentionConfig, dtype="float32") -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, dtype=dtype) for name, shape in config.tensor_shapes().items()}


def describe(layout: str) -> str:
    """The layout's table as text: key, canonical tensors, form; then its ties."""
    lay = _get(layout)
    lines = [f"{lay.id}: {lay.description}"]
    for table in lay.tables:
        if table.note:
            lines.append(f"  [{table.note}]")
        roles = lay.roles[0]
        for row in table.rows:
            key = lay.scope.replace("{layer}", "{L}") + _fill(row.key, roles)
            lines.append(f"  {key:<44} {' + '.join(row.parts):<42} {row.form}")
        lines += [f"  tie: {tie.field} == {tie.equals} ({tie.why})" for tie in table.ties]
    if lay.bias != "each":
        lines.append(f"  biases: {lay.bias} ({lay.bias_why})")
    return "\n".join(lines)


def _self_check() -> None:
    """Internal invariant: a concatenated kernel row's parts share their input axis once tied."""
    for layout in LAYOUT_LIST:
        for table in layout.tables:
            ties = _ties(table)
            for row in table.rows:
                if len(row.parts) > 1 and not row.is_bias:
                    ins = {_substitute((FLAT[p][0],), ties) for p in row.parts}
                    assert len(ins) == 1, (layout.id, row.key)


_self_check()
