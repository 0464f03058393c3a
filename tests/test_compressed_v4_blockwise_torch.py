"""The block-wise path of DeepSeek V4's layer in PyTorch (impl_torch.compressed, chunk_size=: attend_blockwise)
against the float64 NumPy stages (impl_numpy.compressed without chunk_size, never the path under test): prefills
long enough that whole key and entry blocks are skipped, a decode through the returned cache and through the
in-place buffers, batch 2, float64 and float32; with blocks of one key, exactly the keys and entries each query
sees; its refusals; and two porting bugs of a block-wise path caught. Marked `torch`; timing in the docstring of
each heavier test and in docs/spec-frontier.md ("The block-wise path")."""

from __future__ import annotations

import numpy as np
import pytest
from test_compressed_v4 import KINDS, _layer, _x
from test_compressed_v4_blockwise import BLOCK_BUGS as NUMPY_BLOCK_BUGS

from impl_numpy.compressed import cache_buffers
from impl_numpy.compressed import compressed_attention as reference

torch = pytest.importorskip("torch")
import impl_torch.compressed as compressed  # noqa: E402
from impl_torch import functional as F  # noqa: E402
from impl_torch.compressed import compressed_attention  # noqa: E402

pytestmark = pytest.mark.torch

L = 100  # 25 csa windows of 4 (its top-k keeps 2 of up to 25 entries), 12 hca windows of 8; the window is 6 keys
# float64: the same sums in other orders (block by block, rescaled by the running max), a few ulps of the output's
# size (tests/test_compressed_v4_blockwise.py's bound for NumPy's path). float32 against the float64 stages: every
# stage rounded to float32, 256 float32 ulps of the output's size (tests/test_compressed_v4_torch.py's bound; csa's
# selection is the float64 one: its smallest gap at the top-k boundary is far above float32's round-off there).
BOUND = {torch.float64: 1e-12, torch.float32: 256 * float(np.finfo(np.float32).eps)}
CUTS = [0, 37, 38, 39, 40, 63, L]  # a prefill, then calls of 1, 1, 1, 23 and 37 tokens across window boundaries


def _error(got, want):
    return np.abs(got.detach().double().numpy() - want).max() / np.abs(want).max()


@pytest.mark.parametrize("kind,dtype", [(kind, torch.float64) for kind in KINDS] + [("csa", torch.float32)],
                         ids=[*KINDS, "csa-float32"])
