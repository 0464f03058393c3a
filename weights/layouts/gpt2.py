"""The hf-gpt2 layout: a GPT-2 checkpoint's attention (Conv1D, fused c_attn), and its config.json reader.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| hf-gpt2           | [P]h.{L}.attn.c_attn.weight (E, 3E), .bias        | query+key+value            | dense  |
|                   | [P]h.{L}.attn.c_proj.weight (E, E), .bias         | output                     | dense  |

What it cannot express: every dimension is hidden_size = num_heads*head_dim,
no GQA, all four biases present. GPT-2 is causal: call the converted weights
with is_causal=True.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .table import _HIDDEN_TIES, DENSE, Layout, R, Table


def _gpt2_config(cfg: Mapping[str, Any], layer: int | None = None) -> dict[str, Any]:
    return {"num_heads": cfg.get("n_head"), "hidden": cfg.get("n_embd"), "dropout": cfg.get("attn_pdrop"),
            "scale": None if cfg.get("scale_attn_weights", True) else 1.0,
            "scale_by_layer": bool(cfg.get("scale_attn_by_inverse_layer_idx", False))}


FAMILY = (
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
)
