"""The Keras mirror's two other paths of DeepSeek V4's layer (impl_tf/compressed.py) on Keras's TensorFlow backend:
the in-place cache (in_place=True: the buffers tf.Variables written by XLA) and the block-wise path (chunk_size=:
attend_blockwise), against the float64 NumPy stages (impl_numpy.compressed's copying call, never the path under
test). Batch 2, the three kinds, float64 and float32: the in-place call over tests/test_compressed_v4.py's
IN_PLACE_CUTS (a prefill, windows closing inside calls, then token by token across csa's and hca's window
boundaries) with the buffers read back as the copying cache; the block-wise path on a prefill of 40 tokens (csa's
top-k keeps 2 of up to 10 entries) and the same tokens decoded through the copying cache and in place; with blocks
of one key, exactly what each query sees computed; the refusals (Keras's jax and torch backends refuse both paths,
as the regular call's); `mha check`'s in_place row; a porting bug of each path caught. Marked `tf`; about 6 s of
CPU in the tf env, 4.5 s more than before with tests/test_compressed_v4_tf.py's token-by-token decode moved here
(2-core AMD EPYC VM, 2026-11-29, under other jobs' load)."""

from __future__ import annotations

import numpy as np
import pytest
from test_compressed_v4 import IN_PLACE_CUTS, KINDS, T, _layer, _x, source_mutant

from impl_numpy.compressed import cache_buffers, logical_cache
from impl_numpy.compressed import compressed_attention as reference

tf = pytest.importorskip("tensorflow")
import impl_tf.compressed as compressed  # noqa: E402
from impl_tf import functional as F  # noqa: E402
from impl_tf.compressed import compressed_attention  # noqa: E402

pytestmark = pytest.mark.tf

# float64: the same sums in other orders (the ring's keys in slot order, the blocks' online softmax), a few ulps
# of the output's size (tests/test_compressed_v4.py's PORT_BOUND). float32 against the float64 reference: every
# stage rounded to float32, 256 float32 ulps of the output's size (tests/test_compressed_v4_tf.py's bound; measured
# at most 5.6e-7 relative, 2-core AMD EPYC VM, 2026-11-29: a margin of ~100; csa's selection is the float64 one,
# its smallest gap at the top-k boundary far above float32's round-off there).
BOUND = {"float64": 1e-12, "float32": 256 * float(np.finfo(np.float32).eps)}
L = 40  # 10 csa windows of 4 (its top-k keeps 2 of up to 10 entries), 5 hca windows of 8; the window is 6 keys
CUTS = [0, 15, 16, 17, 25, L]  # a prefill, then calls of 1, 1, 8 and 15 tokens across window boundaries (16, 24, 32)


def _error(got, want):
    return np.abs(np.asarray(got.numpy(), np.float64) - want).max() / np.abs(want).max()


def _buffers(config, capacity, dtype):
    return {n: tf.Variable(a.astype(dtype)) for n, a in cache_buffers(config, 2, capacity).items()}


def _in_place_errors(kind, dtype, module=compressed, copying=True):
    """Over IN_PLACE_CUTS, each in-place call (one set of tf.Variables) and (copying) each copying call of the
    Keras mirror (its present cache fed back as past) against the copying float64 reference: the relative errors
    of (the in-place output, the worst cache row read back from the buffers by logical_cache, relative to 1 + its
    size, the copying output (0 without))."""
    config, t = _layer(kind)
    x = _x()
    buffers, past, keras_past, errors = _buffers(config, T, dtype), None, None, np.zeros(3)
    for a, b in zip(IN_PLACE_CUTS, IN_PLACE_CUTS[1:]):
        want, past = reference(config, t, x[:, a:b], np.arange(a, b), past, return_cache=True)
        got, present = module.compressed_attention(config, t, x[:, a:b].astype(dtype), np.arange(a, b), buffers,
                                                   return_cache=True, in_place=True)
        if copying:
            copied, keras_past = compressed_attention(config, t, x[:, a:b].astype(dtype), np.arange(a, b),
                                                      keras_past, return_cache=True)
        assert present is buffers  # the present cache is the caller's variables, written
        held = logical_cache(config, {n: v.numpy().astype(np.float64) for n, v in buffers.items()}, b)
        assert sorted(held) == sorted(past)
        cache_err = 0.0
        for name, rows in past.items():
            assert held[name].shape == rows.shape, name
            cache_err = max(cache_err, np.abs(held[name] - rows).max(initial=0) / (1 + np.abs(rows).max(initial=0)))
        errors = np.maximum(errors, [_error(got, want), cache_err, _error(copied, want) if copying else 0.0])
    return errors


@pytest.mark.parametrize("kind,dtype", [(kind, "float64") for kind in KINDS] + [("csa", "float32")],
                         ids=[*KINDS, "csa-float32"])
