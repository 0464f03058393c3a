"""Every error path of a call: one line, naming the argument and the value."""

from __future__ import annotations

import numpy as np
import pytest

import weights
from impl_numpy import multi_head_attention
from weights import AttentionConfig

CONFIG = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, dropout=0.1)
TENSORS = weights.init(CONFIG, seed=0)
X = np.zeros((2, 3, 4), np.float32)

# (kwargs, exact message). Shared with the framework tests: every backend must
# say the same words (tests/test_<framework>.py import this table).
BAD_CALLS = [
    (dict(query=np.zeros((3, 4), np.float32)), "query must have shape (B, L, query_dim) = (B, L, 4): got rank 2 shape (3, 4)"),
    (dict(query=np.zeros((2, 3, 5), np.float32)), "query must have query_dim=4 features: got shape (2, 3, 5)"),
    (dict(key=np.zeros((3, 3, 4), np.float32)), "query, key and value must share the batch size B: got 2, 3, 3"),
    (dict(key=np.zeros((2, 3, 4), np.float32), value=np.zeros((2, 4, 4), np.float32)),
     "key and value must share the length S: got key shape (2, 3, 4), value shape (2, 4, 4)"),
    (dict(query=np.zeros((2, 0, 4), np.float32)), "query is empty: got shape (2, 0, 4); empty batches and sequences are refused"),
    (dict(mask=np.ones((3, 3), np.float32)), "mask must be bool with True = may attend: got dtype float32 (an additive float mask goes in bias=)"),
    (dict(mask=np.ones((2, 3), bool)), "mask has shape (2, 3), which does not broadcast to (B, N, T, S) = (2, 2, 3, 3); accepted: (T, S), (B, T, S), (B, 1, T, S) or (B, N, T, S)"),
    (dict(mask=np.ones((3,), bool)), "mask must have shape (T, S), (B, T, S), (B, 1, T, S) or (B, N, T, S): got rank 1 shape (3,)"),
    (dict(bias=np.ones((3, 3), bool)), "bias must be a float array: got dtype bool"),
    (dict(bias=np.full((3, 3), np.nan)), "bias must not contain NaN or +inf (use -inf to mask a position)"),
    (dict(is_causal=True, causal_alignment="bottom-right"), "causal_alignment must be one of top_left, bottom_right: got 'bottom-right'"),
    (dict(dropout_mask=np.ones((2, 2, 3, 3), bool)), "dropout_mask was given but training is false; pass training=True (CLI: --training)"),
    (dict(training=True), "training with dropout=0.1 needs dropout_mask (a bool keep-mask) or seed; got neither"),
    (dict(training=True, dropout_mask=np.ones((2, 3, 3), bool)), "dropout_mask must have shape (B, N, T, S) = (2, 2, 3, 3): got (2, 3, 3)"),
    (dict(dtype="int8"), "dtype must be one of float16, bfloat16, float32, float64: got 'int8'"),
    # cross-attention of equal lengths: the keys' ids are not the queries' (they defaulted to them)
    (dict(key=np.zeros((2, 3, 4), np.float32), segment_ids=np.zeros(3, np.int64)),
     "key_segment_ids is required when key or value is passed (only self-attention, where the keys are the "
     "queries, takes segment_ids for both): got segment_ids and no key_segment_ids"),
]


def call_numpy(kwargs):
    kwargs = dict(kwargs)
    query = kwargs.pop("query", X)
    return multi_head_attention(CONFIG, TENSORS, query, **kwargs)


@pytest.mark.parametrize("kwargs, message", BAD_CALLS, ids=[m[:40] for _, m in BAD_CALLS])
def test_bad_call_message(kwargs, message):
    with pytest.raises(ValueError) as info:
        call_numpy(kwargs)
    assert str(info.value) == message


def test_bad_tensors_are_listed():
    tensors = dict(TENSORS)
    del tensors["query.bias"]
    with pytest.raises(weights.WeightsFormatError, match="tensors: missing tensors: query.bias"):
        multi_head_attention(CONFIG, tensors, X)


