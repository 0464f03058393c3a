"""The hf-gptj layout: a GPT-J checkpoint's attention, and its config.json reader.

| layout            | foreign key (defaults; {role} names overridable)  | canonical                  | form   |
|-------------------|---------------------------------------------------|----------------------------|--------|
| hf-gptj           | [P]h.{L}.attn.{q,k,v,out}_proj.weight             | query ... output           | linear |

A decoder: its config file is required (write.py says what that brings);
interleaved RoPE pairs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .table import _HIDDEN_TIES, LINEAR, Layout, R, Table


def _gptj_config(cfg: Mapping[str, Any], layer: int | None) -> dict[str, Any]:
    """config.json of GPT-J: interleaved RoPE (rotate_every_two) on the first rotary_dim features, base 10000."""
    heads, hidden = cfg.get("n_head"), cfg.get("n_embd")
    if not heads or not hidden:
        raise ValueError("hf_config: GPT-J's config.json needs n_head and n_embd")
    if cfg.get("rotary_dim") is None:
        raise ValueError("hf_config: rotary_dim=None (GPT-J then builds its frequencies over n_embd, not over a "
                         "head; only a whole rotary_dim converts)")
    rope = {"theta": 10000.0, "rotary_dim": int(cfg["rotary_dim"]), "interleaved": True, "scaling": None}
    return {"num_heads": heads, "hidden": hidden, "dropout": cfg.get("attn_pdrop"), "scale": None,
            "scale_by_layer": False, "modern": {"rope": rope}, "model_type": "gptj"}


FAMILY = (
    Layout(
        "hf-gptj", "a GPT-J checkpoint's attention: [prefix]h.{L}.attn.{q,k,v,out}_proj (no biases); "
        "config.json gives rotary_dim; interleaved RoPE (rotate_every_two), base 10000; causal",
        sep=".", scope="h.{layer}.attn.", select=True, hf=_gptj_config, pairing="interleaved",
        needs_hf_config=True,
        tables=(Table((
            R("q_proj.weight", "query.kernel", LINEAR), R("k_proj.weight", "key.kernel", LINEAR),
            R("v_proj.weight", "value.kernel", LINEAR), R("out_proj.weight", "output.kernel", LINEAR),
        ), ties=_HIDDEN_TIES),),
    ),
)
