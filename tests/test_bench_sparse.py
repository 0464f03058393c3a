"""`mha bench --shapes sparse` (conformance/bench/sparse.py): a DSA decode step's parts against their bounds.

The bound arithmetic is checked against an independent count (bytes from the arrays the family builds,
FLOPs from the shapes of the matmuls, the bound from seconds rather than paired ratios); the sparse step is
held to a float64 dense call over the gathered keys alone (not through topk_indices); the --quick family
runs end to end in NumPy. No assertion is about speed: benchmarks are not tests."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.bench import sparse
from conformance.cli.commands import main
from conformance.suite.tolerance import assert_close

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, not `all`


def _counted(d, ix, tensors, data, P):
    """The bounds counted from the arrays and the matmuls' shapes (no formula of sparse.bounds)."""
    att = {k: v for k, v in tensors.items() if k.startswith(("query.", "latent.", "key.", "value.", "output."))}
    index = {k: v for k, v in tensors.items() if k.startswith("indexer.")}
    assert len(att) + len(index) == len(tensors), sorted(tensors)
    k = data["topk"].shape[-1]
    row = (data["latent"].nbytes + data["rotary"].nbytes) // P  # one cached token's latent and rotary key
    attention_weights = sum(v.nbytes for v in att.values())

    def matmul_flops(a, b):  # 2 m n p for (m, n) @ (n, p)
        return 2 * a[0] * a[1] * b[1]

    def absorbed(keys):  # one token through every kernel (2 FLOPs per weight: the projections, the query's
        # absorption through key.kernel and the context's expansion through value.kernel), then per head the
        # logits over keys of width C + R and the context over values of width C
        projections = sum(2 * v.size for name, v in att.items() if name.endswith(".kernel"))
        return projections + d.N * (matmul_flops((1, d.C + d.R), (d.C + d.R, keys)) + matmul_flops((1, keys),
                                                                                                   (keys, d.C)))

    I, J = index["indexer.query.kernel"].shape[-2:]
    indexer_flops = (sum(2 * int(np.prod(index[n].shape)) for n in ("indexer.query.kernel", "indexer.key.kernel",
                                                                   "indexer.weights.kernel"))
                     + I * matmul_flops((1, J), (J, P + 1)) + matmul_flops((1, I), (I, P + 1)))
    return {"dense": {"bytes": P * row + attention_weights, "flops": absorbed(P + 1)},
            "sparse": {"bytes": k * row + data["topk"].nbytes + attention_weights, "flops": absorbed(k)},
            "indexer": {"bytes": data["index_keys"].nbytes + sum(v.nbytes for v in index.values()),
                        "flops": indexer_flops}}


@pytest.mark.parametrize("quick", [True, False])
def test_bounds_count_what_the_step_reads_and_computes(quick):
    d, ix = sparse.dims(quick)
    P = 64 if quick else 4096  # the family's k (2048) of a cache twice as long
    config, tensors = sparse.layer(d, ix)
    data = sparse.inputs(d, ix, P)
    assert data["topk"].shape == (d.B, 1, ix.k) and data["topk"][0, 0, -1] == P  # the new token selects itself
    assert len(np.unique(data["topk"])) == ix.k and data["topk"].min() >= 0
    assert sparse.bounds(d, ix, P) == _counted(d, ix, tensors, data, P)


def test_x_bound_is_the_time_over_the_larger_of_the_two_bounds():
    """From seconds: bandwidth = read bytes / read time, rate = 2 n^3 / matmul time, bound = max(bytes /
    bandwidth, flops / rate); the paired form (ratios to the matmul) gives the same number."""
    t_mm, t_read, read_bytes, n = 0.2, 0.01, 10**8, 2048
    for t, nbytes, flops, binding in ((0.05, 10**8, 10**6, "read"), (0.05, 10**3, 10**11, "flops")):
        bound = max(nbytes / (read_bytes / t_read), flops / (2 * n**3 / t_mm))
        got = sparse.x_bound(t / t_mm, t_read / t_mm, read_bytes, nbytes, flops, n)
        assert got["x_bound"] == pytest.approx(t / bound, rel=1e-12) and got["bound"] == binding, got