def test_chunk_size_errors():
    with pytest.raises(ValueError, match="chunk_size cannot be combined with return_weights"):
        multi_head_attention(CONFIG, TENSORS, X, chunk_size=2, return_weights=True)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer: got 0"):
        multi_head_attention(CONFIG, TENSORS, X, chunk_size=0)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True, "8"])
def test_bad_chunk_size_is_refused_before_any_projection(chunk_size, monkeypatch):
    import impl_numpy.functional as functional

    def project(*args, **kwargs):
        raise AssertionError("a projection ran before chunk_size was checked")

    monkeypatch.setattr(functional, "project", project)
    with pytest.raises(ValueError) as err:
        multi_head_attention(CONFIG, TENSORS, X, chunk_size=chunk_size)
    assert str(err.value) == f"chunk_size must be a positive integer: got {chunk_size!r}"


def test_nan_in_query_propagates():
    x = X.copy()
    x[0, 1, 2] = np.nan
    out = multi_head_attention(CONFIG, TENSORS, x)
    assert np.isnan(out[0]).all(), "a NaN token reaches every output row of its sequence through keys/values"
    assert np.isfinite(out[1]).all(), "other sequences stay finite"


def test_inf_inputs_are_refused_nan_propagates():
    x = X.copy()
    x[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match=r"query contains \+-inf; NaN propagates"):
        multi_head_attention(CONFIG, TENSORS, x)
    # The case that motivated it: an infinite query made every logit -inf, and
    # the row silently took the masked-row policy.
    config = AttentionConfig(num_heads=1, query_dim=1, head_dim=1, use_query_bias=False, use_key_bias=False,
                             use_value_bias=False, use_output_bias=False)
    ones = {n: np.ones(s) for n, s in config.tensor_shapes().items()}
    with pytest.raises(ValueError, match="infinite inputs are refused"):
        multi_head_attention(config, ones, np.array([[[np.inf]]]), np.array([[[-1.0], [-2.0]]]))


def test_scores_that_cannot_fit_are_refused_up_front(monkeypatch):
    from weights import contract

    monkeypatch.setattr(contract, "available_memory_bytes", lambda: 64 * 2**20)  # 64 MiB
    x = np.zeros((1, 2048, 4), np.float32)  # (1, 2, 2048, 2048) float32 scores x 4 copies = 128 MiB
    with pytest.raises(ValueError, match=r"attention scores need about 0\.1 GiB, more than the 0\.1 GiB of memory"):
        multi_head_attention(CONFIG, TENSORS, x)
    out = multi_head_attention(CONFIG, TENSORS, x, chunk_size=256)  # the chunked path holds no (T, S) array
    assert out.shape == (1, 2048, 4)


def test_a_real_t_by_s_beyond_memory_is_refused():
    x = np.zeros((1, 2**20, 4), np.float32)  # 4 TiB of scores
    with pytest.raises(ValueError, match="attention scores need about"):
        multi_head_attention(CONFIG, TENSORS, x)


@pytest.mark.parametrize("backend_id", ["numpy", pytest.param("torch", marks=pytest.mark.torch),
                                        pytest.param("tf", marks=pytest.mark.tf), pytest.param("jax", marks=pytest.mark.jax)])
def test_inf_inputs_get_the_same_words_from_every_adapter(backend_id):
    from conformance.suite import backends

    ok, reason = backends.availability(backend_id)
    if not ok:
        pytest.skip(reason)
    x = X.copy()
    x[0, 0, 0] = -np.inf
    with pytest.raises(ValueError) as info:
        backends.load(backend_id).forward(CONFIG, TENSORS, {"query": x}, {})
    assert str(info.value) == ("query contains +-inf; NaN propagates but infinite inputs are refused "
                               "(an infinite logit would look like a masked one)")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_the_one_pass_finiteness_check_is_exact(dtype):
    """extremes_finite decides by the sum where it is finite, by min and max where it is not: finite values whose
    sum overflows are accepted; a NaN, an infinity, or infinities of both signs (whose sum is NaN) among them,
    or among ordinary values, are refused wherever they sit."""
    from weights.dtypes import extremes_finite

    big = np.finfo(dtype).max
    for base in (np.ones(1000, dtype=dtype), np.full(1000, big, dtype=dtype), np.tile([big, -big], 500).astype(dtype)):
        assert extremes_finite(base)
        for bad in ([np.nan], [np.inf], [-np.inf], [np.inf, -np.inf], [np.nan, np.inf]):
            for at in (0, 517, 999):
                x = base.copy()
                x[at:at + len(bad)] = bad[:len(x) - at]
                assert not extremes_finite(x), (base[:2], bad, at)


