"""The chunked path (and the fused fast path built on its core) never holds a
(T, S) array, skips the key blocks a causal mask hides, and agrees with the
stage-by-stage path."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import weights
from impl_numpy import multi_head_attention
from impl_numpy.attention import FUSED_BLOCK
from impl_numpy.chunked import QUERY_ROWS


@pytest.fixture(params=["bounded", "running max"])
def softmax_way(request, monkeypatch):
    """Both ways of chunked.py's softmax: where the logits are bounded (every
    test's data here) the bounded way runs unless switched off."""
    from impl_numpy import chunked

    monkeypatch.setattr(chunked, "SKIP_MAX_WHEN_BOUNDED", request.param == "bounded")
    return request.param


def blas_threads():
    from threadpoolctl import threadpool_info

    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def spy(monkeypatch, module, name, record):
    """Wrap module.name so that each call first appends record(args, kwargs); returns that list."""
    seen, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        seen.append(record(args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return seen


def assert_equals_stages(label, out, staged, tol=1e-13):
    """NaN exactly where the float64 stages have NaN, and within tol elsewhere."""
    assert np.array_equal(np.isnan(out), np.isnan(staged)), f"{label}: NaN rows differ"
    err = np.abs(np.where(np.isnan(staged), 0, out - staged)).max()
    assert err <= tol, f"{label}: max abs difference {err:.3g}"


def peak_bytes(fn):
    from impl_numpy.chunked import release_workspace

    release_workspace()  # so that the call's kept scratch buffers are allocated, and counted, inside the trace
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def run_long(T, chunk, causal=True, dtype="float32"):
    config = weights.AttentionConfig(num_heads=4, query_dim=64, head_dim=16)
    tensors = weights.init(config, seed=0, dtype=dtype)
    x = np.random.default_rng(0).standard_normal((1, T, 64)).astype(dtype)
    out, peak = peak_bytes(lambda: multi_head_attention(config, tensors, x, is_causal=causal, chunk_size=chunk))
    block = config.num_heads * chunk * chunk * np.dtype(dtype).itemsize  # one (B, N, chunk, chunk) temporary
    ts = config.num_heads * T * T * np.dtype(dtype).itemsize  # the weights the plain path would hold
    return config, tensors, x, out, peak, block, ts


@pytest.mark.parametrize("causal", [False, True])
def test_peak_memory_is_blocks_not_t_by_s(causal):
    _, _, x, out, peak, block, ts = run_long(2048, 256, causal)
    # Inputs/outputs/projections plus a handful of block temporaries; the
    # plain path's (B, N, T, S) weights alone would be `ts` = 64 MiB.
    budget = 6 * (x.nbytes + out.nbytes) + 8 * block
    assert peak < budget, f"peak {peak / 2**20:.1f} MiB > budget {budget / 2**20:.1f} MiB (T x S would be {ts / 2**20:.0f} MiB)"


@pytest.mark.slow
def test_16384_runs_in_bounded_memory():
    _, _, x, out, peak, block, ts = run_long(16384, 512, True)
    print(f"T=S=16384 chunked: peak {peak / 2**20:.1f} MiB; inputs+outputs {(x.nbytes + out.nbytes) / 2**20:.1f} MiB; "
          f"(B, N, T, S) float32 weights would be {ts / 2**20:.0f} MiB")
    assert peak < 6 * (x.nbytes + out.nbytes) + 8 * block


@pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, not `tox -e all` again
def test_chunked_matches_plain_at_moderate_length_float64(softmax_way):
    config = weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=16, head_dim=8, masked_row="uniform")
    tensors = weights.init(config, seed=1, dtype="float64")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 300, 16))
    mask = rng.random((2, 1, 300, 300)) < 0.5
    mask[0, 0, 7] = False  # a fully masked row
    for alignment in ("top_left", "bottom_right"):
        plain = multi_head_attention(config, tensors, x, mask=mask, is_causal=True, causal_alignment=alignment,
                                     trace=[])  # the stages (a trace turns the fused fast path off)
        for chunk in (1, 64, 299, 1000, None):  # None: the plain call's fused fast path
            chunked = multi_head_attention(config, tensors, x, mask=mask, is_causal=True, causal_alignment=alignment,
                                           chunk_size=chunk)
            err = np.abs(chunked - plain).max()
            assert err <= 1e-13, f"{alignment} chunk {chunk}: max abs difference {err:.3g}"


@pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, not `tox -e all` again
@pytest.mark.parametrize("alignment, T, S", [("top_left", 300, 300), ("bottom_right", 200, 330), ("bottom_right", 330, 200)])
@pytest.mark.parametrize("dtype, chunk", [("float32", 64), ("float32", None), ("float16", 64), ("bfloat16", 96)])
def test_blocks_meet_the_tolerance_policy(alignment, T, S, dtype, chunk, softmax_way):
    """float32 and 16-bit through several query and key blocks (GQA, a mask,
    causal), against the float64 stages, judged by the project's tolerance
    policy (16-bit: against 3x the stages' own error in that dtype)."""
    from conformance.suite.tolerance import assert_close

    config = weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=16, head_dim=8)
    tensors = weights.init(config, seed=5, dtype=dtype)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, T, 16)).astype(tensors["query.kernel"].dtype)
    kv = rng.standard_normal((2, S, 16)).astype(q.dtype)
    mask = rng.random((2, 1, T, S)) < 0.8
    options = dict(mask=mask, is_causal=True, causal_alignment=alignment)
    t64 = {name: t.astype(np.float64) for name, t in tensors.items()}
    trace = []
    expected = multi_head_attention(config, t64, q.astype(np.float64), kv.astype(np.float64), trace=trace, **options)
    same_precision = None
    if dtype != "float32":
        own = multi_head_attention(config, tensors, q, kv, trace=[], **options).astype(np.float64)
        same_precision = float(np.abs(own - expected).max())
    actual = multi_head_attention(config, tensors, q, kv, chunk_size=chunk, **options)
    assert actual.dtype == q.dtype
    assert_close(f"{dtype} chunk_size={chunk}", actual, expected, config=config, dtype=dtype, quantity="output",
                 B=2, T=T, S=S, logits=dict((e.stage, e.value) for e in trace)["logits"], same_precision_error=same_precision)


@pytest.mark.parametrize("chunk", [32, None])
def test_hidden_key_blocks_are_never_read(chunk, softmax_way):
    """A NaN in the last token's key and value: every row that reads its block
    gets NaN (0 * NaN in the attend matmul), so rows stay finite exactly where
    the key block holding it was skipped as hidden by the causal mask."""
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=0, dtype="float64")
    T = 600
    x = np.random.default_rng(0).standard_normal((1, T, 8))
    kv = x.copy()
    kv[0, -1] = np.nan
    out = multi_head_attention(config, tensors, x, kv, is_causal=True, chunk_size=chunk)
    rows = min(FUSED_BLOCK if chunk is None else chunk, QUERY_ROWS)  # the query block size
    first_reading_row = (T - 1) // rows * rows  # only the last query block reaches key T-1
    finite_rows = np.isfinite(out[0]).all(axis=-1)
    assert finite_rows[:first_reading_row].all() and not finite_rows[first_reading_row:].any(), (
        f"finite rows {np.flatnonzero(finite_rows)[[0, -1]]}, expected 0..{first_reading_row - 1}")


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("mask_heads, bias_heads", [(1, None), (4, 4), (None, 1)])
@pytest.mark.parametrize("masked_row", ["zero", "uniform", "nan"])
def test_heads_on_threads_equal_the_stages(threads, mask_heads, bias_heads, masked_row, monkeypatch):
    """Large calls split their kv heads across threads (forced here on a small
    one): masks, bias and dropout with a full or a broadcast head axis, GQA,
    fully masked rows, causal; against the float64 stages."""
    from impl_numpy import chunked

    monkeypatch.setattr(chunked, "THREADED_MIN_SCORES", 0)
    monkeypatch.setattr(chunked, "THREADS", threads)
    config = weights.AttentionConfig(num_heads=4, num_kv_heads=2 if threads == 2 else 4, query_dim=16, head_dim=8,
                                     masked_row=masked_row, dropout=0.25)
    tensors = weights.init(config, seed=3, dtype="float64")
    rng = np.random.default_rng(4)
    B, T, S = 2, 70, 90
    q, kv = rng.standard_normal((B, T, 16)), rng.standard_normal((B, S, 16))
    options = dict(is_causal=True, causal_alignment="bottom_right", training=True,
                   dropout_mask=rng.random((B, 4, T, S)) < 0.75)
    if mask_heads:
        options["mask"] = rng.random((B, mask_heads, T, S)) < 0.7
        options["mask"][:, :, 3] = False  # fully masked rows
    if bias_heads:
        options["bias"] = rng.standard_normal((B, bias_heads, T, S))
    staged = multi_head_attention(config, tensors, q, kv, trace=[], **options)
    for chunk in (16, None):
        threaded = multi_head_attention(config, tensors, q, kv, chunk_size=chunk, **options)
        assert_equals_stages(f"chunk {chunk}, {threads} threads", threaded, staged)


