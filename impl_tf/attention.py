"""The call: validate, then run functional.py's stages, the fused fast path
below, or chunked.py's chunked path: mirrors impl_numpy/attention.py.

Kept apart from functional.py so that imports point one way: this module and
chunked.py import the stages; the stages import neither.

Three paths, each honouring every feature of the config and the call (rope,
QK-norm, softcap, windows, sinks, a cache, segment ids):
- the stages (functional.py), whenever `trace` or `return_weights` is asked
  for: the spec, stage by stage, each result stored in the storage dtype;
- `fused_attention` otherwise: logits -> [softcap] -> mask -> softmax [+
  sinks] -> dropout -> attend as one computation on the heads that
  `qkv_heads` made (project, [norm], split, [rope], [cache]): the scale folded
  into q, TensorFlow's own softmax kernel (a sink-aware one where sinks are
  on), masks and masked rows handled with as few passes over the (B, N, T,
  S) scores as the call allows; compiled by XLA from XLA_MIN_SCORES scores;
- `chunk_size=` (chunked.py): impl_numpy's chunked mode, exact attention with
  an online softmax over key blocks that never holds a (T, S) array and
  skips key blocks the causal mask or a window hides.
A plain call (no modern feature, no cache, no segments) runs exactly the ops
it ran before the modern features existed.

cache_length= (an in-place cache in the caller's tf.Variables): the new keys
are written by `write_cache` (XLA, in the buffers where they lie); the fused
path then attends over the buffers' whole capacity with the positions past
P+S masked (`in_place_fused`, which says why not a slice); the stages and the
chunked path read the first P+S positions back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from weights import DTYPES, AttentionConfig, dtype_from_name, validate_tensors
from weights.call import OPTIONAL_INPUTS, record
from weights.contract import CallShapes, Plan, check_bias_values, check_call, check_chunk_size, in_place_buffer_error
from weights.rope import rope_tables

from . import functional as F
from ._keras import keras, tf
from .chunked import chunked_attention

ops = keras.ops


# -- the path ---------------------------------------------------------------------

def plan(*, return_weights: bool, traced: bool, chunk_size: int | None) -> Plan:
    """The path of a call (the module docstring says what each computes): the
    chunked path when chunk_size is given, the stages when the weights or the
    trace are asked for, fused_attention otherwise, in every storage dtype
    (it computes in the compute dtype throughout, where the stages round each
    result to the storage dtype)."""
    if chunk_size is not None:
        return Plan("chunked", f"chunk_size={chunk_size}")
    if return_weights or traced:
        return Plan("stages", "the weights or the trace are asked for")
    return Plan("fused", "no weights, no trace")


# -- validation ------------------------------------------------------------------

def _is_symbolic(x) -> bool:
    return keras.backend.is_keras_tensor(x) or (tf.is_tensor(x) and not tf.executing_eagerly())


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
    return static if static >= 0 else ops.shape(x)[axis]


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
    return None if x is None else ops.convert_to_tensor(x)


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
    positions: Any = None  # (B|1, T) int where the config has rope
    key_positions: Any = None  # (B|1, S)
    past_key: Any = None  # (B, K, P, H); with cache_length the caller's tf.Variable (B, K, C, H)
    past_value: Any = None  # (B, K, P, V); with cache_length (B, K, C, V)
    segment_ids: Any = None  # (T,) or (B, T)
    key_segment_ids: Any = None  # (S_total,) or (B, S_total)
    cache_length: int | None = None  # P of an in-place cache (past_key/past_value are buffers), else None

    def allowed(self, config: AttentionConfig, is_causal: bool, causal_alignment: str):
        """mask AND causal AND window AND segments over every key (rank 4), or None."""
        return F.allowed_mask(self.mask4, self.T, self.S_total, is_causal, causal_alignment,
                              window_left=config.window_left, window_right=config.window_right,
                              segment_ids=self.segment_ids, key_segment_ids=self.key_segment_ids)

    @property
    def modern(self) -> bool:
        """Uses a cache or packed segments (the config's own features: config.is_modern)."""
        return self.past_key is not None or self.segment_ids is not None


def prepare(config, tensors, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, return_weights, dtype, positions=None, key_positions=None, past_key=None,
            past_value=None, segment_ids=None, key_segment_ids=None, return_cache=False, cache_length=None,
            materializes_scores=True) -> Call:
    """Validate a call and cast everything to the storage dtype (an in-place
    cache's buffers excepted: they are the caller's variables, kept as given)."""
    stored = check_tensors(config, tensors)
    dtype = stored if dtype is None else dtype_from_name(dtype).name
    training = bool(training)
    query = ops.convert_to_tensor(query)
    keys_given = key is not None or value is not None  # else self-attention: the keys are the queries
    key = query if key is None else ops.convert_to_tensor(key)
    value = key if value is None else ops.convert_to_tensor(value)
    # An in-place cache's variables are checked by their shape and dtype, never read here: a read tensor
    # alive while the call writes a buffer would make that write copy the buffer whole
    buffers = ("past_key", "past_value") if cache_length is not None else ()
    given = {name: x if name in buffers and isinstance(x, tf.Variable) else _tensor(x) for name, x in (
        ("mask", mask), ("bias", bias), ("dropout_mask", dropout_mask), ("positions", positions),
        ("key_positions", key_positions), ("past_key", past_key), ("past_value", past_value),
        ("segment_ids", segment_ids), ("key_segment_ids", key_segment_ids)) if x is not None}
    shapes = check_inputs(
        config, dtype, query, key if keys_given else None, value if keys_given else None, is_causal=is_causal,
        causal_alignment=causal_alignment, training=training,
        seed=seed, return_weights=return_weights, return_cache=return_cache, cache_length=cache_length,
        materializes_scores=materializes_scores, **given,
    )
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
    segment_ids, key_segment_ids = given.get("segment_ids"), given.get("key_segment_ids")
    if segment_ids is not None and key_segment_ids is None:
        key_segment_ids = segment_ids  # self-attention without a cache: the keys are the queries (check_call)
    rope = config.rope is not None
    return Call(
        shapes=shapes, params=params, query=F._cast(query, dtype), key=F._cast(key, dtype),
        value=F._cast(value, dtype), mask4=mask4, bias4=bias_t, keep=keep, dtype=dtype, T=T, S_total=S_total,
        positions=F.default_positions(given.get("positions"), P, T) if rope else None,
        key_positions=F.default_positions(given.get("key_positions"), P, S) if rope else None,
        past_key=past_key if in_place or past_key is None else F._cast(past_key, dtype),
        past_value=past_value if in_place or past_value is None else F._cast(past_value, dtype),
        segment_ids=segment_ids, key_segment_ids=key_segment_ids, cache_length=shapes.P if in_place else None,
    )


def _could_record() -> bool:
    """Whether a GradientTape may record this call (TensorFlow's own test, private: False where it is gone)."""
    try:
        from tensorflow.python.eager import record
    except ImportError:
        return False
    return record.could_possibly_record()


def past_key_buffers(past_key, past_value, dtype: str):
    """The buffers of an in-place cache (cache_length=), as given: tf.Variables
    of the storage dtype (a tensor cannot be written; a cast would write a
    copy the caller never sees). Refused under a recording GradientTape: no
    gradient passes through a write into a variable."""
    for name, buffer in (("past_key", past_key), ("past_value", past_value)):
        if not isinstance(buffer, tf.Variable) or F.dtype_name(buffer) != dtype:
            what = (f"dtype {F.dtype_name(buffer)}" if isinstance(buffer, tf.Variable) else
                    f"a {type(buffer).__name__}")
            raise in_place_buffer_error(name, f"be a tf.Variable of the storage dtype {dtype}", what)
    if _could_record():
        raise ValueError("cache_length writes past_key/past_value in place, which no gradient passes through: "
                         "got a call under a recording GradientTape (an in-place cache is for inference)")
    return past_key, past_value


@tf.function(jit_compile=True, autograph=False)
def write_cache(past_key, past_value, k, v, start):
    """past_key[:, :, start:start+S] = k, past_value's = v, in place. Compiled
    by XLA, eagerly too: XLA updates a variable's buffer where it lies (about
    0.5 ms for a (1, 8, 65537, 128) float32 buffer), while TensorFlow's own
    sliced assign copies the buffer whole and leaves the variable copying it
    on every later read (about 150 ms each, measured). start is a tensor, so
    that one compilation serves every step."""
    S = k.shape[2]
    past_key[:, :, start:start + S].assign(k)
    past_value[:, :, start:start + S].assign(v)


def _over_capacity(x, S_total: int, C: int, fill):
    """x (..., S_total) -> (..., C), the keys past S_total filled with `fill`;
    x (..., 1) (broadcast over the keys) or None unchanged."""
    if x is None or x.shape[-1] == 1 or C == S_total:
        return x
    return tf.pad(x, [[0, 0]] * (len(x.shape) - 1) + [[0, C - S_total]], constant_values=fill)


def qkv_heads(config: AttentionConfig, call: Call, rec=None, *, query: bool = True, append: bool = True):
    """project -> [norm] -> split_heads -> [rope] -> [cache appended]: q (B, N,
    T, H) (None unless `query`), k (B, K, S_total, H), v (B, K, S_total, V)
    (k and v: the present cache). rec(stage, value) records a stage.
    append=False: k and v are the new keys' alone (B, K, S, .)."""
    rec = rec or (lambda stage, value: value)
    p, N, K = call.params, config.num_heads, config.num_kv_heads
    q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias"))) if query else None
    k = rec("key.project", F.project(call.key, p["key.kernel"], p.get("key.bias")))  # (B, S, K*H)
    v = rec("value.project", F.project(call.value, p["value.kernel"], p.get("value.bias")))  # (B, S, K*V)
    if config.qk_norm is not None:
        n = config.qk_norm
        if query:
            q = rec("query.norm", F.norm(q, p["query.norm.scale"], p.get("query.norm.bias"), n.type, n.eps, N,
                                         n.scope))
        k = rec("key.norm", F.norm(k, p["key.norm.scale"], p.get("key.norm.bias"), n.type, n.eps, K, n.scope))
    if query:
        q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S, H)
    v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S, V)
    if config.rope is not None:
        inv_freq, factor = rope_tables(config.rope)
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved
        if query:
            q = rec("query.rope", F.rope(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved,
                                         factor))
        k = rec("key.rope", F.rope(k, F.rope_angles(call.key_positions, inv_freq, call.dtype), R, interleaved, factor))
    if call.cache_length is not None:  # in place: the new keys written after the P cached ones
        P = call.cache_length
        write_cache(call.past_key, call.past_value, k, v, tf.constant(P, tf.int32))
        if not append:
            return q, k, v
        n = P + k.shape[2]  # read back after the write (one copy of P+S positions: the stages and chunked paths)
        return q, tf.convert_to_tensor(call.past_key)[:, :, :n], tf.convert_to_tensor(call.past_value)[:, :, :n]
    if call.past_key is not None and append:  # the cache holds keys after norm and rope (as HF and ONNX store it)
        k = ops.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H)
        v = ops.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return q, k, v


