"""The block-wise path of DeepSeek V4's layer in NumPy (impl_numpy.compressed, chunk_size=: attend_blockwise) against
the float64 stages of the same module: prefills long enough that whole key and entry blocks are skipped, a decode
through the returned cache and through the in-place buffers, float64 and float32; what it computes (with blocks of
one key, exactly the keys and entries each query sees); its refusals; and three porting bugs of a block-wise path
caught. Marked `reference` (the numpy env), about 1.1 s in all (2-core AMD EPYC VM, 2026-11-29)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_compressed_v4 import KINDS, _layer, _x

import impl_numpy.compressed as compressed
from impl_numpy import functional as F
from impl_numpy.compressed import cache_buffers, compressed_attention

pytestmark = pytest.mark.reference

L = 100  # 25 csa windows of 4 (its top-k keeps 2 of up to 25 entries), 12 hca windows of 8; the window is 6 keys
# float64: the same sums in other orders (block by block, rescaled by the running max), a few ulps of the
# output's size, as the hand port's bound (tests/test_compressed_v4.py). float32 against the float64 stages: every
# stage rounded to float32, 256 float32 ulps of the output's size (tests/test_compressed_v4_tf.py's bound; the
# csa selection is the float64 one: its indexer is the stages' own code, run before the attention).
BOUND = {"float64": 1e-12, "float32": 256 * float(np.finfo(np.float32).eps)}
CUTS = [0, 37, 38, 39, 40, 63, L]  # a prefill, then calls of 1, 1, 1, 23 and 37 tokens across window boundaries


def _error(got, want):
    return np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", list(BOUND))
def test_the_blockwise_path_gives_the_stages_prefill_and_decode(kind, dtype):
    config, t = _layer(kind)
    x = _x(length=L)
    want = compressed_attention(config, t, x, np.arange(L))  # the float64 stages
    tl, xl = {n: a.astype(dtype) for n, a in t.items()}, x.astype(dtype)
    for chunk_size in (3, 8, 64):  # 64: one block of window keys, one of entries, per query block
        got = compressed_attention(config, tl, xl, np.arange(L), chunk_size=chunk_size)
        assert got.dtype == np.dtype(dtype) and _error(got, want) <= BOUND[dtype], (chunk_size, _error(got, want))
    past, buffers, copied, in_place = None, cache_buffers(config, 2, L, dtype), [], []
    for a, b in zip(CUTS, CUTS[1:]):
        out, past = compressed_attention(config, tl, xl[:, a:b], np.arange(a, b), past, return_cache=True,
                                         chunk_size=4)
        copied.append(out)
        in_place.append(compressed_attention(config, tl, xl[:, a:b], np.arange(a, b), buffers, in_place=True,
                                             chunk_size=4))
    assert _error(np.concatenate(copied, axis=1), want) <= BOUND[dtype]
    assert _error(np.concatenate(in_place, axis=1), want) <= BOUND[dtype]


@pytest.mark.parametrize("kind", list(KINDS))
def test_blocks_of_one_key_compute_exactly_what_each_query_sees(kind, monkeypatch):
    """chunk_size=1 (query blocks of one row, key blocks of one key): the logits computed are the query's window
    keys (min(W, t + 1)) and its entries (hca: the (t + 1) // m visible; csa: the ones its top-k selected), each
    once: every other key and entry is skipped, not computed and masked. Counted from functional.logits' calls."""
    config, t = _layer(kind)
    x = _x(length=L)
    _, selection = compressed_attention(config, t, x, np.arange(L), return_selection=True)
    computed = []
    logits = F.logits
    monkeypatch.setattr(F, "logits", lambda q, k, scale: computed.append(q.shape[2] * k.shape[2]) or logits(q, k, scale))
    compressed_attention(config, t, x, np.arange(L), chunk_size=1)
    W, pos = config.window_left + 1, np.arange(L)
    seen = np.minimum(W, pos + 1).sum()
    if kind == "hca":
        seen += ((pos + 1) // config.compressed.ratio).sum()
    if kind == "csa":  # one selection for the batch's two rows would differ: a block is skipped only if neither took it
        seen += sum(len(set(selection[:, i][selection[:, i] >= 0].tolist())) for i in range(L))
    assert sum(computed) == seen, (sum(computed), seen)
    assert seen < L * (L + L // 4) / 8  # against the stages' (T, W - 1 + T + E) logits


def test_the_blockwise_path_refuses_a_trace_and_a_bad_chunk_size():
    config, t = _layer("hca")
    x = _x(length=8)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer: got 0"):
        compressed_attention(config, t, x, np.arange(8), chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        compressed_attention(config, t, x, np.arange(8), chunk_size=4, trace=[])


# Porting bugs of a block-wise path, planted in attend_blockwise's arguments: each must fail the stages' bound.
BLOCK_BUGS = {
    "sink_not_in_running_sum": ("hca", lambda a: {**a, "sinks": None}),  # the running sum starts at 0, not the sink
    "selection_ignored_in_blocks": ("csa", lambda a: {**a, "selection": None}),  # every visible entry block attended
    "window_block_one_key_wide": ("sliding", lambda a: {**a, "config": dataclasses.replace(
        a["config"], window_left=a["config"].window_left + 1)}),  # the window's block test one key too wide
}


@pytest.mark.parametrize("bug", list(BLOCK_BUGS))
def test_each_blockwise_bug_fails_against_the_stages(bug, monkeypatch):
    kind, plant = BLOCK_BUGS[bug]
    config, t = _layer(kind)
    x = _x(length=L)
    want = compressed_attention(config, t, x, np.arange(L))
    original = compressed.attend_blockwise
    names = ["config", "q", "window_keys", "key_pos", "positions", "entries", "selection", "sinks", "chunk_size"]
    monkeypatch.setattr(compressed, "attend_blockwise", lambda *args: original(**plant(dict(zip(names, args)))))
    got = compressed_attention(config, t, x, np.arange(L), chunk_size=8)
    assert _error(got, want) > 1e3 * BOUND["float64"], bug
