"""Keras measured against itself (conformance/native/conventions/keras_backends.py): the fifth and sixth
tables of `mha check --conventions`.

Three tests. The first runs the cross-backend comparison on made-up backends whose outputs are NumPy
emulations with a known stage changed (no framework): the table must name each changed stage. The second
starts one real worker (torch, the cheap subset of calls) with a wrong mask polarity planted: every cell
must be filled, and the plant reported in the first table's cells, in the list of disagreements with the
recorded expectations and in the cross table's closest emulation. The third (slow) runs the whole
measurement on the three backends: every cell, no disagreement.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conformance.native.conventions import keras_backends as kb

TF_TORCH = "keras/torch not installed: pip install -c constraints/cpu.txt '.[tf,torch]'"


def _every_cell(data: dict) -> None:
    """Every measured row of both tables has text in every column (a not-installed row says so in one)."""
    for table, rows in ((kb.RowsTable, data["rows"]), (kb.CrossTable, data["cross"])):
        for row, cells in zip(rows, table.cells(rows)):
            if row.get("status", "measured") != "measured":
                continue
            for (title, _), cell in zip(table.COLUMNS, cells):
                if table is kb.CrossTable and title.endswith(": err") and title.split(":")[0] not in row["backends"]:
                    continue  # a backend this run did not start
                assert cell.strip(), f"{row.get('api', row.get('call'))}: empty cell {title!r}"
    text = kb.to_markdown(data)
    assert text.count("\n| ") >= len(data["rows"]) + len(data["cross"]), text


@pytest.mark.reference
def test_cross_table_names_the_stage_each_backend_changed():
    """Made-up backends, each the NumPy emulation of every call with one stage changed: the verdicts and the
    why must say which (an explanation that always answered "rounding" would fail)."""
    shared = kb.shared_arrays()
    plain = {"float32": kb.Stages("float32", "float32", "float32"),
             "float64": kb.Stages("float64", "float64", "float64"),
             "bfloat16": kb.Stages("float32", "float32", "float32"),
             "float16": kb.Stages("float32", "float32", "float32")}
    changed = {  # backend -> how its stage differs from the spec's
        "tensorflow": lambda st: dataclasses.replace(st, scale="float32"),
        "jax": lambda st: st,
        "torch": lambda st: dataclasses.replace(st, mask_inverted=True, masked_row="uniform"),
    }
    results = {}
    for backend, change in changed.items():
        outputs, facts = {}, {}
        for spec in kb.CALLS:
            outputs[spec.name] = kb.emulate(spec, shared, change(plain[spec.dtype]))
            facts[spec.name] = {"dtype": spec.dtype, "kernel": f"{backend}'s kernel"}
        results[backend] = {"status": "measured", "outputs": outputs, "facts": facts}
    rows = {row["call"]: row for row in kb.cross_rows(results, kb.BACKENDS)}
    assert set(rows) == {spec.name for spec in kb.CALLS}

    f64 = rows["MHA, no mask, float64"]
    assert f64["verdict"] == "differ", f64
    assert "tensorflow: scale 1/sqrt(H) rounded to float32" in f64["why"], f64["why"]
    assert f64["backends"]["jax"]["best"] == "every stage in float64", f64["backends"]["jax"]
    masked = rows["dot_product_attention, mask with an empty row"]
    assert masked["verdict"] == "differ", masked
    assert "torch: mask complemented (True = masked); empty row mean of V" in masked["why"], masked["why"]
    assert masked["backends"]["jax"]["empty_row"].startswith("0 (err"), masked["backends"]["jax"]
    unmasked32 = rows["MHA, no mask"]  # no mask, float32: the scale's float32 rounding is no change
    assert unmasked32["verdict"] in ("same numbers", "same up to rounding"), unmasked32
    assert "kernels: " in unmasked32["why"], unmasked32["why"]  # the one difference left is the kernel's name
    _every_cell({"rows": [], "cross": list(rows.values()), "versions": {}, "seconds": 0.0})


@pytest.mark.tf
@pytest.mark.torch
def test_a_worker_fills_every_cell_and_reports_a_planted_polarity():
    """One real worker (torch: the cheapest to start; the quick subset of calls) with every mask complemented
    before Keras sees it: the first table's polarity cells, the disagreements with the recorded expectations and
    the cross table's closest emulation must all say so. (Comparing backends: the test above, on emulations,
    and the slow test below, on all three.)"""
    pytest.importorskip("keras", reason=TF_TORCH)
    pytest.importorskip("torch", reason=TF_TORCH)
    data = kb.measure(("torch",), plant={"torch": "polarity"}, quick=True)
    json.dumps(data, allow_nan=False)  # `mha check --json` writes it
    for row in data["rows"]:
        assert row["status"] == "measured", row
    _every_cell(data)
    polarity = {row["api"]: row["mask_true_means"] for row in data["rows"]}
    assert set(polarity) == {f"{label} on torch" for label in kb.API_LABELS}, polarity
    assert set(polarity.values()) == {"masked"}, polarity
    lines = kb.disagreements(data)
    assert len(lines) == 3 and all("on torch: mask_true_means expected 'attend', measured 'masked'" in line
                                   for line in lines), lines
    cross = {row["call"]: row for row in data["cross"]}
    assert set(cross) == set(kb.QUICK_CALLS), sorted(cross)
    for name in ("MHA, mask with an empty row", "dot_product_attention, mask with an empty row"):
        best = cross[name]["backends"]["torch"]["best"]
        assert best.startswith("mask complemented (True = masked)"), (name, best)
    dpa = {row["api"]: row for row in data["rows"]}["keras.ops.dot_product_attention on torch"]
    assert set(dpa["mask_shapes"]) == {label for label, _, _ in kb_worker().DPA_MASK_SHAPES}, dpa["mask_shapes"]
    assert all(kernel for kernel in dpa["kernels"].values()), dpa["kernels"]


def kb_worker():
    from conformance.native.conventions import keras_backends_worker

    return keras_backends_worker


@pytest.mark.slow
@pytest.mark.tf
@pytest.mark.torch
@pytest.mark.jax
def test_three_backends_every_cell_and_no_disagreement():
    pytest.importorskip("keras")
    for module in ("tensorflow", "torch", "jax"):
        pytest.importorskip(module)
    data = kb.measure()
    assert [row["status"] for row in data["rows"]] == ["measured"] * 9, [(r["api"], r.get("reason")) for r in data["rows"]]
    _every_cell(data)
    assert kb.disagreements(data) == []
    assert [row["call"] for row in data["cross"]] == [spec.name for spec in kb.CALLS]
    for row in data["cross"]:
        for backend, info in row["backends"].items():
            assert "error" in info or np.isfinite(info["best_err"]), (row["call"], backend, info)
