"""docs/spec-modern.md's native-feature table is generated: it must equal what
conformance.native.conventions.features reads from the installed frameworks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from conformance.native.conventions.features import markdown, measure

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


def test_a_cell_names_an_argument_the_api_really_has():
    """The reader finds arguments by name: an API with a window argument shows it, one without shows '-'."""
    from conformance.native.conventions.features import _row

    row = _row({"q", "k", "v", "local_window_size", "softcap"}, mask=None)
    assert row["window"] == "local_window_size" and row["softcap"] == "softcap"
    assert row["sinks"] == "-" and row["rope"] == "-" and row["packed segments"] == "-"
    assert _row({"attn_mask"}, mask="attn_mask")["window"] == "mask"