def test_sparse_step_attends_to_the_selected_keys_alone():
    """numpy's sparse path (topk_indices) against the float64 dense call over the gathered cache (the selected
    cached tokens alone, the new token's query and key at their own position P): the selection drops keys (k < P + 1), and the
    dense step differs from it by more than the bar (so the check could fail)."""
    from impl_numpy.attention import multi_head_attention

    d, ix = sparse.dims(True)
    P = 40
    config, tensors = sparse.layer(d, ix)
    data = sparse.inputs(d, ix, P)
    calls = sparse.numpy_paths(config, tensors, data, P)
    kept = data["topk"][0, 0, :-1]
    att = {k: v for k, v in tensors.items() if not k.startswith("indexer.")}
    trace = []
    expected = np.asarray(multi_head_attention(
        config.replace(indexer=None), att, data["x"], past_key=data["latent"][:, :, kept],
        past_value=data["rotary"][:, :, kept], positions=np.array([P]), key_positions=np.array([P]),
        is_causal=True,
        causal_alignment="bottom_right", dtype="float64", trace=trace))
    logits = next(e.value for e in trace if e.stage == "logits")
    for call in range(2):  # the in-place step writes its new token again
        assert_close(f"sparse step (call {call + 1})", calls["sparse"](), expected, config=config.replace(indexer=None),
                     dtype="float32", quantity="output", B=d.B, T=1, S=ix.k, logits=logits)
    with pytest.raises(AssertionError):
        assert_close("dense step", calls["dense"](), expected, config=config.replace(indexer=None), dtype="float32",
                     quantity="output", B=d.B, T=1, S=ix.k, logits=logits)
    assert calls["indexer"]().shape == (d.B, 1, ix.k)


