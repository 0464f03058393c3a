"""The canonical layout: the common format's own tensors, under their own names.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| canonical         | query.kernel, query.bias, ... output.bias         | the same                   | heads  |

It expresses every config.
"""

from __future__ import annotations

from .table import HEADS, Layout, R, Table

FAMILY = (
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
)