@pytest.mark.parametrize("dtype, big", [("float16", 6.0e4), ("bfloat16", 3.0e38), ("float32", 3.0e38), ("float64", 1.7e308)])
def test_finite_checks_catch_one_bad_element_in_every_dtype(dtype, big):
    """The weight and input checks run in the array's own dtype (bfloat16
    through float64): a lone NaN/Inf is still found, and the largest finite
    values are not mistaken for one."""
    from weights.contract import check_input_values

    tensors = weights.init(CONFIG, seed=0, dtype=dtype)
    huge = {name: np.full(t.shape, big, dtype=t.dtype) for name, t in tensors.items()}
    assert weights.validate_tensors(CONFIG, huge) == np.dtype(tensors["output.kernel"].dtype)
    check_input_values(query=np.full((2, 3, 4), big, dtype=tensors["output.kernel"].dtype))
    for bad in (np.nan, np.inf, -np.inf):
        broken = dict(tensors)
        broken["output.kernel"] = tensors["output.kernel"].copy()
        broken["output.kernel"].flat[-1] = bad
        with pytest.raises(weights.WeightsFormatError, match="output.kernel contains NaN or Inf"):
            weights.validate_tensors(CONFIG, broken)
        x = np.zeros((2, 3, 4), dtype=tensors["output.kernel"].dtype)
        x.flat[-1] = bad
        if np.isnan(bad):
            check_input_values(query=x)  # NaN propagates
            x.flat[0] = np.inf  # ... but does not hide an inf elsewhere (NaN is both extremes of x)
            with pytest.raises(ValueError, match=r"query contains \+-inf"):
                check_input_values(query=x)
        else:
            with pytest.raises(ValueError, match=r"query contains \+-inf"):
                check_input_values(query=x)


def test_checked_tensors_are_proven_once_and_held_read_only():
    """weights.CheckedTensors: its construction refuses what validate_tensors refuses (a NaN weight); its arrays
    are its own, read-only copies (the caller's array changing afterwards changes nothing); a call with them
    gives the plain dict's output; a call still checks their names and shapes against its own config; and
    impl_numpy's layer holds its tensors so."""
    import impl_numpy

    tensors = weights.init(CONFIG, seed=0, dtype="float64")
    broken = dict(tensors, **{"output.kernel": tensors["output.kernel"].copy()})
    broken["output.kernel"].flat[3] = np.nan
    with pytest.raises(weights.WeightsFormatError, match="output.kernel contains NaN or Inf"):
        weights.CheckedTensors(CONFIG, broken)
    mine = {name: t.copy() for name, t in tensors.items()}
    checked = weights.CheckedTensors(CONFIG, mine)
    mine["output.kernel"].flat[3] = np.nan  # the caller's array, not the checked copy
    assert np.isfinite(checked["output.kernel"]).all() and not checked["output.kernel"].flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        checked["query.kernel"][0] = 0.0
    x = np.random.default_rng(5).standard_normal((2, 3, 4))
    assert np.array_equal(multi_head_attention(CONFIG, checked, x), multi_head_attention(CONFIG, tensors, x))
    with pytest.raises(weights.WeightsFormatError, match="has shape"):  # 4 heads of 1 against the tensors' 2 of 2
        multi_head_attention(CONFIG.replace(num_heads=4, head_dim=1), checked, x)
    layer = impl_numpy.MultiHeadAttention(CONFIG, tensors)
    assert isinstance(layer.tensors, weights.CheckedTensors)
    assert np.array_equal(layer(x), multi_head_attention(CONFIG, tensors, x))
