"""impl_tf's indexer fast paths (issue 39 item 5), on Keras's TensorFlow backend: one query's scores with the keys
as the rows (_decode_scores), the top-k of a few among many keys without sorting every score (_select_few), the
projections as 2-D products (project), the in-place index cache (lightning_indexer's cache_length). Each against
impl_numpy's stage or call (the spec), its threshold lowered so that small inputs take it, on inputs built to hit
what the path could get wrong: ties by the hundred, -inf, +inf, NaN, rows with fewer visible keys than k, several
batch rows, groups and queries. A query transposed by a reshape, and an index cache written one row early, are
planted and fail."""

from __future__ import annotations

import numpy as np
import pytest
from test_indexer import _dsa, _kpool, _m3, _x
from topk_draws import distinct_scores, scores_with_ties

from impl_numpy import indexer as ref
from weights import init

pytestmark = pytest.mark.tf
tf = pytest.importorskip("tensorflow")
from impl_tf import functional as F  # noqa: E402
from impl_tf import indexer  # noqa: E402


@pytest.mark.parametrize("scores", ["ties", "distinct"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1000), (2, 3, 4, 257)])
@pytest.mark.parametrize("width", [1, 7, 100])
def test_select_few_is_the_stable_sorts_selection(monkeypatch, scores, shape, width):
    """Distinct scores take top_k's keys; ties straddling the width-th score (or a NaN) go back to the sort."""
    monkeypatch.setattr(indexer, "TOPK_FEW_MIN_KEYS", 16)
    rng = np.random.default_rng(width)
    # no NaN: impl_tf's stable sort, which a row holding NaN goes back to, places it otherwise than NumPy's
    # (test_select_few_with_a_nan_among_the_scores)
    x = scores_with_ties(rng, shape, nan=False) if scores == "ties" else distinct_scores(rng, shape)
    right, few = indexer._select_few, []
    monkeypatch.setattr(indexer, "_select_few", lambda *a: few.append(right(*a)) or few[-1])
    got = np.asarray(indexer.select_topk(tf.constant(x), width))
    np.testing.assert_array_equal(got, ref.select_topk(x, width))
    assert len(few) == 1, few
    if scores == "distinct" or width > 1:  # (width 1 over ties: the top score may stand alone)
        assert (few[0] is None) == (scores == "ties"), few


def test_select_few_with_a_nan_among_the_scores(monkeypatch):
    """A NaN, which top_k and the sort rank differently: the row goes back to the sort, whose selection it is."""
    x = distinct_scores(np.random.default_rng(3), (1, 1, 2, 300))
    x[0, 0, 1, 7] = np.nan
    assert indexer._select_few(tf.constant(x), 20) is None
    sorted_ = np.asarray(indexer.select_topk(tf.constant(x), 20))  # 300 keys: under TOPK_FEW_MIN_KEYS, the sort
    monkeypatch.setattr(indexer, "TOPK_FEW_MIN_KEYS", 16)
    np.testing.assert_array_equal(np.asarray(indexer.select_topk(tf.constant(x), 20)), sorted_)