@pytest.mark.parametrize("threaded", ["core", "stages"])
def test_threads_hold_blas_to_one_thread_and_raise_a_threads_error(threaded, monkeypatch):
    """The core alone (THREADED_MIN_SCORES) or every stage (THREADED_MIN_FLOPS:
    split stages at B 1, batch slices at B 3) on two threads: BLAS held to one
    thread inside each thread's work, restored after, also when a thread
    fails, whose exception the call raises."""
    from impl_numpy import chunked, functional

    before = blas_threads()
    monkeypatch.setattr(chunked, "THREADS", 2)
    monkeypatch.setattr(chunked, "THREADED_MIN_SCORES" if threaded == "core" else "THREADED_MIN_FLOPS", 0)
    spied = [(chunked, "_core")] if threaded == "core" else [(functional, "project"), (functional, "output")]
    calls = {"_core": 2} if threaded == "core" else {"project": 6, "output": 2}
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=0, dtype="float32")
    seen = {name: spy(monkeypatch, module, name, lambda args, kwargs: blas_threads()) for module, name in spied}
    for B in (1, 3):
        for runs in seen.values():
            runs.clear()
        multi_head_attention(config, tensors, np.random.default_rng(0).standard_normal((B, 40, 8)).astype(np.float32))
        assert {name: len(s) for name, s in seen.items()} == calls, f"B {B}: stage calls {seen}"
        assert all(n == 1 for runs in seen.values() for s in runs for n in s), f"B {B}: BLAS threads inside: {seen}"
        assert blas_threads() == before

    def failing(*args, **kwargs):
        raise RuntimeError("a thread's failure")

    monkeypatch.setattr(*spied[-1], failing)
    with pytest.raises(RuntimeError, match="a thread's failure"):
        multi_head_attention(config, tensors, np.zeros((3, 40, 8), np.float32))
    assert blas_threads() == before


# -- bounded logits: no running max when |q_i| |k_j| <= LOGIT_BOUND ------------------

def _spy_core(monkeypatch):
    """Record the `bounded` flag of every _core call (which softmax way ran)."""
    from impl_numpy import chunked

    return spy(monkeypatch, chunked, "_core", lambda args, kwargs: kwargs["bounded"])


