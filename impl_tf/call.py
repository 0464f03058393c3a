"""One call of impl_tf's attention, validated and cast: the spec's checks
on shapes and dtypes (check_tensors, check_inputs), `prepare` (the checks,
then every tensor in its storage dtype) and the `Call` it returns, and the
buffers of an in-place cache (past_key_buffers: the caller's tf.Variables).
attention.py runs the call; this module imports neither it nor heads.py,
fused.py or chunked.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from weights import DTYPES, AttentionConfig, dtype_from_name, validate_tensors
from weights.call import OPTIONAL_INPUTS, record
from weights.contract import (
    CallShapes,
    check_bias_values,
    check_call,
    check_indexer_call,
    check_position_values,
    check_topk_values,
    in_place_buffer_error,
)
from weights.rope import mrope_axes

from . import backend as bk
from . import functional as F
from ._keras import BACKEND, TENSORFLOW, keras
from .backend import check_dtype, is_symbolic, to_tensor

ops = keras.ops


_is_symbolic = is_symbolic


def _static_shape(x) -> tuple[int, ...]:
    """Static shape; an unknown dimension (a traced batch) reads -1."""
    return tuple(-1 if d is None else int(d) for d in x.shape)


def _rank4(x):
    """(T, S) -> (1, 1, T, S); (B, T, S) -> (B, 1, T, S); rank 4 unchanged,
    the reading check_call has already accepted."""
    if len(x.shape) == 2:
        return x[None, None]  # (1, 1, T, S)
    if len(x.shape) == 3:
        return x[:, None]  # (B, 1, T, S)
    return x


def _size(static: int, x, axis: int):
    return static if static >= 0 else bk.shape(x)[axis]


def check_tensors(config: AttentionConfig, tensors) -> str:
    """validate_tensors on NumPy arrays; on framework tensors and variables,
    the same checks of names, shapes and dtype (values are not read).
    Returns the storage dtype's name."""
    expected = config.tensor_shapes()
    if len(tensors) == len(expected) and not any(isinstance(t, np.ndarray) for t in tensors.values()):
        # Framework tensors, the usual call: names, shapes and one dtype checked
        # here; anything amiss goes the long way for validate_tensors' words.
        try:
            same_shapes = all(tuple(tensors[name].shape) == shape for name, shape in expected.items())
            names = {F.dtype_name(tensors[name]) for name in expected} if same_shapes else set()
        except (KeyError, AttributeError, ValueError, TypeError):
            names = set()
        if len(names) == 1 and next(iter(names)) in DTYPES:
            return next(iter(names))
    proxies = {}
    for name, t in tensors.items():
        if isinstance(t, np.ndarray) or not (hasattr(t, "shape") and hasattr(t, "dtype")):
            proxies[name] = t
            continue
        try:
            dt = dtype_from_name(F.dtype_name(t))
        except ValueError:
            dt = np.dtype(object)
        proxies[name] = np.broadcast_to(np.zeros((), dt), tuple(t.shape))
    return validate_tensors(config, proxies).name




def check_inputs(config: AttentionConfig, dtype: str, query, key=None, value=None, *, is_causal=False,
                 causal_alignment="top_left", training=False, seed=None, return_weights=False, return_cache=False,
                 cache_length=None, materializes_scores=True, **optional):
    """The spec's checks on one call, shapes and dtypes only (plus bias values
    when they are concrete): ValueError with the spec's words. Returns CallShapes.
    optional: the OPTIONAL_INPUTS given (None or absent: not given).
    materializes_scores: the call holds (B, N, T, S) arrays (all but the chunked
    path), refused up front when they cannot fit in memory."""
    keys_given = key is not None or value is not None  # else self-attention: the keys are the queries
    key = query if key is None else key
    value = key if value is None else value
    for name, x in (("query", query), ("key", key), ("value", value)):
        got = F.dtype_name(x)
        if not keras.backend.is_float_dtype(got) and got != dtype:
            raise ValueError(f"{name} must be a float array: got dtype {got}")
    meta = {}
    for name in OPTIONAL_INPUTS:
        x = optional.get(name)
        meta[f"{name}_shape"] = None if x is None else _static_shape(x)
        meta[f"{name}_dtype"] = None if x is None else F.dtype_name(x)
    shapes = check_call(
        config, query_shape=_static_shape(query), key_shape=_static_shape(key), value_shape=_static_shape(value),
        **meta, is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        return_weights=return_weights, return_cache=return_cache, cache_length=cache_length,
        materializes_scores=materializes_scores, scores_itemsize=np.dtype(F.compute_dtype(dtype)).itemsize,
        keys_given=keys_given,
    )
    bias = optional.get("bias")
    if bias is not None and not _is_symbolic(bias):
        check_bias_values(ops.convert_to_numpy(bias))  # traced bias values are not inspected
    return shapes


