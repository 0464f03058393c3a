"""The lightning indexer's contract field and its NumPy spec (impl_numpy.indexer), against an independent
formulation: the scores written out per query, key and head with Python's complex numbers for RoPE, the
selection by sorting (score, key) pairs. The independent formulation shares nothing with the code under test
but the config. Each case is a few tokens (milliseconds)."""

from __future__ import annotations

import cmath
import math

import numpy as np
import pytest

from impl_numpy import indexer
from impl_numpy.indexer import lightning_indexer, quantize_fp8, select_topk
from weights import AttentionConfig, init

pytestmark = pytest.mark.reference

D, QR = 12, 5
DSA = dict(num_heads=4, query_dim=D, head_dim=8, use_value_bias=False, rope={"theta": 10000.0, "rotary_dim": 4},
           latent={"query_rank": QR, "kv_rank": 6, "rope_dim": 4})


def _dsa(interleaved: bool, topk: int = 3, **extra) -> AttentionConfig:
    """DeepSeek V3.2 (half-split) / GLM-5 (interleaved): the query latent, a LayerNorm on the key, RoPE on the
    first 4 of 8 features, head weights, ReLU."""
    return AttentionConfig(**DSA, indexer={"heads": 3, "head_dim": 8, "topk": topk, "key_norm": {"type": "layer"},
                                           "rope": {"rotary_dim": 4, "interleaved": interleaved, "theta": 500.0},
                                           **extra})


def _m3(topk: int = 2, block_size: int = 2, local_blocks: int = 1) -> AttentionConfig:
    """MiniMax M3: the query input, per-head RMS norms, partial RoPE, no weights, no ReLU, scale 1, blocks of
    keys per kv head, local blocks."""
    return AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=D, head_dim=8, rope={"rotary_dim": 4},
                           indexer={"heads": 2, "head_dim": 8, "topk": topk, "query_source": "input",
                                    "query_norm": {"type": "rms"}, "key_norm": {"type": "rms"},
                                    "rope": {"rotary_dim": 4}, "head_weights": False, "relu": False,
                                    "score_scale": 1.0, "per_kv_head": True, "block_size": block_size,
                                    "local_blocks": local_blocks})


def _x(B=2, T=7, seed=0):
    return np.random.default_rng(seed).standard_normal((B, T, D))


# -- the independent formulation --------------------------------------------------------------------------

def _norm(v, kind, eps, scale, bias):
    if kind == "layer":
        mean = sum(v) / len(v)
        v = [a - mean for a in v]
    r = math.sqrt(sum(a * a for a in v) / len(v) + eps)
    out = [a / r * (1.0 if scale is None else scale[i]) for i, a in enumerate(v)]
    return [a + (0.0 if bias is None else bias[i]) for i, a in enumerate(out)]