@pytest.mark.parametrize("way", ["bounded", "running max"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("masked_row", ["zero", "uniform", "nan"])
def test_both_softmax_ways_equal_the_stages(way, threads, masked_row, monkeypatch):
    """The bounded way (exp against 0, blocks simply summed) and the running
    max take the same causal, masked, dropped-out GQA call over several query
    and key blocks, with fully masked rows, to the float64 stages' result; the
    spy proves which way ran."""
    from impl_numpy import chunked

    monkeypatch.setattr(chunked, "SKIP_MAX_WHEN_BOUNDED", way == "bounded")
    monkeypatch.setattr(chunked, "THREADED_MIN_SCORES", 0 if threads > 1 else 2**62)
    monkeypatch.setattr(chunked, "THREADS", threads)
    seen = _spy_core(monkeypatch)
    config = weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=16, head_dim=8, masked_row=masked_row,
                                     dropout=0.25)
    tensors = weights.init(config, seed=7, dtype="float64")
    rng = np.random.default_rng(8)
    B, T, S = 2, 150, 170
    q, kv = rng.standard_normal((B, T, 16)), rng.standard_normal((B, S, 16))
    mask = rng.random((B, 1, T, S)) < 0.7
    mask[:, :, 5] = False  # fully masked rows
    options = dict(mask=mask, is_causal=True, causal_alignment="bottom_right", training=True,
                   dropout_mask=rng.random((B, 4, T, S)) < 0.75)
    staged = multi_head_attention(config, tensors, q, kv, trace=[], **options)
    for chunk in (32, None):
        seen.clear()
        out = multi_head_attention(config, tensors, q, kv, chunk_size=chunk, **options)
        assert seen and all(b == (way == "bounded") for b in seen), f"chunk {chunk}: _core ran with bounded={seen}"
        assert_equals_stages(f"{way}, chunk {chunk}", out, staged)


def _qkv(logit, H=4, S=8, dtype=np.float32):
    """q (1, 1, 1, H), k and v (1, 1, S, H) whose largest |q| |k| is `logit`."""
    q = np.zeros((1, 1, 1, H), dtype)
    q[..., 0] = logit / 2
    k = np.zeros((1, 1, S, H), dtype)
    k[..., 1, 0] = 2.0
    return q, k, np.ones((1, 1, S, H), dtype)


def test_logits_bounded_is_cauchy_schwarz_against_the_bound():
    from impl_numpy.chunked import LOGIT_BOUND, logits_bounded

    assert logits_bounded(*_qkv(LOGIT_BOUND * 0.999), None)
    assert not logits_bounded(*_qkv(LOGIT_BOUND * 1.001), None)
    q, k, v = _qkv(1.0)
    assert not logits_bounded(q, k, v, np.zeros((1, 1, 1, 8), np.float32)), "a bias takes the running max"
    for array in (q, k, v):
        bad = array.copy()
        bad.flat[0] = np.nan
        args = [bad if a is array else a for a in (q, k, v)]
        assert not logits_bounded(*args, None), "NaN takes the running max"
    assert not logits_bounded(q, k, v * np.float32(1e20), None), "sum_j e^60 |v_j| could overflow float32"
    # GQA: query head n reads kv head n // G; a large query head against a small kv head stays bounded.
    qg = np.zeros((1, 4, 1, 4), np.float32)
    qg[0, :2, 0, 0] = 100.0  # query heads 0, 1 read kv head 0
    qg[0, 2:, 0, 0] = 0.1  # query heads 2, 3 read kv head 1
    kg = np.zeros((1, 2, 8, 4), np.float32)
    kg[0, 0, 0, 0] = 0.1
    kg[0, 1, 0, 0] = 100.0
    assert logits_bounded(qg, kg, np.ones((1, 2, 8, 4), np.float32), None)  # 100 * 0.1 = 10 in both pairs
    assert not logits_bounded(qg[:, ::-1].copy(), kg, np.ones((1, 2, 8, 4), np.float32), None)


def test_a_decode_step_skips_the_bound_check(monkeypatch):
    """One query row against a long GQA cache: the bound check (a pass over k,
    two over v) would cost more than the max passes it spares, so the step
    takes the running max without it, and still equals the float64 stages;
    a call with many query rows still asks."""
    from impl_numpy import chunked

    asked = spy(monkeypatch, chunked, "logits_bounded", lambda args, kwargs: args[0].shape)
    seen = _spy_core(monkeypatch)
    config = weights.AttentionConfig(num_heads=8, num_kv_heads=2, query_dim=32, head_dim=16)
    tensors = weights.init(config, seed=3, dtype="float64")
    rng = np.random.default_rng(4)
    P = 300
    past = rng.standard_normal((1, 2, P, 16)), rng.standard_normal((1, 2, P, 16))
    x = rng.standard_normal((1, 1, 32))
    options = dict(past_key=past[0], past_value=past[1], is_causal=True, causal_alignment="bottom_right")
    staged = multi_head_attention(config, tensors, x, trace=[], **options)
    out = multi_head_attention(config, tensors, x, **options)
    assert asked == [] and seen == [False], f"decode step: logits_bounded asked for {asked}, _core bounded={seen}"
    assert_equals_stages("decode step, running max", out, staged)
    multi_head_attention(config, tensors, rng.standard_normal((1, 64, 32)), is_causal=True)
    assert asked == [(1, 8, 64, 16)], f"64 query rows: logits_bounded asked for {asked}"


def test_logits_past_the_bound_take_the_running_max(monkeypatch):
    """float32 logits near 100: exp(100) overflows float32, so without the
    bound check the bounded way would return inf/NaN. The call must match
    the float64 stages; forcing the bounded way shows what the check prevents."""
    from impl_numpy import chunked

    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=0, dtype="float32")
    x = (np.random.default_rng(1).standard_normal((1, 40, 8)) * 30).astype(np.float32)
    t64 = {name: t.astype(np.float64) for name, t in tensors.items()}
    trace = []
    expected = multi_head_attention(config, t64, x.astype(np.float64), trace=trace)
    logits = dict((e.stage, e.value) for e in trace)["logits"]
    assert np.abs(logits).max() > 90, "the case needs logits past exp's range"
    seen = _spy_core(monkeypatch)
    out = multi_head_attention(config, tensors, x)
    assert seen == [False]
    err = np.abs(out - expected).max()
    assert err <= 1e-4 * np.abs(expected).max(), f"running max: max abs difference {err:.3g}"
    monkeypatch.setattr(chunked, "logits_bounded", lambda *args: True)
    with np.errstate(over="ignore", invalid="ignore"):
        forced = multi_head_attention(config, tensors, x)
    assert not np.isfinite(forced).all(), "the bounded way should overflow here (else this case tests nothing)"