def test_torch_blockwise_path_gives_the_reference_stages_prefill_and_decode(kind, dtype):
    """A prefill in blocks of 8 (query blocks of 8 rows: most of the window's key blocks and the entry blocks past
    a block's last visible entry skipped), then CUTS' calls in blocks of 4 through the copying cache and through
    the in-place buffers (there a key block straddles the ring's part and the call's). float32 on csa alone: the
    path is dtype-blind, and a torch test's many small ops are slow on a loaded 2-core VM (tox's two workers)."""
    config, t = _layer(kind)
    x = _x(length=L)
    want = reference(config, t, x, np.arange(L))  # the float64 NumPy stages
    xt = torch.as_tensor(x, dtype=dtype)
    got = compressed_attention(config, t, xt, np.arange(L), chunk_size=8)
    assert got.dtype == dtype and _error(got, want) <= BOUND[dtype], _error(got, want)
    buffers = {n: torch.from_numpy(a).to(dtype) for n, a in cache_buffers(config, 2, L).items()}
    past, copied, in_place = None, [], []
    with torch.no_grad():
        for a, b in zip(CUTS, CUTS[1:]):
            out, past = compressed_attention(config, t, xt[:, a:b], np.arange(a, b), past, return_cache=True,
                                             chunk_size=4)
            copied.append(out)
            in_place.append(compressed_attention(config, t, xt[:, a:b], np.arange(a, b), buffers, in_place=True,
                                                 chunk_size=4))
    assert _error(torch.cat(copied, dim=1), want) <= BOUND[dtype]
    assert _error(torch.cat(in_place, dim=1), want) <= BOUND[dtype]


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_torch_blocks_of_one_key_compute_exactly_what_each_query_sees(kind, monkeypatch):
    """chunk_size=1 over 40 tokens: the logits computed are the query's window keys (min(W, t + 1)) and its entries (hca: the
    (t + 1) // m visible; csa: the ones a batch row's top-k selected), each once: every other key and entry is
    skipped, not computed and masked. Counted from functional.logits' calls; the selection is NumPy's."""
    n = 40
    config, t = _layer(kind)
    x = _x(length=n)
    _, selection = reference(config, t, x, np.arange(n), return_selection=True)
    computed = []
    logits = F.logits
    monkeypatch.setattr(F, "logits", lambda q, k, scale: computed.append(q.shape[2] * k.shape[2]) or logits(q, k, scale))
    compressed_attention(config, t, torch.as_tensor(x), np.arange(n), chunk_size=1)
    W, pos = config.window_left + 1, np.arange(n)
    seen = np.minimum(W, pos + 1).sum()
    if kind == "hca":
        seen += ((pos + 1) // config.compressed.ratio).sum()
    if kind == "csa":  # a block is skipped only if neither batch row selected it
        seen += sum(len(set(selection[:, i][selection[:, i] >= 0].tolist())) for i in range(n))
    assert sum(computed) == seen, (sum(computed), seen)


def test_torch_blockwise_path_is_differentiable_as_the_stages():
    """Autograd through the online softmax (torch.where keeps a hidden logit's gradient 0): x's gradient of a fixed
    projection of the output, block-wise against the stages of the same torch module in float64 (both are the same
    function; the stages' gradient is checked against NumPy's VJP by tests/test_compressed_v4_torch.py). 1e-10
    relative: float64 sums in other orders, through a backward pass."""
    config, t = _layer("csa")
    x = _x(length=40)
    probe = torch.as_tensor(np.random.default_rng(3).standard_normal((2, 40, config.out_dim)))
    grads = []
    for chunk_size in (None, 4):
        xt = torch.as_tensor(x).requires_grad_()
        (compressed_attention(config, t, xt, np.arange(40), chunk_size=chunk_size) * probe).sum().backward()
        grads.append(xt.grad.numpy())
    assert np.isfinite(grads[1]).all()
    assert np.abs(grads[1] - grads[0]).max() <= 1e-10 * np.abs(grads[0]).max()


def test_torch_blockwise_path_refuses_a_trace_and_a_bad_chunk_size():
    config, t = _layer("hca")
    x = torch.as_tensor(_x(length=8))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer: got 0"):
        compressed_attention(config, t, x, np.arange(8), chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        compressed_attention(config, t, x, np.arange(8), chunk_size=4, trace=[])


# Porting bugs of a block-wise path, planted in attend_blockwise's arguments (NumPy's test's, those that plant in
# the arguments torch's path takes alike): each must fail the stages' bound.
BLOCK_BUGS = {name: NUMPY_BLOCK_BUGS[name] for name in ("sink_not_in_running_sum", "selection_ignored_in_blocks")}


@pytest.mark.parametrize("bug", list(BLOCK_BUGS))
def test_each_torch_blockwise_bug_fails_against_the_stages(bug, monkeypatch):
    kind, plant = BLOCK_BUGS[bug]
    config, t = _layer(kind)
    x = _x(length=L)
    want = reference(config, t, x, np.arange(L))
    original = compressed.attend_blockwise
    names = ["config", "q", "window_keys", "key_pos", "positions", "entries", "selection", "sinks", "chunk_size"]
    monkeypatch.setattr(compressed, "attend_blockwise", lambda *args: original(**plant(dict(zip(names, args)))))
    got = compressed_attention(config, t, torch.as_tensor(x), np.arange(L), chunk_size=8)
    assert _error(got, want) > 1e3 * BOUND[torch.float64], bug
