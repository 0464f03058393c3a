"""The block-wise path's one host schedule (impl_numpy.compressed.blockwise_schedule: which window-key and entry
blocks each query block visits, and what the stages' mask hides in each), which every mirror's attend_blockwise
walks with its own arithmetic. Against an independent formulation (the stages' masks: the window, the entries'
visibility, csa's selection), every query and key visited exactly where a query may see it, nothing else unhidden,
no block visited twice; then each porting bug of a schedule, planted once in the shared generator, fails the
float64 stages in every mirror (numpy, torch, mlx, tf, jax: each patched at its own import of the generator, so a
mirror that kept a schedule of its own would pass the mutant and fail here). Each parameter carries its mirror's
marker (jax's also slow, as tests/test_compressed_v4_blockwise_jax.py: the jax env has no room in tox's budget).
About 0.6 s in the numpy env, 1 s in torch, 1 s in mlx, 3 s in tf (2-core AMD EPYC VM, 2026-11-30, under other
jobs' load)."""

from __future__ import annotations

import numpy as np
import pytest
from test_compressed_v4 import KINDS, _layer, _x, source_mutant

import impl_numpy.compressed as numpy_compressed
from impl_numpy.compressed import blockwise_schedule, ring_positions
from impl_numpy.compressed import compressed_attention as reference

L = 40  # 10 csa windows of 4 (its top-k keeps 2 of up to 10 entries), 5 hca windows of 8; the window is 6 keys
BOUND = 1e-12  # float64: the same sums in other orders, a few ulps of the output's size (the mirrors' own files')


@pytest.mark.reference
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("p0,T,ring", [(0, 23, False), (13, 9, False), (13, 9, True), (30, 1, True)],
                         ids=["prefill", "call-after-13", "in-place-after-13", "in-place-decode"])
