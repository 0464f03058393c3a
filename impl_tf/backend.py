"""The few primitives whose form differs per Keras backend; everything else is keras.ops.

On TensorFlow they are TensorFlow's own ops (tf_only.py says why each is
faster there than its keras.ops form); on JAX and PyTorch they are
keras.ops. The stages, the fused core and the call import them from here, so
that one module runs on Keras's tensorflow, jax and torch backends.

    einsum(subscripts, a, b)   the stages' contractions (the spec's strings)
    matmul(a, b)               a @ b
    matmul_nt(a, b)            a @ swapaxes(b, -1, -2)
    where(cond, x, y)          a select, x and y tensors of one dtype
    softmax(x)                 over the last axis
    tanh, sin, cos, floor, maximum, mean   float64 kept (below)
    constant(value, dtype)     a scalar tensor
    reshape(x, shape), shape(x)  keras.ops' (on TensorFlow without leaving its eager fast path)
    same_dtype(x, dtype)       x is a tensor of that dtype (the casts' fast path)
    to_tensor(x)               ops.convert_to_tensor (NumPy bfloat16 included, on torch too)
    is_symbolic(x)             x is traced (a Keras symbolic tensor, a tf.function or jax.jit tracer):
                               its values cannot be read
    argsort_stable(x)          ascending over the last axis, ties in ascending index (the indexer's
                               top-k rule): keras.ops.argsort is unstable on TensorFlow
"""

from __future__ import annotations

import warnings

from ._keras import BACKEND, TENSORFLOW, keras

ops = keras.ops

if TENSORFLOW:
    from .tf_only import constant, einsum, is_symbolic, matmul, matmul_nt, reshape, same_dtype, shape, softmax, where
    to_tensor = ops.convert_to_tensor
else:
    einsum = ops.einsum
    where = ops.where
    reshape = ops.reshape
    shape = ops.shape

    def softmax(x):
        """keras.ops.softmax over the last axis, without its warning on an axis of size 1 (one key: the
        weight is 1, as it should be)."""
        if x.shape[-1] != 1:
            return ops.softmax(x, axis=-1)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="You are using a softmax over axis")
            return ops.softmax(x, axis=-1)

    if BACKEND == "torch":
        def to_tensor(x):
            """ops.convert_to_tensor, NumPy bfloat16 (ml_dtypes) included: Keras's torch backend refuses it
            (torch.from_numpy knows no bfloat16), so it goes through float32, exactly."""
            if getattr(x, "dtype", None) is not None and getattr(x.dtype, "name", None) == "bfloat16" \
                    and not ops.is_tensor(x):
                return ops.cast(ops.convert_to_tensor(x.astype("float32")), "bfloat16")
            return ops.convert_to_tensor(x)
    else:
        import jax
        import numpy as np

        def to_tensor(x):
            """ops.convert_to_tensor; a NumPy array through jax.device_put, which copies it to the device
            as it is, where jnp.asarray (what Keras calls) compiles a small XLA program per shape and
            dtype (jax 0.10: lax.stage)."""
            if isinstance(x, np.ndarray) and not isinstance(x, np.generic):
                return jax.device_put(x)
            return ops.convert_to_tensor(x)

    def constant(value, dtype):
        return ops.convert_to_tensor(value, dtype)

    # Batched matmuls as einsums: keras.ops.matmul computes float64 operands in float32 on Keras's torch
    # backend (3.15: its result dtype comes from keras.backend.result_type, which maps 64-bit types to
    # 32-bit ones on every backend but TensorFlow, "to be aligned with JAX's default"); einsum keeps them.
    def matmul(a, b):
        return ops.einsum("...ij,...jk->...ik", a, b)

    def matmul_nt(a, b):
        return ops.einsum("...ij,...kj->...ik", a, b)

    def same_dtype(x, dtype) -> bool:
        standardize = keras.backend.standardize_dtype
        return ops.is_tensor(x) and standardize(x.dtype) == standardize(dtype)

    if BACKEND == "jax":
        import jax

        def is_symbolic(x) -> bool:
            return keras.backend.is_keras_tensor(x) or isinstance(x, jax.core.Tracer)
    else:
        def is_symbolic(x) -> bool:
            return keras.backend.is_keras_tensor(x)

