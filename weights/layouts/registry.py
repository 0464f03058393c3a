"""The layouts by id: every family's layouts in LAYOUT_LIST order, and the functions that take a layout id.

A family is one module holding its layouts (FAMILY) and its config-file
reader; adding one means adding its file and naming it in FAMILIES below (the
order of FAMILIES is the order of LAYOUT_LIST, LAYOUTS and `mha convert
--help`), and its id in DETECT_ORDER if detect_layout should try it. The
functions here resolve an id through CATALOGUE and run the engine (locate.py,
read.py, write.py), which imports no family and not this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..config import AttentionConfig
from . import (
    alibi_models,
    bert,
    canonical,
    deepseek,
    flax,
    gpt2,
    gptj,
    keras,
    llama,
    locate,
    meta,
    minimax,
    neox,
    read,
    torch,
    write,
)
from .table import Catalogue, Layout, Table, _self_check
from .table import describe as _describe

# The families, one module each (its FAMILY: its layouts), in LAYOUT_LIST's order
FAMILIES = (canonical, torch, keras, flax, bert, gpt2, llama, neox, gptj, meta, alibi_models, deepseek, minimax)

LAYOUT_LIST = tuple(layout for family in FAMILIES for layout in family.FAMILY)

# detect_layout tries these in order: the first whose kernel keys all exist under one prefix
# (hf-falcon has hf-bloom's keys: a state alone answers hf-bloom; config.json's model_type tells them apart)
DETECT_ORDER = ("hf-bert", "hf-gpt2", "hf-llama", "hf-gpt-neox", "hf-gptj", "meta-llama", "hf-bloom", "hf-mpt",
                "hf-deepseek", "deepseek", "hf-minimax",
                "torch-mha", "torch-per-head", "torch-fused-qkv", "torch-linears", "keras-split-heads", "keras-mha",
                "flax-linen-mha", "canonical")

CATALOGUE = Catalogue(LAYOUT_LIST, DETECT_ORDER)
_BY_ID = CATALOGUE.by_id
LAYOUTS: dict[str, str] = CATALOGUE.descriptions
ROLES: dict[str, tuple[str, ...]] = CATALOGUE.roles
# Layouts whose tensors the table engine cannot hold (latent attention): their family module converts them
OWN_CONVERTERS = {layout.id: family for family in FAMILIES if getattr(family, "OWN_CONVERTER", False)
                  for layout in family.FAMILY}


def spec(layout: str) -> Layout:
    """The Layout (its tables, ties and bias rule) for a layout id."""
    return _get(layout)


def _get(layout: str) -> Layout:
    return CATALOGUE.get(layout)


def to_canonical(layout: str, state: Mapping[str, Any], **hints: Any) -> tuple[AttentionConfig, dict[str, np.ndarray]]:
    """Read a layout's state dict: (config, canonical tensors), bit-exact.

    Raises one WeightsFormatError listing every missing, unexpected,
    mis-shaped or mis-typed key; ValueError for a bad hint.
    """
    own = OWN_CONVERTERS.get(_get(layout).id)
    if own is not None:
        return own.to_canonical(CATALOGUE, layout, state, **hints)
    return read.to_canonical(CATALOGUE, layout, state, **hints)


def from_canonical(layout: str, config: AttentionConfig, tensors: Mapping[str, np.ndarray],
                   **hints: Any) -> dict[str, np.ndarray]:
    """Write canonical tensors in a layout: state dict name -> array, bit-exact.

    ValueError naming each field and value the layout cannot express.
    Hints: names, prefix, layer (hf-*; default 0).
    """
    own = OWN_CONVERTERS.get(_get(layout).id)
    if own is not None:
        return own.from_canonical(CATALOGUE, layout, config, tensors, **hints)
    return write.from_canonical(CATALOGUE, layout, config, tensors, **hints)


def cannot_express(layout: str, config: AttentionConfig, *, table: Table | None = None) -> list[str]:
    """Why `layout` cannot hold `config`'s tensors: one line per offending field, or [].

    Behaviour fields (scale, RoPE, windows, softcap: config.json's business for hf-*) are not
    tensors and never make a layout refuse; a RoPE pairing other than the layout's is permuted
    (repair_pairing), not refused."""
    own = OWN_CONVERTERS.get(_get(layout).id)
    if own is not None:
        return own.cannot_express(CATALOGUE, layout, config)
    return write.cannot_express(CATALOGUE, layout, config, table=table)


def mapping(layout: str, config: AttentionConfig, **hints: Any) -> dict[str, tuple[str, ...]]:
    """Which canonical tensors each key of from_canonical's state holds (hints as from_canonical's)."""
    own = OWN_CONVERTERS.get(_get(layout).id)
    if own is not None:
        return own.mapping(CATALOGUE, layout, config, **hints)
    return write.mapping(CATALOGUE, layout, config, **hints)


def describe(layout: str) -> str:
    """The layout's table as text: key, canonical tensors, form; then its ties."""
    return _describe(CATALOGUE, layout)


def layers(layout: str, state: Mapping[str, Any], *, prefix: str | None = None) -> list[int]:
    """hf-*: the block indices a checkpoint holds (sorted)."""
    return locate.layers(CATALOGUE, layout, state, prefix=prefix)


def detect_layout(state: Mapping[str, Any]) -> str | None:
    """The first layout whose kernel keys all exist under one prefix, or None.

    flax-linen-mha and flax-nnx-mha have the same keys; this answers
    flax-linen-mha, and either converts the same tensors.
    """
    return locate.detect_layout(CATALOGUE, state)


_self_check(LAYOUT_LIST)