def test_keras_in_place_and_copying_decodes_are_the_reference(kind, dtype):
    """The in-place call's outputs and buffers, and the copying call's outputs through its own present cache (a
    prefill, calls that close windows inside them, then token by token across csa's 16 and 20 and hca's 16),
    against the copying float64 reference, within BOUND."""
    errors = _in_place_errors(kind, dtype)
    assert (errors <= BOUND[dtype]).all(), errors


@pytest.mark.parametrize("kind,dtype", [(kind, "float64") for kind in KINDS] + [("hca", "float32")],
                         ids=[*KINDS, "hca-float32"])
def test_keras_blockwise_path_gives_the_reference_stages_prefill_and_decode(kind, dtype):
    """A prefill in blocks of 8 (query blocks of 8 rows: most window key blocks and the entry blocks past a query
    block's last visible entry skipped), then CUTS' calls in blocks of 4 through the copying cache and through
    the in-place buffers (there a key block straddles the ring's part and the call's)."""
    config, t = _layer(kind)
    x = _x(length=L)
    want = reference(config, t, x, np.arange(L))  # the float64 NumPy stages
    xl = x.astype(dtype)
    got = compressed_attention(config, t, xl, np.arange(L), chunk_size=8)
    assert F.dtype_name(got) == dtype and _error(got, want) <= BOUND[dtype], _error(got, want)
    buffers, past, copied, in_place = _buffers(config, L, dtype), None, [], []
    for a, b in zip(CUTS, CUTS[1:]):
        out, past = compressed_attention(config, t, xl[:, a:b], np.arange(a, b), past, return_cache=True,
                                         chunk_size=4)
        copied.append(out)
        in_place.append(compressed_attention(config, t, xl[:, a:b], np.arange(a, b), buffers, in_place=True,
                                             chunk_size=4))
    assert _error(tf.concat(copied, axis=1), want) <= BOUND[dtype]
    assert _error(tf.concat(in_place, axis=1), want) <= BOUND[dtype]


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_keras_blocks_of_one_key_compute_exactly_what_each_query_sees(kind, monkeypatch):
    """chunk_size=1 over 24 tokens: the logits computed are the query's window keys (min(W, t + 1)) and its
    entries (hca: the (t + 1) // m visible; csa: the ones a batch row's top-k selected), each once: every other
    key and entry is skipped, not computed and masked. Counted from functional.logits' calls; the selection is
    NumPy's."""
    n = 24
    config, t = _layer(kind)
    x = _x(length=n)
    _, selection = reference(config, t, x, np.arange(n), return_selection=True)
    computed = []
    logits = F.logits
    monkeypatch.setattr(F, "logits", lambda q, k, scale: computed.append(q.shape[2] * k.shape[2]) or logits(q, k, scale))
    compressed_attention(config, t, x, np.arange(n), chunk_size=1)
    W, pos = config.window_left + 1, np.arange(n)
    seen = np.minimum(W, pos + 1).sum()
    if kind == "hca":
        seen += ((pos + 1) // config.compressed.ratio).sum()
    if kind == "csa":  # a block is skipped only if neither batch row selected it
        seen += sum(len(set(selection[:, i][selection[:, i] >= 0].tolist())) for i in range(n))
    assert sum(computed) == seen, (sum(computed), seen)


def test_keras_blockwise_path_is_differentiable_as_the_stages():
    """A GradientTape through the online softmax (the select keeps a hidden logit's gradient 0): x's gradient of a
    fixed projection of the output, block-wise against the stages of the same module in float64 (the stages'
    gradients are held to NumPy's VJP by `mha check`'s tf column and tests/test_compressed_v4_tf.py). 1e-10
    relative: float64 sums in other orders, through a backward pass."""
    config, t = _layer("csa")
    x = tf.constant(_x(length=24))
    probe = tf.constant(np.random.default_rng(3).standard_normal((2, 24, config.out_dim)))
    grads = []
    for chunk_size in (None, 4):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(compressed_attention(config, t, x, np.arange(24), chunk_size=chunk_size) * probe)
        grads.append(tape.gradient(loss, x).numpy())
    assert np.isfinite(grads[1]).all()
    assert np.abs(grads[1] - grads[0]).max() <= 1e-10 * np.abs(grads[0]).max()


def test_keras_in_place_and_blockwise_refusals(monkeypatch):
    config, t = _layer("csa")
    x = tf.constant(_x(length=1))
    buffers = _buffers(config, 8, "float64")

    def call(given, **kw):
        return compressed_attention(config, t, x, np.array([3]), given, in_place=True, **kw)
    with pytest.raises(ValueError, match=r"past\['entries'\] with in_place is written in place: it must be a "
                                         r"tf.Variable of the storage dtype float64: got a EagerTensor"):
        call({**buffers, "entries": tf.constant(buffers["entries"])})
    with pytest.raises(ValueError, match=r"past\['window_kv'\] .* got dtype float32"):
        call({**buffers, "window_kv": tf.Variable(tf.cast(buffers["window_kv"], tf.float32))})
    with pytest.raises(ValueError, match=r"past\['key'\] with in_place must have shape \(2, 1, 5, 16\)"):
        call({**buffers, "key": tf.Variable(buffers["key"][:, :, :3])})
    with pytest.raises(ValueError, match=r"trace must be None with in_place"):
        call(buffers, trace=[])
    with tf.GradientTape() as tape:
        tape.watch(x)
        with pytest.raises(ValueError, match=r"in_place writes the cache's buffers, which no gradient passes "
                                             r"through: got a call under a recording GradientTape"):
            call(buffers)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer: got 0"):
        compressed_attention(config, t, x, np.array([0]), chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        compressed_attention(config, t, x, np.array([0]), chunk_size=4, trace=[])
    # Keras's jax and torch backends (TENSORFLOW False there): both paths refused with the reason, as cache_length
    # and the regular chunk_size are (impl_tf.call.IN_PLACE_UNSUPPORTED, impl_tf.attention.CHUNKED_UNSUPPORTED)
    monkeypatch.setattr(compressed, "TENSORFLOW", False)
    with pytest.raises(NotImplementedError, match=r"in_place \(DeepSeek V4's in-place cache\) needs Keras's "
                                                  r"TensorFlow backend"):
        call(buffers)
    with pytest.raises(NotImplementedError, match=r"chunk_size \(DeepSeek V4's block-wise path\) needs Keras's "
                                                  r"TensorFlow backend"):
        compressed_attention(config, t, x, np.array([0]), chunk_size=4)


def _mutant(old: str, new: str):
    """impl_tf/compressed.py with one passage replaced, as a module of its own (tests/test_compressed_v4.py's
    RING_WRITTEN_FIRST pattern: source_mutant)."""
    return source_mutant(compressed, old, new, "_v4_paths_mutant")


# In place: a step that closes no window forgets to write its token's projections into the open window's slots
# (the window, when it closes, pools what the slots held before: issue 41's "a decode that drops the open window's
# buffered tokens", in the in-place form).
# Two forms: a step that closes no window forgets it (a decode step's token), or a call that closes one forgets the
# tokens it leaves open (the open window taken for empty after a close).
ROW_WRITES = ("    write(window_kv, kv[:, T - new:], rest - new, 1)\n"
              "    write(window_gate, gate[:, T - new:], rest - new, 1)\n")
OPEN_ROW_FORGOTTEN = {when: (ROW_WRITES, f"    if {when}:\n" + ROW_WRITES.replace("    write", "        write"))
                      for when in ("n", "not n")}


@pytest.mark.parametrize("kind,when", [("hca", "n"), ("csa", "not n")], ids=["decode-step", "after-a-close"])
def test_an_in_place_row_forgotten_fails_against_the_copying_reference(kind, when):
    out_err, cache_err, _ = _in_place_errors(kind, "float64", _mutant(*OPEN_ROW_FORGOTTEN[when]), copying=False)
    assert out_err > 1e3 * BOUND["float64"] and cache_err > 1e3 * BOUND["float64"], (out_err, cache_err)


def test_the_sink_left_out_of_the_running_sum_fails_against_the_stages(monkeypatch):
    """Block-wise, a bug of the mirror's own arithmetic: the running sum started at 0, not at the sink (its
    attend_blockwise given no sinks). The schedule's bugs (visible blocks skipped), planted once in the shared
    impl_numpy.compressed.blockwise_schedule, fail this mirror too: tests/test_compressed_v4_schedule.py."""
    config, t = _layer("hca")
    x = _x(length=L)
    want = reference(config, t, x, np.arange(L))
    original = compressed.attend_blockwise
    monkeypatch.setattr(compressed, "attend_blockwise", lambda *a: original(*a[:7], None, a[8]))
    got = compressed_attention(config, t, x, np.arange(L), chunk_size=2)
    assert _error(got, want) > 1e3 * BOUND["float64"]


@pytest.mark.parametrize("bug", [False, True])
def test_the_tf_column_judges_the_in_place_cache_on_its_path(bug, monkeypatch):
    """`mha check`'s in_place row of v4_hca_decode on the tf column (COMPRESSED_IN_PLACE on TensorFlow: P 9, the
    open window's token 8 closes window 2 with the call's 9..11, token 12 opens the next) runs the in-place call:
    it passes, and the row forgotten after a close fails it there (the present cache's open window)."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    if bug:
        monkeypatch.setattr(compressed, "compress_in_place", _mutant(*OPEN_ROW_FORGOTTEN["not n"]).compress_in_place)
    result = run_case(CASES["v4_hca_decode"], "tf", dtype="float32", path="in_place")
    assert result.status == ("fail" if bug else "pass"), (result.status, result.message)
    if bug:
        failed = {c.name for c in result.comparisons if not c.ok}
        assert {"present_window_kv", "present_window_gate"} <= failed, failed