def _turn(v, pos, R, interleaved, theta):
    """RoPE on v[:R] as complex multiplication: pair i is (2i, 2i+1) or (i, i + R/2)."""
    v = list(v)
    for i in range(R // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + R // 2)
        z = complex(v[a], v[b]) * cmath.exp(1j * pos * theta ** (-2 * i / R))
        v[a], v[b] = z.real, z.imag
    return v


def _independent_scores(config, t, x):
    """(B, G, T, S) float64 scores with -inf where causal masks, from loops."""
    ix, (B, T, _) = config.indexer, x.shape
    I, J = ix.heads, ix.head_dim
    out = np.full((B, I if ix.per_kv_head else 1, T, T), -np.inf)
    for b in range(B):
        keys = []
        for s in range(T):
            k = [sum(x[b, s, d] * t["indexer.key.kernel"][d, j] for d in range(D)) for j in range(J)]
            kn = ix.key_norm
            k = _norm(k, kn.type, kn.eps, t.get("indexer.key.norm.scale"), t.get("indexer.key.norm.bias"))
            keys.append(_turn(k, s, ix.rope.rotary_dim, ix.rope.interleaved, ix.rope.theta))
        for q_at in range(T):
            src = list(x[b, q_at])
            if ix.query_source == "latent":
                src = [sum(src[d] * t["query.down.kernel"][d, r] for d in range(D)) + t["query.down.bias"][r]
                       for r in range(QR)]
                src = _norm(src, "rms", config.latent.eps, t["query.down.norm.scale"], None)
            heads = []
            for i in range(I):
                q = [sum(src[d] * t["indexer.query.kernel"][d, i, j] for d in range(len(src))) for j in range(J)]
                if ix.query_norm is not None:
                    q = _norm(q, ix.query_norm.type, ix.query_norm.eps, t["indexer.query.norm.scale"], None)
                heads.append(_turn(q, q_at, ix.rope.rotary_dim, ix.rope.interleaved, ix.rope.theta))
            for s in range(q_at + 1):
                per_head = []
                for i in range(I):
                    d = ix.effective_score_scale * sum(a * c for a, c in zip(heads[i], keys[s]))
                    per_head.append(max(d, 0.0) if ix.relu else d)
                if ix.per_kv_head:
                    out[b, :, q_at, s] = per_head
                elif ix.head_weights:
                    w = [ix.effective_weight_scale * sum(x[b, q_at, d] * t["indexer.weights.kernel"][d, i]
                                                         for d in range(D)) for i in range(I)]
                    out[b, 0, q_at, s] = sum(a * c for a, c in zip(w, per_head))
                else:
                    out[b, 0, q_at, s] = sum(per_head)
    return out


def _independent_selection(scores, k):
    """Sort (-score, key) pairs: highest first, ties to the lower key; -inf keys dropped; pad -1."""
    rows = scores.reshape(-1, scores.shape[-1])
    width = min(k, scores.shape[-1])
    out = []
    for row in rows:
        ranked = sorted((-float(v), j) for j, v in enumerate(row) if v > -math.inf)[:width]
        out.append([j for _, j in ranked] + [-1] * (width - len(ranked)))
    return np.array(out).reshape(*scores.shape[:-1], width)


def _close(name, got, want, rtol=1e-12):
    """float64 agreement: the two formulations sum the same terms in other orders (a few ulps of the largest
    term; 1e-12 relative to the largest score is ~4500 ulps, far below any score difference that matters)."""
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got)), f"{name}: the masked entries differ"
    err = np.abs(got[finite] - want[finite]).max()
    scale = np.abs(want[finite]).max()
    assert err <= rtol * scale, f"{name}: max abs error {err:.3g} over {rtol:g} x {scale:.3g}"


@pytest.mark.parametrize("interleaved", [False, True], ids=["v32-half-split", "glm5-interleaved"])
def test_dsa_scores_and_selection_match_the_independent_formulation(interleaved):
    config = _dsa(interleaved)
    t = init(config, seed=1, dtype="float64")
    x = _x()
    got = lightning_indexer(config, t, x, return_scores=True)
    want = _independent_scores(config, t, x)
    _close("index_scores", got["index_scores"], want)
    expected = _independent_selection(want, 3)[:, 0]
    assert np.array_equal(got["topk_indices"], expected), f"{got['topk_indices']} != {expected}"
    assert got["topk_indices"].shape == (2, 7, 3)
    assert (got["topk_indices"][:, 0, 1:] == -1).all(), "query 0 sees one key: its spare slots must be -1"


def test_the_pairing_matters():
    """The two pairings give other scores on the same weights: a port that swaps them is visible."""
    t = init(_dsa(False), seed=1, dtype="float64")
    a = lightning_indexer(_dsa(False), t, _x(), return_scores=True)["index_scores"]
    b = lightning_indexer(_dsa(True), t, _x(), return_scores=True)["index_scores"]
    finite = np.isfinite(a)
    assert np.abs(a[finite] - b[finite]).max() > 1e-3 * np.abs(a[finite]).max()


