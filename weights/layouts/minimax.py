"""hf-minimax: MiniMax M3's text attention (transformers 5.23's minimax_m3_vl: MiniMaxM3VLAttention and
MiniMaxM3VLIndexer), from a text-only folder or from the released VL model's.

| foreign key ([P]layers.{L}.self_attn.)              | canonical                         | form   |
|------------------------------------------------------|-----------------------------------|--------|
| q_norm.weight (H,)                                   | query.norm.scale = 1 + w          | 1-D    |
| k_norm.weight (H,)                                   | key.norm.scale = 1 + w            | 1-D    |
| q_proj.weight / k_proj.weight / v_proj.weight        | query / key / value.kernel        | linear |
| o_proj.weight                                        | output.kernel                     | linear |
| indexer.q_proj.weight (text) / index_q_proj.weight (VL) | indexer.query.kernel (D, I, J) | linear |
| indexer.k_proj.weight / index_k_proj.weight          | indexer.key.kernel (D, J)         | linear |
| indexer.q_norm.weight / index_q_norm.weight          | indexer.query.norm.scale = 1 + w  | 1-D    |
| indexer.k_norm.weight / index_k_norm.weight          | indexer.key.norm.scale = 1 + w    | 1-D    |

Folders: a text-only model (MiniMaxM3VLForCausalLM, config.json model_type minimax_m3_vl_text; keys
`model.layers.{L}.self_attn.indexer.*`, transformers' module names) and the released VL model
(MiniMaxM3SparseForConditionalGeneration, model_type minimax_m3_vl with its text_config; keys
`language_model.model.layers.{L}.self_attn.index_*`: transformers' conversion_mapping.py renames them to
`indexer.*` on load and back on save). The prefix is detected (the vision tower's attention holds no q_norm);
either naming reads the same tensors, and from_canonical writes the one its prefix names (index_* under a
`language_model.` prefix).

Facts, from transformers 5.23's modeling_minimax_m3_vl.py (tests/test_layouts_minimax.py measures them
against a tiny model's own output):
- q_norm and k_norm are Gemma RMS norms over each head's H features (`x * (1 + w)`, float32, rms_norm_eps;
  MiniMaxM3VLRMSNorm, :140-160), before RoPE (:431-436): the canonical scale is 1 + w.
- RoPE is half-split on the first head_dim * partial_rotary_factor features (MiniMaxM3VLRotaryEmbedding
  reads partial_rotary_factor, :296-298, not rotary_dim); softmax scale head_dim ** -0.5 (:407); no biases.
- Sparse layers (layer_types "minimax_m3_sparse", else sparse_attention_config.sparse_attention_freq) run the
  indexer (weights.layouts.indexer.indexer_field: blocks per kv head, local blocks); the others are dense.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..config import AttentionConfig
from ..format import WeightsFormatError, validate_tensors
from .hf_rope import _hf_rope
from .indexer import indexer_field, indexer_layers, indexer_tensors
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
    _check_hints,
    _load_hf_config,
    _names_hint,
)
from .write import _behaviour_differences

OWN_CONVERTER = True  # registry.py: this module converts its layout
M3_TEXT_TYPES = ("minimax_m3_vl_text", "minimax_m3")
VL_TYPE = "minimax_m3_vl"
# the indexer's keys: transformers' module names (text folder) -> the released VL checkpoint's
INDEXER_NAMES = {"indexer.q_proj.weight": "index_q_proj.weight", "indexer.k_proj.weight": "index_k_proj.weight",
                 "indexer.q_norm.weight": "index_q_norm.weight", "indexer.k_norm.weight": "index_k_norm.weight"}
VL_PREFIX = "language_model."  # the released VL model's text keys start with it (then model.layers...)


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    model_type = cfg.get("model_type")
    if model_type == VL_TYPE:
        text = cfg.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError("hf_config: a minimax_m3_vl config.json needs text_config (its language model)")
        return text
    if model_type not in M3_TEXT_TYPES:
        raise ValueError(f"hf_config: model_type must be one of {', '.join((VL_TYPE,) + M3_TEXT_TYPES)} for "
                         f"hf-minimax: got {model_type!r}")
    return cfg


def _hf_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of a MiniMax M3 model (text or VL) -> block `layer`'s AttentionConfig fields."""
    cfg = _text_config(cfg)
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers") if cfg.get(k) is None]
    if missing:
        raise ValueError(f"hf_config: hf-minimax needs {', '.join(missing)}: got none")
    N = int(cfg["num_attention_heads"])
    H = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // N)
    rope = _hf_rope(cfg, None, H, interleaved=False)  # int(H * partial_rotary_factor) features, half-split
    kinds = indexer_layers("minimax_m3_vl", cfg)
    index = 0 if layer is None else layer
    if not 0 <= index < len(kinds):
        raise ValueError(f"layer must be in [0, {len(kinds)}) (num_hidden_layers): got {layer}")
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    return {"model_type": "minimax_m3", "indexer_kind": kinds[index], "fields": {
        "num_heads": N, "num_kv_heads": int(cfg.get("num_key_value_heads") or N), "query_dim": int(cfg["hidden_size"]),
        "head_dim": H, "use_query_bias": False, "use_key_bias": False, "use_value_bias": False,
        "use_output_bias": False, "dropout": float(cfg.get("attention_dropout") or 0.0), "rope": rope,
        "qk_norm": {"type": "rms", "eps": eps, "scope": "head"},
        "indexer": indexer_field("minimax_m3_vl", cfg, rope) if kinds[index] == "full" else None}}


