"""The block-wise path of DeepSeek V4's layer in JAX (impl_jax.compressed, chunk_size=: attend_blockwise) against
the float64 NumPy stages (impl_numpy.compressed without chunk_size, never the path under test): a prefill long
enough that whole key and entry blocks are skipped, a decode through the returned cache and through the in-place
buffers (donated under jax.jit), batch 2, float64 and float32; what a jitted program traces against an eager run
(csa's unselected entry blocks masked, not skipped, under jit); its refusals; a porting bug caught. Marked `jax`
and slow as tests/test_compressed_v4_jax.py (JAX compiles a program per call shape; the jax env has no room left
in tox's budget): `tox -e full` runs them. Timings in docs/spec-frontier.md ("The block-wise path")."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from test_compressed_v4 import KINDS, _layer, _x

from impl_numpy.compressed import cache_buffers
from impl_numpy.compressed import compressed_attention as reference

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import impl_jax.adapter  # noqa: E402, F401  (switches x64 on)
import impl_jax.compressed as compressed  # noqa: E402
from impl_jax import functional as F  # noqa: E402
from impl_jax.compressed import compressed_attention  # noqa: E402

pytestmark = [pytest.mark.jax, pytest.mark.slow]

L = 100  # 25 csa windows of 4 (its top-k keeps 2 of up to 25 entries), 12 hca windows of 8; the window is 6 keys
# As tests/test_compressed_v4_blockwise_torch.py: float64, the same sums in other orders (block by block, rescaled
# by the running max), a few ulps of the output's size; float32 against the float64 stages, every stage rounded to
# float32, 256 float32 ulps of the output's size (csa's selection the same: no near-tie at its top-k boundary).
BOUND = {"float64": 1e-12, "float32": 256 * float(np.finfo(np.float32).eps)}
CUTS = [0, 37, 38, 39, 40, 63, L]  # a prefill, then calls of 1, 1, 1, 23 and 37 tokens across window boundaries


def _error(got, want):
    return np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()


@pytest.mark.parametrize("kind,dtype", [(kind, "float64") for kind in KINDS] + [("csa", "float32")],
                         ids=[*KINDS, "csa-float32"])
def test_jax_blockwise_path_gives_the_reference_stages_prefill_and_decode(kind, dtype):
    """Jitted (jit={}): a prefill in blocks of 8, then CUTS' calls in blocks of 4 through the copying cache and
    through the in-place buffers (donated). The eager path is the same function op by op (the next test runs it)."""
    config, t = _layer(kind)
    x = _x(length=L)
    want = reference(config, t, x, np.arange(L))  # the float64 NumPy stages
    xj = jnp.asarray(x, dtype)
    got = compressed_attention(config, t, xj, np.arange(L), chunk_size=8, jit={})
    assert got.dtype == jnp.dtype(dtype) and _error(got, want) <= BOUND[dtype], _error(got, want)
    buffers = {n: jnp.asarray(a, dtype) for n, a in cache_buffers(config, 2, L).items()}
    past, copied, in_place = None, [], []
    for a, b in zip(CUTS, CUTS[1:]):
        out, past = compressed_attention(config, t, xj[:, a:b], np.arange(a, b), past, return_cache=True,
                                         chunk_size=4, jit={})
        copied.append(out)
        out, buffers = compressed_attention(config, t, xj[:, a:b], np.arange(a, b), buffers, in_place=True,
                                            return_cache=True, chunk_size=4, jit={})
        in_place.append(out)
    assert _error(jnp.concatenate(copied, axis=1), want) <= BOUND[dtype]
    assert _error(jnp.concatenate(in_place, axis=1), want) <= BOUND[dtype]


def _count_logits(monkeypatch):
    computed = []
    logits = F.logits
    monkeypatch.setattr(F, "logits", lambda q, k, scale, *a: computed.append(q.shape[2] * k.shape[2])
                        or logits(q, k, scale, *a))
    return computed


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_jax_skips_by_positions_when_traced_and_masks_csa_selection(kind, monkeypatch):
    """chunk_size=1 over 24 tokens: eagerly, the logits computed are exactly each query's window keys and its
    visible (hca) or selected (csa) entries, as NumPy's path; traced for jax.jit (jax.eval_shape: the program
    jax.jit would compile, not compiled), the window's and hca's skips (static positions) are the same, and csa's
    skip of unselected entry blocks (the selection's values, a tracer) is not made: every visible entry block is
    computed and masked, (t + 1) // m per query. The eager result is the stages' (BOUND)."""
    n = 24
    config, t = _layer(kind)
    x = _x(length=n)
    want, selection = reference(config, t, x, np.arange(n), return_selection=True)
    W, m, pos = config.window_left + 1, config.compressed.ratio, np.arange(n)
    window, visible = np.minimum(W, pos + 1).sum(), ((pos + 1) // m).sum()
    picked = sum(len(set(selection[:, i][selection[:, i] >= 0].tolist())) for i in range(n)) if kind == "csa" else 0
    eager = _count_logits(monkeypatch)
    got = compressed_attention(config, t, jnp.asarray(x), np.arange(n), chunk_size=1)
    assert _error(got, want) <= BOUND["float64"]
    assert sum(eager) == window + (visible if kind == "hca" else picked), sum(eager)
    traced = _count_logits(monkeypatch)
    p = {name: jnp.asarray(a) for name, a in t.items()}
    jax.eval_shape(functools.partial(compressed.layer, config, p0=0, return_cache=False, return_selection=False,
                                     chunk_size=1), p, jnp.asarray(x), None)
    assert sum(traced) == window + visible, sum(traced)
    if kind == "csa":
        assert picked < visible  # the masked blocks are real work the jitted program does


def test_jax_blockwise_path_refuses_a_trace_and_a_bad_chunk_size():
    config, t = _layer("hca")
    x = jnp.asarray(_x(length=8))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer: got 0"):
        compressed_attention(config, t, x, np.arange(8), chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        compressed_attention(config, t, x, np.arange(8), chunk_size=4, trace=[])


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_jax_blockwise_sink_left_out_of_the_running_sum_fails(kind, monkeypatch):
    """A porting bug of a block-wise path: the running sum started at 0, not at the sink (attend_blockwise given
    no sinks), jitted: it must fail the stages' bound."""
    config, t = _layer(kind)
    x = _x(length=L)
    want = reference(config, t, x, np.arange(L))
    original = compressed.attend_blockwise
    monkeypatch.setattr(compressed, "attend_blockwise", lambda *a: original(*a[:7], None, a[8]))
    got = compressed_attention(config, t, jnp.asarray(x), np.arange(L), chunk_size=8, jit={})
    assert _error(got, want) > 1e3 * BOUND["float64"]
