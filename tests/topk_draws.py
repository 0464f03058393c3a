"""Score rows for the top-k fast paths' tests (tests/test_torch_indexer_fast.py, tests/test_tf_indexer_fast.py):
rows full of ties, and rows with none, against which a few-of-many selection must equal the stable sort's."""

from __future__ import annotations

import numpy as np


def scores_with_ties(rng, shape, *, nan: bool = True) -> np.ndarray:
    """Scores on a grid of 8 values (ties everywhere, zeros the most), with -inf, +inf and (nan) NaN sprinkled
    in, and the last row mostly -inf (fewer visible keys than most widths)."""
    x = np.maximum(rng.integers(-4, 4, size=shape), 0).astype(np.float32) * 0.25
    x[rng.random(shape) < 0.1] = -np.inf
    x[rng.random(shape) < 0.01] = np.inf
    if nan:
        x[rng.random(shape) < 0.01] = np.nan
    x.reshape(-1, shape[-1])[-1, 5:] = -np.inf
    return x


def distinct_scores(rng, shape) -> np.ndarray:
    """Scores without a tie at any width (a permutation of distinct values), a tenth of them -inf."""
    x = rng.permuted(np.tile(np.arange(shape[-1], dtype=np.float32), (*shape[:-1], 1)), axis=-1)
    x[rng.random(shape) < 0.1] = -np.inf
    return x
