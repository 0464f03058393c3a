"""impl_jax's long one-query fast paths (issue 39 item 5, `mha bench --shapes sparse`): the absorbed (latent)
decode step over an in-place cache in key blocks with an online softmax (fused.absorbed_decode, from
fused.DECODE_MIN_KEYS buffer positions on), and the lightning indexer's long decode row (indexer.JIT_MIN_KEYS:
jitted, the scores with the keys as rows, the top-k from its candidates).

Each is taken here on a small layer with its threshold lowered, held to the float64 NumPy reference within the
tolerance policy, and shown to have run (a spy); the porting bugs an online softmax makes (the rescale of the
blocks before dropped, the clamped last block's overlap counted twice) are planted and must fail."""

from __future__ import annotations

import numpy as np
import pytest
from test_sparse_gather import P, _expected, _judge  # the float64 stages and the judge of one decode step

pytestmark = pytest.mark.jax

SPARE = 4  # the buffer: P cached keys (test_sparse_gather's 80), the new one, 3 spare positions (hidden)
BLOCK = 32  # keys per turn (lowered): capacity 84 -> blocks at 0, 32 and 52 (the last clamped back over 12)


def _step():
    """The latent family's quick layer (N 4, C 16, R 4), B 2, one new token over P 80 cached."""
    from conformance.bench import latent

    config, tensors = latent.layer(latent.QUICK)
    rng = np.random.default_rng(11)
    d = latent.QUICK
    x = rng.standard_normal((2, 1, d.D)).astype(np.float32)
    lat = (3 * rng.standard_normal((2, 1, P, d.C))).astype(np.float32)  # spread logits: the running max moves
    rot = rng.standard_normal((2, 1, P, d.R)).astype(np.float32)
    return config, tensors, x, lat, rot


def _in_place(config, tensors, x, lat, rot, traced: bool):
    """impl_jax's in-place step under jax.jit (the bench's form), P a Python int or traced."""
    import jax
    import jax.numpy as jnp

    from impl_jax.attention import apply

    buffers = [jnp.zeros((2, 1, P + SPARE, a.shape[-1]), jnp.float32).at[:, :, :P].set(a) for a in (lat, rot)]
    common = dict(return_cache=True, is_causal=True, causal_alignment="bottom_right")
    if traced:
        step = jax.jit(lambda p, inp, k, v, n: apply(config, p, inp, past_key=k, past_value=v, cache_length=n,
                                                     **common)[0])
        return step(tensors, x, *buffers, jnp.int32(P))
    step = jax.jit(lambda p, inp, k, v: apply(config, p, inp, past_key=k, past_value=v, cache_length=P, **common)[0])
    return step(tensors, x, *buffers)


def _blocks(monkeypatch, bug=None):
    """absorbed_decode from 16 positions on, BLOCK keys a turn, recorded; bug: one planted."""
    import jax.numpy as jnp

    import impl_jax.attention as attention
    import impl_jax.fused as fused

    monkeypatch.setattr(fused, "DECODE_MIN_KEYS", 16)
    monkeypatch.setattr(fused, "DECODE_BLOCK", BLOCK)
    if bug == "rescale_dropped":  # the blocks before keep their sum and context at their own max
        monkeypatch.setattr(fused, "_rescale", lambda top, new_top: jnp.where(top > -jnp.inf, 1.0, 0.0))
    if bug == "overlap_counted_twice":  # the clamped last block attends the keys the block before did
        monkeypatch.setattr(fused, "_counted", lambda i, start, block, count:
                            start + jnp.arange(block, dtype=jnp.int32) < count)
    ran, right = [], attention.absorbed_decode

    def spy(q, latent, rotary, *args):
        ran.append(latent.shape)
        return right(q, latent, rotary, *args)

    monkeypatch.setattr(attention, "absorbed_decode", spy)
    return ran


@pytest.mark.parametrize("traced", [False, True], ids=["static_P", "traced_P"])
def test_decode_in_blocks_matches_the_stages(monkeypatch, traced):
    pytest.importorskip("jax")  # the numpy env runs every file with no framework installed
    step = _step()
    expected, logits = _expected(*step, None)  # every key attended
    ran = _blocks(monkeypatch)
    _judge("jax decode in blocks", _in_place(*step, traced), expected, logits, step[0])
    assert ran == [(2, 1, P + SPARE, step[0].latent.kv_rank)], ran  # the blocked step ran, over the whole buffer


@pytest.mark.parametrize("bug", ["rescale_dropped", "overlap_counted_twice"])
def test_decode_in_blocks_bugs_are_caught(monkeypatch, bug):
    pytest.importorskip("jax")  # the numpy env runs every file with no framework installed
    step = _step()
    expected, logits = _expected(*step, None)  # every key attended
    _blocks(monkeypatch, bug)
    with pytest.raises(AssertionError, match="FAIL"):
        _judge(f"jax decode in blocks ({bug})", _in_place(*step, False), expected, logits, step[0])


# --- the indexer's long decode row ------------------------------------------------------------------------------