_ROWS = (R("q_norm.weight", "query.norm.scale", HEADS), R("k_norm.weight", "key.norm.scale", HEADS),
         R("q_proj.weight", "query.kernel", LINEAR), R("k_proj.weight", "key.kernel", LINEAR),
         R("v_proj.weight", "value.kernel", LINEAR), R("o_proj.weight", "output.kernel", LINEAR))

FAMILY = (
    Layout(
        "hf-minimax", "transformers' MiniMax M3 text attention (minimax_m3_vl_text, and minimax_m3_vl's "
        "text_config; the released VL folder's language_model.model.layers.{L}.self_attn.index_* read as "
        "indexer.*): [prefix]layers.{L}.self_attn.{q_norm,k_norm,q_proj,k_proj,v_proj,o_proj,indexer.*}; "
        "config.json gives partial RoPE, the Gemma QK-norm's eps and which layers are sparse; causal",
        sep=".", scope="layers.{layer}.self_attn.", select=True, hf=_hf_config, needs_hf_config=True,
        pairing="half", tables=(Table(_ROWS, note="Gemma norms: canonical scale = 1 + w"),),
    ),
)


def _state_of(config: AttentionConfig, tensors: Mapping[str, np.ndarray], base: str, vl: bool) -> dict[str, np.ndarray]:
    """Canonical tensors -> the block's keys (Gemma's w = scale - 1)."""
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
    one = np.ones((), dtype=np.asarray(tensors["query.kernel"]).dtype)
    out = {"q_norm.weight": tensors["query.norm.scale"] - one, "k_norm.weight": tensors["key.norm.scale"] - one,
           "q_proj.weight": tensors["query.kernel"].reshape(-1, N * H).T,
           "k_proj.weight": tensors["key.kernel"].reshape(-1, K * H).T,
           "v_proj.weight": tensors["value.kernel"].reshape(-1, K * H).T,
           "o_proj.weight": tensors["output.kernel"].reshape(N * H, -1).T}
    if config.indexer is not None:
        ix = config.indexer
        names = INDEXER_NAMES if vl else {k: k for k in INDEXER_NAMES}  # the released VL names, or the modules'
        out.update({names["indexer.q_proj.weight"]: tensors["indexer.query.kernel"].reshape(-1, ix.heads * ix.head_dim).T,
                    names["indexer.k_proj.weight"]: tensors["indexer.key.kernel"].T,
                    names["indexer.q_norm.weight"]: tensors["indexer.query.norm.scale"] - one,
                    names["indexer.k_norm.weight"]: tensors["indexer.key.norm.scale"] - one})
    return {f"{base}{key}": np.ascontiguousarray(array) for key, array in out.items()}


