"""The block-wise path of DeepSeek V4's layer in MLX (impl_mlx.compressed, chunk_size=: attend_blockwise) against
the float64 NumPy stages (impl_numpy.compressed without chunk_size, never the path under test): prefills long
enough that whole key and entry blocks are skipped, a decode through the returned cache and through the in-place
buffers, batch 2, float64 (MLX's CPU device) and float32; with blocks of one key, exactly the keys and entries each
query sees; its gradient; its refusals; and three porting bugs of a block-wise path caught (the shared
schedule's in tests/test_compressed_v4_schedule.py). Marked `mlx`; timing in
docs/spec-frontier.md ("The block-wise path")."""

from __future__ import annotations

import numpy as np
import pytest
from test_compressed_v4 import KINDS, _layer, _x
from test_compressed_v4_blockwise import BLOCK_BUGS as NUMPY_BLOCK_BUGS

from impl_numpy.compressed import cache_buffers
from impl_numpy.compressed import compressed_attention as reference

mx = pytest.importorskip("mlx.core")
import impl_mlx.compressed as compressed  # noqa: E402
from impl_mlx import functional as F  # noqa: E402
from impl_mlx.compressed import compressed_attention  # noqa: E402

pytestmark = pytest.mark.mlx

L = 100  # 25 csa windows of 4 (its top-k keeps 2 of up to 25 entries), 12 hca windows of 8; the window is 6 keys
# float64: the same sums in other orders (block by block, rescaled by the running max; MLX's float64 exp through
# functional.exp is float64-accurate), a few ulps of the output's size (tests/test_compressed_v4_blockwise.py's bound
# for NumPy's path). float32 against the float64 stages: every stage rounded to float32, 256 float32 ulps of the
# output's size (tests/test_compressed_v4_mlx.py's bound; csa's selection is the float64 one: its smallest gap at the
# top-k boundary is far above float32's round-off there).
BOUND = {"float64": 1e-12, "float32": 256 * float(np.finfo(np.float32).eps)}
DTYPES = {"float64": mx.float64, "float32": mx.float32}
CUTS = [0, 37, 38, 39, 40, 63, L]  # a prefill, then calls of 1, 1, 1, 23 and 37 tokens across window boundaries


def _error(got, want):
    return np.abs(np.array(got.astype(mx.float64)) - want).max() / np.abs(want).max()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", list(BOUND))
def test_mlx_blockwise_path_gives_the_reference_stages_prefill_and_decode(kind, dtype):
    """A prefill in blocks of 8 (query blocks of 8 rows: most of the window's key blocks and the entry blocks past
    a block's last visible entry skipped), then CUTS' calls in blocks of 4 through the copying cache and through
    the in-place buffers (there a key block straddles the ring's part and the call's)."""
    config, t = _layer(kind)
    x = _x(length=L)
    want = reference(config, t, x, np.arange(L))  # the float64 NumPy stages
    xm = mx.array(x, dtype=DTYPES[dtype])
    got = compressed_attention(config, t, xm, np.arange(L), chunk_size=8)
    assert got.dtype == DTYPES[dtype] and _error(got, want) <= BOUND[dtype], _error(got, want)
    buffers = {n: mx.array(a, dtype=DTYPES[dtype]) for n, a in cache_buffers(config, 2, L).items()}
    past, copied, in_place = None, [], []
    for a, b in zip(CUTS, CUTS[1:]):
        out, past = compressed_attention(config, t, xm[:, a:b], np.arange(a, b), past, return_cache=True,
                                         chunk_size=4)
        copied.append(out)
        in_place.append(compressed_attention(config, t, xm[:, a:b], np.arange(a, b), buffers, in_place=True,
                                             chunk_size=4))
    assert _error(mx.concatenate(copied, axis=1), want) <= BOUND[dtype]
    assert _error(mx.concatenate(in_place, axis=1), want) <= BOUND[dtype]