def test_quick_family_runs_in_numpy(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--shapes", "sparse", "--backends", "numpy", "--json", str(out)]) == 0
    record = json.loads(out.read_text())["sparse"]
    assert record["backends"]["numpy"]["status"] == "ok"
    rows = {(r["P"], r["path"]): r for r in record["rows"]}
    assert set(rows) == {(P, p) for P in sparse.QUICK_SPARSE_LENGTHS for p in sparse.PATHS}
    for (_, path), r in rows.items():
        assert r["status"] == "ok", r
        if path != "read":
            assert r["x_bound"] > 0 and r["bound"] in ("read", "flops"), r
    assert "sparse: DSA decode step" in capsys.readouterr().out


def test_sparse_max_below_the_first_length_is_one_line(capsys):
    code = main(["bench", "--shapes", "sparse", "--backends", "numpy", "--sparse-max", "100"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "mha: error: --sparse-max must be at least 8192: got 100", err


def _two_rows():
    """A latent layer, B 2, one new token over P 50 cached, each row its own 6 keys (row 1 with a -1 pad)."""
    from conformance.bench import latent

    d = latent.QUICK
    config, tensors = latent.layer(d)
    rng = np.random.default_rng(0)
    P = 50
    x = rng.standard_normal((2, 1, d.D)).astype(np.float32)
    past = (rng.standard_normal((2, 1, P, d.C)).astype(np.float32), rng.standard_normal((2, 1, P, d.R)).astype(np.float32))
    idx = np.stack([np.sort(rng.choice(P + 1, 6, replace=False)) for _ in range(2)])[:, None]  # (2, 1, 6)
    idx[1, 0, 0] = -1
    return config, tensors, x, past, idx, P


def _assert_gathered_matches_stages(monkeypatch=None, mutant=None):
    from impl_numpy.attention import multi_head_attention

    config, tensors, x, (latent_, rotary), idx, P = _two_rows()
    if mutant is not None:
        import impl_numpy.chunked as chunked

        monkeypatch.setattr(chunked, "_selected_columns", mutant)
    options = dict(past_key=latent_, past_value=rotary, topk_indices=idx, is_causal=True,
                   causal_alignment="bottom_right")
    got = multi_head_attention(config, tensors, x, **options)  # the fused path: gathers the selected rows
    trace = []
    expected = np.asarray(multi_head_attention(config, tensors, x, dtype="float64", trace=trace, **options))  # stages
    logits = next(e.value for e in trace if e.stage == "logits")
    assert_close("gathered decode step", got, expected, config=config, dtype="float32", quantity="output", B=2, T=1,
                  S=P + 1, logits=logits)


def test_gathered_decode_step_over_two_rows_with_their_own_selections():
    """impl_numpy's gather of the selected rows (a one-token latent call over a selection) gathers the union
    of every row's keys and keeps each row's mask over it: the stages' float64 result (every key, masked)."""
    _assert_gathered_matches_stages()


def test_gather_that_reads_row_0s_selection_alone_is_caught(monkeypatch):
    """A porting bug: the columns gathered from batch row 0's selection only (row 1's keys dropped)."""
    import impl_numpy.chunked as chunked

    right = chunked._selected_columns

    def row_0_only(config, call, is_causal, causal_alignment):
        cols = right(config, call, is_causal, causal_alignment)
        return None if cols is None else np.flatnonzero(call.mask4[0].any(axis=(0, 1)))

    with pytest.raises(AssertionError, match="FAIL"):
        _assert_gathered_matches_stages(monkeypatch, row_0_only)


def test_no_gather_where_a_masked_row_weighs_every_key():
    """Found by the sweep (seed 991125, 2026-11-29; that seed is this test's now): a one-token latent call
    whose indexer keeps 1 key, masked_row "uniform", a fully masked row. Its 1/S_total weights spread over
    every key; gathering the selected columns spread them over those alone (fused and in-place paths off by
    0.32, margin 1e12 in float64). Every path must now agree with the reference."""
    from conformance.suite.cases import random_case
    from conformance.suite.sweep import sweep

    case = random_case(991125)
    assert case.config.masked_row == "uniform" and case.T == 1 and case.config.indexer is not None
    found = sweep("numpy", [991125], ("float64", "float32"))
    assert found["runs"] > 0 and not found["failures"], found["failures"]


@pytest.mark.parametrize("in_place", [False, True])
def test_dense_decode_step_is_one_block_over_the_cache_in_place(monkeypatch, in_place):
    """A one-token latent call without a selection (the dense decode step) over P 700 cached keys: the fused
    core takes every key in one block (attention.fused_block: 701 > FUSED_BLOCK), the key [latent | rotary]
    read as JoinedKeys (no copy of the cache), and equals the float64 stages (B 2, sinks off, masked_row zero)."""
    import impl_numpy.chunked as chunked
    from conformance.bench import latent
    from impl_numpy.attention import FUSED_BLOCK, multi_head_attention

    d = latent.QUICK
    config, tensors = latent.layer(d)
    P = 700
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 1, d.D)).astype(np.float32)
    lat, rot = (rng.standard_normal((2, 1, P, w)).astype(np.float32) for w in (d.C, d.R))
    seen, right = [], chunked._core

    def spy(config, q, k, v, **kwargs):
        seen.append((kwargs["chunk_size"], type(k).__name__, k.shape[2]))
        return right(config, q, k, v, **kwargs)

    monkeypatch.setattr(chunked, "_core", spy)
    options = dict(is_causal=True, causal_alignment="bottom_right")
    if in_place:
        buffers = [np.zeros((2, 1, P + 3, a.shape[-1]), np.float32) for a in (lat, rot)]
        buffers[0][:, :, :P], buffers[1][:, :, :P] = lat, rot
        got = multi_head_attention(config, tensors, x, past_key=buffers[0], past_value=buffers[1], cache_length=P,
                                   **options)
    else:
        got = multi_head_attention(config, tensors, x, past_key=lat, past_value=rot, **options)
    assert seen == [(P + 1, "JoinedKeys", P + 1)] and P + 1 > FUSED_BLOCK, seen
    trace = []
    expected = np.asarray(multi_head_attention(config, tensors, x, past_key=lat, past_value=rot, dtype="float64",
                                               trace=trace, **options))
    logits = next(e.value for e in trace if e.stage == "logits")
    assert_close("dense decode step", got, expected, config=config, dtype="float32", quantity="output", B=2, T=1,
                 S=P + 1, logits=logits)