def test_m3_blocks_per_kv_head_with_local_blocks():
    config = _m3(topk=2, block_size=2, local_blocks=1)
    t = init(config, seed=2, dtype="float64")
    x = _x(T=9)
    got = lightning_indexer(config, t, x, return_scores=True)
    want = _independent_scores(config, t, x)
    _close("index_scores", got["index_scores"], want)
    B, G, T, S = want.shape
    blocks = np.full((B, G, T, 5), -np.inf)
    for j in range(5):
        blocks[..., j] = want[..., 2 * j:2 * j + 2].max(axis=-1)
    for q in range(T):  # the query's own block always kept
        blocks[:, :, q, q // 2] = np.inf
    expected_blocks = _independent_selection(blocks, 2)
    assert np.array_equal(got["topk_blocks"], expected_blocks), f"{got['topk_blocks']} != {expected_blocks}"
    assert got["topk_indices"].shape == (B, G, T, 4)
    for b, g, q in np.ndindex(B, G, T):
        keys = [k for blk in expected_blocks[b, g, q] if blk >= 0 for k in (2 * blk, 2 * blk + 1) if k <= q]
        row = list(got["topk_indices"][b, g, q])
        assert row == keys + [-1] * (4 - len(keys)), (b, g, q, row, keys)


def test_tie_rule_and_padding():
    """Equal scores go to the lower key; -inf (masked) slots are -1 at the end; width min(k, n)."""
    x = np.array([[[0.5, 2.0, 0.5, 2.0, -np.inf, 0.0]]])
    assert select_topk(x, 3).tolist() == [[[1, 3, 0]]]
    assert select_topk(x, 6).tolist() == [[[1, 3, 0, 2, 5, -1]]]
    assert select_topk(x[..., :2], 5).tolist() == [[[1, 0]]]
    zeros = np.zeros((1, 1, 4))  # a ReLU that zeroed every score: the first keys, in order
    assert select_topk(zeros, 2).tolist() == [[[0, 1]]]


def test_partitioned_top_k_is_the_sorted_selection():
    """select_topk's partitioned path (few long rows: the candidates at or above the k-th largest score, then
    sorted) against sorting (score, key) pairs: rows of many ties, -inf and NaN, k from 1 to the row's
    length."""
    rng = np.random.default_rng(5)
    for trial in range(200):
        n, k = int(rng.integers(1, 60)), int(rng.integers(1, 70))
        x = rng.integers(-2, 3, size=(2, 1, n)).astype(np.float32)  # five values: ties everywhere
        x[rng.random(x.shape) < 0.2] = -np.inf
        if trial % 4 == 0:
            x[rng.random(x.shape) < 0.1] = np.nan
        want = _independent_selection(x, k)
        assert np.array_equal(indexer._select_topk_partitioned(x, min(k, n)), want), (x, k)
        assert np.array_equal(select_topk(x, k), want), (x, k)


@pytest.mark.parametrize("extra", [{}, {"head_weights": False}], ids=["weighted", "unweighted"])
def test_decode_scores_with_keys_as_rows_match_the_independent_formulation(monkeypatch, extra):
    """A decode step's scores with the keys as the rows (indexer._decode_scores, from 4096 keys on: from 2 here)
    and its selection by the partitioned top-k: the independent formulation's, for the last query."""
    monkeypatch.setattr(indexer, "DECODE_SCORES_MIN_KEYS", 2)
    config = _dsa(False, topk=1, **extra)
    t = init(config, seed=6, dtype="float64")
    x = _x()
    cache = lightning_indexer(config, t, x[:, :6])["present_index_keys"]
    step = lightning_indexer(config, t, x[:, 6:], past_index_keys=cache, return_scores=True)
    want = _independent_scores(config, t, x)[:, :, 6:]
    _close("index_scores", step["index_scores"], want)
    assert np.array_equal(step["topk_indices"], _independent_selection(want, 1)[:, 0])


def test_padding_mask_acts_before_the_selection():
    config = _dsa(False, topk=4)
    t = init(config, seed=3, dtype="float64")
    mask = np.ones((2, 7, 7), dtype=bool)
    mask[0, :, :2] = False  # batch row 0: its first two tokens are left padding
    got = lightning_indexer(config, t, _x(), mask=mask)["topk_indices"]
    assert not np.isin(got[0], [0, 1]).any(), got[0]
    assert (got[0, :2] == -1).all() and (got[0, 2, 1:] == -1).all(), got[0, :3]


@pytest.mark.parametrize("make", [lambda: _dsa(True), lambda: _m3(topk=2, block_size=2)], ids=["dsa", "m3"])
def test_decode_from_the_index_cache_matches_prefill(make):
    """Prefill 4 tokens, then decode 3 one at a time from present_index_keys: each step selects what the
    7-token prefill selects for that query (same keys, same order) and returns the same cache."""
    config = make()
    t = init(config, seed=4, dtype="float64")
    x = _x()
    full = lightning_indexer(config, t, x, return_scores=True)
    step = lightning_indexer(config, t, x[:, :4])
    cache = step["present_index_keys"]
    for i in range(4, 7):
        step = lightning_indexer(config, t, x[:, i:i + 1], past_index_keys=cache)
        cache = step["present_index_keys"]
        got, want = step["topk_indices"][..., 0, :], full["topk_indices"][..., i, :]
        width = got.shape[-1]
        assert np.array_equal(got, want[..., :width]) and (want[..., width:] == -1).all(), (i, got, want)
    assert np.allclose(cache, full["present_index_keys"], rtol=1e-13, atol=0), "the index cache differs"


@pytest.mark.parametrize("make", [lambda: _dsa(True), lambda: _m3(topk=2, block_size=2), lambda: _kpool()],
                         ids=["dsa", "m3", "kpool"])
def test_decode_into_an_in_place_index_cache_matches_prefill(make):
    """cache_length: prefill 4 tokens into a buffer of 9 rows, then decode 3 one at a time in place: each step
    selects what the 7-token prefill (copying, no buffer) selects for that query, returns the buffer itself, and
    leaves the buffer's rows past P+S as they were (the write is the new rows alone)."""
    config = make()
    t = init(config, seed=4, dtype="float64")
    x = _x()
    full = lightning_indexer(config, t, x)
    width = config.indexer.cache_width
    buffer = np.full((2, 9, width), 7.0)
    step = lightning_indexer(config, t, x[:, :4], past_index_keys=buffer, cache_length=0)
    assert step["present_index_keys"] is buffer
    for i in range(4, 7):
        step = lightning_indexer(config, t, x[:, i:i + 1], past_index_keys=buffer, cache_length=i)
        assert step["present_index_keys"] is buffer
        got, want = step["topk_indices"][..., 0, :], full["topk_indices"][..., i, :]
        width_k = got.shape[-1]
        assert np.array_equal(got, want[..., :width_k]) and (want[..., width_k:] == -1).all(), (i, got, want)
    assert np.allclose(buffer[:, :7], full["present_index_keys"], rtol=1e-13, atol=0), "the index cache differs"
    assert (buffer[:, 7:] == 7.0).all(), "rows past the cache were written"


def test_in_place_index_cache_refusals():
    """cache_length's bad inputs: one line naming cache_length and what was received."""
    config = _dsa(True)
    t = init(config, seed=4, dtype="float64")
    x = _x(T=2)
    bad = [(dict(past_index_keys=None, cache_length=0), "cache_length needs past_index_keys"),
           (dict(past_index_keys=np.zeros((2, 5, 8), np.float32), cache_length=0), "storage dtype float64"),
           (dict(past_index_keys=np.zeros((2, 5, 8)), cache_length=4), "cache_length must be an int in 0..C-S = 0..3"),
           (dict(past_index_keys=np.zeros((2, 5, 8)), cache_length=-1), "got -1"),
           (dict(past_index_keys=np.zeros((2, 5, 8)), cache_length=1.0), "got 1.0")]
    frozen = np.zeros((2, 5, 8))
    frozen.flags.writeable = False
    bad.append((dict(past_index_keys=frozen, cache_length=0), "writeable numpy array"))
    for kwargs, words in bad:
        with pytest.raises(ValueError, match="cache_length") as info:
            lightning_indexer(config, t, x, **kwargs)
        assert words in str(info.value) and "\n" not in str(info.value), (kwargs, str(info.value))


def test_fp8_simulation_follows_deepseek_quantisation():
    """Each quantised value is an e4m3 number (|q| <= 448, at most 3 mantissa bits), the block's largest is
    near 448, ue8m0 scales are powers of two; the fp8 scores stay within fp8's error of the exact ones."""
    x = np.random.default_rng(5).standard_normal((3, 8)) * 3
    for fmt in ("float", "ue8m0"):
        q, s = quantize_fp8(x, 8, fmt)
        mant, _ = np.frexp(q[q != 0])
        assert np.all(np.abs(q) <= 448) and np.all((mant * 16) == np.round(mant * 16)), q
        if fmt == "ue8m0":
            assert np.all(np.log2(s) == np.round(np.log2(s))), s
        else:
            assert np.allclose(np.abs(q).max(axis=-1), 448, rtol=2 ** -4), q
        assert np.abs(q * s - x).max() <= 2 ** -4 * np.abs(x).max(axis=-1, keepdims=True).max(), fmt
    config = _dsa(False)
    t = init(config, seed=6, dtype="float64")
    exact = lightning_indexer(config, t, _x(), return_scores=True)
    fp8 = lightning_indexer(config, t, _x(), precision="fp8_e4m3", return_scores=True)
    finite = np.isfinite(exact["index_scores"])
    err = np.abs(fp8["index_scores"][finite] - exact["index_scores"][finite])
    # two e4m3 factors, each within 2^-4 relative of its block's largest: at most ~2 * 2^-4 of the magnitude
    bound = 2 * 2 ** -4 * exact["index_score_magnitudes"][finite] * math.sqrt(8)
    assert np.all(err <= bound), f"worst {np.max(err / bound):.3g} of the bound"
    assert err.max() > 0, "fp8 changed nothing: the simulation did not run"


def test_the_config_field():
    config = _m3()
    assert AttentionConfig.from_json(config.to_json()) == config
    plain = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    assert "indexer" not in plain.to_json() and "indexer" not in str(plain.tensor_shapes())
    assert set(config.tensor_shapes()) >= {"indexer.query.kernel", "indexer.query.norm.scale",
                                           "indexer.key.kernel", "indexer.key.norm.scale"}
    assert "indexer.weights.kernel" in _dsa(False).tensor_shapes()
    bad = [({"heads": 2, "head_dim": 8}, "indexer is missing topk"),
           ({"heads": 2, "head_dim": 8, "topk": 0}, "indexer.topk must be a positive integer: got 0"),
           ({"heads": 2, "head_dim": 8, "topk": 1, "query_source": "input", "block_size": 4, "local_blocks": 2},
            "indexer.local_blocks must be at most indexer.topk"),
           ({"heads": 2, "head_dim": 8, "topk": 1, "query_source": "input", "rope": {"rotary_dim": 10}},
            "indexer.rope.rotary_dim must be at most indexer.head_dim"),
           ({"heads": 2, "head_dim": 8, "topk": 1}, "indexer.query_source latent needs latent.query_rank"),
           ({"heads": 3, "head_dim": 8, "topk": 1, "query_source": "input", "per_kv_head": True,
             "head_weights": False}, "indexer.per_kv_head needs indexer.heads equal to num_kv_heads"),
           ({"heads": 2, "head_dim": 8, "topk": 1, "unknown": 1}, "indexer has unknown fields: 'unknown'")]
    for value, words in bad:
        with pytest.raises(ValueError, match=words.replace(".", r"\.")) as err:
            AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=D, head_dim=8, indexer=value)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="precision fp8_e4m3 needs indexer.head_dim a power of two"):
        c = AttentionConfig(num_heads=2, query_dim=D, head_dim=6, indexer={"heads": 2, "head_dim": 6, "topk": 1,
                                                                          "query_source": "input"})
        lightning_indexer(c, init(c, seed=0), _x(), precision="fp8_e4m3")