def test_long_row_top_k_is_the_sorted_selection():
    """impl_jax.indexer._select_topk_partitioned (a long row's top-k from its candidates: lax.top_k's k-th
    value, then the scores above it and the lowest-index ties at it) against impl_numpy's select_topk (the
    stable sort's first k): rows of many ties (-0.0 among the zeros), -inf and NaN, k from 1 to a quarter
    of the row."""
    pytest.importorskip("jax")  # the numpy env runs every file with no framework installed
    import jax

    import impl_jax.indexer as jix
    from impl_numpy.indexer import select_topk

    rng = np.random.default_rng(3)
    n = 64
    for k in (1, 3, 8, 16):
        pick = jax.jit(lambda x, k=k: jix._select_topk_partitioned(x, k))
        for trial in range(6):
            x = rng.integers(-2, 3, size=(2, 1, 1, n)).astype(np.float32)  # five values: ties everywhere
            x[rng.random(x.shape) < 0.2] = -np.inf
            x[(x == 0) & (rng.random(x.shape) < 0.5)] = -0.0
            if trial % 2:
                x[rng.random(x.shape) < 0.1] = np.nan
            if trial == 4:
                x[0, 0, 0, k // 2:] = -np.inf  # fewer finite scores than k: -1 slots
            assert np.array_equal(np.asarray(pick(x)), select_topk(x.astype(np.float64), k)), (x, k)


@pytest.mark.parametrize("in_place", [False, True], ids=["copying", "in_place"])
def test_indexer_long_decode_row_is_judged_right(monkeypatch, in_place):
    """A decode step of a DeepSeek V3.2-style indexer (head weights, ReLU, RoPE, LayerNorm key) over 40 cached
    index keys, with impl_jax's long-row path lowered to take it (jitted, the scores with the keys as rows, the
    top-k from its candidates): its scores and selection judged against the float64 reference
    (conformance.suite.selection.judge_indexer). in_place: the cache a buffer of 44 rows (cache_length 40),
    read in blocks of 16 (the last clamped back over 4); the returned buffer holds the cache, the new key
    where the copying call puts it, and the spare rows untouched."""
    pytest.importorskip("jax")  # the numpy env runs every file with no framework installed
    import impl_jax.indexer as jix
    from conformance.suite.selection import judge_indexer
    from impl_numpy.indexer import lightning_indexer
    from weights import AttentionConfig, init

    monkeypatch.setattr(jix, "JIT_MIN_KEYS", 2)
    monkeypatch.setattr(jix, "INDEX_BLOCK", 16)
    ran = []
    for name in ("_one_query_scores", "_select_topk_partitioned", "_scores_in_blocks"):
        right = getattr(jix, name)
        monkeypatch.setattr(jix, name, lambda *a, right=right, name=name: ran.append(name) or right(*a))
    config = AttentionConfig(num_heads=4, query_dim=12, head_dim=8, use_value_bias=False,
                             rope={"theta": 10000.0, "rotary_dim": 4}, latent={"query_rank": 5, "kv_rank": 6, "rope_dim": 4},
                             indexer={"heads": 3, "head_dim": 8, "topk": 5, "key_norm": {"type": "layer"},
                                      "rope": {"rotary_dim": 4, "theta": 500.0}})
    tensors = init(config, seed=6, dtype="float32")
    x = np.random.default_rng(9).standard_normal((2, 41, 12)).astype(np.float32)
    cache = lightning_indexer(config, tensors, x[:, :40], dtype="float32")["present_index_keys"]
    inputs = {"query": x[:, 40:], "past_index_keys": cache}
    if in_place:
        buffer = np.full((2, 44, cache.shape[-1]), 7.0, np.float32)  # the spare rows: 7, to be left as they are
        buffer[:, :40] = cache
        got = jix.lightning_indexer(config, tensors, inputs["query"], past_index_keys=buffer, cache_length=40,
                                    return_scores=True)
        copying = jix.lightning_indexer(config, tensors, inputs["query"], past_index_keys=cache)["present_index_keys"]
        present = np.asarray(got["present_index_keys"])
        assert present.shape == buffer.shape and np.array_equal(present[:, :40], cache)
        assert np.array_equal(present[:, 41:], buffer[:, 41:])
        np.testing.assert_allclose(present[:, 40], np.asarray(copying)[:, 40], rtol=1e-6, atol=1e-6)  # the same
        # stages (index_keys) on the same float32 inputs: equal up to a reordered sum
    else:
        got = jix.lightning_indexer(config, tensors, inputs["query"], past_index_keys=cache, return_scores=True)
    want = ["_one_query_scores", "_scores_in_blocks", "_select_topk_partitioned"] if in_place else \
        ["_one_query_scores", "_select_topk_partitioned"]
    assert sorted(set(ran)) == want, ran
    result = {"topk_indices": np.asarray(got["topk_indices"]), "index_scores": np.asarray(got["index_scores"])}
    verdicts = judge_indexer(config, tensors, inputs, result, dtype="float32")
    assert verdicts and all(v.ok for v in verdicts), [v.describe() if hasattr(v, "describe") else v for v in verdicts]


def test_in_place_index_cache_refusals():
    """cache_length without a buffer, past its room, or not an int: a ValueError naming it."""
    pytest.importorskip("jax")  # the numpy env runs every file with no framework installed
    import impl_jax.indexer as jix
    from weights import AttentionConfig, init

    config = AttentionConfig(num_heads=2, query_dim=8, head_dim=4, indexer={"heads": 2, "head_dim": 4, "topk": 2,
                                                                                  "query_source": "input"})
    tensors = init(config, seed=1, dtype="float32")
    x = np.ones((1, 1, 8), np.float32)
    buffer = np.zeros((1, 5, 4), np.float32)
    for given, kwargs in (("past_index_keys None", dict(cache_length=2)),
                          ("0..4", dict(past_index_keys=buffer, cache_length=5)),
                          ("got 2.0", dict(past_index_keys=buffer, cache_length=2.0))):
        with pytest.raises(ValueError, match="cache_length") as info:
            jix.lightning_indexer(config, tensors, x, **kwargs)
        assert given in str(info.value), str(info.value)