def _tensor(x):
    return None if x is None else to_tensor(x)


@dataclasses.dataclass
class Call:
    """One validated call, every float tensor in its storage dtype (bias in the compute dtype)."""

    shapes: CallShapes
    params: dict[str, Any]
    query: Any  # (B, T, Dq)
    key: Any  # (B, S, Dk)
    value: Any  # (B, S, Dv)
    mask4: Any  # (B|1, N|1, T|1, S_total|1) bool, or None
    bias4: Any  # same, compute dtype, or None
    keep: Any  # dropout keep-mask (B, N, T, S_total), or None
    dtype: str
    T: Any  # int, or a traced scalar
    S_total: Any  # P + S: int, or a traced scalar
    positions: Any = None  # (B|1, T) int where the config reads positions (config.reads_positions)
    key_positions: Any = None  # (B|1, S)
    past_key: Any = None  # (B, K, P, H); with cache_length the caller's tf.Variable (B, K, C, H)
    past_value: Any = None  # (B, K, P, V); with cache_length (B, K, C, V)
    segment_ids: Any = None  # (T,) or (B, T)
    key_segment_ids: Any = None  # (S_total,) or (B, S_total)
    cache_length: int | None = None  # P of an in-place cache (past_key/past_value are buffers), else None
    P: Any = 0  # the cache's length: int, or a traced scalar
    past_key_positions: Any = None  # (B|1, P) the cached keys' positions (default 0..P-1), or None
    selection: Any = None  # config.indexer's selection (B, T, k) or (B, K, T, k), or None
    topk: Any = None  # the selection that joined mask4 (topk_indices, or the indexer's), or None
    present_index_keys: Any = None  # (B, P+S, J); with cache_length the caller's tf.Variable (B, C, J)
    # kv_shared (issue 42): the cache's last S = T entries, the queries' own keys and values (B, K, S, H|V)
    shared_key: Any = None
    shared_value: Any = None

    def allowed(self, config: AttentionConfig, is_causal: bool, causal_alignment: str):
        """mask AND causal AND window AND local chunks AND segments over every key (rank 4), or None."""
        return F.allowed_mask(self.mask4, self.T, self.S_total, is_causal, causal_alignment,
                              window_left=config.window_left, window_right=config.window_right,
                              segment_ids=self.segment_ids, key_segment_ids=self.key_segment_ids,
                              local_chunk=config.local_chunk, positions=self.positions,
                              key_positions=self.every_key_position)

    @property
    def every_key_position(self):
        """(B|1, P+S): the cache's keys at past_key_positions (0..P-1 by default), then key_positions (where
        the config reads positions)."""
        if self.key_positions is None:
            return None
        return F.all_key_positions(self.key_positions, self.P, self.past_key_positions)

    def temperature_positions(self, config: AttentionConfig):
        """(B|1, T): the positions the query temperature reads (functional.temperature_positions)."""
        return F.temperature_positions(self.positions, config.query_temperature.position, self.P, self.T)

    def rope_tables(self, config: AttentionConfig):
        """(inv_freq (R/2,), attention_factor) of this call: weights.rope.rope_tables, where LongRoPE picks its
        table by the call's largest position (its queries' and new keys'). Eagerly that position is read to
        the host (LongRoPE only); in a graph (tf.function, XLA, jax.jit) the table is selected by a where on
        max position + 1 > original_max_position_embeddings, nothing read to Python."""
        return F.rope_tables_of(config.rope, self.positions, self.key_positions)

    def alibi_bias(self, config: AttentionConfig):
        """ALiBi's (B|1, N, T, P+S) bias in compute dtype (functional.alibi_bias)."""
        return F.alibi_bias(self.params["alibi.slopes"], self.positions, self.every_key_position, self.dtype,
                            config.alibi_bias_dtype)

    @property
    def modern(self) -> bool:
        """Uses a cache or packed segments (the config's own features: config.is_modern)."""
        return self.past_key is not None or self.segment_ids is not None


