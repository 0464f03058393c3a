"""impl_torch's indexer fast paths (issue 39 item 5): the head-weighted scores in key blocks (_weighted_scores), the
top-k of a few among many keys without sorting every score (_select_few), the present index cache written into
NumPy's memory (_join_cache). Each against impl_numpy's stage (the spec) on inputs built to hit what the path could
get wrong: ties by the hundred (ReLU zeros, scores on a coarse grid), -inf (masked), +inf (kept local blocks), NaN,
rows with fewer visible keys than k, several batch rows, groups and queries; the scores over several blocks, the
last a partial one. A block that reads the wrong keys is planted and fails."""

from __future__ import annotations

import numpy as np
import pytest

from impl_numpy import indexer as ref

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")  # the numpy env runs every file with no framework installed
from impl_torch import indexer  # noqa: E402


def _scores_with_ties(rng, shape):
    """Scores on a grid of 8 values (ties everywhere, zeros the most), with -inf, +inf and NaN sprinkled in, and
    the last row mostly -inf (fewer visible keys than most widths)."""
    x = np.maximum(rng.integers(-4, 4, size=shape), 0).astype(np.float32) * 0.25
    x[rng.random(shape) < 0.1] = -np.inf
    x[rng.random(shape) < 0.01] = np.inf
    x[rng.random(shape) < 0.01] = np.nan
    x.reshape(-1, shape[-1])[-1, 5:] = -np.inf
    return x


def _distinct_scores(rng, shape):
    """Scores without a tie at any width (a permutation of distinct values), a tenth of them -inf."""
    x = rng.permuted(np.tile(np.arange(shape[-1], dtype=np.float32), (*shape[:-1], 1)), axis=-1)
    x[rng.random(shape) < 0.1] = -np.inf
    return x


@pytest.mark.parametrize("scores", ["ties", "distinct"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1000), (2, 3, 4, 257)])
@pytest.mark.parametrize("width", [1, 7, 100])
def test_select_few_is_the_stable_sorts_selection(monkeypatch, scores, shape, width):
    """Ties straddling the width-th score (and NaN) go to _select_ties; distinct scores stay with topk's keys."""
    rng = np.random.default_rng(width)
    x = _scores_with_ties(rng, shape) if scores == "ties" else _distinct_scores(rng, shape)
    assert width * 2 < shape[-1]  # the few-of-many path is the one select_topk takes
    right, tied = indexer._select_ties, []
    monkeypatch.setattr(indexer, "_select_ties", lambda *a: tied.append(1) or right(*a))
    got = indexer.select_topk(torch.from_numpy(x), width).numpy()
    np.testing.assert_array_equal(got, ref.select_topk(x, width))
    if scores == "distinct" or width > 1:  # (width 1 over ties: the top score may stand alone)
        assert bool(tied) == (scores == "ties"), tied


def test_select_few_with_a_nan_among_the_chosen():
    """No tie, but a NaN, which topk ranks first and the stable sort last (a -1 at the end)."""
    x = _distinct_scores(np.random.default_rng(3), (1, 1, 2, 300))
    x[0, 0, 1, 7] = np.nan
    np.testing.assert_array_equal(indexer.select_topk(torch.from_numpy(x), 20).numpy(), ref.select_topk(x, 20))


def _stage_inputs(rng, B=2, I=3, T=2, S=70, J=5):
    q = rng.standard_normal((B, I, T, J))
    k = rng.standard_normal((B, S, J))
    w = rng.standard_normal((B, T, I))
    return q, k, w


def test_weighted_scores_in_blocks_match_the_stage(monkeypatch):
    """float64 both sides: the same products and sums in another order, so equal to round-off (rtol 1e-12: 2^-52
    times the few terms of each sum, with room)."""
    monkeypatch.setattr(indexer, "SCORE_BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(indexer, "SCORE_BLOCK_MIN_KEYS", 16)  # 70 keys in five blocks, the last of 6
    q, k, w = _stage_inputs(np.random.default_rng(0))
    expected = ref.scores(q, k, w, 0.3, True, False)
    got = indexer.scores(*(torch.from_numpy(a) for a in (q, k, w)), 0.3, True, False).numpy()
    assert got.shape == expected.shape == (2, 1, 2, 70)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_a_block_reading_the_wrong_keys_is_caught(monkeypatch):
    monkeypatch.setattr(indexer, "SCORE_BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(indexer, "SCORE_BLOCK_MIN_KEYS", 16)
    q, k, w = _stage_inputs(np.random.default_rng(0))
    right_baddbmm = torch.baddbmm
    calls = []

    def first_block_only(c, a, b, **kw):  # every block's keys read from the first block's (its start dropped)
        calls.append(b.shape)
        return right_baddbmm(c, a, kt[..., :b.shape[-1]], **kw)

    kt = torch.from_numpy(k)[:, :16].transpose(1, 2)
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
