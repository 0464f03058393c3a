"""Finding a layout's table in a state dict: the prefix, the module names, the layer.

A state may hold other modules' keys (a whole checkpoint, an optimizer's
state); the first row's key anchors the table: a unique prefix (and, for the
decoders and hf-*, a layer) under which it exists. layers() lists the blocks
a checkpoint holds; detect_layout() names the layout whose kernels are there.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..format import WeightsFormatError
from .table import Catalogue, Layout, Row, Table, _check_int, _fill

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
    anchors: set[str] = set()
    for t_index, table in enumerate(layout.tables):
        if table.rows[0].key in anchors:
            continue  # the state cannot tell it from an earlier table: config.json picks (hf: "table")
        anchors.add(table.rows[0].key)
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


def layers(catalogue: Catalogue, layout: str, state: Mapping[str, Any], /, *, prefix: str | None = None) -> list[int]:
    """weights.layouts.layers over `catalogue`'s layouts."""
    lay = catalogue.get(layout)
    if not lay.scope:
        raise ValueError(f"layers() applies to layouts with blocks ({', '.join(i for i, x in catalogue.by_id.items() if x.scope)}): "
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


def detect_layout(catalogue: Catalogue, state: Mapping[str, Any], /) -> str | None:
    """weights.layouts.detect_layout over `catalogue`'s layouts, tried in its `detect` order."""
    for layout_id in catalogue.detect:
        layout = catalogue.by_id[layout_id]
        found, role_sets = _candidates(layout, state, None)
        for (t_index, r_index, prefix), found_layers in found.items():
            table, roles = layout.tables[t_index], role_sets[r_index]
            for layer in found_layers:
                base = prefix + layout.scope.format(layer=layer)
                kernels = [_fill(row.key, roles, 0) for row in table.rows if not row.is_bias]
                if all(base + key in state for key in kernels):
                    return layout_id
    return None


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
