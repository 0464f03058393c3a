"""torch layouts: nn.MultiheadAttention's state dict and hand-written nn.Linear modules.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| torch-mha         | in_proj_weight (3E, E), in_proj_bias (3E)         | query+key+value            | linear |
|   (kdim/vdim != E)| q_proj_weight, k_proj_weight, v_proj_weight       | query / key / value.kernel | linear |
|                   | out_proj.weight (E, E), out_proj.bias             | output                     | linear |
| torch-linears     | {query}.weight/.bias  W_query  (N*H, D)           | query                      | linear |
|                   | {key} W_key, {value} W_value, {output} out_proj   | key, value, output         | linear |
| torch-fused-qkv   | {qkv}.weight (3*N*H, D) qkv (or qkv_proj), .bias  | query+key+value            | linear |
|                   | {output}.weight (O, N*H) proj (or out_proj)       | output                     | linear |
| torch-per-head    | heads.{i}.W_q.weight (H, D), .bias; W_k; W_v      | head i of query/key/value  | linear |
|                   | fc_out.weight (O, N*V), fc_out.bias               | output                     | linear |

What they cannot express:
- torch-mha: num_kv_heads == num_heads, value_head_dim == head_dim,
  query_dim == out_dim == num_heads*head_dim, and with kdim == vdim ==
  embed_dim the packed in_proj_weight (else q/k/v_proj_weight); one `bias`
  flag for all four projections.
- torch-fused-qkv: one input (key_dim == value_dim == query_dim), equal q/k/v
  widths (no GQA, value_head_dim == head_dim); q, k, v biases together.
- torch-per-head: no GQA (each head owns its key and value projection).
- torch-linears expresses every config.
"""

from __future__ import annotations

from .table import LINEAR, NO_GQA, Layout, R, Table, Tie

_TORCH_MHA_TIES = (
    Tie("num_kv_heads", NO_GQA, "nn.MultiheadAttention has no grouped-query attention"),
    Tie("value_head_dim", "head_dim", "nn.MultiheadAttention's value heads are embed_dim // num_heads wide"),
    Tie("query_dim", "num_heads*head_dim", "nn.MultiheadAttention's embed_dim = num_heads * head_dim"),
    Tie("out_dim", "num_heads*head_dim", "nn.MultiheadAttention's output width is embed_dim"),
)

FAMILY = (
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
)
