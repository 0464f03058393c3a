"""The meta-llama layout: Meta's own Llama checkpoint (consolidated.*.pth), and its params.json reader.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| meta-llama        | [P]layers.{L}.attention.{wq,wk,wv,wo}.weight      | query ... output           | linear |

A decoder: its config file (params.json) is required (write.py says what
that brings); interleaved RoPE pairs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .table import LINEAR, Layout, R, Table, Tie


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


FAMILY = (
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
