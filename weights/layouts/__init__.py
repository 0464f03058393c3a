"""Foreign weight layouts <-> the canonical tensors: one named table per layout.

NumPy only, never a framework: a layout's `state` maps its own tensor names to
NumPy arrays (the impl_*/native.py modules and conformance/cli/files.py turn live
objects and files into such dicts).

    to_canonical(layout, state, **hints) -> (AttentionConfig, tensors)
    from_canonical(layout, config, tensors, **hints) -> state

What lives where
----------------
table.py      the table vocabulary (Row, Tie, Table, Layout, Extra, R; FIELDS ... BIAS_FLAG), how to
              read a table, the hint and config-file helpers, describe
locate.py     finding a table in a state dict (prefix, names, layer); layers, detect_layout
read.py       state -> canonical (to_canonical); the hints and the behaviour fields
write.py      canonical -> state (from_canonical, cannot_express, mapping); RoPE pairing (repair_pairing)
hf_rope.py    config.json's RoPE fields -> the canonical rope (hf-llama, hf-gpt-neox)
canonical.py, torch.py, keras.py, flax.py, bert.py, gpt2.py, llama.py, neox.py, gptj.py, meta.py:
              one family each: its layouts' tables, what they cannot express, its config-file reader
deepseek.py, minimax.py: families that convert themselves (latent attention, the lightning indexer's tensors:
              hf-deepseek, deepseek, hf-minimax)
indexer.py    the lightning indexer's field and tensors from transformers' Indexer modules (their readers call it)
registry.py   the families in LAYOUT_LIST order, LAYOUTS, ROLES, and the functions taking a layout id
"""

from __future__ import annotations

from .hf_rope import _YARN_KEYS as _YARN_KEYS
from .hf_rope import _hf_rope as _hf_rope
from .llama import _DECODER_TIES as _DECODER_TIES
from .llama import HF_LLAMA_TYPES
from .registry import _BY_ID as _BY_ID
from .registry import (
    CATALOGUE,
    DETECT_ORDER,
    FAMILIES,
    LAYOUT_LIST,
    LAYOUTS,
    ROLES,
    cannot_express,
    describe,
    detect_layout,
    from_canonical,
    layers,
    mapping,
    spec,
    to_canonical,
)
from .registry import _get as _get
from .table import _HIDDEN_TIES as _HIDDEN_TIES
from .table import (
    AXES,
    BIAS_FLAG,
    DENSE,
    FIELDS,
    FLAT,
    FROM_HINTS,
    HEAD,
    HEADS,
    LETTER,
    LINEAR,
    NO_GQA,
    TO_HINTS,
    Catalogue,
    Extra,
    Layout,
    R,
    Row,
    Size,
    Table,
    Tie,
    load_config_file,
)
from .torch import _TORCH_MHA_TIES as _TORCH_MHA_TIES
from .write import _pairing_permutation as _pairing_permutation
from .write import repair_pairing

# The names imported `as` themselves are private, kept reachable as weights.layouts._name as they were
# (conformance/native/torchtune.py and keras_hub.py reach _pairing_permutation).
__all__ = [
    "AXES", "BIAS_FLAG", "CATALOGUE", "DENSE", "DETECT_ORDER", "FAMILIES", "FIELDS", "FLAT", "FROM_HINTS", "HEAD",
    "HEADS", "HF_LLAMA_TYPES", "LAYOUTS", "LAYOUT_LIST", "LETTER", "LINEAR", "NO_GQA", "ROLES", "TO_HINTS",
    "Catalogue", "Extra", "Layout", "R", "Row", "Size", "Table", "Tie", "cannot_express", "describe",
    "detect_layout", "from_canonical", "layers", "load_config_file", "mapping", "repair_pairing", "spec",
    "to_canonical",
]
