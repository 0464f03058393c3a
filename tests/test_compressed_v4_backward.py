"""DeepSeek V4's backward (impl_numpy/compressed_backward.py) against an independent formulation: central finite
differences of the forward (impl_numpy.compressed.compressed_attention) in float64, each kind (sliding, csa,
hca), a prefill from position 0 and a decode step over a cache, for the layer's input, every tensor and every
past_<name> of the cache. Tensors of at most SMALL elements (the norms' scales, the sinks, position_bias) are
checked element by element, the others along random directions. The indexer's tensors (csa) get zero: its
top-k is a constant of the backward (piecewise constant: a step of 1e-5 moves no score past another here,
so the finite difference is 0 too). A mutant of the backward (the compressor gate's softmax without its
Jacobian's diagonal term; the sinks' gradient dropped) fails the same check.

About 1 s in all (2-core AMD EPYC VM, 2026-11-29); NumPy only: marked reference (the numpy env)."""

from __future__ import annotations

import numpy as np
import pytest
from test_compressed_v4 import KINDS, _layer, _x

from impl_numpy import compressed_backward
from impl_numpy.compressed import compressed_attention
from impl_numpy.compressed_backward import compressed_attention_vjp

pytestmark = pytest.mark.reference

T, P = 11, 9  # a prefill of 11 tokens (csa's windows of 4 close at 3 and 7, hca's of 8 at 7); decode: 9 before
STEP = 1e-5
SMALL = 32
# Central differences in float64: truncation h^2 f'''/6 ~ 1e-10 of the derivative's own size (the stages'
# third derivatives are O(1)-O(100) times it on these unit-scale shapes), rounding eps |f| / h ~ 1e-11 |f|
# (|f| at most F = sum |out * d_output|). Allowed: 1e-6 |fd| + 1e-9 F, four orders above both (measured: at
# most ~1e-10 absolute) and orders below a dropped term (a few percent of the derivative or more).
REL, ABS = 1e-6, 1e-9


def _call(kind, decode):
    config, tensors = _layer(kind)
    x = _x(seed=3, length=P + T)
    past = None
    if decode:
        _, past = compressed_attention(config, tensors, x[:, :P], np.arange(P), return_cache=True)
    start = P if decode else 0
    xs, positions = x[:, start:start + T] if decode else x[:, :T], np.arange(start, start + T)
    d_out = np.random.default_rng(7).standard_normal((2, T, config.out_dim))
    return config, tensors, xs, positions, past, d_out


def _fd_mismatches(kind, decode, names=None):
    """The (name, direction, analytic, finite difference, allowed) of every check outside the allowance (of the
    gradients named in `names`, None: all)."""
    config, tensors, x, positions, past, d_out = _call(kind, decode)
    out, grads, magnitudes = compressed_attention_vjp(config, tensors, x, positions, past, d_output=d_out,
                                                        gradient_magnitudes=True)
    F = float(np.abs(compressed_attention(config, tensors, x, positions, past) * d_out).sum())

    def f(name, delta):
        t, xs, pp = dict(tensors), x, None if past is None else dict(past)
        if name == "query":
            xs = x + delta
        elif name.startswith("past_"):
            pp[name[5:]] = past[name[5:]] + delta
        else:
            t[name] = tensors[name] + delta
        return float((compressed_attention(config, t, xs, positions, pp) * d_out).sum())

    rng = np.random.default_rng(11)
    bad = []
    for name, g in grads.items():
        if names is not None and name not in names:
            continue
        assert g.shape == (x.shape if name == "query" else tensors[name].shape if name in tensors
                           else past[name[5:]].shape), name
        assert np.all(np.abs(g) <= np.abs(magnitudes[name]) * (1 + 1e-12) + 1e-300), f"{name}: |grad| > magnitude"
        if name.startswith(("indexer.", "past_index_")):  # zero by the contract: one direction shows it
            directions = [rng.standard_normal(g.shape)]
        elif g.size <= SMALL:
            directions = [np.eye(g.size)[i].reshape(g.shape) for i in range(g.size)]
        else:
            directions = [rng.standard_normal(g.shape) for _ in range(3)]
        for i, u in enumerate(directions):
            fd = (f(name, STEP * u) - f(name, -STEP * u)) / (2 * STEP)
            analytic = float((g * u).sum())
            allowed = REL * abs(fd) + ABS * F
            if not abs(analytic - fd) <= allowed:
                bad.append((name, i, analytic, fd, allowed))
    return bad


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_backward_matches_finite_differences(kind, decode):
    bad = _fd_mismatches(kind, decode)
    assert not bad, f"{kind} {'decode' if decode else 'prefill'}: {len(bad)} mismatches, first " + ", ".join(
        f"{n}[{i}] analytic {a:.9g} fd {fd:.9g} allowed {al:.2g}" for n, i, a, fd, al in bad[:3])


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_output_is_the_forwards(kind):
    """The backward's own forward is compressed_attention's (the same float64 sums, maybe in another order)."""
    config, tensors, x, positions, past, d_out = _call(kind, True)
    out, _ = compressed_attention_vjp(config, tensors, x, positions, past, d_output=d_out)
    ref = compressed_attention(config, tensors, x, positions, past)
    assert np.abs(out - ref).max() <= 1e-12 * np.abs(ref).max(), np.abs(out - ref).max()