# Ops whose keras.ops form computes float64 in float32 on some backend (Keras 3.15.1: their compute dtype
# comes from keras.backend.result_type, which maps 64-bit types to 32-bit ones on every backend but
# TensorFlow): on jax ops.tanh, ops.sin, ops.cos, ops.floor and ops.mean; on torch ops.maximum, ops.floor,
# ops.mean (the result cast back to float64: the dtype looks right, the digits are float32's) and ops.matmul
# (above). Measured with JAX's x64 mode on, against NumPy in float64 (relative errors 4e-8 to 9e-8 where
# float64's are 1e-16); every other keras.ops call the layer makes keeps float64. Those backends' own
# functions take Keras's tensors (jax arrays, torch tensors) as they are; the mean is the sum over the count.
if BACKEND == "jax":
    import jax.numpy as jnp

    tanh, sin, cos, floor, maximum = jnp.tanh, jnp.sin, jnp.cos, jnp.floor, ops.maximum
elif BACKEND == "torch":
    import torch

    tanh, sin, cos, floor, maximum = ops.tanh, ops.sin, ops.cos, torch.floor, torch.maximum
else:
    tanh, sin, cos, floor, maximum = ops.tanh, ops.sin, ops.cos, ops.floor, ops.maximum

if TENSORFLOW:
    mean = ops.mean
else:
    def mean(x, axis, keepdims=False):
        return ops.sum(x, axis=axis, keepdims=keepdims) / x.shape[axis]



def argsort_stable(x):
    """Indices sorting x ascending over the last axis, equal values in ascending index: each framework's
    stable sort (Keras 3.15.1's ops.argsort calls tf.argsort without stable=True, keras/src/backend/
    tensorflow/numpy.py; its jax and torch forms are stable but keras.ops documents no tie order). The
    indexer's top-k (higher score first, then lower key index) sorts the negated scores."""
    if TENSORFLOW:
        import tensorflow as tf

        return tf.argsort(x, axis=-1, stable=True)
    if BACKEND == "jax":
        return jnp.argsort(x, axis=-1, stable=True)
    return torch.argsort(x, dim=-1, stable=True)


__all__ = ["argsort_stable", "constant", "cos", "einsum", "floor", "is_symbolic", "matmul", "matmul_nt", "maximum", "mean", "reshape",
           "same_dtype", "shape", "sin", "softmax", "tanh", "to_tensor", "where"]


X64_MESSAGE = (
    "float64 on Keras's jax backend needs JAX's x64 mode, which is off: call "
    "jax.config.update('jax_enable_x64', True) (or set JAX_ENABLE_X64=1) before creating arrays; "
    "without it JAX computes float64 in float32, and impl_tf never does"
)


def check_dtype(dtype: str, argument: str = "dtype") -> str:
    """dtype (a name), refused where this backend would silently compute another: float64 on jax without x64."""
    if BACKEND == "jax" and dtype == "float64":
        import jax

        if not jax.config.jax_enable_x64:
            raise ValueError(f"{argument} float64: {X64_MESSAGE}")
    return dtype


# -- devices and float32 matmul precision, per backend ------------------------------

if TENSORFLOW:
    from .tf_only import gpus, matmul_precision, placement

    GPU_MISSING = "TensorFlow sees no GPU (tf.config.list_physical_devices('GPU') is empty)"
else:
    GPU_MISSING = (f"Keras's {BACKEND} backend sees no GPU ("
                   + ("jax.devices() has none)" if BACKEND == "jax" else "torch.cuda.is_available() is False)"))

    import contextlib

    def gpus() -> bool:
        """Whether this backend's framework sees a GPU."""
        if BACKEND == "jax":
            import jax

            return any(d.platform == "gpu" for d in jax.devices())
        import torch

        return torch.cuda.is_available()

    @contextlib.contextmanager
    def placement(device: str | None):
        """Run (and create variables) on the CPU or the first GPU: keras.device, Keras's own scope."""
        if device is None:
            yield
            return
        with keras.device(f"{device}:0"):
            yield

    @contextlib.contextmanager
    def matmul_precision(precision: str):
        """float32 matmuls in full float32 ("highest") or TF32 ("tf32") for the block, restored after: on jax
        jax.default_matmul_precision (its GPU default is TF32), on torch torch.backends' allow_tf32 flags.
        Only a GPU's float32 matmuls differ."""
        if BACKEND == "jax":
            import jax

            with jax.default_matmul_precision("float32" if precision == "highest" else "tensorfloat32"):
                yield
            return
        import torch

        flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
        before = [flag.allow_tf32 for flag in flags]
        for flag in flags:
            flag.allow_tf32 = precision == "tf32"
        try:
            yield
        finally:
            for flag, value in zip(flags, before):
                flag.allow_tf32 = value
