"""The measured table of the native packed and sharded paths
(conformance/native/conventions/packed.py).

The harness tests feed the labels fake API results written here with plain
NumPy (a softmax over the keys a rule allows), some with deliberately wrong
conventions, so a label that always said "prefix" or "same document only"
would fail them. The framework tests run the real probes; each skips, naming
the extra to install, when its framework is missing.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conformance.native import conventions as conv
from conformance.native.conventions import packed as cp
from conformance.native.conventions import packed_labels as cpl
from conformance.native.conventions import packed_sharded as cps

TORCH = "torch not installed: pip install -c constraints/cpu.txt '.[torch]'"
JAX = "jax not installed: pip install -c constraints/cpu.txt '.[jax]'"


def _softmax_rows(q, k, allowed, empty="zero"):
    """(B, T, S) weights of q (B, T, H) against k (B, S, H) over `allowed`
    (B, T, S), written out here; a row with no allowed key: 0, 'uniform' 1/S or NaN."""
    logits = np.einsum("bth,bsh->bts", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    logits = np.where(allowed, logits, -np.inf)
    out = np.zeros(logits.shape)
    for b, t in np.ndindex(*logits.shape[:2]):
        if allowed[b, t].any():
            e = np.exp(logits[b, t] - logits[b, t][allowed[b, t]].max())
            out[b, t] = e / e.sum()
        else:
            out[b, t] = {"zero": 0.0, "uniform": 1.0 / logits.shape[2], "nan": np.nan}[empty]
    return out


def _strip(text: str) -> str:
    return re.sub(r" \(err [^)]*\)", "", text)


# -- jax's lengths -------------------------------------------------------------------------

def _lengths_fake(rule, padded_rows=0.0):
    """What an API with V = I returns under cpl.Q_LENS / cpl.KV_LENS when query i
    of batch b sees key j iff rule(b, i, j); padded query rows get padded_rows,
    a row without keys 1/S."""
    B, T = len(cpl.Q_LENS), cpl.LEN_T
    q, k = cpl._inputs(B, T, T, T, seed=cpl.LEN_SEED)
    allowed = np.array([[[rule(b, i, j) for j in range(T)] for i in range(T)] for b in range(B)])
    w = _softmax_rows(q, k, allowed, empty="uniform")
    for b in range(B):
        if cpl.KV_LENS[b] > 0:
            w[b, cpl.Q_LENS[b]:] = padded_rows
    return w


def test_lengths_labels_as_jax_measures_them():
    got = cpl.lengths_labels(_lengths_fake(lambda b, i, j: j < cpl.KV_LENS[b]))
    assert _strip(got["keys_visible"]) == ("keys j < key_value_seq_lengths[b] (a prefix), "
                                           "for queries i < query_seq_lengths[b]"), got
    assert got["empty_row"] == ("padded query i >= query_seq_lengths[b]: 0; key_value_seq_lengths[b] = 0: "
                                "mean of V over all S keys (padding included)"), got["empty_row"]


def test_lengths_labels_change_with_the_convention():
    ignored = cpl.lengths_labels(_lengths_fake(lambda b, i, j: True))
    assert ignored["keys_visible"] == "every key (lengths ignored)", ignored["keys_visible"]
    suffix = cpl.lengths_labels(_lengths_fake(lambda b, i, j: j >= cpl.LEN_T - cpl.KV_LENS[b]))
    assert suffix["keys_visible"] == "keys j >= S - key_value_seq_lengths[b] (a suffix)", suffix["keys_visible"]
    nan_rows = cpl.lengths_labels(_lengths_fake(lambda b, i, j: j < cpl.KV_LENS[b], padded_rows=np.nan))
    assert nan_rows["empty_row"].startswith("padded query i >= query_seq_lengths[b]: NaN;"), nan_rows["empty_row"]
    odd = cpl.lengths_labels(_lengths_fake(lambda b, i, j: j < cpl.KV_LENS[b], padded_rows=0.5))
    assert odd["empty_row"].startswith("padded query i >= query_seq_lengths[b]: other ("), odd["empty_row"]


# -- documents ------------------------------------------------------------------------------

def _documents_fake(ids, causal, see_all=False):
    T = len(ids)
    q, k = cpl._inputs(1, T, T, T, seed=cpl.DOC_SEED)
    ids = np.asarray(ids)
    allowed = np.ones((T, T), bool) if see_all else ids[:, None] == ids[None, :]
    if causal:
        allowed &= np.tri(T, dtype=bool)
    return _softmax_rows(q, k, allowed[None])[0]


@pytest.mark.parametrize("causal", [False, True])
def test_documents_label_isolated_and_leaking(causal):
    good, ev = cpl.documents_label(_documents_fake(cpl.DOCS, causal), cpl.DOCS, cpl.DOCS, causal=causal)
    want = "same document, j <= i" if causal else "same document only"
    assert _strip(good) == want and ev["max_err_vs_reference_segment_ids"] < 1e-12, (good, ev)
    leaking, _ = cpl.documents_label(_documents_fake(cpl.DOCS, causal, see_all=True), cpl.DOCS, cpl.DOCS, causal=causal)
    assert leaking == ("j <= i (documents see each other)" if causal else "every key (documents see each other)"), leaking


@pytest.mark.parametrize("policy,label", [("zero", "0"), ("uniform", "mean of V (uniform)"), ("nan", "NaN")])
def test_policy_label_reads_the_empty_document_row(policy, label):
    rng = np.random.default_rng(13)
    T, S = len(cpl.CROSS_Q_DOCS), len(cpl.CROSS_K_DOCS)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, T, 4), (1, S, 4), (1, S, 3)))
    allowed = np.asarray(cpl.CROSS_Q_DOCS)[:, None] == np.asarray(cpl.CROSS_K_DOCS)[None, :]
    w = _softmax_rows(q, k, allowed[None], empty="zero")[0]
    out = w @ v[0].astype(np.float64)  # (T, V)
    rows = np.flatnonzero(~allowed.any(1))
    out[rows] = {"zero": 0.0, "uniform": v[0].mean(0), "nan": np.nan}[policy]
    got, ev = cpl.policy_label(out, q, k, v, cpl.CROSS_Q_DOCS, cpl.CROSS_K_DOCS, rows)
    assert got == label and ev["max_err_other_rows"] < 1e-6, (got, ev)


# -- the sharded answers ---------------------------------------------------------------------

def _attention(q, k, v, allowed=None):
    """(1, N, T, H) softmax attention written here; allowed (T, S)."""
    logits = np.einsum("bnth,bnsh->bnts", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    if allowed is not None:
        logits = np.where(allowed, logits, -np.inf)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v.astype(np.float64)


SPLIT = ([0, 1, 6, 7], [2, 3, 4, 5])  # the head-tail order context_parallel was measured to use


def _rank_answers(kind: str, inputs) -> list[dict]:
    """Fake rank answers for every probe: "whole" computes the right rows,
    "local" each rank's queries against its own keys only."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    answers = [{}, {}]
    names = [f"{p} math={m} causal={c}" for p in ("cp", "heads") for m in (False, True) for c in (False, True)]
    names += ["cp math=False mask=whole", "cp math=True mask=whole", "cp math=True mask=buffer"]
    for name in names:
        for rank, rows in enumerate(SPLIT):
            if "causal=True" in name or "mask=" in name:
                answers[rank][name] = {"error": "NotImplementedError: no strategy"}
            elif name.startswith("heads"):
                answers[rank][name] = {"out": _attention(q, k, v), "rows": list(range(cpl.SHARD_T)),
                                       "placements": "(Shard(dim=1),)"}
            elif kind == "whole":
                answers[rank][name] = {"out": _attention(q, k, v)[:, :, rows], "rows": rows}
            else:
                r = np.asarray(rows)
                answers[rank][name] = {"out": _attention(q[:, :, r], k[:, :, r], v[:, :, r]), "rows": rows}
    return answers