def test_the_schedule_visits_exactly_what_the_stages_mask_shows(kind, p0, T, ring):
    """Blocks of 1, 2, 3 and 5 keys: the (query, key) pairs a visited block leaves unhidden are the stages' allowed
    pairs (window: t - W < s <= t; hca: entry w < (t + 1) // m; csa: the pairs its selection holds, per batch row),
    each visited once; every block within its source and at most chunk_size wide. The selection is random (-1
    padding included), the keys those a copying call holds (the cache's, then the call's) or the in-place ring's
    in slot order."""
    config, _ = _layer(kind)
    c, W, B = config.compressed, config.window_left + 1, 2
    positions = np.arange(p0, p0 + T)
    if ring:
        key_pos = np.concatenate([ring_positions(p0, W), positions])
    else:
        key_pos = np.arange(max(0, p0 - (W - 1)), p0 + T)
    S, E = len(key_pos), 0 if kind == "sliding" else (p0 + T) // c.ratio
    visible = np.arange(E)[None] < ((positions + 1) // c.ratio)[:, None] if E else np.zeros((T, 0), bool)
    selection = None
    if kind == "csa":
        rng = np.random.default_rng(p0 + T)
        selection = np.where(rng.random((B, T, 3)) < 0.8, rng.integers(0, max(E, 1), (B, T, 3)), -1)
        selection = np.where(np.take_along_axis(np.broadcast_to(visible, (B, T, E)), np.maximum(selection, 0), -1)
                             & (selection >= 0), selection, -1) if E else np.full((B, T, 3), -1)
        entries_allowed = (selection[..., None] == np.arange(E)).any(axis=2)  # (B, T, E)
    else:
        entries_allowed = np.broadcast_to(visible, (B, T, E))
    window_allowed = (key_pos[None] <= positions[:, None]) & (key_pos[None] > positions[:, None] - W)  # (T, S)
    want = np.concatenate([np.broadcast_to(window_allowed, (B, T, S)), entries_allowed], axis=2)
    for chunk_size in (1, 2, 3, 5):
        seen = np.zeros((B, T, S + E), int)
        rows = []
        for t0, t1, blocks in blockwise_schedule(config, key_pos, positions, E, chunk_size, selection):
            rows.append((t0, t1))
            for source, b0, b1, hidden in blocks:
                size = S if source == "window" else E
                assert 0 <= b0 < b1 <= min(size, b0 + chunk_size), (source, b0, b1)
                shown = np.ones((B, 1, t1 - t0, b1 - b0), bool) if hidden is None else ~hidden
                offset = 0 if source == "window" else S
                seen[:, t0:t1, offset + b0:offset + b1] += np.broadcast_to(shown, (B, 1, t1 - t0, b1 - b0))[:, 0]
        assert rows == [(t0, min(T, t0 + min(chunk_size, T))) for t0 in range(0, T, min(chunk_size, T))]
        assert seen.max(initial=0) <= 1, chunk_size  # no pair visited twice
        np.testing.assert_array_equal(seen.astype(bool), want, err_msg=f"chunk_size={chunk_size}")


# Porting bugs of a block-wise schedule: visible blocks skipped. The window's first visible block lost (a skip test
# one block too eager); the window's oldest visible key (position lo - W + 1) left out of the blocks visited; the
# entries' bound one token late (an entry block that only the query block's last query sees, skipped); csa's
# selected blocks read from the first batch row alone (a block only the other row selected, skipped).
SCHEDULE_BUGS = {
    "first_visible_window_block_skipped": ("sliding", (
        "for s0 in (np.unique(near // chunk_size) * chunk_size).tolist():",
        "for s0 in (np.unique(near // chunk_size) * chunk_size).tolist()[1:]:")),
    "oldest_visible_key_block_skipped": ("sliding", ("near = np.flatnonzero((key_pos >= lo - W + 1)",
                                                     "near = np.flatnonzero((key_pos > lo - W + 1)")),
    "entry_block_visible_to_the_last_query_skipped": ("hca", ("seen = min(E, (hi + 1) // c.ratio) if E else 0",
                                                              "seen = min(E, hi // c.ratio) if E else 0")),
    "block_selected_by_another_batch_row_skipped": ("csa", ("            if not picked.any():\n",
                                                            "            if not picked[0].any():\n")),
}


def _mirror(name):
    """(the mirror's compressed module, x as it takes it)."""
    if name == "numpy":
        return numpy_compressed, lambda x: x
    if name == "torch":
        torch = pytest.importorskip("torch")
        import impl_torch.compressed as module
        return module, torch.as_tensor
    if name == "mlx":
        mx = pytest.importorskip("mlx.core")
        import impl_mlx.compressed as module
        return module, lambda x: mx.array(x, dtype=mx.float64)
    if name == "tf":
        pytest.importorskip("tensorflow")
        import impl_tf.compressed as module
        return module, lambda x: x
    jnp = pytest.importorskip("jax.numpy")
    import impl_jax.adapter  # noqa: F401  (switches x64 on)
    import impl_jax.compressed as module
    return module, jnp.asarray


MIRRORS = [pytest.param("numpy", marks=pytest.mark.reference), pytest.param("torch", marks=pytest.mark.torch),
           pytest.param("mlx", marks=pytest.mark.mlx), pytest.param("tf", marks=pytest.mark.tf),
           pytest.param("jax", marks=[pytest.mark.jax, pytest.mark.slow])]


@pytest.mark.parametrize("mirror", MIRRORS)
@pytest.mark.parametrize("bug", list(SCHEDULE_BUGS))
def test_a_schedule_bug_fails_every_mirror_against_the_stages(bug, mirror, monkeypatch):
    """One mutant of the shared generator, given to the mirror where it imported it (jax eagerly: its csa skip is
    the schedule's there; under jax.jit it masks instead), in blocks of 2 over 40 tokens: the float64 output
    leaves the float64 stages' bound by far. Without the mutant each mirror's own file holds it within the bound."""
    kind, (old, new) = SCHEDULE_BUGS[bug]
    config, t = _layer(kind)
    x = _x(length=L)
    want = reference(config, t, x, np.arange(L))
    module, convert = _mirror(mirror)
    monkeypatch.setattr(module, "blockwise_schedule", source_mutant(numpy_compressed, old, new, "_schedule_mutant").blockwise_schedule)
    got = np.asarray(module.compressed_attention(config, t, convert(x), np.arange(L), chunk_size=2), np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() > 1e3 * BOUND, bug