def _no_diagonal(self, w, dw, axis):  # the softmax's Jacobian without its diagonal term w dw
    row = (dw * w).sum(axis=axis, keepdims=True)
    return -w * row, row


@pytest.mark.parametrize("bug", ["gate_softmax_no_diagonal", "sinks_dropped"])
def test_a_backward_bug_fails_the_finite_differences(bug, monkeypatch):
    """The check can fail: each bug leaves the finite differences by far more than the allowance."""
    real = compressed_backward._Pass.run
    if bug == "gate_softmax_no_diagonal":
        real_compress_back = compressed_backward._Pass.compress_back

        def compress_back(self, prefix, d):
            self.softmax_back = _no_diagonal.__get__(self)
            return real_compress_back(self, prefix, d)
        monkeypatch.setattr(compressed_backward._Pass, "compress_back", compress_back)
    else:
        def run(self, d_out):
            out = real(self, d_out)
            self.grads["sinks"] = np.zeros_like(self.grads["sinks"])
            return out
        monkeypatch.setattr(compressed_backward._Pass, "run", run)
    expected = {"compressor.gate.kernel", "compressor.position_bias"} if bug != "sinks_dropped" else {"sinks"}
    names = {n for n, *_ in _fd_mismatches("hca", True, expected)}
    assert expected <= names, (bug, sorted(names))


class _MutantAdapter:
    """impl_numpy's adapter, its V4 gradients from the backward with `bug` (the forward the reference's)."""

    def __init__(self, bug, monkeypatch):
        self.bug, self.monkeypatch = bug, monkeypatch

    def forward(self, config, tensors, inputs, options, **kwargs):
        from impl_numpy import adapter

        return adapter.forward(config, tensors, inputs, options, **kwargs)

    def vjp(self, config, tensors, inputs, options, d_output, **kwargs):
        from impl_numpy import adapter

        with self.monkeypatch.context() as m:
            if self.bug is not None:
                _mutate(m, self.bug)
            return adapter.vjp(config, tensors, inputs, options, d_output, **kwargs)


def _mutate(m, bug):
    if bug == "gate_softmax_no_diagonal":
        real_compress_back = compressed_backward._Pass.compress_back

        def compress_back(self, prefix, d):
            self.softmax_back = _no_diagonal.__get__(self)
            return real_compress_back(self, prefix, d)
        m.setattr(compressed_backward._Pass, "compress_back", compress_back)
    else:
        real = compressed_backward._Pass.run

        def run(self, d_out):
            out = real(self, d_out)
            self.grads["sinks"] = np.zeros_like(self.grads["sinks"])
            return out
        m.setattr(compressed_backward._Pass, "run", run)


@pytest.mark.parametrize("bug", [None, "gate_softmax_no_diagonal", "sinks_dropped"])
@pytest.mark.parametrize("case", ["v4_csa_prefill", "v4_hca_decode"])
def test_a_backward_bug_fails_the_grid_case_through_run_case(case, bug, monkeypatch):
    """`mha check`'s own judgement (run_case, float32, the policy's bar on every gradient) passes the reference's
    backward and fails each bug on both V4 grid cases."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    result = run_case(CASES[case], "v4-backward", dtype="float32", adapter=_MutantAdapter(bug, monkeypatch))
    failed = sorted(c.name for c in result.comparisons if not c.ok)
    assert result.status == ("pass" if bug is None else "fail"), (bug, result.status, result.message, failed)
    if bug is not None:
        assert ("grad sinks" in failed) == (bug == "sinks_dropped"), failed


def test_a_bad_cotangent_is_refused():
    config, tensors, x, positions, past, d_out = _call("sliding", False)
    with pytest.raises(ValueError, match=r"d_output must have shape \(B, T, O\)"):
        compressed_attention_vjp(config, tensors, x, positions, d_output=d_out[:, :1])