def _gather(config: AttentionConfig, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{key relative to the scope (indexer.* names): array} -> canonical tensors."""
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
    one = np.ones((), dtype=arrays["q_proj.weight"].dtype)
    t = {"query.norm.scale": one + arrays["q_norm.weight"], "key.norm.scale": one + arrays["k_norm.weight"],
         "query.kernel": arrays["q_proj.weight"].T.reshape(-1, N, H),
         "key.kernel": arrays["k_proj.weight"].T.reshape(-1, K, H),
         "value.kernel": arrays["v_proj.weight"].T.reshape(-1, K, H),
         "output.kernel": arrays["o_proj.weight"].T.reshape(N, H, -1)}
    if config.indexer is not None:
        state = {key[len("indexer."):]: arrays[key] for key in INDEXER_NAMES}
        t.update(indexer_tensors("minimax_m3_vl", state, heads=config.indexer.heads))
    return {name: np.array(t[name], order="C", copy=True) for name in config.tensor_shapes()}


def _zeros(config: AttentionConfig) -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, np.float32) for name, shape in config.tensor_shapes().items()}


def to_canonical(catalogue: Catalogue, layout: str, state: Mapping[str, Any], /,
                 **hints: Any) -> tuple[AttentionConfig, dict[str, np.ndarray]]:
    """weights.layouts.to_canonical for hf-minimax: the sizes from config.json; the prefix (a text folder's
    `model.`, the VL folder's `language_model.model.`) detected, and the indexer's naming from the keys; every missing, unexpected, mis-shaped or
    mis-typed key of the block listed in one WeightsFormatError."""
    lay = catalogue.get(layout)
    _check_hints("to_canonical", lay, hints, TO_HINTS)
    hints = {k: v for k, v in hints.items() if v is not None}
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a mapping of names to numpy arrays: got {type(state).__name__}")
    _names_hint(catalogue, lay, hints.get("names"))
    cfg = _load_hf_config(hints.get("hf_config"))
    if cfg is None:
        raise ValueError("hf_config: hf-minimax reads the sizes, RoPE and sparse layers from the checkpoint's config "
                         "file (a dict or the path of config.json; CLI: beside SRC): got None")
    ignore = hints.get("ignore") or ()
    ignore = (ignore,) if isinstance(ignore, str) else tuple(ignore)
    visible = {k: v for k, v in state.items()
               if isinstance(k, str) and not any(fnmatch.fnmatchcase(k, p) for p in ignore)}
    place = _locate(lay, visible, None, hints.get("prefix"), hints.get("layer"))
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
    vl = f"{base}{INDEXER_NAMES['indexer.q_proj.weight']}" in visible  # the released VL names (index_*)
    expected = {key: tuple(int(d) for d in array.shape)
                for key, array in _state_of(config, _zeros(config), base, vl).items()}
    problems = []
    missing = [key for key in expected if key not in visible]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    unexpected = sorted(k for k in visible if k.startswith(base) and k not in expected)
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected)} (config file: this layer's indexer: "
                        f"{facts['indexer_kind'] or 'none (dense)'})")
    problems += shape_and_dtype_problems(expected, visible)
    if problems:
        raise WeightsFormatError(f"{lay.id}: " + "; ".join(problems))
    back = {v: k for k, v in INDEXER_NAMES.items()}
    arrays = {back.get(key[len(base):], key[len(base):]): np.asarray(visible[key]) for key in expected}
    tensors = _gather(config, arrays)
    validate_tensors(config, tensors, source=lay.id)  # internal invariant: every tensor read
    return config, tensors


def cannot_express(catalogue: Catalogue, layout: str, config: AttentionConfig, /, *, table=None) -> list[str]:
    """Why hf-minimax cannot hold config's tensors, one line per field."""
    problems = []
    for flag in ("use_query_bias", "use_key_bias", "use_value_bias", "use_output_bias"):
        if getattr(config, flag):
            problems.append(f"{flag}=True (MiniMax M3's projections have no bias)")
    for field, equals, why in (("key_dim", "query_dim", "k_proj and v_proj read the hidden states"),
                               ("value_dim", "query_dim", "v_proj reads the hidden states"),
                               ("out_dim", "query_dim", "o_proj maps back to hidden_size"),
                               ("value_head_dim", "head_dim", "one head_dim for q, k and v")):
        if getattr(config, field) != getattr(config, equals):
            problems.append(f"{field}={getattr(config, field)} (needs {field} == {equals}: {why})")
    norm = config.qk_norm
    if norm is None or norm.type != "rms" or norm.scope != "head" or norm.per_head or norm.after_rope:
        problems.append(f"qk_norm={norm!r} (needs an rms norm over each head's features before RoPE: q_norm, k_norm)")
    for field, on in (("use_sinks", config.use_sinks), ("alibi", config.alibi),
                      ("output_gate", config.output_gate is not None), ("latent", config.latent is not None),
                      ("value_norm", config.value_norm is not None)):
        if on:
            problems.append(f"{field}={getattr(config, field)!r} (hf-minimax holds no such tensor)")
    ix = config.indexer
    if ix is not None:
        for field, want, why in (("query_source", "input", "index_q_proj reads the hidden states"),
                                 ("head_weights", False, "no head weights"), ("relu", False, "no ReLU"),
                                 ("per_kv_head", True, "one selection per kv head"),
                                 ("rope_end", "first", "the rotary features come first")):
            if getattr(ix, field) != want:
                problems.append(f"indexer.{field}={getattr(ix, field)!r} (needs {want!r}: {why})")
        for field in ("query_norm", "key_norm"):
            n = getattr(ix, field)
            if n is None or n.type != "rms":
                problems.append(f"indexer.{field}={n!r} (needs an rms norm: index_{field[0]}_norm)")
        if ix.block_size is None:
            problems.append("indexer.block_size=None (MiniMax M3 selects blocks)")
        if ix.block_pool != "max":  # no key holds GLM-5.3-Flash's pool gate and slot positions
            problems.append(f"indexer.block_pool={ix.block_pool!r} (needs 'max': M3 scores a block by its best key)")
    return problems


def from_canonical(catalogue: Catalogue, layout: str, config: AttentionConfig, tensors: Mapping[str, np.ndarray], /,
                   **hints: Any) -> dict[str, np.ndarray]:
    """weights.layouts.from_canonical for hf-minimax: the indexer keys named as the prefix says (index_* under
    a `language_model.` prefix, the released VL form; indexer.* otherwise). With hf_config the block is read
    back under it and must mean what config says."""
    lay = catalogue.get(layout)
    _check_hints("from_canonical", lay, hints, FROM_HINTS)
    hints = {k: v for k, v in hints.items() if v is not None}
    if not isinstance(config, AttentionConfig):
        raise ValueError(f"config must be an AttentionConfig: got {type(config).__name__}")
    _names_hint(catalogue, lay, hints.get("names"))
    problems = cannot_express(catalogue, lay.id, config)
    if problems:
        raise ValueError(f"{lay.id} cannot express " + "; ".join(problems))
    if config.rope is not None and config.rope.interleaved:
        raise ValueError("hf-minimax cannot express rope.interleaved=True (MiniMax M3 rotates half-split pairs)")
    validate_tensors(config, tensors, source="canonical tensors")
    prefix = hints.get("prefix") or ""
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a string: got {prefix!r}")
    layer = hints.get("layer", 0)
    state = _state_of(config, tensors, prefix + lay.scope.format(layer=layer), prefix.startswith(VL_PREFIX))
    cfg = _load_hf_config(hints.get("hf_config"))
    if cfg is not None:
        read, _ = to_canonical(catalogue, lay.id, state, hf_config=cfg, layer=layer, prefix=prefix)
        differ = _behaviour_differences(config, read)
        if differ:
            raise ValueError(f"hf_config disagrees with config for {lay.id} block {layer}: " + "; ".join(differ))
    return state


def mapping(catalogue: Catalogue, layout: str, config: AttentionConfig, /, **hints: Any) -> dict[str, tuple[str, ...]]:
    """Which canonical tensors each key of from_canonical's state holds."""
    state = from_canonical(catalogue, layout, config, _zeros(config), **hints)
    hints = {k: v for k, v in hints.items() if v is not None}
    base = (hints.get("prefix") or "") + catalogue.get(layout).scope.format(layer=hints.get("layer", 0))
    held = {"q_norm": "query.norm.scale", "k_norm": "key.norm.scale", "q_proj": "query.kernel",
            "k_proj": "key.kernel", "v_proj": "value.kernel", "o_proj": "output.kernel",
            "indexer.q_proj": "indexer.query.kernel", "indexer.k_proj": "indexer.key.kernel",
            "indexer.q_norm": "indexer.query.norm.scale", "indexer.k_norm": "indexer.key.norm.scale"}
    held.update({v[:-len(".weight")]: held[k[:-len(".weight")]] for k, v in INDEXER_NAMES.items()})
    return {key: (held[key[len(base):-len(".weight")]],) for key in state}
