"""The table engine's vocabulary: what a layout's table says, and the helpers every stage shares.

A family module (torch.py, llama.py, ...) writes its layouts in this
vocabulary; locate.py, read.py and write.py run every table alike; a
Catalogue (built by registry.py) is the set of layouts the id-taking
functions know, handed to the engine, which imports no family.

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
`c_attn` = [q | k | v]; a head_major row alternates them head by head instead (Qwen3-Next's
`q_proj` = per head [query | gate]). A key with `{i}` repeats for each head i and holds that
head's slice (kernel[:, i, :], bias[i]). Conversion is transposes, reshapes,
concatenation and slicing only, so every round trip is bit-exact in every dtype.

Each family module's docstring holds its rows of the layout table (foreign
key, canonical tensors, form) and what its layouts cannot express.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..config import AttentionConfig

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
    "gate.kernel": ("D", "N", "V"), "gate.bias": ("N", "V"),  # the element-wise output gate
}
FLAT = {
    "query.kernel": (("D",), ("N", "H")), "query.bias": (("N", "H"),),
    "key.kernel": (("Dk",), ("K", "H")), "key.bias": (("K", "H"),),
    "value.kernel": (("Dv",), ("K", "V")), "value.bias": (("K", "V"),),
    "output.kernel": (("N", "V"), ("O",)), "output.bias": (("O",),),
    "gate.kernel": (("D",), ("N", "V")), "gate.bias": (("N", "V"),),
}
HEAD = {
    "query.kernel": (("D",), ("H",)), "query.bias": (("H",),),
    "key.kernel": (("Dk",), ("H",)), "key.bias": (("H",),),
    "value.kernel": (("Dv",), ("V",)), "value.bias": (("V",),),
    "gate.kernel": (("D",), ("V",)), "gate.bias": (("V",),),
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
    head_major: bool = False  # the parts alternate head by head: each head's slice of every part in turn

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
    shared: tuple[tuple[str, str], ...] = ()  # (canonical, source): stored once, as source (Gemma 4's k = v)


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
    qkv_per_head: tuple[str, ...] = ()  # keys whose rows are (K, N/K + 2, H): each kv head's q's, k, v together
    #   (GPT-NeoX, BLOOM: (N, 3, H); Falcon: K from config.json, 1 for multi_query)
    derived: tuple[str, ...] = ()  # canonical tensors computed from config.json, never stored (ALiBi slopes)


@dataclasses.dataclass(frozen=True)
class Extra:
    key: str  # foreign name relative to the block's scope: a 1-D vector
    canonical: str  # the canonical tensor it holds, reshaped (e.g. OLMo 2's (N*H,) -> (N, H))


def R(key: str, parts: str, form: str, *, head_major: bool = False) -> Row:
    return Row(key, tuple(parts.split()), form, head_major)


NO_GQA = "num_heads"  # Tie target for "no grouped-query attention"


_HIDDEN_TIES = (  # hf-bert, hf-gpt2, hf-gpt-neox, hf-gptj: every width is hidden_size
    Tie("num_kv_heads", NO_GQA, "no grouped-query attention"),
    Tie("value_head_dim", "head_dim", "value heads are hidden_size // num_heads wide"),
    Tie("query_dim", "num_heads*head_dim", "hidden_size = num_heads * head_dim"),
    Tie("key_dim", "num_heads*head_dim", "keys are projected from hidden states"),
    Tie("value_dim", "num_heads*head_dim", "values are projected from hidden states"),
    Tie("out_dim", "num_heads*head_dim", "the output projection maps hidden_size to hidden_size"),
)


# -- the layouts a conversion may name --------------------------------------------------

class Catalogue:
    """The layouts the id-taking functions know, in order: registry.py builds the one weights.layouts uses
    and passes it to the engine's functions, so the engine imports no family and no registry."""

    def __init__(self, layouts: Sequence[Layout], detect: Sequence[str]):
        self.layouts = tuple(layouts)  # LAYOUT_LIST
        self.by_id = {layout.id: layout for layout in self.layouts}  # _BY_ID
        self.descriptions: dict[str, str] = {layout.id: layout.description for layout in self.layouts}  # LAYOUTS
        self.roles: dict[str, tuple[str, ...]] = {  # ROLES
            layout.id: tuple(layout.roles[0]) for layout in self.layouts if layout.roles[0]}
        self.detect = tuple(detect)  # the order detect_layout tries

    def get(self, layout: str) -> Layout:
        if isinstance(layout, Layout):
            return layout
        try:
            return self.by_id[layout]
        except (KeyError, TypeError):
            raise ValueError(f"layout must be one of {', '.join(self.descriptions)}: got {layout!r}") from None


# -- small helpers -----------------------------------------------------------------

Size = tuple[tuple[str, ...], ...]  # a sum of products of letters


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


def _names_hint(catalogue: Catalogue, layout: Layout, names) -> dict[str, str] | None:
    if names is None:
        return None
    roles = layout.roles[0]
    if not roles:
        raise ValueError(f"names: layout {layout.id} has fixed names; names apply to {', '.join(catalogue.roles)}: got {names!r}")
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


def describe(catalogue: Catalogue, layout: str, /) -> str:
    """weights.layouts.describe over `catalogue`'s layouts."""
    lay = catalogue.get(layout)
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


def _self_check(layouts: Sequence[Layout]) -> None:
    """Internal invariant: a concatenated kernel row's parts share their input axis once tied."""
    for layout in layouts:
        for table in layout.tables:
            ties = _ties(table)
            for row in table.rows:
                if len(row.parts) > 1 and not row.is_bias:
                    ins = {_substitute((FLAT[p][0],), ties) for p in row.parts}
                    assert len(ins) == 1, (layout.id, row.key)