def prepare(config, tensors, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, return_weights, dtype, positions=None, key_positions=None, past_key=None,
            past_value=None, segment_ids=None, key_segment_ids=None, return_cache=False, cache_length=None,
            materializes_scores=True, past_key_positions=None, topk_indices=None, past_index_keys=None,
            trace: list | None = None) -> Call:
    """Validate a call and cast everything to the storage dtype (an in-place
    cache's buffers excepted: they are the caller's variables, kept as given).
    With config.indexer its selection joins the mask (run_indexer), a trace receiving its stages first."""
    stored = check_tensors(config, tensors)
    dtype = check_dtype(stored if dtype is None else dtype_from_name(dtype).name)
    training = bool(training)
    query = to_tensor(query)
    keys_given = key is not None or value is not None  # else self-attention: the keys are the queries
    key = query if key is None else to_tensor(key)
    value = key if value is None else to_tensor(value)
    # An in-place cache's variables are checked by their shape and dtype, never read here: a read tensor
    # alive while the call writes a buffer would make that write copy the buffer whole
    if cache_length is not None and not TENSORFLOW:
        raise NotImplementedError(IN_PLACE_UNSUPPORTED)
    buffers = ("past_key", "past_value") if cache_length is not None else ()
    given = {name: x if name in buffers and _is_variable(x) else _tensor(x) for name, x in (
        ("mask", mask), ("bias", bias), ("dropout_mask", dropout_mask), ("positions", positions),
        ("key_positions", key_positions), ("past_key", past_key), ("past_value", past_value),
        ("segment_ids", segment_ids), ("key_segment_ids", key_segment_ids),
        ("past_key_positions", past_key_positions), ("topk_indices", topk_indices)) if x is not None}
    shapes = check_inputs(
        config, dtype, query, key if keys_given else None, value if keys_given else None, is_causal=is_causal,
        causal_alignment=causal_alignment, training=training,
        seed=seed, return_weights=return_weights, return_cache=return_cache, cache_length=cache_length,
        materializes_scores=materializes_scores, **given,
    )
    check_indexer_call(config, "topk_indices" in given, past_index_keys, shapes, cache_length)
    given_positions = given.get("positions")
    if config.query_temperature is not None and given_positions is not None and not _is_symbolic(given_positions):
        check_position_values(config, ops.convert_to_numpy(given_positions))  # traced positions are not read
    in_place = shapes.capacity is not None
    if in_place:
        given["past_key"], given["past_value"] = past_key_buffers(past_key, past_value, dtype)
    bias_t = given.get("bias")
    if bias_t is not None:
        bias_t = _rank4(F._cast(bias_t, F.compute_dtype(dtype)))  # (B|1, N|1, T|1, S_total|1)
    params = {name: F._cast(t, dtype) for name, t in tensors.items()}
    B, T, S = _size(shapes.B, query, 0), _size(shapes.T, query, 1), _size(shapes.S, key, 1)
    past_key, past_value = given.get("past_key"), given.get("past_value")
    P = shapes.P if in_place else 0 if past_key is None else _size(shapes.P, past_key, 2)
    S_total = S + P
    keep = given.get("dropout_mask")
    if training and keep is None and config.dropout > 0:
        keep = F.dropout_keep_mask((B, config.num_heads, T, S_total), config.dropout, seed)
    if not training:
        keep = None
    mask4 = None if "mask" not in given else _rank4(F._cast(given["mask"], "bool"))  # (B|1, N|1, T|1, S_total|1)
    if "topk_indices" in given:  # the selection joins the mask (impl_numpy's prepare): (B, 1|N, T, S_total)
        if not _is_symbolic(given["topk_indices"]):
            check_topk_values(ops.convert_to_numpy(given["topk_indices"]), shapes.P, shapes.S)
        selected = F.selection_mask(given["topk_indices"], config.num_heads, S_total)
        mask4 = selected if mask4 is None else ops.logical_and(mask4, selected)
    segment_ids, key_segment_ids = given.get("segment_ids"), given.get("key_segment_ids")
    if segment_ids is not None and key_segment_ids is None:
        key_segment_ids = segment_ids  # self-attention without a cache: the keys are the queries (check_call)
    rope = config.reads_positions  # RoPE, ALiBi, local chunks and the temperature read the positions
    call = Call(
        shapes=shapes, params=params, query=F._cast(query, dtype), key=F._cast(key, dtype),
        value=F._cast(value, dtype), mask4=mask4, bias4=bias_t, keep=keep, dtype=dtype, T=T, S_total=S_total,
        positions=F.default_positions(given.get("positions"), P, T) if rope else None,
        key_positions=F.default_positions(given.get("key_positions"), P, S) if rope else None,
        past_key=past_key if in_place or past_key is None else F._cast(past_key, dtype),
        past_value=past_value if in_place or past_value is None else F._cast(past_value, dtype),
        segment_ids=segment_ids, key_segment_ids=key_segment_ids, cache_length=shapes.P if in_place else None, P=P,
        past_key_positions=F.default_positions(given["past_key_positions"], 0, P)
        if rope and "past_key_positions" in given else None, topk=given.get("topk_indices"),
    )
    axes = None if config.rope is None else mrope_axes(config.rope)
    if axes is not None:  # multimodal RoPE: each rotating pair's position, (B|1, L, R/2); nothing reads the cache's
        call.positions = F.mrope_positions(given.get("positions"), P, T, axes)
        call.key_positions = F.mrope_positions(given.get("key_positions"), P, S, axes)
        call.past_key_positions = None
    if config.indexer is not None:
        run_indexer(config, call, is_causal, causal_alignment, given.get("positions"), given.get("key_positions"),
                    past_index_keys, rec=lambda stage, value: record(trace, stage, value))
    if config.kv_shared:
        share_cache(call)
    return call


