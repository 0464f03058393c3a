"""The hf-gpt-neox layout: a GPT-NeoX / Pythia checkpoint's attention, and its config.json reader.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| hf-gpt-neox       | [P]layers.{L}.attention.query_key_value (N, 3, H) | query+key+value, per head  | linear |
|                   | [P]layers.{L}.attention.dense.weight, .bias       | output                     | linear |

A decoder: its config file is required (write.py says what that brings);
half-split RoPE pairs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .hf_rope import _hf_rope
from .table import _HIDDEN_TIES, LINEAR, Layout, R, Table


def _neox_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of GPT-NeoX / Pythia: half-split RoPE on the first rotary_pct of each head."""
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    if not heads or not hidden:
        raise ValueError("hf_config: GPT-NeoX's config.json needs num_attention_heads and hidden_size")
    head_dim = hidden // heads
    if not isinstance(cfg.get("rope_parameters"), Mapping):  # 4.x: rotary_pct, rotary_emb_base
        cfg = {**cfg, "partial_rotary_factor": cfg.get("rotary_pct", cfg.get("partial_rotary_factor", 1.0))}
    rope = _hf_rope(cfg, None, head_dim, theta_key="rotary_emb_base")
    return {"num_heads": heads, "hidden": hidden, "dropout": cfg.get("attention_dropout"), "scale": None,
            "scale_by_layer": False, "modern": {"rope": rope}, "model_type": "gpt_neox"}


FAMILY = (
    Layout(
        "hf-gpt-neox", "a GPT-NeoX / Pythia checkpoint's attention: [prefix]layers.{L}.attention.query_key_value "
        "(3*N*H, D) with rows (N, 3, H) (each head's q, k, v together), attention.dense; config.json gives "
        "rotary_pct / partial_rotary_factor and the base; half-split RoPE; causal",
        sep=".", scope="layers.{layer}.attention.", select=True, hf=_neox_config, pairing="half",
        needs_hf_config=True, qkv_per_head=("query_key_value.weight", "query_key_value.bias"), bias="all",
        bias_why="attention_bias covers query_key_value and dense",
        tables=(Table((
            R("query_key_value.weight", "query.kernel key.kernel value.kernel", LINEAR),  # read as (3, N, H) rows
            R("query_key_value.bias", "query.bias key.bias value.bias", LINEAR),
            R("dense.weight", "output.kernel", LINEAR), R("dense.bias", "output.bias", LINEAR),
        ), ties=_HIDDEN_TIES),),
    ),
)
