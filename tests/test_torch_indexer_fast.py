"""impl_torch's indexer fast paths (issue 39 item 5): the head-weighted scores in key blocks (_weighted_scores; one
query's with the keys as the rows, _decode_scores), the top-k of a few among many keys without sorting every score
(_select_few), the present index cache written into NumPy's memory (_join_cache), the in-place index cache
(cache_length). Each against impl_numpy's stage or call (the spec) on inputs built to hit what the path could
get wrong: ties by the hundred (ReLU zeros, scores on a coarse grid), -inf (masked), +inf (kept local blocks), NaN,
rows with fewer visible keys than k, several batch rows, groups and queries; the scores over several blocks, the
last a partial one. A block that reads the wrong keys, and an index cache written one row early, are planted and
fail."""

from __future__ import annotations

import numpy as np
import pytest
from test_indexer import _dsa, _kpool, _m3, _x
from topk_draws import distinct_scores, scores_with_ties

from impl_numpy import indexer as ref
from weights import init

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")  # the numpy env runs every file with no framework installed
from impl_torch import indexer  # noqa: E402


@pytest.mark.parametrize("scores", ["ties", "distinct"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1000), (2, 3, 4, 257)])
@pytest.mark.parametrize("width", [1, 7, 100])
def test_select_few_is_the_stable_sorts_selection(monkeypatch, scores, shape, width):
    """Ties straddling the width-th score (and NaN) go to _select_ties; distinct scores stay with topk's keys."""
    rng = np.random.default_rng(width)
    x = scores_with_ties(rng, shape) if scores == "ties" else distinct_scores(rng, shape)
    assert width * 2 < shape[-1]  # the few-of-many path is the one select_topk takes
    right, tied = indexer._select_ties, []
    monkeypatch.setattr(indexer, "_select_ties", lambda *a: tied.append(1) or right(*a))
    got = indexer.select_topk(torch.from_numpy(x), width).numpy()
    np.testing.assert_array_equal(got, ref.select_topk(x, width))
    if scores == "distinct" or width > 1:  # (width 1 over ties: the top score may stand alone)
        assert bool(tied) == (scores == "ties"), tied


def test_select_few_with_a_nan_among_the_chosen():
    """No tie, but a NaN, which topk ranks first and the stable sort last (a -1 at the end)."""
    x = distinct_scores(np.random.default_rng(3), (1, 1, 2, 300))
    x[0, 0, 1, 7] = np.nan
    np.testing.assert_array_equal(indexer.select_topk(torch.from_numpy(x), 20).numpy(), ref.select_topk(x, 20))


def _stage_inputs(rng, B=2, I=3, T=2, S=70, J=5):
    q = rng.standard_normal((B, I, T, J))
    k = rng.standard_normal((B, S, J))
    w = rng.standard_normal((B, T, I))
    return q, k, w


@pytest.mark.parametrize("T", [2, 1], ids=["queries", "decode"])
def test_weighted_scores_in_blocks_match_the_stage(monkeypatch, T):
    """float64 both sides: the same products and sums in another order, so equal to round-off (rtol 1e-12: 2^-52
    times the few terms of each sum, with room). One query (T 1) takes _decode_scores' keys-as-rows form."""
    monkeypatch.setattr(indexer, "SCORE_BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(indexer, "SCORE_BLOCK_MIN_KEYS", 16)  # 70 keys in five blocks, the last of 6
    q, k, w = _stage_inputs(np.random.default_rng(0), T=T)
    expected = ref.scores(q, k, w, 0.3, True, False)
    got = indexer.scores(*(torch.from_numpy(a) for a in (q, k, w)), 0.3, True, False).numpy()
    assert got.shape == expected.shape == (2, 1, T, 70)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [2, 1], ids=["queries", "decode"])