# -- large calls: every stage on threads (fused_forward) ------------------------------

@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("B, T, S, K", [(4, 40, 40, 2), (1, 70, 70, 4), (1, 50, 90, 1), (2, 64, 48, 1), (5, 33, 33, 4)])
def test_threaded_stages_equal_the_stages(threads, B, T, S, K, monkeypatch):
    """Forced onto threads (THREADED_MIN_FLOPS 0): batch slices where B >=
    threads, else projections and output split by rows and the core by kv
    heads or batch, with T != S, GQA/MQA, a non-contiguous query, a separate
    key and value of other widths, a mask broadcast over heads, a dropout
    mask, every masked-row policy; against the float64 stages."""
    from impl_numpy import chunked

    monkeypatch.setattr(chunked, "THREADED_MIN_FLOPS", 0)
    monkeypatch.setattr(chunked, "THREADS", threads)
    rng = np.random.default_rng(B * 100 + T)
    for masked_row in ("zero", "uniform", "nan"):
        config = weights.AttentionConfig(num_heads=4, num_kv_heads=K, query_dim=12, key_dim=10, value_dim=6,
                                         head_dim=8, value_head_dim=5, out_dim=7, masked_row=masked_row, dropout=0.2)
        tensors = weights.init(config, seed=B + T, dtype="float64")
        query = rng.standard_normal((B, 12, T)).transpose(0, 2, 1)  # not contiguous
        key, value = rng.standard_normal((B, S, 10)), rng.standard_normal((B, S, 6))
        mask = rng.random((B, 1, T, S)) < 0.7
        mask[:, :, 2] = False  # fully masked rows
        options = dict(mask=mask, is_causal=True, causal_alignment="bottom_right", training=True,
                       dropout_mask=rng.random((B, 4, T, S)) < 0.8)
        staged = multi_head_attention(config, tensors, query, key, value, trace=[], **options)
        for chunk in (16, None):
            threaded = multi_head_attention(config, tensors, query, key, value, chunk_size=chunk, **options)
            assert threaded.shape == (B, T, 7)
            assert_equals_stages(f"{masked_row} chunk {chunk}", threaded, staged)