def _stage_inputs(rng, B, I=3, S=70, J=5):
    return rng.standard_normal((B, I, 1, J)), rng.standard_normal((B, S, J)), rng.standard_normal((B, 1, I))


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("relu", [True, False])
def test_decode_scores_match_the_stage(monkeypatch, B, weighted, relu):
    """float64 both sides: the same products and sums in another order (the scale on the query), so equal to
    round-off (rtol 1e-12: 2^-52 times the few terms of each sum, with room). One batch row: the 2-D products."""
    monkeypatch.setattr(indexer, "DECODE_SCORES_MIN_KEYS", 16)
    q, k, w = _stage_inputs(np.random.default_rng(B), B)
    w = w if weighted else None
    expected = ref.scores(q, k, w, -0.3, relu, False)
    seen = []
    real = indexer._decode_scores
    monkeypatch.setattr(indexer, "_decode_scores", lambda *a: seen.append(1) or real(*a))
    got = np.asarray(indexer.scores(*(None if a is None else tf.constant(a) for a in (q, k, w)), -0.3, relu, False))
    assert seen and got.shape == expected.shape == (B, 1, 1, 70)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_a_query_reshaped_where_it_is_transposed_is_caught(monkeypatch):
    """The mutant: the (I, J) query turned (J, I) by a reshape, not a transpose (a port's slip): the scores differ."""
    monkeypatch.setattr(indexer, "DECODE_SCORES_MIN_KEYS", 16)
    q, k, w = _stage_inputs(np.random.default_rng(0), 1)

    class Ops:
        def __getattr__(self, name):
            return getattr(indexer.keras.ops, name)

        @staticmethod
        def transpose(x, axes=None):
            return tf.reshape(x, tuple(x.shape)[::-1])

    monkeypatch.setattr(indexer, "ops", Ops())
    got = np.asarray(indexer.scores(*(tf.constant(a) for a in (q, k, w)), 0.3, True, False))
    assert not np.allclose(got, ref.scores(q, k, w, 0.3, True, False), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_project_is_the_stage(dtype):
    """The 2-D product is F.project's contraction: float64 to round-off (rtol 1e-13, 2^-52 times the 6-term
    sums, with room); bfloat16 storage both rounded once from the same float32 sums, to one bfloat16 unit."""
    rng = np.random.default_rng(1)
    x, kernel = tf.cast(tf.constant(rng.standard_normal((2, 3, 6))), dtype), tf.cast(tf.constant(
        rng.standard_normal((6, 4, 5))), dtype)
    got, want = indexer.project(x, kernel, None), F.project(x, kernel, None)
    assert got.dtype == want.dtype and tuple(got.shape) == (2, 3, 20)
    rtol = 1e-13 if dtype == "float64" else 2.0 ** -7
    np.testing.assert_allclose(np.asarray(tf.cast(got, "float64")), np.asarray(tf.cast(want, "float64")), rtol=rtol,
                               atol=rtol)


def test_a_decode_step_over_many_keys_is_the_references(monkeypatch):
    """Decode steps (T 1) over caches of 40-42 keys, every fast path taken (thresholds lowered; the prelude a graph):
    the float64 reference's selection (random inputs: no ties) and its index scores to round-off."""
    for name, value in (("DECODE_SCORES_MIN_KEYS", 16), ("TOPK_FEW_MIN_KEYS", 16)):
        monkeypatch.setattr(indexer, name, value)
    config = _dsa(True, topk=5)
    t = init(config, seed=4, dtype="float64")
    x = _x(T=1)
    past = np.random.default_rng(2).standard_normal((2, 42, 8))
    for P in (40, 41, 42):  # a decode loop: the prelude's graph traced once (its shapes do not grow with P)
        want = ref.lightning_indexer(config, t, x, past_index_keys=past[:, :P], return_scores=True)
        got = indexer.lightning_indexer(config, t, x, past_index_keys=past[:, :P], return_scores=True)
        np.testing.assert_array_equal(np.asarray(got["topk_indices"]), want["topk_indices"])
        np.testing.assert_allclose(np.asarray(got["index_scores"]), want["index_scores"], rtol=1e-12, atol=1e-12)
    assert indexer._decode_prelude(config, "float64").experimental_get_tracing_count() == 1
    traced = tf.function(lambda x, past: indexer.lightning_indexer(config, t, x, past_index_keys=past)["topk_indices"],
                         autograph=False)  # traced: the decode scores, the sort (no flag read), the prelude inline
    np.testing.assert_array_equal(np.asarray(traced(tf.constant(x), tf.constant(past))), want["topk_indices"])


# -- the in-place index cache (lightning_indexer's cache_length) ----------------------------------------------------

MAKERS = {"dsa": lambda: _dsa(True), "m3": lambda: _m3(topk=2, block_size=2), "kpool": lambda: _kpool()}


def _decode_in_place(config, rows=9):
    """impl_numpy's 7-token prefill (float64, copying: the spec), then impl_tf's: a prefill of 4 tokens into a
    tf.Variable of `rows` rows filled with 7.0 (cache_length 0), then 3 one-token steps in place, each beside the
    copying call handed the last present_index_keys. Asserted as it runs: the variable handed back; the selection
    the copying call's and the prefill's for that query (float64 scores of random inputs: no ties to order
    differently); the variable's first P+S rows the copying call's present_index_keys to round-off (rtol 1e-13:
    the same float64 stages) and the prefill's; its rows past P+S still 7.0 (the write is the new rows alone).
    rows 7: the last step fills the buffer (its value read whole, no slice)."""
    t = init(config, seed=4, dtype="float64")
    x = _x()
    full = ref.lightning_indexer(config, t, x)
    buffer = tf.Variable(np.full((2, rows, config.indexer.cache_width), 7.0))
    copying, P = None, 0
    for S in (4, 1, 1, 1):
        step = x[:, P:P + S]
        placed = indexer.lightning_indexer(config, t, step, past_index_keys=buffer, cache_length=P)
        copying = indexer.lightning_indexer(config, t, step, past_index_keys=None if copying is None else
                                            copying["present_index_keys"])
        assert placed["present_index_keys"] is buffer, "the buffer was not handed back"
        got, want = np.asarray(placed["topk_indices"]), np.asarray(copying["topk_indices"])
        assert np.array_equal(got, want), (P, got, want)
        prefill = full["topk_indices"][..., P:P + S, :]
        assert np.array_equal(got, prefill[..., :got.shape[-1]]) and (prefill[..., got.shape[-1]:] == -1).all(), \
            (P, got, prefill)
        held = buffer.numpy()
        np.testing.assert_allclose(held[:, :P + S], np.asarray(copying["present_index_keys"]), rtol=1e-13, atol=0,
                                   err_msg=f"P={P}: the buffer's rows differ from the copying call's")
        np.testing.assert_allclose(held[:, :P + S], full["present_index_keys"][:, :P + S], rtol=1e-13, atol=0,
                                   err_msg=f"P={P}: the buffer's rows differ from the prefill's")
        assert (held[:, P + S:] == 7.0).all(), f"P={P}: rows past the cache were written"
        P += S
    return buffer.numpy(), full["present_index_keys"]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_decode_into_an_in_place_index_cache_matches_the_copying_call(name):
    held, prefill = _decode_in_place(MAKERS[name](), rows=9 if name != "dsa" else 7)  # each step checked as it ran
    np.testing.assert_allclose(held[:, :7], prefill, rtol=1e-13, atol=0)  # and the buffer at the end
    assert (held[:, 7:] == 7.0).all()


def test_an_index_cache_written_one_row_early_is_caught(monkeypatch):
    """The mutant: the new index keys written at P - 1 (an off-by-one a port makes) fail at the first decode step."""
    from impl_tf import tf_only

    real = tf_only.write_rows
    monkeypatch.setattr(tf_only, "write_rows", lambda buffer, value, start, axis: real(buffer, value, max(start - 1, 0),
                                                                                       axis))
    with pytest.raises(AssertionError, match="P=4"):
        _decode_in_place(MAKERS["dsa"]())


def test_in_place_index_cache_refusals():
    """cache_length's bad inputs (impl_numpy's, and TensorFlow's own: a buffer that is no tf.Variable of the
    storage dtype): one line naming cache_length and what was received; nothing written."""
    config = _dsa(True)
    t = init(config, seed=4, dtype="float64")
    x = _x(T=2)
    zeros = tf.Variable(np.zeros((2, 5, 8)))
    bad = [(dict(past_index_keys=None, cache_length=0), "cache_length needs past_index_keys"),
           (dict(past_index_keys=tf.Variable(np.zeros((2, 5, 8), np.float32)), cache_length=0),
            "storage dtype float64: got ResourceVariable float32"),
           (dict(past_index_keys=tf.constant(np.zeros((2, 5, 8))), cache_length=0), "got EagerTensor float64"),
           (dict(past_index_keys=zeros, cache_length=4), "cache_length must be an int in 0..C-S = 0..3"),
           (dict(past_index_keys=zeros, cache_length=-1), "got -1"),
           (dict(past_index_keys=zeros, cache_length=1.0), "got 1.0"),
           (dict(past_index_keys=tf.Variable(np.zeros((2, 5, 7))), cache_length=0), "(2, C, 8) with cache_length")]
    for kwargs, words in bad:
        with pytest.raises(ValueError, match="cache_length") as info:
            indexer.lightning_indexer(config, t, x, **kwargs)
        assert words in str(info.value) and "\n" not in str(info.value), (words, str(info.value))
    assert not zeros.numpy().any(), "a refused call wrote into the buffer"