def test_a_block_reading_the_wrong_keys_is_caught(monkeypatch, T):
    monkeypatch.setattr(indexer, "SCORE_BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(indexer, "SCORE_BLOCK_MIN_KEYS", 16)
    q, k, w = _stage_inputs(np.random.default_rng(0), T=T)
    right_baddbmm = torch.baddbmm
    calls = []
    keys = torch.from_numpy(k)[:, :16]  # (B, 16, J): the first block's keys

    def first_block_only(c, a, b, **kw):  # every block's keys read from the first block's (its start dropped)
        if T == 1:  # the keys are the rows: (B, s, J) x (J, I)
            calls.append(a.shape)
            return right_baddbmm(c, keys[:, :a.shape[1]], b, **kw)
        calls.append(b.shape)  # the keys are the columns: (I T, J) x (J, s)
        return right_baddbmm(c, a, keys.transpose(1, 2)[..., :b.shape[-1]], **kw)

    monkeypatch.setattr(indexer.torch, "baddbmm", first_block_only)
    got = indexer.scores(*(torch.from_numpy(a) for a in (q, k, w)), 0.3, True, False).numpy()
    monkeypatch.undo()
    assert len(calls) == 5, calls
    assert not np.allclose(got, ref.scores(q, k, w, 0.3, True, False), rtol=1e-12, atol=1e-12)


def test_join_cache_is_the_concatenation(monkeypatch):
    monkeypatch.setattr(indexer, "HUGE_PAGE_MIN_BYTES", 1)
    rng = np.random.default_rng(1)
    past, new = (torch.from_numpy(rng.standard_normal((2, n, 3)).astype(np.float32)) for n in (5, 2))
    joined = indexer._join_cache(past, new)
    assert joined.data_ptr() not in (past.data_ptr(), new.data_ptr())
    assert torch.equal(joined, torch.cat([past, new], dim=1))  # a copy: the same values, bit for bit


# -- the in-place index cache (lightning_indexer's cache_length) ----------------------------------------------------

MAKERS = {"dsa": lambda: _dsa(True), "m3": lambda: _m3(topk=2, block_size=2), "kpool": lambda: _kpool()}


def _decode_in_place(config):
    """impl_numpy's 7-token prefill (float64, copying: the spec), then torch's: a prefill of 4 tokens into a buffer
    of 9 rows filled with 7.0 (cache_length 0), then 3 one-token steps in place, each beside the copying call handed
    the last present_index_keys. Every call's checks are asserted as it runs: the buffer handed back; the selection
    the copying call's and the prefill's for that query (float64 scores of random inputs: no ties to order
    differently); the buffer's first P+S rows the copying call's present_index_keys and the prefill's to round-off
    (rtol 1e-13: the same float64 stages, the key's LayerNorm summed in another order at most); its rows past P+S
    still 7.0 (the write is the new rows alone)."""
    from impl_torch.indexer import lightning_indexer

    t = init(config, seed=4, dtype="float64")
    x = _x()
    full = ref.lightning_indexer(config, t, x)
    tt = {n: torch.from_numpy(a) for n, a in t.items()}
    xt = torch.from_numpy(x)
    buffer = torch.full((2, 9, config.indexer.cache_width), 7.0, dtype=torch.float64)
    copying, P = None, 0
    with torch.no_grad():
        for S in (4, 1, 1, 1):
            step = xt[:, P:P + S]
            placed = lightning_indexer(config, tt, step, past_index_keys=buffer, cache_length=P)
            copying = lightning_indexer(config, tt, step, past_index_keys=None if copying is None else
                                        copying["present_index_keys"])
            assert placed["present_index_keys"] is buffer, "the buffer was not handed back"
            got, want = placed["topk_indices"].numpy(), copying["topk_indices"].numpy()
            assert np.array_equal(got, want), (P, got, want)
            prefill = full["topk_indices"][..., P:P + S, :]
            assert np.array_equal(got, prefill[..., :got.shape[-1]]) and (prefill[..., got.shape[-1]:] == -1).all(), \
                (P, got, prefill)
            held = buffer[:, :P + S].numpy()
            np.testing.assert_allclose(held, copying["present_index_keys"].numpy(), rtol=1e-13, atol=0,
                                       err_msg=f"P={P}: the buffer's rows differ from the copying call's")
            np.testing.assert_allclose(held, full["present_index_keys"][:, :P + S], rtol=1e-13, atol=0,
                                       err_msg=f"P={P}: the buffer's rows differ from the prefill's")
            assert (buffer[:, P + S:] == 7.0).all(), f"P={P}: rows past the cache were written"
            P += S
    return buffer.numpy(), full["present_index_keys"]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_decode_into_an_in_place_index_cache_matches_the_copying_call(name):
    held, prefill = _decode_in_place(MAKERS[name]())  # every step checked as it ran; the buffer at the end too
    np.testing.assert_allclose(held[:, :7], prefill, rtol=1e-13, atol=0)
    assert (held[:, 7:] == 7.0).all()


def test_an_index_cache_written_one_row_early_is_caught(monkeypatch):
    """The mutant: the new index keys written at P - 1 (an off-by-one a port makes) fail at the first decode step."""
    real = indexer._write_rows
    monkeypatch.setattr(indexer, "_write_rows", lambda buffer, rows, start: real(buffer, rows, max(start - 1, 0)))
    with pytest.raises(AssertionError, match="P=4"):
        _decode_in_place(MAKERS["dsa"]())


def test_in_place_index_cache_refusals():
    """cache_length's bad inputs (impl_numpy's, and torch's own: a buffer that is no tensor of the storage dtype, or
    that autograd would record): one line naming cache_length and what was received."""
    from impl_torch.indexer import lightning_indexer

    config = _dsa(True)
    t = {n: torch.from_numpy(a) for n, a in init(config, seed=4, dtype="float64").items()}
    x = torch.from_numpy(_x(T=2))
    zeros = torch.zeros((2, 5, 8), dtype=torch.float64)
    bad = [(dict(past_index_keys=None, cache_length=0), "cache_length needs past_index_keys"),
           (dict(past_index_keys=zeros.float(), cache_length=0), "storage dtype float64 on cpu: got dtype float32"),
           (dict(past_index_keys=zeros.numpy(), cache_length=0), "got a ndarray"),
           (dict(past_index_keys=zeros, cache_length=4), "cache_length must be an int in 0..C-S = 0..3"),
           (dict(past_index_keys=zeros, cache_length=-1), "got -1"),
           (dict(past_index_keys=zeros, cache_length=1.0), "got 1.0"),
           (dict(past_index_keys=zeros.clone().requires_grad_(), cache_length=0), "got past_index_keys requiring grad")]
    for kwargs, words in bad:
        with pytest.raises(ValueError, match="cache_length") as info:
            lightning_indexer(config, t, x, **kwargs)
        assert words in str(info.value) and "\n" not in str(info.value), (words, str(info.value))
