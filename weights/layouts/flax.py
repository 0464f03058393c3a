"""Flax layouts: linen's MultiHeadDotProductAttention and nnx's MultiHeadAttention, params flattened with '/'.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| flax-linen-mha    | query/kernel (D, N, H) ...; out/kernel (N, H, O)  | query ... output           | heads  |
| flax-nnx-mha      | the same keys as flax-linen-mha (GQA allowed)     | query ... output           | heads  |

What they cannot express:
- flax-linen-mha: no GQA, value_head_dim == head_dim, one use_bias.
- flax-nnx-mha: value_head_dim == head_dim, key_dim == value_dim
  (in_kv_features), one use_bias; GQA allowed (num_kv_heads).
"""

from __future__ import annotations

from .table import HEADS, NO_GQA, Layout, R, Table, Tie

FAMILY = (
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
)
