"""State -> canonical: to_canonical's work, for every table alike.

Behaviour fields (scale, dropout, masked_row) live in no state dict: they come
from hints (`scale=`, `dropout=`, `masked_row=`), and for hf-* from the
checkpoint's config.json (`hf_config=`: attention dropout, GPT-2's
scale_attn_weights and scale_attn_by_inverse_layer_idx). from_canonical drops
them.

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

import fnmatch
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..config import AttentionConfig
from ..dtypes import DTYPES, resolve_dtype
from ..format import WeightsFormatError, validate_tensors
from .locate import _expand, _locate
from .table import (
    AXES,
    BIAS_FLAG,
    FIELDS,
    FLAT,
    HEAD,
    HEADS,
    LINEAR,
    TO_HINTS,
    Catalogue,
    Layout,
    Size,
    _check_hints,
    _evaluate,
    _fmt_shape,
    _load_hf_config,
    _names_hint,
    _row_size,
    _substitute,
    _ties,
)

# -- state -> canonical ----------------------------------------------------------------


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


def shape_and_dtype_problems(expected: dict[str, tuple[int, ...]], visible) -> list[str]:
    """Each present tensor of `expected` (key -> shape) checked as an array, then for its shape; and one
    dtype for all of them. -> the problems, each a readable phrase (the readers that list their keys and
    shapes themselves: deepseek, minimax)."""
    problems, dtypes = [], {}
    for key, shape in expected.items():
        if key not in visible:
            continue
        issue = _array_problem(key, visible[key])
        if issue is None and tuple(visible[key].shape) != shape:
            issue = f"{key} has shape {tuple(visible[key].shape)}, expected {shape}"
        if issue:
            problems.append(issue)
        else:
            dtypes.setdefault(str(visible[key].dtype), []).append(key)
    if len(dtypes) > 1:
        problems.append("mixed dtypes (one dtype for all tensors): "
                        + "; ".join(f"{d}: {', '.join(k)}" for d, k in dtypes.items()))
    return problems


def to_canonical(catalogue: Catalogue, layout: str, state: Mapping[str, Any], /,
                 **hints: Any) -> tuple[AttentionConfig, dict[str, np.ndarray]]:
    """weights.layouts.to_canonical over `catalogue`'s layouts."""
    lay = catalogue.get(layout)
    _check_hints("to_canonical", lay, hints, TO_HINTS)
    hints = {k: v for k, v in hints.items() if v is not None}
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a mapping of names to numpy arrays: got {type(state).__name__}")
    bad_keys = [k for k in state if not isinstance(k, str)]
    if bad_keys:
        raise ValueError(f"state keys must be strings: got {', '.join(map(repr, bad_keys[:5]))}")
    names = _names_hint(catalogue, lay, hints.get("names"))
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
    if "table" in hf and lay.tables[hf["table"]].rows[0].key == place.table.rows[0].key:
        place.table = lay.tables[hf["table"]]  # tables the state cannot tell apart: config.json's choice
    if lay.qkv_per_head:
        visible = _qkv_rows(visible, [base + key for key in lay.qkv_per_head], known.get("N"), to_blocks=True,
                            kv_heads=known.get("K"))
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
        for target, source in place.table.shared:
            if target in BIAS_FLAG:
                flags[BIAS_FLAG[target]] = flags[BIAS_FLAG[source]]
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
    if config is not None and lay.derived:
        dtype = next((visible[k].dtype for k in sorted(present) if isinstance(visible[k], np.ndarray)), None)
        for name in lay.derived:
            if name in config.tensor_shapes():  # computed from config.json (float64), stored in the state's dtype
                extra_tensors[name] = np.asarray(hf["derived"][name], dtype=np.float64).astype(dtype)
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
    for target, source in place.table.shared:
        if source in tensors:
            tensors[target] = tensors[source].copy()
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
        key = base + hf.get("extra_keys", {}).get(extra.canonical, extra.key)  # a model's own name (llama_knobs)
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
        stored = shape if _per_head_norm(config, extra.canonical) else (math.prod(shape),)  # Cohere: (heads, H)
        if issue is None and array.shape != stored:
            issue = f"{key} has shape {_fmt_shape(array.shape)}, expected {_fmt_shape(stored)}"
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


def _per_head_norm(config: AttentionConfig, name: str) -> bool:
    """A norm tensor with one row per head (qk_norm.per_head: Cohere's q_norm (N, H)): stored in that shape,
    every other extra flat."""
    norm = config.value_norm if name.startswith("value.") else config.qk_norm
    return ".norm." in name and norm is not None and norm.per_head


def _qkv_rows(state: Mapping[str, Any], keys: Sequence[str], heads: int | None, *, to_blocks: bool,
              kv_heads: int | None = None):
    """Fused rows grouped by kv head, (K, G + 2, H) with G = N / K (each group's G query heads, then its
    key and value head: Falcon; K = N gives GPT-NeoX's and BLOOM's (N, 3, H)) <-> the table's [q; k; v]
    blocks (N*H; K*H; K*H): a permutation of the first axis, exact. Left alone when the row count does
    not divide (the shape check then reports it)."""
    out = dict(state)
    K = heads if kv_heads is None else kv_heads
    for key in keys:
        array = out.get(key)
        if (not isinstance(array, np.ndarray) or heads is None or not K or heads % K or array.ndim < 1
                or array.shape[0] % (heads + 2 * K)):
            continue
        width, G, rest = array.shape[0] // (heads + 2 * K), heads // K, array.shape[1:]
        if to_blocks:
            grid = array.reshape(K, G + 2, width, *rest)  # (K, G + 2, H, ...)
            parts = [grid[:, :G], grid[:, G:G + 1], grid[:, G + 1:]]  # (K, G, H, ...), (K, 1, H, ...) twice
            moved = np.concatenate([part.reshape(-1, *rest) for part in parts])  # (N*H + 2*K*H, ...)
        else:
            q, k, v = np.split(array, [heads * width, (heads + K) * width])
            moved = np.concatenate([q.reshape(K, G, width, *rest), k.reshape(K, 1, width, *rest),
                                    v.reshape(K, 1, width, *rest)], axis=1)  # (K, G + 2, H, ...)
        out[key] = np.array(moved.reshape(array.shape), order="C", copy=True)
    return out


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
        if row.head_major:  # (in, heads*sum(widths)) -> (in, heads, sum(widths)), split per head
            widths = [_evaluate((HEAD[p][-1],), dims) for p in row.parts]
            heads = dims[AXES[row.parts[0]][-2]]
            flat = flat.reshape(*flat.shape[:-1], heads, sum(widths))
        else:
            widths = [_evaluate((FLAT[p][-1],), dims) for p in row.parts]
        pieces = np.split(flat, np.cumsum(widths)[:-1], axis=-1)
        for name, piece in zip(row.parts, pieces):
            tensors[name] = np.array(piece.reshape(shapes[name]), order="C", copy=True)
    return {name: tensors[name] for name in shapes if name in tensors}
