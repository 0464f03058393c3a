"""What only TensorFlow has, for impl_tf on Keras's TensorFlow backend (imported there alone).

- The primitives backend.py hands the stages on TensorFlow: tf.einsum (keras.ops.einsum rewrites
  "BLD,DF->BLF" into a broadcasting 3-D matmul that TensorFlow runs about 1.3x slower than the einsum it
  came from), tf.matmul (transpose_b=True folded in), tf.where and tf.constant (keras.ops' forms resolve dtypes and
  convert their operands on every call: tens of microseconds each, eagerly, on the conformance grid's
  tiny calls); reshape and shape (below: keras.ops' forms leave TensorFlow's eager fast path).
- The in-place cache: its tf.Variables checked (past_key_buffers) and written by XLA (write_cache); DeepSeek V4's
  (impl_tf.compressed, in_place=True) likewise (compressed_buffers, write_rows).
- XLA: the fused core compiled (xla), for large score arrays (attention.XLA_MIN_SCORES).
- Devices and TF32 (placement, matmul_precision, gpus).
- The indexer's fp8 simulation (indexer.quantize_fp8): TensorFlow's float8_e4m3fn type (round_fp8) and the
  float32 bit pattern of a UE8M0 scale (ue8m0); keras.ops has neither a float8 cast every backend honours
  nor a bitcast.
The chunked path (tf.while_loop over key blocks, xla.dynamic_slice) is chunked.py, TensorFlow-only too.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import tensorflow as tf

from weights.contract import in_place_buffer_error

from ._keras import keras

einsum = tf.einsum
matmul = tf.matmul
where = tf.where
constant = tf.constant


def reshape(x, shape):
    """tf.reshape, the shape handed over as an int32 array where it is Python ints alone. TensorFlow's eager
    fast path (TFE_Py_FastPathExecute) does not take a tuple or list for Reshape's shape and falls back to its
    Python path: 133 against 39 us a call, measured (tf 2.x, 2-core EPYC VM, 2026-11-29); the grid's float32
    column reshapes about 13,000 times. A Keras variable is read first (as keras.ops.reshape reads it), so
    a GradientTape watching it sees the read."""
    if keras.backend.is_keras_tensor(x):  # a symbolic (functional-model) input: Keras's own op
        return keras.ops.reshape(x, shape)
    if isinstance(x, keras.Variable):
        x = x.value
    if all(type(d) is int for d in shape):
        shape = np.asarray(shape, np.int32)
    return tf.reshape(x, shape)


def shape(x):
    """keras.ops.shape, without its tf.shape op where the static shape is whole: Keras's TensorFlow backend
    runs tf.shape(x) on every call, eagerly too (13,700 ops a float32 column of the grid). Dimensions unknown
    in a tf.function stay tensors, as keras.ops.shape gives them."""
    static = getattr(x, "shape", None)
    if isinstance(static, tf.TensorShape) and static.is_fully_defined():
        return tuple(static.as_list())
    return keras.ops.shape(x)


def softmax(x):
    return tf.nn.softmax(x, axis=-1)


def matmul_nt(a, b):
    return tf.matmul(a, b, transpose_b=True)


def same_dtype(x, dtype) -> bool:
    return tf.is_tensor(x) and x.dtype == dtype


def is_symbolic(x) -> bool:
    return keras.backend.is_keras_tensor(x) or (tf.is_tensor(x) and not tf.executing_eagerly())


def xla(function):
    """function compiled by XLA (tf.function(jit_compile=True)), eagerly too."""
    return tf.function(function, jit_compile=True, autograph=False)


@tf.function(jit_compile=True, autograph=False)
def write_cache(past_key, past_value, k, v, start):
    """past_key[:, :, start:start+S] = k, past_value's = v, in place: XLA's
    dynamic-update-slice of each variable's value assigned back, which XLA
    runs on the variable's own buffer, compiled by XLA eagerly too. start is
    a run-time operand, so that one compilation serves every step: in the
    sliced-assign form (`past_key[:, :, start:start + S].assign(k)`) XLA
    takes the slice's offsets as compile-time constants and compiled once
    per start, 32 ms a step at a new position against 0.4 ms repeated, for
    (1, 8, 4096, 128) float32 buffers (tf 2.21, 2-core AMD EPYC VM,
    2026-11-29); TensorFlow's own sliced assign, uncompiled, copies the
    buffer whole and leaves the variable copying it on every later read
    (about 150 ms each, measured). write_rows below is the same write for
    DeepSeek V4's buffers."""
    from tensorflow.compiler.tf2xla.python import xla  # TensorFlow's own XLA op wrappers

    zero = tf.zeros((), start.dtype)
    at = tf.stack([zero, zero, start, zero])
    past_key.assign(xla.dynamic_update_slice(past_key.read_value(), k, at))
    past_value.assign(xla.dynamic_update_slice(past_value.read_value(), v, at))


def _could_record() -> bool:
    """Whether a GradientTape may record this call (TensorFlow's own test, private: False where it is gone)."""
    try:
        from tensorflow.python.eager import record
    except ImportError:
        return False
    return record.could_possibly_record()


def is_variable(x) -> bool:
    return isinstance(x, tf.Variable)


