"""Each case of the edge group (conformance/suite/cases.py's _edge_grid) sits where its comment says: on its
threshold, on the side it names, computed here from the case's own config and inputs (not from the code that
judges it), so that an edit to a case, a size or a default cannot drift it off its edge unnoticed. The existing
cases the edge group counts on for the window's and a prefill's chunk edges are held to theirs too."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance.suite.cases import CASES, _edge_grid, make_inputs
from weights.rope import uses_long_table

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for


def _positions(name):
    """(query positions (B|1, T), every key's position (B|1, P + S)): the cache's keys at 0..P-1 (spec-frontier.md)."""
    case, inputs = CASES[name], make_inputs(CASES[name])
    q = np.asarray(inputs.get("positions", case.P + np.arange(case.T))).reshape(-1, case.T)
    k_new = np.asarray(inputs.get("key_positions", case.P + np.arange(case.S))).reshape(-1, case.S)
    k = np.concatenate([np.broadcast_to(np.arange(case.P), (k_new.shape[0], case.P)), k_new], axis=1)
    return q, k


def _visible(name):
    """(B|1, T, P + S) bool: causal (by index, either alignment), window and chunk together, no mask."""
    case, c = CASES[name], CASES[name].config
    q, k = _positions(name)
    T, S = case.T, case.S_total
    offset = S - T if case.causal_alignment == "bottom_right" else 0
    i, j = np.arange(T)[:, None] + offset, np.arange(S)[None, :]
    seen = np.ones((T, S), bool)
    if case.is_causal:
        seen &= j <= i
    if c.window_left >= 0:
        seen &= j >= i - c.window_left
    if c.window_right >= 0:
        seen &= j <= i + c.window_right
    seen = np.broadcast_to(seen, (max(q.shape[0], k.shape[0]), T, S)).copy()
    if c.local_chunk:
        seen &= q[:, :, None] // c.local_chunk == k[:, None, :] // c.local_chunk
    return seen


def _largest_position(name):
    q, k = _positions(name)
    return int(max(q.max(), k[:, CASES[name].P:].max()))  # the call's own: the queries' and the new keys'


def test_every_edge_case_has_its_claim_tested():
    claimed = {name.removeprefix("test_") for name in globals() if name.startswith("test_edge_")}
    assert {case.name for case in _edge_grid()} == claimed, "an edge case without a test of its edge, or the reverse"


def test_edge_longrope_at_original():
    """max position + 1 == original_max_position_embeddings: the short table, the last call that takes it."""
    scaling = CASES["edge_longrope_at_original"].config.rope.scaling
    largest = _largest_position("edge_longrope_at_original")
    assert largest + 1 == scaling.original_max_position_embeddings, (largest, scaling.original_max_position_embeddings)
    assert not uses_long_table(CASES["edge_longrope_at_original"].config.rope, largest)
    _attention_factor_is_its_own(scaling)


def test_edge_longrope_past_original():
    """max position + 1 == original + 1: the long table, the first call that takes it."""
    scaling = CASES["edge_longrope_past_original"].config.rope.scaling
    largest = _largest_position("edge_longrope_past_original")
    assert largest + 1 == scaling.original_max_position_embeddings + 1, largest
    assert uses_long_table(CASES["edge_longrope_past_original"].config.rope, largest)
    _attention_factor_is_its_own(scaling)


def _attention_factor_is_its_own(scaling):
    """Given in the config and not what the LongRoPE rule computes from factor (sqrt(1 + ln s / ln original)),
    so that a port that recomputes it is wrong by a visible amount (over 10%)."""
    rule = math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))
    assert abs(scaling.attention_factor / rule - 1) > 0.1, (scaling.attention_factor, rule)


def test_edge_temperature_floor_step():
    """Consecutive positions, two on each side of the floor step (position + offset reaching floor)."""
    t = CASES["edge_temperature_floor_step"].config.query_temperature
    q, _ = _positions("edge_temperature_floor_step")
    steps = np.floor((q[0] + t.offset) / t.floor)
    assert np.array_equal(np.diff(q[0]), np.ones(len(q[0]) - 1)), q
    assert steps.tolist() == [0, 0, 1, 1], (q, steps)
    # and the offset counts: read as 0, the step falls elsewhere (temperature_offset_ignored shows here)
    assert np.floor(q[0] / t.floor).tolist() != steps.tolist()


def test_edge_llama3_ramp_ends():
    """Pairs on each side of both ends of llama3's ramp: wavelength < original / high_freq_factor (kept), between
    the two (blended), > original / low_freq_factor (divided), and each end crossed between neighbouring pairs."""
    rope = CASES["edge_llama3_ramp_ends"].config.rope
    s = rope.scaling
    wavelength = 2 * np.pi * rope.theta ** (np.arange(0, rope.rotary_dim, 2) / rope.rotary_dim)  # rising
    short_end, long_end = s.original_max_position_embeddings / s.high_freq_factor, \
        s.original_max_position_embeddings / s.low_freq_factor
    region = np.where(wavelength < short_end, 0, np.where(wavelength > long_end, 2, 1))
    assert region.tolist() == sorted(region.tolist()) and set(region.tolist()) == {0, 1, 2}, (wavelength, region)
    assert _largest_position("edge_llama3_ramp_ends") + 1 > s.original_max_position_embeddings  # past the original


def test_edge_yarn_ramp_ends():
    """YaRN without rounding: the ramp over pairs (i - low) / (high - low) below 0 for a pair, inside (0, 1) for
    another, above 1 for a third; and rounding the ends would change it (truncate matters here)."""
    rope = CASES["edge_yarn_ramp_ends"].config.rope
    s, R = rope.scaling, rope.rotary_dim
    assert s.truncate is False

    def dimension(rotations):  # Peng et al.: the dimension turning `rotations` times over the original context
        return R * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    ramp = (np.arange(R // 2) - low) / (high - low)
    assert ramp.min() < 0 and ramp.max() > 1 and ((ramp > 0) & (ramp < 1)).any(), ramp
    rounded = (np.arange(R // 2) - math.floor(low)) / (math.ceil(high) - math.floor(low))
    assert np.abs(np.clip(rounded, 0, 1) - np.clip(ramp, 0, 1)).max() > 0.1, (ramp, rounded)


def test_edge_chunk_decode():
    """One decode step across a chunk boundary: its first query at the chunk's last position sees the chunk's first
    key (the cache's key 0) and its last (itself); the second, the next chunk's first position, sees itself alone.
    The temperature's floor step falls between the two queries too; the QK-norm is weightless."""
    case = CASES["edge_chunk_decode"]
    C, t = case.config.local_chunk, case.config.query_temperature
    q, k = _positions("edge_chunk_decode")
    seen = _visible("edge_chunk_decode")[0]
    assert case.P > 0 and case.T == 2 and q[0].tolist() == [C - 1, C], q
    assert seen[0].nonzero()[0].tolist() == list(range(C)), seen  # keys at positions 0..C-1: the cache's first
    assert k[0, seen[0]].tolist() == list(range(C)) and k[0, 0] == 0
    assert k[0, seen[1]].tolist() == [C], seen
    assert np.floor((q[0] + t.offset) / t.floor).tolist() == [0, 1]
    assert case.config.qk_norm.weight is False and case.config.qk_norm.after_rope


def test_edge_alibi_decode_positions():
    """ALiBi over a cache whose keys every query sees, at explicit positions that are not the keys' indices (a
    constant gap after the cache): distances by index are wrong on every cache key. T < S, bottom-right."""
    case = CASES["edge_alibi_decode_positions"]
    q, k = _positions("edge_alibi_decode_positions")
    seen = _visible("edge_alibi_decode_positions")[0]
    P, S, T = case.P, case.S_total, case.T
    assert case.config.alibi and case.P > 0 and case.T < case.S and case.causal_alignment == "bottom_right"
    assert seen[:, :P].all(), seen  # every cache key visible to every query
    by_index = np.abs((S - T + np.arange(T))[:, None] - np.arange(S)[None, :])
    by_position = np.abs(q[0][:, None] - k[0][None, :])
    assert (by_index[:, :P] != by_position[:, :P]).all() and (by_index[:, P:] == by_position[:, P:]).all()


def test_edge_value_norm_cache_long_query():
    """A weighted value norm (its scale a tensor) over a cache, causal with more queries than new keys (T > S)."""
    case = CASES["edge_value_norm_cache_long_query"]
    norm = case.config.value_norm
    assert norm.weight and "value.norm.scale" in case.config.tensor_shapes()
    assert case.P > 0 and case.T > case.S and case.is_causal and case.return_cache
    seen = _visible("edge_value_norm_cache_long_query")[0]
    assert seen[:, case.P:].any(), "no query sees a new (normalised) value"


@pytest.mark.parametrize("name", ["window_left_causal", "window_both_bottom_right", "cache_window_gqa"])
def test_window_cases_sit_on_both_edges_of_the_window(name):
    """Some query sees the key at p - left and not the one before it (both in range); with a right window, some
    sees p + right and not p + right + 1."""
    case, c = CASES[name], CASES[name].config
    T, S = case.T, case.S_total
    p = np.arange(T) + (S - T if case.causal_alignment == "bottom_right" else 0)
    seen = _visible(name)[0]
    rows = [i for i in range(T) if 0 <= p[i] - c.window_left - 1 and p[i] - c.window_left < S]
    assert any(seen[i, p[i] - c.window_left] and not seen[i, p[i] - c.window_left - 1] for i in rows), seen
    if c.window_right >= 0:
        rows = [i for i in range(T) if p[i] + c.window_right + 1 < S]
        assert any(seen[i, p[i] + c.window_right] and not seen[i, p[i] + c.window_right + 1] for i in rows), seen


@pytest.mark.parametrize("name", ["local_chunk_per_batch", "norm_after_rope_chunked", "edge_chunk_decode"])
def test_chunk_cases_cross_a_boundary_inside_one_call(name):
    """The queries of one call (a prefill; edge_chunk_decode's decode step) span two chunks, and some query sees
    its chunk's first key while the key just before it (the previous chunk's last) is hidden."""
    C = CASES[name].config.local_chunk
    q, k = _positions(name)
    seen = _visible(name)
    assert all(len(set((row // C).tolist())) >= 2 for row in q), q
    first = (k % C == 0) & (k > 0)  # (B|1, S): a chunk's first key, with a key before it
    b, i, j = np.nonzero(seen & first[:, None, :])
    assert any(not seen[b_, i_, j_ - 1] and k[min(b_, k.shape[0] - 1), j_ - 1] == k[min(b_, k.shape[0] - 1), j_] - 1
               for b_, i_, j_ in zip(b, i, j)), (q, k)
