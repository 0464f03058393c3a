"""Keras layouts: Dense layers per projection, and keras.layers.MultiHeadAttention's variables.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| keras-split-heads | WQ/kernel (D, N*H), WQ/bias; WK; WV               | query, key, value          | dense  |
|                   | WO/kernel (N*V, O), WO/bias                       | output                     | dense  |
| keras-mha         | query/kernel (D, N, H), query/bias; key; value    | query, key, value          | heads  |
|                   | attention_output/kernel (N, V, O), .../bias       | output                     | heads  |

What they cannot express:
- keras-mha: no GQA; one use_bias.
- keras-split-heads expresses every config.
"""

from __future__ import annotations

from .table import DENSE, HEADS, NO_GQA, Layout, R, Table, Tie

FAMILY = (
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
)