def share_cache(call: Call) -> None:
    """kv_shared (issue 42; impl_numpy.attention.share_cache): the given cache's last S = T entries become
    call.shared_key / shared_value, read, never written; the cache before them is call.past_key / past_value (an
    in-place cache's tf.Variables stay whole)."""
    P, S = call.shapes.P, call.shapes.S
    past_key, past_value = (keras.ops.convert_to_tensor(x) for x in (call.past_key, call.past_value))
    call.shared_key, call.shared_value = past_key[:, :, P:P + S], past_value[:, :, P:P + S]
    if call.cache_length is None:
        call.past_key, call.past_value = past_key[:, :, :P], past_value[:, :, :P]


def run_indexer(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str, positions,
                key_positions, past_index_keys, rec=lambda stage, value: value) -> None:
    """impl_numpy.attention.run_indexer in keras.ops: the indexer's selection (impl_tf.indexer) over the keys
    every other mask shows (call.allowed before the selection joins it, any head's), joined to call.mask4;
    call.selection and call.present_index_keys set. On every Keras backend, traced too (jax.jit: the
    keras-jax adapter's). An in-place cache (TensorFlow only, as cache_length): past_index_keys a tf.Variable
    (B, C, J), the new index keys written at P..P+S-1 by XLA in the variable's own buffer (tf_only.write_rows: an
    eager sliced assign copies the whole buffer every step), the variable returned. No gradient flows through it
    (the selection is piecewise constant; the indexer's inputs are read through stop_gradient, so its
    variables get zeros)."""
    from .indexer import READS, lightning_indexer

    T, S, P = call.shapes.T, call.shapes.S, call.shapes.P
    allowed = call.allowed(config, is_causal, causal_alignment)
    mask = None
    if allowed is not None:  # any head's: (B|1, 1, T, P+S)
        mask = ops.broadcast_to(ops.any(allowed, axis=1, keepdims=True), (allowed.shape[0], 1, T, P + S))
    in_place = call.cache_length is not None and past_index_keys is not None
    if in_place and (not _is_variable(past_index_keys) or F.dtype_name(past_index_keys) != call.dtype):
        raise in_place_buffer_error("past_index_keys", f"be a tf.Variable of the storage dtype {call.dtype}",
                                    f"a {type(past_index_keys).__name__}")
    # in place, the variable itself goes to the indexer (its cache_length): the new rows written by XLA where they
    # lie, the first P+S rows read, no slice of the cache and no join (two copies of it a step before)
    past = past_index_keys if in_place else None
    if past_index_keys is not None and not in_place:
        past = ops.stop_gradient(F._cast(to_tensor(past_index_keys), call.dtype))

    def held(x):
        return None if x is None else ops.stop_gradient(x)

    result = lightning_indexer(config, {n: held(t) for n, t in call.params.items() if n.startswith(READS)},
                               held(call.query), held(call.key), positions=positions, key_positions=key_positions,
                               past_index_keys=past, mask=mask, is_causal=False, dtype=call.dtype,
                               precision=config.indexer.scoring_precision,
                               fp8_scale_format=config.indexer.fp8_scale_format,
                               cache_length=P if in_place else None, rec=rec)
    call.selection, call.present_index_keys = result["topk_indices"], result["present_index_keys"]
    call.topk = call.selection
    selected = F.selection_mask(call.selection, config.num_heads, call.S_total)
    call.mask4 = selected if call.mask4 is None else ops.logical_and(call.mask4, selected)


# Why the in-place cache (cache_length=) is TensorFlow's alone: the new keys are written into the caller's
# tf.Variables where they lie, by XLA (tf_only.write_cache).
IN_PLACE_UNSUPPORTED = (
    f"cache_length (an in-place cache) needs Keras's TensorFlow backend (keras runs on {BACKEND}): the keys are "
    "written into the caller's tf.Variables by XLA; on jax an array cannot be written in place (a "
    "keras.Variable.assign replaces it whole), and the torch form is not written; pass past_key/past_value "
    "without cache_length (the cache appended)"
)


def _is_variable(x) -> bool:
    if not TENSORFLOW:
        return False
    from .tf_only import is_variable

    return is_variable(x)


def past_key_buffers(past_key, past_value, dtype: str):
    """The buffers of an in-place cache (cache_length=), as given: tf.Variables
    of the storage dtype (tf_only.past_key_buffers: TensorFlow only)."""
    if not TENSORFLOW:
        raise NotImplementedError(IN_PLACE_UNSUPPORTED)
    from .tf_only import past_key_buffers as buffers

    return buffers(past_key, past_value, dtype, F.dtype_name)