def test_core_splits_its_batch_when_kv_heads_are_fewer_than_threads(monkeypatch):
    """MQA (one kv head) on two threads: the core's parts are batch slices."""
    from impl_numpy import chunked

    monkeypatch.setattr(chunked, "THREADED_MIN_SCORES", 0)
    monkeypatch.setattr(chunked, "THREADS", 2)
    seen = spy(monkeypatch, chunked, "_core", lambda args, kwargs: args[1].shape)  # q's
    config = weights.AttentionConfig(num_heads=4, num_kv_heads=1, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=0, dtype="float64")
    x = np.random.default_rng(1).standard_normal((3, 20, 8))
    out = multi_head_attention(config, tensors, x, is_causal=True, chunk_size=8)
    assert sorted(seen) == [(1, 4, 20, 4), (2, 4, 20, 4)], seen
    staged = multi_head_attention(config, tensors, x, is_causal=True, trace=[])
    assert np.abs(out - staged).max() <= 1e-13


@given(B=st.integers(1, 2), K=st.integers(1, 3), G=st.integers(1, 3), T=st.integers(1, 9), S=st.integers(1, 9),
       H=st.integers(1, 8), margin=st.floats(0.001, 0.1), below=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_logits_bounded_decides_on_the_largest_norms_of_each_head_pair(B, K, G, T, S, H, margin, below, seed):
    """An independent formulation (a loop over query heads, each against its
    kv head n // G, norms row by row) gives the largest |q_i| |k_j|; the data
    are scaled so that it lands `margin` below or above LOGIT_BOUND. The
    decision must follow it, and a yes must mean every logit is within the
    bound (Cauchy-Schwarz)."""
    from impl_numpy.chunked import LOGIT_BOUND, logits_bounded

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, K * G, T, H)) * rng.random((1, K * G, 1, 1))  # heads of unequal size
    k = rng.standard_normal((B, K, S, H)) * rng.random((1, K, 1, 1))
    largest = max(max(np.linalg.norm(q[b, n, i]) for i in range(T))
                  * max(np.linalg.norm(k[b, n // G, j]) for j in range(S))
                  for b in range(B) for n in range(K * G))
    target = LOGIT_BOUND * (1 - margin if below else 1 + margin)
    q, k = q * np.sqrt(target / largest), k * np.sqrt(target / largest)  # the largest product is now `target`
    bounded = logits_bounded(q, k, rng.standard_normal((B, K, S, 2)), None)
    assert bounded == below, f"largest |q_i| |k_j| {target:.6g}: logits_bounded said {bounded}"
    logits = np.einsum("bkgth,bksh->bkgts", q.reshape(B, K, G, T, H), k)
    assert np.abs(logits).max() <= target * (1 + 1e-12), "Cauchy-Schwarz"


# -- scratch buffers kept between calls (chunked.workspace) ----------------------------------------------------------

def _bert_like(B=2, T=48, seed=0):
    config = weights.AttentionConfig(num_heads=4, query_dim=32, head_dim=8)
    tensors = weights.init(config, seed=0, dtype="float32")
    return config, tensors, np.random.default_rng(seed).standard_normal((B, T, 32)).astype(np.float32)


def test_kept_buffers_serve_later_calls_and_never_reach_the_caller(monkeypatch):
    """A second call of the same shape takes the first call's buffers (no new
    scratch allocation), and writes nothing into the first call's output: the
    output must be its own array, not a view of a buffer the next call reuses."""
    from impl_numpy import chunked

    config, tensors, x = _bert_like()
    chunked.release_workspace()
    first = multi_head_attention(config, tensors, x)
    kept = {id(buffer) for buffer in chunked._kept}
    assert kept and chunked.kept_workspace_bytes() > 0, "the fast path kept no buffer"
    saved = first.copy()
    fresh = spy(monkeypatch, np, "empty", lambda args, kwargs: args[0])
    second = multi_head_attention(config, tensors, x[::-1].copy())
    assert {id(buffer) for buffer in chunked._kept} == kept, "the second call did not reuse the kept buffers"
    scratch = [size for size in fresh if np.ndim(size) == 0 and int(size) >= x.size]
    assert not scratch, f"the second call allocated scratch afresh: {scratch}"
    assert np.array_equal(first, saved), "the second call wrote into the first call's output"
    for buffer in chunked._kept:
        assert not np.shares_memory(second, buffer), "the output is a view of a kept buffer"
    monkeypatch.setattr(chunked, "WORKSPACE_KEEP_BYTES", 0)
    chunked.release_workspace()
    assert np.array_equal(second, multi_head_attention(config, tensors, x[::-1].copy())), \
        "kept buffers changed the result"
    assert chunked.kept_workspace_bytes() == 0


def test_workspace_hands_a_buffer_to_one_caller_at_a_time():
    """Nested or concurrent users of the workspace never share a buffer."""
    from impl_numpy import chunked

    chunked.release_workspace()
    with chunked.workspace(np.float32, (100,)) as (a,):
        pass
    with chunked.workspace(np.float32, (100,)) as (b,), chunked.workspace(np.float32, (60,), (40,)) as (c, d):
        assert np.shares_memory(a, b), "a kept buffer was not reused"
        assert not np.shares_memory(b, c) and not np.shares_memory(b, d) and not np.shares_memory(c, d)
    assert len(chunked._kept) == 2


def test_kept_bytes_stay_under_the_cap_and_release_frees_them(monkeypatch):
    from impl_numpy import chunked

    monkeypatch.setattr(chunked, "WORKSPACE_KEEP_BYTES", 64 * 2**10)
    chunked.release_workspace()
    for B, T in [(1, 8), (2, 40), (1, 100), (3, 17), (1, 8)]:  # scratch from 2 KiB to about 100 KiB
        config, tensors, x = _bert_like(B, T)
        staged = multi_head_attention(config, tensors, x, return_weights=True)[0]
        out = multi_head_attention(config, tensors, x)
        assert np.abs(out - staged).max() < 1e-5, f"B {B} T {T}"
        assert 0 < chunked.kept_workspace_bytes() <= chunked.WORKSPACE_KEEP_BYTES, f"after B {B} T {T}"
    chunked.release_workspace()
    assert chunked.kept_workspace_bytes() == 0


def test_concurrent_calls_each_get_their_own_result():
    """Four threads calling at once (each on its own inputs) get exactly what
    each gets alone: a kept buffer handed to two callers would mix them."""
    from concurrent.futures import ThreadPoolExecutor

    config, tensors, _ = _bert_like()
    inputs = [_bert_like(seed=seed)[2] for seed in range(4)]
    alone = [multi_head_attention(config, tensors, x) for x in inputs]

    def repeat(i):
        return [multi_head_attention(config, tensors, inputs[i]) for _ in range(25)]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(repeat, range(4)))
    for i, outs in enumerate(results):
        for out in outs:
            assert np.array_equal(out, alone[i]), f"thread {i}: a result differs from the call made alone"


@pytest.mark.parametrize("threads", [1, 2])
def test_cache_not_returned_is_not_concatenated(threads, monkeypatch):
    """Without return_cache the fused core reads the cache and the new keys
    as parts (KeyParts): no concatenation of the cache, key blocks that
    straddle the two (chunk 5 against a cache of 13), a mask, a bias,
    softcap, a window and sinks, heads on threads or not; equal to the
    float64 stages."""
    from impl_numpy import chunked

    monkeypatch.setattr(chunked, "THREADED_MIN_SCORES", 0 if threads > 1 else 2**62)
    monkeypatch.setattr(chunked, "THREADS", threads)
    joined = []
    real = np.concatenate
    monkeypatch.setattr(np, "concatenate", lambda xs, *a, **k: joined.append([x.shape for x in xs]) or real(xs, *a, **k))
    P = 13
    for config in (weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=8, head_dim=4),
                   weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=8, head_dim=4, window_left=6,
                                           logit_softcap=5.0, use_sinks=True, masked_row="uniform")):
        tensors = weights.init(config, seed=4, dtype="float64")
        rng = np.random.default_rng(9)
        pk, pv = rng.standard_normal((2, 2, P, 4)), rng.standard_normal((2, 2, P, 4))
        for T, extra in ((1, {}), (3, {"mask": rng.random((2, 1, 3, P + 3)) < 0.8}),
                         (3, {"bias": rng.standard_normal((1, 4, 3, P + 3))})):
            x = rng.standard_normal((2, T, 8))
            options = dict(past_key=pk, past_value=pv, is_causal=True, causal_alignment="bottom_right", **extra)
            staged = multi_head_attention(config, tensors, x, trace=[], **options)
            joined.clear()
            out = multi_head_attention(config, tensors, x, chunk_size=5, **options)
            cache_joins = [shapes for shapes in joined if (2, 2, P, 4) in shapes]
            assert cache_joins == [], f"T={T} {sorted(extra)}: the cache was concatenated: {cache_joins}"
            assert_equals_stages(f"T={T} {sorted(extra)} window={config.window_left}", out, staged)