def _kpool(topk: int = 2, block_size: int = 3, open_block: bool = True) -> AttentionConfig:
    """GLM-5.3-Flash's k-pool (glm5_next): the DSA indexer without RoPE, blocks scored by gated pooled keys."""
    return AttentionConfig(**DSA, indexer={"heads": 3, "head_dim": 8, "topk": topk, "key_norm": {"type": "layer"},
                                           "block_size": block_size, "block_pool": "gated", "open_block": open_block})


def _kpool_independent(config, t, x, P):
    """The k-pool's selection written out per query: each block's pooled key feature by feature (Python's
    math.exp over its slots), its score per head, candidates the blocks whose every key is at or before the
    query, sorted by (-score, block), the top blocks' keys, then the query's own block's keys up to it when
    that block is not complete. x (B, P + T, D): the first P tokens the cache's. -> [set of keys] per (b, t)."""
    ix = config.indexer
    bs, J, I_ = ix.block_size, ix.head_dim, ix.heads
    B, S, _ = x.shape
    latent = x @ t["query.down.kernel"] + t.get("query.down.bias", 0.0)
    latent = latent / np.sqrt((latent ** 2).mean(-1, keepdims=True) + config.latent.eps) * t["query.down.norm.scale"]
    q = (latent @ t["indexer.query.kernel"].reshape(QR, -1)).reshape(B, S, I_, J)
    k = x @ t["indexer.key.kernel"]
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + ix.key_norm.eps)
    k = k * t["indexer.key.norm.scale"] + t["indexer.key.norm.bias"]
    g = x @ t["indexer.pool.gate.kernel"]
    w = x @ t["indexer.weights.kernel"] * I_ ** -0.5
    out = []
    for b in range(B):
        for i in range(P, S):
            pooled = {}
            for blk in range(S // bs):
                keys = range(blk * bs, blk * bs + bs)
                if keys[-1] > i:
                    continue
                pooled[blk] = []
                for f in range(J):
                    e = [math.exp(g[b, j, f] + t["indexer.pool.position"][j - blk * bs, f]) for j in keys]
                    pooled[blk].append(sum(e_j * k[b, j, f] for e_j, j in zip(e, keys)) / sum(e))
            score = {blk: sum(w[b, i, h] * max(0.0, float(np.dot(q[b, i, h], p)) * J ** -0.5) for h in range(I_))
                     for blk, p in pooled.items()}
            chosen = sorted(score, key=lambda blk: (-score[blk], blk))[:ix.topk]
            keys = {blk * bs + j for blk in chosen for j in range(bs)}
            own = i // bs
            if ix.open_block and own * bs + bs - 1 > i:
                keys |= set(range(own * bs, i + 1))
            out.append(keys)
    return out


@pytest.mark.parametrize("open_block", [True, False])
def test_kpool_against_an_independent_formulation(open_block):
    """GLM-5.3-Flash's k-pool (block_pool gated, open_block) against _kpool_independent: a prefill of 10 tokens
    (3 complete blocks of 3, 2 kept) and a decode of one token from the returned [key | gate] cache."""
    config = _kpool(open_block=open_block)
    t = init(config, seed=9, dtype="float64")
    t["indexer.pool.position"] = np.random.default_rng(1).standard_normal(t["indexer.pool.position"].shape)
    x = np.random.default_rng(4).standard_normal((2, 11, D))
    pre = lightning_indexer(config, t, x[:, :10])
    step = lightning_indexer(config, t, x[:, 10:], past_index_keys=pre["present_index_keys"])
    assert pre["present_index_keys"].shape == (2, 10, 16) and pre["topk_indices"].shape[-1] == 6 + 2 * open_block
    for got, P, width in ((pre, 0, 10), (step, 10, 11)):
        ours = [{int(j) for j in row if j >= 0} for row in got["topk_indices"].reshape(-1, got["topk_indices"].shape[-1])]
        want = _kpool_independent(config, t, x[:, :width], P)
        assert ours == want, f"P={P}: {ours} against {want}"
    assert {0, 1, 2} - want[-1] or {3, 4, 5} - want[-1] or {6, 7, 8} - want[-1], "the selection drops no block"


def test_kpool_selections_are_judged():
    """judge_indexer on a k-pool: the float32 reference's own selection passes; its open block dropped, its
    pools max-pooled (M3's path) and its pools not expanded (pool numbers as keys) each fail."""
    from conformance.suite.selection import judge_indexer

    config = _kpool()
    t = init(config, seed=9, dtype="float64")
    x = np.random.default_rng(4).standard_normal((2, 11, D))
    ok = lightning_indexer(config, t, x.astype(np.float32), dtype="float32")

    def verdicts(selection):
        return judge_indexer(config, t, {"query": x}, {"topk_indices": selection}, dtype="float32")

    assert all(v.ok for v in verdicts(ok["topk_indices"])), [v.describe() for v in verdicts(ok["topk_indices"])]
    no_tail = lightning_indexer(config.replace(indexer={**config.indexer.to_dict(), "open_block": False}), t, x)
    maxed = lightning_indexer(config.replace(indexer={**config.indexer.to_dict(), "block_pool": "max",
                                                      "open_block": False}), t, x)
    for name, bad in (("open block dropped", no_tail["topk_indices"]), ("max-pooled", maxed["topk_indices"]),
                      ("not expanded", ok["topk_blocks"][:, 0])):
        assert not all(v.ok for v in verdicts(bad)), f"{name} passed the judge"


def test_kpool_fields():
    config = _kpool()
    assert AttentionConfig.from_json(config.to_json()) == config
    assert config.indexer.cache_width == 16 and _dsa(False).indexer.cache_width == 8
    assert config.tensor_shapes()["indexer.pool.gate.kernel"] == (D, 8)
    assert config.tensor_shapes()["indexer.pool.position"] == (3, 8)
    assert "block_pool" not in _m3().to_json() and "open_block" not in _m3().to_json(), "defaults must not serialise"
    base = {"heads": 3, "head_dim": 8, "topk": 1, "key_norm": {"type": "layer"}}
    bad = [({"block_pool": "mean"}, "indexer.block_pool must be one of max, gated: got 'mean'"),
           ({"block_pool": "gated"}, "indexer.block_pool gated needs block_size and local_blocks 0"),
           ({"block_size": 2, "open_block": True}, "indexer.open_block needs block_pool gated"),
           ({"block_size": 2, "block_pool": "gated", "open_block": 1}, "indexer.open_block must be")]
    for extra, words in bad:
        with pytest.raises(ValueError, match=words.replace(".", r"\.")) as err:
            AttentionConfig(**DSA, indexer={**base, **extra})
        assert "\n" not in str(err.value)
    t = init(config, seed=0)
    from weights.call import indexer_stages

    traced = []
    lightning_indexer(config, t, _x(), rec=lambda stage, value: traced.append(stage) or value)
    assert tuple(traced) == indexer_stages(config), "the named stages the traced mirrors (JAX, MLX) prepend are " \
                                                    f"not the spec's: {traced}"
    with pytest.raises(ValueError, match=r"past_index_keys must have shape \(B, P, 2J\) = \(2, P, 16\)"):
        lightning_indexer(config, t, _x(), past_index_keys=np.zeros((2, 3, 8)))
    with pytest.raises(ValueError, match="precision fp8_e4m3 needs indexer.block_pool max"):
        lightning_indexer(config, t, _x(), precision="fp8_e4m3")
    from weights import layouts

    m3_like = _m3().replace(indexer={**_m3().indexer.to_dict(), "local_blocks": 0, "block_pool": "gated"})
    for layout in ("hf-minimax", "hf-deepseek"):  # neither holds the pool's gate and slot positions
        problems = layouts.cannot_express(layout, m3_like if layout == "hf-minimax" else config)
        assert any("indexer.block" in p for p in problems), (layout, problems)


def test_a_weights_file_keeps_the_indexer_and_no_layout_drops_it_silently(tmp_path):
    from weights import layouts, load, save

    config = _m3()
    t = init(config, seed=7)
    save(tmp_path / "w.safetensors", config, t)
    again, tensors = load(tmp_path / "w.safetensors")
    assert again == config and all(np.array_equal(tensors[n], t[n]) for n in t) and set(tensors) == set(t)
    for layout in ("canonical", "torch-linears", "hf-llama"):
        problems = layouts.cannot_express(layout, config)
        assert any(p.startswith("indexer (") for p in problems), (layout, problems)


@pytest.mark.parametrize("make", [lambda: _dsa(True), lambda: _m3()], ids=["dsa", "m3"])
def test_the_trace_follows_indexer_stages(make):
    """The stages recorded (rec) are weights.call.INDEXER_STAGES' names, in its order; the mirrors use the same
    names (impl_torch/impl_jax/impl_tf indexer.py), so a divergence names a stage."""
    from weights.call import INDEXER_STAGES

    config = make()
    seen = []
    lightning_indexer(config, init(config, seed=8, dtype="float64"), _x(), precision="fp8_e4m3",
                      rec=lambda stage, value: seen.append(stage) or value)
    assert all(stage in INDEXER_STAGES for stage in seen), seen
    assert seen == sorted(seen, key=INDEXER_STAGES.index) and len(seen) == len(set(seen)), seen
    assert "indexer.scores" in seen and "indexer.selection" in seen