@pytest.mark.parametrize("kind", list(KINDS))
def test_mlx_blocks_of_one_key_compute_exactly_what_each_query_sees(kind, monkeypatch):
    """chunk_size=1 over 40 tokens: the logits computed are the query's window keys (min(W, t + 1)) and its
    entries (hca: the (t + 1) // m visible; csa: the ones a batch row's top-k selected), each once: every other key
    and entry is skipped, not computed and masked. Counted from functional.logits' calls; the selection is
    NumPy's."""
    n = 40
    config, t = _layer(kind)
    x = _x(length=n)
    _, selection = reference(config, t, x, np.arange(n), return_selection=True) if kind == "csa" else (None, None)
    computed = []
    logits = F.logits
    monkeypatch.setattr(F, "logits", lambda q, k, scale: computed.append(q.shape[2] * k.shape[2]) or logits(q, k, scale))
    compressed_attention(config, t, mx.array(x, dtype=mx.float64), np.arange(n), chunk_size=1)
    W, pos = config.window_left + 1, np.arange(n)
    seen = np.minimum(W, pos + 1).sum()
    if kind == "hca":
        seen += ((pos + 1) // config.compressed.ratio).sum()
    if kind == "csa":  # a block is skipped only if neither batch row selected it
        seen += sum(len(set(selection[:, i][selection[:, i] >= 0].tolist())) for i in range(n))
    assert sum(computed) == seen, (sum(computed), seen)


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_mlx_blockwise_path_is_differentiable_as_the_stages(kind):
    """mx.vjp through the online softmax (functional.where keeps a hidden logit's gradient 0, the running max a
    constant): the gradients of x and of every tensor of a fixed projection of the output, block-wise against the
    stages of the same MLX module in float64 (the same function; the stages' gradients are judged against NumPy's
    VJP by `mha check`'s mlx column, tests/test_compressed_v4_mlx.py). 1e-10 of each gradient's size: float64 sums
    in other orders, through a backward pass. The sinks' gradient is among them (its term of the running sum)."""
    config, t = _layer(kind)
    x = mx.array(_x(length=40), dtype=mx.float64)
    probe = mx.array(np.random.default_rng(3).standard_normal((2, 40, config.out_dim)), dtype=mx.float64)
    names = list(t)
    grads = []
    for chunk_size in (None, 4):
        def f(x, *tensors, chunk_size=chunk_size):
            out = compressed_attention(config, dict(zip(names, tensors)), x, np.arange(40), chunk_size=chunk_size)
            return [out]

        _, found = mx.vjp(f, [x, *(mx.array(t[n], dtype=mx.float64) for n in names)], [probe])
        grads.append([np.array(g) for g in found])
    nonzero = set()
    for name, g, want in zip(["x", *names], grads[1], grads[0]):
        size = np.abs(want).max()
        assert np.isfinite(g).all(), name
        assert np.abs(g - want).max() <= 1e-10 * size, (name, np.abs(g - want).max(), size)
        nonzero |= {name} if size > 0 else set()
    # every gradient but the indexer's (read only by the top-k, which passes none) is judged, the sinks' included
    assert nonzero == {"x", *(n for n in names if not n.startswith("indexer."))}, sorted(nonzero)


def test_mlx_blockwise_path_refuses_a_trace_and_a_bad_chunk_size():
    config, t = _layer("hca")
    x = mx.array(_x(length=8), dtype=mx.float64)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer: got 0"):
        compressed_attention(config, t, x, np.arange(8), chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        compressed_attention(config, t, x, np.arange(8), chunk_size=4, trace=[])


# Porting bugs of a block-wise path: NumPy's three, planted in attend_blockwise's arguments: each must fail the
# stages' bound (the schedule's own bugs, planted once in the shared impl_numpy.compressed.blockwise_schedule, fail
# every mirror: tests/test_compressed_v4_schedule.py).
BLOCK_BUGS = NUMPY_BLOCK_BUGS


@pytest.mark.parametrize("bug", list(BLOCK_BUGS))
def test_each_mlx_blockwise_bug_fails_against_the_stages(bug, monkeypatch):
    kind, plant = BLOCK_BUGS[bug]
    config, t = _layer(kind)
    x = _x(length=L)
    want = reference(config, t, x, np.arange(L))
    original = compressed.attend_blockwise
    names = ["config", "q", "window_keys", "key_pos", "positions", "entries", "selection", "sinks", "chunk_size"]
    monkeypatch.setattr(compressed, "attend_blockwise", lambda *args: original(**plant(dict(zip(names, args)))))
    got = compressed_attention(config, t, mx.array(x, dtype=mx.float64), np.arange(L), chunk_size=8)
    assert _error(got, want) > 1e3 * BOUND["float64"], bug
