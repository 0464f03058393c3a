"""docs/spec-modern.md's native-feature table is generated: it must equal what
conformance.native.conventions.features reads from the installed frameworks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from conformance.native.conventions.features import FRONTIER_FEATURES, markdown, measure

DOC = Path(__file__).resolve().parent.parent / "docs" / "spec-modern.md"


def test_the_docs_table_is_what_the_installed_apis_say():
    missing = [m for m in ("torch", "keras", "jax", "flax", "onnx") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the table is read from every framework; not installed: {', '.join(missing)}")
    rows, notes = measure()
    assert not notes, notes
    text = DOC.read_text(encoding="utf-8")
    shown = text.split("<!-- native-features:begin -->\n", 1)[1].split("\n<!-- native-features:end -->", 1)[0]
    assert shown == markdown(rows), ("docs/spec-modern.md is stale: regenerate it with "
                                     "`python -m conformance.native.conventions.features`\n" + markdown(rows))
    frontier = text.split("<!-- native-frontier-features:begin -->\n", 1)[1].split(
        "\n<!-- native-frontier-features:end -->", 1)[0]
    assert frontier == markdown(rows, FRONTIER_FEATURES), (
        "docs/spec-modern.md's frontier table is stale: regenerate it with "
        "`python -m conformance.native.conventions.features`\n" + markdown(rows, FRONTIER_FEATURES))


def test_a_cell_names_an_argument_the_api_really_has():
    """The reader finds arguments by name: an API with a window argument shows it, one without shows '-'."""
    from conformance.native.conventions.features import _row

    row = _row({"q", "k", "v", "local_window_size", "softcap"}, mask=None)
    assert row["window"] == "local_window_size" and row["softcap"] == "softcap"
    assert row["sinks"] == "-" and row["rope"] == "-" and row["packed segments"] == "-"
    assert _row({"attn_mask"}, mask="attn_mask")["window"] == "mask"


def test_frontier_cells_name_the_argument_or_the_general_one():
    """ALiBi through score_mod or a named slopes argument, else only through the reader-named additive
    argument ("bias"); local chunks through block_mask, else the general mask; nothing else guessed."""
    from conformance.native.conventions.features import _row

    flex = _row({"score_mod", "block_mask"}, mask="block_mask")
    assert (flex["ALiBi"], flex["local chunks"], flex["query temperature"]) == ("score_mod", "block_mask", "score_mod")
    dpa = _row({"bias", "mask", "local_window_size"}, mask="mask", bias="bias")
    assert (dpa["ALiBi"], dpa["local chunks"], dpa["query temperature"]) == ("bias", "mask", "-")
    # a layer whose "bias" parameter is a projection flag takes no ALiBi unless the reader names an additive one
    layer = _row({"bias", "attention_mask"}, mask=None)
    assert layer["ALiBi"] == "-" and layer["local chunks"] == "-"
    assert all(layer[f] == "-" for f in ("QKV clip", "output gate", "value norm", "latent (MLA)"))
    assert _row({"alibi_slopes", "clip_qkv"}, mask=None)["ALiBi"] == "alibi_slopes"
    assert _row({"clip_qkv"}, mask=None)["QKV clip"] == "clip_qkv"