def test_batched_mqa_decode_with_a_whole_cache_splits_its_key_parts_by_batch(monkeypatch):
    """A batched MQA decode step with a whole cache (past_key given, no
    return_cache, no cache_length: the core reads the cache and the new keys
    as KeyParts) on two threads with K 1 < THREADS 2 <= B 2: the core's parts
    are batch slices, so KeyParts is sliced by a bare slice k[b0:b1] (it took
    only tuples and raised TypeError). Equal to the traced stages."""
    from impl_numpy import chunked

    monkeypatch.setattr(chunked, "THREADED_MIN_SCORES", 0)
    monkeypatch.setattr(chunked, "THREADS", 2)
    seen = spy(monkeypatch, chunked, "_core", lambda args, kwargs: args[1].shape)  # q's
    config = weights.AttentionConfig(num_heads=4, num_kv_heads=1, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=3, dtype="float64")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 1, 8))  # (B, T, D): one new token per row
    cache = dict(past_key=rng.standard_normal((2, 1, 9, 4)), past_value=rng.standard_normal((2, 1, 9, 4)))
    options = dict(is_causal=True, causal_alignment="bottom_right", **cache)
    out = multi_head_attention(config, tensors, x, **options)
    assert sorted(seen) == [(1, 4, 1, 4), (1, 4, 1, 4)], f"the core's parts (q shapes): {seen}"
    staged = multi_head_attention(config, tensors, x, trace=[], **options)
    assert_equals_stages("batched MQA decode, whole cache, 2 threads", out, staged)