def test_sharded_cells_tell_whole_from_rank_local_and_refusals():
    inputs = cps.shard_inputs()
    whole = cps.sharded_cells(_rank_answers("whole", inputs), inputs)
    local = cps.sharded_cells(_rank_answers("local", inputs), inputs)
    assert "sdpa_kernel(MATH), no mask: matches the whole-sequence reference (err" in whole["cp"]["keys_visible"], whole
    assert "sdpa_kernel(MATH), no mask: each rank sees only its own keys (err" in local["cp"]["keys_visible"], local
    assert "is_causal: unsupported: NotImplementedError: no strategy" in whole["cp"]["keys_visible"], whole
    assert "positions per rank 0: 0, 1, 6, 7; 1: 2, 3, 4, 5" in whole["cp"]["keys_visible"], whole
    assert "output placements (Shard(dim=1),)" in whole["heads"]["keys_visible"], whole


def test_sharded_label_on_a_wrong_and_a_skipped_answer():
    ref = np.zeros((1, 2, 4, 3))
    wrong, _ = cpl.sharded_label({"out": ref + 1.0}, ref, ref + 2.0)
    assert wrong.startswith("runs, matches no candidate (closest err 1.0e+00): wrong output"), wrong
    skipped, _ = cpl.sharded_label({"skipped": cps.SKIPPED}, None)
    assert skipped == cps.SKIPPED
    refused, _ = cpl.sharded_label({"error": "RuntimeError: no"}, None)
    assert refused == "unsupported: RuntimeError: no"