def past_key_buffers(past_key, past_value, dtype: str, dtype_name):
    """The buffers of an in-place cache (cache_length=), as given: tf.Variables
    of the storage dtype (a tensor cannot be written; a cast would write a
    copy the caller never sees). Refused under a recording GradientTape: no
    gradient passes through a write into a variable."""
    for name, buffer in (("past_key", past_key), ("past_value", past_value)):
        if not isinstance(buffer, tf.Variable) or dtype_name(buffer) != dtype:
            what = (f"dtype {dtype_name(buffer)}" if isinstance(buffer, tf.Variable) else
                    f"a {type(buffer).__name__}")
            raise in_place_buffer_error(name, f"be a tf.Variable of the storage dtype {dtype}", what)
    if _could_record():
        raise ValueError("cache_length writes past_key/past_value in place, which no gradient passes through: "
                         "got a call under a recording GradientTape (an in-place cache is for inference)")
    return past_key, past_value


# -- DeepSeek V4's in-place cache (impl_tf.compressed, in_place=True) ------------------------------------------


def compressed_buffers(buffers: dict, dtype: str, dtype_name) -> None:
    """The buffers of DeepSeek V4's in-place cache (impl_numpy.compressed.buffer_shapes, shapes checked by
    check_in_place_call), as given: tf.Variables of the storage dtype (a tensor cannot be written; a cast would
    write a copy the caller never sees). Refused under a recording GradientTape: no gradient passes through a
    write into a variable."""
    for name, buffer in buffers.items():
        if not isinstance(buffer, tf.Variable) or dtype_name(buffer) != dtype:
            what = (f"dtype {dtype_name(buffer)}" if isinstance(buffer, tf.Variable) else
                    f"a {type(buffer).__name__}")
            raise ValueError(f"past[{name!r}] with in_place is written in place: it must be a tf.Variable of the "
                             f"storage dtype {dtype}: got {what}")
    if _could_record():
        raise ValueError("in_place writes the cache's buffers, which no gradient passes through: got a call under "
                         "a recording GradientTape (an in-place cache is for inference; pass the cache as past "
                         "without in_place to differentiate)")


def _write(axis: int, buffer, value, start):
    from tensorflow.compiler.tf2xla.python import xla  # TensorFlow's own XLA op wrappers

    zero = tf.zeros((), tf.int32)
    at = tf.stack([zero, start, zero] if axis == 1 else [zero, zero, start, zero])
    buffer.assign(xla.dynamic_update_slice(buffer.read_value(), value, at))


@functools.lru_cache(maxsize=256)  # (a sweep's random shapes: the programs kept bounded)
def _writer(axis: int, buffer_shape: tuple, value_shape: tuple, dtype: str):
    """One XLA program per axis, shapes and dtype, each a tf.function of its own (TensorFlow counts the traces of
    one Python function's code as retraces and warns of them: a functools.partial has no code to count by)."""
    return tf.function(functools.partial(_write, axis), jit_compile=True, autograph=False)


def write_rows(buffer, value, start: int, axis: int) -> None:
    """buffer[(:,) * axis, start:start + S] = value (S its size along axis 1 or 2), in place: XLA's
    dynamic-update-slice of the variable's value assigned back, which XLA runs on the variable's own buffer, start
    a run-time operand (one compilation per shape serves every decode step). Measured (tf 2.21, 2-core AMD EPYC
    VM, 2026-11-29, one row of (2, n, 512) float32): 0.2-0.3 ms a write for n = 1024 and 65536 alike, reads after
    it 0.2 ms. Not TensorFlow's sliced assign: eagerly it copies the buffer (1.3 ms at n = 1024, 40 ms at
    65536), and compiled by XLA its offsets are compile-time constants, one compilation (about 20 ms) per
    start; nor a scatter (0.2 ms, but the variable copies itself on every later read: 46 ms)."""
    if value.shape[axis]:
        writer = _writer(axis, tuple(buffer.shape), tuple(value.shape), buffer.dtype.name)
        writer(buffer, value, tf.constant(start, tf.int32))


def gpus() -> bool:
    return bool(tf.config.list_physical_devices("GPU"))


@contextlib.contextmanager
def placement(device: str | None):
    """Run (and create variables) on a TensorFlow device: /CPU:0 or /GPU:0."""
    if device is None:
        yield
        return
    with tf.device("/GPU:0" if device == "gpu" else "/CPU:0"):
        yield


@contextlib.contextmanager
def matmul_precision(precision: str):
    """TF32 matmuls off ("highest") or on ("tf32") for the block, restored after.

    TensorFlow enables TF32 by default on Ampere and later GPUs; it only
    matters there. Inside tf.function this takes effect while tracing.
    """
    before = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(precision == "tf32")
    try:
        yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(before)


# -- the indexer's fp8 simulation (impl_tf.indexer.quantize_fp8) ---------------------------------------------

def float8_e4m3fn():
    """TensorFlow's float8 e4m3 type, or a ValueError saying why the simulation cannot run."""
    fp8 = getattr(tf.dtypes.experimental, "float8_e4m3fn", None)
    if fp8 is None:
        raise ValueError(f"precision fp8_e4m3 needs tf.dtypes.experimental.float8_e4m3fn, which TensorFlow "
                         f"{tf.__version__} lacks")
    return fp8


def round_fp8(x):
    """float64 x (already within +-448) rounded to float8 e4m3 (nearest even, as ml_dtypes) and back."""
    return tf.cast(tf.cast(x, float8_e4m3fn()), tf.float64)


def ue8m0(scale):
    """2^ceil(log2 scale) of a positive float32 scale, exactly: its exponent, plus one unless a power of two."""
    bits = tf.bitcast(scale, tf.int32)
    exponent = tf.bitwise.right_shift(bits, 23) - 127 + tf.cast(tf.bitwise.bitwise_and(bits, (1 << 23) - 1) != 0,
                                                                tf.int32)
    return tf.bitcast(tf.bitwise.left_shift(exponent + 127, 23), tf.float32)