def test_a_blas_loaded_after_the_first_threaded_call_is_held_too():
    """A BLAS library loaded after the first threaded call (scipy's own OpenBLAS here; torch's or TensorFlow's
    elsewhere) is held to one thread inside the threads as well: a controller made once missed it (found when
    pytest-xdist ran this file's thread test in a worker that imported scipy after it). A fresh process, so
    that the import order is this test's."""
    import subprocess
    import sys

    pytest.importorskip("scipy", reason="needs a second BLAS library to load: scipy")
    script = """
import numpy as np
from threadpoolctl import threadpool_info
import weights
from impl_numpy import chunked, multi_head_attention
chunked.THREADS, chunked.THREADED_MIN_SCORES = 2, 0
config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
tensors = weights.init(config, seed=0, dtype="float32")
x = np.random.default_rng(0).standard_normal((1, 40, 8)).astype(np.float32)
multi_head_attention(config, tensors, x)  # the first threaded call, before scipy's BLAS is loaded
import scipy.linalg  # noqa: F401  (loads a second OpenBLAS)
seen, real = [], chunked._core
def spy(*args, **kwargs):
    seen.append(sorted(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"))
    return real(*args, **kwargs)
chunked._core = spy
multi_head_attention(config, tensors, x)
print(seen)
assert seen and all(set(threads) == {1} for threads in seen), seen
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