def test_the_mask_column_candidate_explains_a_misaligned_mask():
    """A mask whose rows follow the shards while its columns do not (what the
    buffer probe tells apart): written here from the definition."""
    inputs = cps.shard_inputs()
    order = [p for rows in SPLIT for p in rows]
    ids = np.asarray(cpl.SHARD_DOCS)
    allowed = np.zeros((8, 8), bool)
    for c, j in enumerate(order):
        allowed[:, j] = ids == ids[c]
    got = cps._columns_in_shard_order(inputs, order)
    expected = _attention(inputs["q"], inputs["k"], inputs["v"], allowed)
    assert np.abs(got - expected).max() < 1e-12, np.abs(got - expected).max()
    right = _attention(inputs["q"], inputs["k"], inputs["v"], ids[:, None] == ids[None, :])
    assert np.abs(got - right).max() > 1e-2, "the candidate must differ from the right answer to tell them apart"


def test_assemble_orders_rows_and_reports_the_first_refusal():
    out0, out1 = np.zeros((1, 1, 2, 1)), np.ones((1, 1, 2, 1))
    got = cps.assemble([{"p": {"out": out0, "rows": [0, 3]}}, {"p": {"out": out1, "rows": [1, 2]}}], "p")
    assert got["rows"] == [0, 1, 2, 3] and got["out"][0, 0, :, 0].tolist() == [0, 1, 1, 0], got
    refused = cps.assemble([{"p": {"out": out0, "rows": [0]}}, {"p": {"error": "E: x"}}], "p")
    assert refused == {"error": "E: x"}, refused


# -- rows, tables, expectations ----------------------------------------------------------------

def test_missing_and_failing_apis_are_rows():
    def boom():
        raise RuntimeError("probe broke")

    ghost = cp.PackedApi("ghost", "ghost", ("mha_no_such_module",), "pip install ghost", dict)
    broken = cp.PackedApi("broken", "numpy", ("numpy",), "-", boom)
    rows = cp.measure((ghost, broken))
    assert rows[0]["status"] == "not installed" and "pip install ghost" in rows[0]["reason"], rows[0]
    assert rows[1] == {"api": "broken", "framework": "numpy", "evidence": {}, "status": "error",
                       "reason": "RuntimeError: probe broke"}, rows[1]
    assert cp.cells(rows)[0][:2] == ["ghost", "not installed"] and cp.notes(rows) == [f"ghost: {rows[0]['reason']}"]


def test_third_table_and_its_disagreements():
    name = "torch flex_attention (document mask)"
    fake = cp.PackedApi(name, "numpy", ("numpy",), "-", lambda: {
        "argument": "a", "keys_visible": "mask_mod & (q >= kv): same document, j <= i (err 1.0e-08)",
        "empty_row": "query of a document with no key: NaN", "packing": "same document only (err 2.0e-08)"})
    data = conv.measure(apis=(), packed_apis=(fake,))
    json.dumps(data, allow_nan=False)
    text = conv.to_markdown(data)
    assert "Packed and sharded paths (" in text and f"| {name} | a |" in text, text
    lines = conv.disagreements(data)
    assert lines == [f"{name}: empty_row expected 'query of a document with no key: 0', measured "
                     "'query of a document with no key: NaN'"], lines


def test_expectations_name_packed_rows_and_keys():
    table = conv.expected()
    names = {api.name for api in cp.APIS}
    mine = {api: keys for api, keys in table.items() if api in names}
    assert mine and all(set(keys) <= set(cp.KEYS) for keys in mine.values()), mine
    assert set(cp.KEYS) - {"argument"} <= set(conv.EXPECTED_KEYS)


# -- the real APIs ------------------------------------------------------------------------------

def _measured(row: dict) -> dict:
    if row["status"] == "not installed":
        pytest.skip(row["reason"])
    assert row["status"] == "measured", row
    json.dumps(row, allow_nan=False)
    return row