# -- the fused fast path (no trace, no weights) -----------------------------------

def may_have_empty_rows(mask4, bias, is_causal: bool, causal_alignment: str, T, S, *, windowed: bool = False,
                        segments: bool = False) -> bool:
    """False only where no query row can lose every key: no mask, no bias, no
    window, no segments, and causal (if at all) aligned so that every query
    sees key 0 or more."""
    if mask4 is not None or bias is not None or windowed or segments:
        return True
    if not is_causal or causal_alignment == "top_left":
        return False
    return not (isinstance(T, int) and isinstance(S, int) and S >= T)  # bottom_right: query 0 sees S - T + 1 keys


def fused_attention(q, k, v, *, mask4, bias, keep, is_causal: bool, causal_alignment: str, scale: float,
                    rate: float, masked_row: str, softcap: float | None = None, window_left: int = -1,
                    window_right: int = -1, segment_ids=None, key_segment_ids=None, sinks=None, key_length=None):
    """logits -> [softcap] -> mask -> softmax [+ sinks] -> dropout -> attend
    as one computation, for calls that ask for neither the trace nor the
    weights: q (B, N, T, H), k (B, K, S, H), v (B, K, S, V) -> (B, N, T, V) in
    the storage dtype (S: every key, a cache's included).

    Equal to the stages within the tolerance policy (the arithmetic runs in the
    compute dtype throughout; the stages round each result to the storage
    dtype). The differences of form: the scale multiplies q (T*H values, not
    T*S); TensorFlow's softmax kernel (with sinks, the softmax written out:
    max, exp and sum with the sink's term); a position whose bias is -inf is
    folded into the allowed mask, so that, as in the spec, no masked position
    passes a gradient; and a fully masked row (every allowed flag False) is
    found on the (broadcast) mask instead of the scores, then given its
    `masked_row` value with one select. Its softmax is NaN before that
    select, and that NaN reaches no gradient: every position of such a row is
    masked, and the mask's select passes none. With sinks no row is empty:
    a fully masked one is 0, as the spec says, with no select.

    key_length (an in-place cache read whole): a scalar tensor, the number of
    keys that count (P + S); the keys past it are the buffers' spare
    positions, which mask4 hides (the caller builds its causal, window and
    segment masks over key_length keys and pads them: is_causal, windows and
    segments are not passed with it). A uniform masked row spreads over
    key_length keys. A hidden key gets weight 0 exactly, so its value must be
    finite (the contract's rule for the spare positions).
    """
    dtype = F.dtype_name(q)
    ct = F.compute_dtype(dtype)
    # k and v may be tuples of parts along S (a cache and the new keys, not concatenated): their
    # logits are joined instead ((T, S) values where the keys are (S, H)), the context summed per part
    ks, vs = (k, v) if isinstance(k, (tuple, list)) else ((k,), (v,))
    B, N, T, H = ops.shape(q)
    K, V = ks[0].shape[1], vs[0].shape[-1]
    S = ops.shape(ks[0])[2]
    for part in ks[1:]:
        S = S + ops.shape(part)[2]
    # LOGITS and ATTEND as matmuls on the grouped (B, K, G*T, .) queries, as impl_numpy computes
    # them: XLA runs these 1.3-1.7x faster than the 5-D einsum's dot.
    qg = ops.reshape(F._cast(q, ct) * tf.constant(scale, ct), (B, K, (N // K) * T, H))  # (B, K, G*T, H)
    if key_length is not None:
        # an in-place cache (one part, T small beside S): the keys as the matmul's left operand, (S, H) x
        # (H, G*T), then the small (S, G*T) result transposed; XLA's CPU dot ran the (G*T, H) x (H, S)
        # form 2.5-3.5x slower on a (1, 8, 65537, 128) cache (measured: 228 ms against 62-96 ms)
        x = [tf.transpose(tf.matmul(F._cast(ks[0], ct), qg, transpose_b=True), (0, 1, 3, 2))]  # (B, K, G*T, S)
    else:
        x = [tf.matmul(qg, F._cast(part, ct), transpose_b=True) for part in ks]  # (B, K, G*T, S_part) each
    x = ops.reshape(x[0] if len(x) == 1 else ops.concatenate(x, axis=-1), (B, N, T, S))  # (B, N, T, S), scaled
    if softcap is not None:  # before mask and bias, as the spec's stage
        cap = tf.constant(softcap, ct)
        x = tf.tanh(x / cap) * cap
    allowed = F.allowed_mask(mask4, T, S, is_causal, causal_alignment, window_left=window_left,
                             window_right=window_right, segment_ids=segment_ids, key_segment_ids=key_segment_ids)
    if bias is not None:
        x = x + bias
        finite = bias > tf.constant(-math.inf, ct)  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else ops.logical_and(allowed, finite)
    if allowed is not None:
        x = tf.where(allowed, x, tf.constant(-math.inf, ct))
    if sinks is None:
        w = tf.nn.softmax(x, axis=-1)  # (B, N, T, S); a row with no allowed key is NaN here
        if may_have_empty_rows(mask4, bias, is_causal, causal_alignment, T, S,
                               windowed=window_left >= 0 or window_right >= 0, segments=segment_ids is not None):
            empty = ops.logical_not(ops.any(allowed, axis=-1, keepdims=True))  # (B|1, N|1, T|1, 1), on the mask
            fill = {"zero": 0.0, "uniform": 1.0, "nan": math.nan}[masked_row]
            if masked_row != "uniform":
                fill = tf.constant(fill, ct)
            elif key_length is None:
                fill = tf.constant(fill, ct) / tf.cast(S, ct)
            else:  # over the keys that count; 0 on the hidden ones
                fill = tf.where(tf.range(S) < key_length, tf.constant(fill, ct) / tf.cast(key_length, ct),
                                tf.constant(0.0, ct))
            w = tf.where(empty, fill, w)
    else:
        sink = ops.reshape(F._cast(sinks, ct), (1, N, 1, 1))  # (1, N, 1, 1)
        shift = tf.stop_gradient(ops.maximum(ops.max(x, axis=-1, keepdims=True), sink))  # finite: the sink is
        e = ops.exp(x - shift)  # (B, N, T, S); masked -> exactly 0
        w = e / (ops.sum(e, axis=-1, keepdims=True) + ops.exp(sink - shift))
    if keep is not None:
        w = tf.where(keep, w / tf.constant(1.0 - rate, ct), tf.constant(0.0, ct))
    wg = ops.reshape(w, (B, K, (N // K) * T, S))  # (B, K, G*T, S)
    if len(vs) == 1:
        ctx = tf.matmul(wg, F._cast(vs[0], ct))  # (B, K, G*T, V)
    else:  # each part's weights times its values
        ctx, s0 = None, 0
        for part in vs:
            s1 = s0 + ops.shape(part)[2]
            term = tf.matmul(wg[..., s0:s1], F._cast(part, ct))  # (B, K, G*T, V)
            ctx, s0 = term if ctx is None else ctx + term, s1
    return F._cast(ops.reshape(ctx, (B, N, T, V)), dtype)  # (B, N, T, V)


# Score arrays of this many elements or more run fused_attention compiled by
# XLA, eagerly too: TensorFlow's own CPU kernels run the (T, H) x (H, S) batched
# matmuls at 20-35% of their large-matmul rate (XLA: 40-90%), and every
# elementwise op over (B, N, T, S) writes a fresh array, one page fault per 4
# KiB once it passes glibc's 32 MiB mmap threshold. XLA fuses those passes.
# Smaller calls (the conformance grid) stay eager: compiling would cost more
# than it saves. The first call of a shape pays the compile.
XLA_MIN_SCORES = 2**18

_fused_attention_xla = tf.function(fused_attention, jit_compile=True, autograph=False)


def _attention(q, k, v, **options):
    """fused_attention, through XLA when the scores are large (XLA_MIN_SCORES)."""
    B, N, T = q.shape[:3]
    sizes = [part.shape[2] for part in (k if isinstance(k, tuple) else (k,))]
    S = None if None in sizes else sum(sizes)
    if None not in (N, T, S) and (B or 1) * N * T * S >= XLA_MIN_SCORES:
        return _fused_attention_xla(q, k, v, **options)
    return fused_attention(q, k, v, **options)


def _modern_core_options(config: AttentionConfig, call: Call) -> dict:
    """fused_attention's options for the config's and the call's modern features (none for a plain call,
    so that a plain call's XLA function is the one it always was)."""
    options = {}
    if config.logit_softcap is not None:
        options["softcap"] = config.logit_softcap
    if config.window_left >= 0 or config.window_right >= 0:
        options.update(window_left=config.window_left, window_right=config.window_right)
    if call.segment_ids is not None:
        options.update(segment_ids=call.segment_ids, key_segment_ids=call.key_segment_ids)
    if config.use_sinks:
        options["sinks"] = call.params["sinks"]
    return options


def in_place_fused(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str):
    """The fused path over an in-place cache: the new keys written into the
    buffers, then attention over their whole capacity C, the positions from
    P+S on hidden by the mask. -> output (B, T, O).

    Whole, not sliced to P+S: the variables are read where they lie, with no
    copy. A slice [:, :, :P+S] of a (B, K, C, H) buffer is no view in
    TensorFlow (it copies P+S positions every step), and a slice inside XLA
    ran slower still (measured on a (1, 8, 65537, 128) float32 variable: the
    sum of it whole 19 ms, of its slice to 65536 positions under XLA 517 ms).
    Reading C rather than P+S positions costs the spare capacity the caller
    chose; the masks over (T, C) are small beside the cache."""
    p = call.params
    q, _, _ = qkv_heads(config, call, append=False)  # writes the new keys and values at P .. P+S-1
    S_total, C = call.S_total, call.past_key.shape[2]
    # one bottom-right query (a decode step) sees every key: no causal mask to build
    decode_step = causal_alignment == "bottom_right" and isinstance(call.T, int) and call.T == 1
    allowed = call.allowed(config, is_causal and not decode_step, causal_alignment)  # over S_total keys, or None
    valid = (tf.range(C) < S_total)[None, None, None]  # (1, 1, 1, C)
    allowed = valid if allowed is None else ops.logical_and(_over_capacity(allowed, S_total, C, False), valid)
    options = {name: value for name, value in _modern_core_options(config, call).items()
               if name in ("softcap", "sinks")}  # windows and segments are in `allowed`
    ctx = _attention(
        q, tf.convert_to_tensor(call.past_key), tf.convert_to_tensor(call.past_value), mask4=allowed,
        bias=_over_capacity(call.bias4, S_total, C, 0.0), keep=_over_capacity(call.keep, S_total, C, False),
        is_causal=False, causal_alignment=causal_alignment, scale=config.effective_scale, rate=config.dropout,
        masked_row=config.masked_row, key_length=tf.constant(S_total, tf.int32), **options,
    )  # (B, N, T, V)
    return F.output(F.merge_heads(ctx), p["output.kernel"], p.get("output.bias"))  # (B, T, O)


# -- the call ------------------------------------------------------------------------

def multi_head_attention(
    config: AttentionConfig,
    tensors,
    query,
    key=None,
    value=None,
    *,
    mask=None,
    bias=None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    training: bool = False,
    dropout_mask=None,
    seed: int | None = None,
    positions=None,
    key_positions=None,
    past_key=None,
    past_value=None,
    segment_ids=None,
    key_segment_ids=None,
    return_weights: bool = False,
    return_cache: bool = False,
    cache_length: int | None = None,
    dtype: str | None = None,
    chunk_size: int | None = None,
    trace: list | None = None,
):
    """The forward pass. Returns output (B, T, O); with return_weights also
    weights (B, N, T, P+S) after softmax and before dropout; with
    return_cache also present_key (B, K, P+S, H) and present_value (B, K,
    P+S, V): (output[, weights][, present_key, present_value]).

    tensors: the canonical tensors (NumPy arrays, or tensors/variables of the
    canonical shapes). dtype: compute in this storage dtype (default: the
    tensors' dtype). chunk_size: exact online softmax over key blocks of this
    size, queries in blocks of the same size; never holds a (T, S) array (see
    chunked.py). Not with return_weights or trace. trace: a list that
    receives a TraceEntry per stage.

    cache_length: an in-place cache (a Python int P). past_key (B, K, C, H)
    and past_value (B, K, C, V) are the caller's tf.Variables of the storage
    dtype whose first P positions are the cache; the call writes its new keys
    and values at P .. P+S-1 of them and computes what it would with
    past_key[:, :, :P]; with return_cache, present_key and present_value are
    the variables themselves (whole, C positions). Eagerly and in
    tf.function (the variables passed or captured). The buffers are not
    checked for infinities (that would read the whole cache every token);
    positions from P+S on must hold finite values (a zeroed buffer): the
    fused path reads them with weight 0. Inference only: refused under a
    recording GradientTape.
    """
    call = prepare(
        config, tensors, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        positions=positions, key_positions=key_positions, past_key=past_key, past_value=past_value,
        segment_ids=segment_ids, key_segment_ids=key_segment_ids, return_weights=return_weights,
        return_cache=return_cache, cache_length=cache_length, dtype=dtype,
        materializes_scores=chunk_size is None or return_weights,
    )
    chunk_size = check_chunk_size(chunk_size, return_weights=return_weights, traced=trace is not None)
    path = plan(return_weights=return_weights, traced=trace is not None, chunk_size=chunk_size).path
    p = call.params

    def result(out, w, k, v):
        if call.cache_length is not None:
            k, v = call.past_key, call.past_value  # the buffers, whole
        parts = (out,) + ((w,) if return_weights else ()) + ((k, v) if return_cache else ())
        return parts[0] if len(parts) == 1 else parts

    if path == "chunked":
        _, k, v = qkv_heads(config, call, query=False)  # (B, K, S_total, H), (B, K, S_total, V)
        ctx = chunked_attention(
            config, call.query, p, k, v, positions=call.positions, mask4=call.mask4, bias=call.bias4,
            keep=call.keep, is_causal=is_causal, causal_alignment=causal_alignment, chunk_size=chunk_size,
            segment_ids=call.segment_ids, key_segment_ids=call.key_segment_ids,
        )  # (B, T, N*V): the queries are projected block by block
        if not return_cache:
            k = v = None  # released (eagerly) before the output projection
        return result(F.output(ctx, p["output.kernel"], p.get("output.bias")), None, k, v)  # (B, T, O)
    if path == "fused" and call.cache_length is not None:
        return result(in_place_fused(config, call, is_causal, causal_alignment), None, None, None)
    if path == "fused":
        # a cache nobody asks back is never concatenated: fused_attention takes it and the new keys as parts
        cache_parts = call.past_key is not None and not return_cache
        q, k, v = qkv_heads(config, call, append=not cache_parts)  # (B, N, T, H), (B, K, S_total|S, H), (.., V)
        if cache_parts:
            k, v = (call.past_key, k), (call.past_value, v)
        # one bottom-right query (a decode step) sees every key: no causal mask to build and select by
        decode_step = causal_alignment == "bottom_right" and isinstance(call.T, int) and call.T == 1
        ctx = _attention(
            q, k, v, mask4=call.mask4, bias=call.bias4, keep=call.keep, is_causal=is_causal and not decode_step,
            causal_alignment=causal_alignment, scale=config.effective_scale, rate=config.dropout,
            masked_row=config.masked_row, **_modern_core_options(config, call),
        )  # (B, N, T, V)
        return result(F.output(F.merge_heads(ctx), p["output.kernel"], p.get("output.bias")), None, k, v)
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    q, k, v = qkv_heads(config, call, rec)
    allowed = call.allowed(config, is_causal, causal_alignment)
    x = rec("logits", F.logits(q, k, config.effective_scale))  # (B, N, T, S_total)
    if config.logit_softcap is not None:
        x = rec("softcap", F.softcap(x, config.logit_softcap))
    x = rec("mask", F.mask_stage(x, allowed, call.bias4))
    w = rec("softmax", F.softmax(x, config.masked_row, p.get("sinks")))  # (B, N, T, S_total)
    wd = rec("dropout", F.dropout(w, call.keep, config.dropout))
    ctx = rec("attend", F.attend(wd, v))  # (B, N, T, V)
    ctx = rec("merge_heads", F.merge_heads(ctx))  # (B, T, N*V)
    out = rec("output", F.output(ctx, p["output.kernel"], p.get("output.bias")))  # (B, T, O)
    return result(out, w, k, v)