@pytest.mark.jax
def test_jax_seq_lengths_are_padding_not_documents():
    pytest.importorskip("jax", reason=JAX)
    row = _measured(cp.measure_row(cp.APIS[0]))
    assert row["keys_visible"].startswith("keys j < key_value_seq_lengths[b] (a prefix), for queries i < "), row
    assert row["evidence"]["keys_visible"]["max_err_vs_reference_prefix_mask"] < cpl.TOL, row["evidence"]
    assert row["empty_row"] == ("padded query i >= query_seq_lengths[b]: 0; key_value_seq_lengths[b] = 0: mean of V "
                                "over all S keys (padding included)"), row["empty_row"]
    # per-document lengths: refused today; a jax that takes them must isolate the documents
    assert row["packing"].startswith(("no: per-document lengths (B, 3) refused: ",
                                      "per-document lengths (B, 3): same document only")), row["packing"]
    assert row["packing"].endswith(")") and "mask= (B, 1, T, S) from the ids: same document only (err" in row["packing"]
    assert "implementation='xla' (None: the same weights; 'cudnn': " in row["argument"], row["argument"]


@pytest.mark.torch
def test_flex_document_mask_isolates_documents():
    pytest.importorskip("torch", reason=TORCH)
    row = _measured(cp.measure_row(cp.APIS[1]))
    assert _strip(row["packing"]) == "same document only", row
    assert _strip(row["keys_visible"]) == "mask_mod & (q >= kv): same document, j <= i", row
    assert row["empty_row"] == "query of a document with no key: 0", row
    assert row["evidence"]["empty_row"]["max_err_other_rows"] < cpl.TOL, row["evidence"]


@pytest.mark.torch
def test_context_parallel_and_dtensor_heads_on_gloo():
    """One 2-process gloo start (seconds): what runs on CPU matches the
    reference, what does not is "unsupported" with torch's own words."""
    pytest.importorskip("torch", reason=TORCH)
    rows = cp.measure(cp.APIS[2:4])  # context_parallel, DTensor heads
    for row in rows:
        _measured(row)
        cells = row["keys_visible"].split("; ")
        math = next(c for c in cells if c.startswith("sdpa_kernel(MATH), no mask: "))
        assert "matches the whole-sequence reference (err" in math, row["keys_visible"]
        for cell in cells:
            if cell.startswith(("default CPU kernel", "sdpa_kernel")):
                verdict = cell.split(": ", 1)[1]
                assert verdict.startswith(("unsupported: ", "matches the whole-sequence reference", "skipped (slow")), cell
    positions = rows[0]["evidence"]["positions_per_rank"]
    assert sorted(p for rank in positions for p in rank) == list(range(cpl.SHARD_T)), positions
    packing = rows[0]["packing"]
    assert "the mask sharded by rows with the buffers, sdpa_kernel(MATH): " in packing, packing


@pytest.mark.torch
@pytest.mark.slow
def test_default_cpu_kernel_without_mask_runs_sharded():
    """The probes left out of the default run: minutes on a 2-core VM."""
    pytest.importorskip("torch", reason=TORCH)
    rows = cp.measure(cp.APIS[2:], slow=True)
    for row in rows:
        cell = next(c for c in _measured(row)["keys_visible"].split("; ") if c.startswith("default CPU kernel, no mask"))
        assert "matches the whole-sequence reference (err" in cell, cell


def test_a_failed_group_is_started_once_per_run(monkeypatch):
    starts = []

    def refuse(inputs, slow=False):
        starts.append(1)
        raise OSError("no loopback")

    monkeypatch.setattr(cps, "run_group", refuse)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # as if torch were installed
    rows = cp.measure((cp.APIS[3],) * 2)
    assert [r["reason"] for r in rows] == ["OSError: no loopback"] * 2 and len(starts) == 1, (rows, starts)


@pytest.mark.torch
def test_flex_block_mask_from_the_indices_matches_and_skips_the_unselected_blocks():
    """flex_attention's block mask from topk_indices: the reference's output, and it computes exactly the
    key blocks that hold a selected key (counted here from the indices), none of the others."""
    pytest.importorskip("torch", reason=TORCH)
    from conformance.native.conventions import selection

    row = cp.measure_row(next(a for a in cp.APIS if a.name == "torch flex_attention (top-k block mask)"))
    assert row["keys_visible"].startswith("the selected keys alone: matches the reference"), row
    idx = selection.inputs()["topk"]
    holding = len(np.unique(idx[idx >= 0] // selection.BLOCK))
    assert holding == len(selection.KEPT_BLOCKS) < selection.S // selection.BLOCK
    assert row["evidence"]["kv_num_blocks"] == holding, row


@pytest.mark.jax
def test_jax_dense_mask_from_the_indices_matches():
    pytest.importorskip("jax", reason="JAX not installed")
    row = cp.measure_row(next(a for a in cp.APIS if a.name == "jax.nn.dot_product_attention (top-k mask)"))
    assert row["keys_visible"].startswith("the selected keys alone: matches the reference"), row
