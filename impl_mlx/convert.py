"""Dtypes and arrays between NumPy and MLX, at the edges of impl_mlx.

The storage dtypes are the contract's (weights.DTYPES: float64, float32,
float16, bfloat16); each has one MLX dtype. The compute dtype of a storage
dtype is the contract's too (weights.compute_dtype: float32 for the 16-bit
ones), mapped here. float64 runs on MLX's CPU device only (its GPU backend,
Metal, has no float64): `check_device` refuses it on the GPU with that reason.
"""

from __future__ import annotations

import ml_dtypes
import mlx.core as mx
import numpy as np

from weights import compute_dtype

# numpy storage dtype -> mlx dtype
MX = {np.dtype(np.float64): mx.float64, np.dtype(np.float32): mx.float32, np.dtype(np.float16): mx.float16,
      np.dtype(ml_dtypes.bfloat16): mx.bfloat16}
NP = {v: k for k, v in MX.items()}
INTEGER = {mx.int8: "int8", mx.int16: "int16", mx.int32: "int32", mx.int64: "int64", mx.uint8: "uint8",
           mx.uint16: "uint16", mx.uint32: "uint32", mx.uint64: "uint64", mx.bool_: "bool"}


def to_mx_dtype(dtype) -> mx.Dtype:
    """A NumPy storage dtype (or its name) -> the MLX dtype."""
    return MX[np.dtype(dtype)]


def np_dtype(dtype) -> np.dtype:
    """An MLX dtype (or an array's) -> the NumPy dtype of the same name (bfloat16: ml_dtypes')."""
    if dtype in NP:
        return NP[dtype]
    if dtype in INTEGER:
        return np.dtype(INTEGER[dtype])
    raise ValueError(f"dtype must be a float or integer mlx dtype: got {dtype}")


def dtype_name(x) -> str:
    """The NumPy name of an array's dtype (NumPy or MLX)."""
    return np_dtype(x.dtype).name if isinstance(x, mx.array) else np.dtype(x.dtype).name


def ct(dtype: mx.Dtype) -> mx.Dtype:
    """The compute dtype of an MLX storage dtype (weights.compute_dtype's rule)."""
    return to_mx_dtype(compute_dtype(np_dtype(dtype)))


def to_mx(x, dtype=None) -> mx.array:
    """A NumPy (or MLX) array as an mx.array, cast to the NumPy dtype `dtype` when given. NumPy does the
    cast (the reference's rounding); mx.array would otherwise turn float64 into float32."""
    if isinstance(x, mx.array):
        return x if dtype is None else x.astype(to_mx_dtype(dtype))
    x = np.asarray(x)
    if dtype is not None:
        x = x.astype(dtype, copy=False)
    if x.dtype in MX:
        return mx.array(x, dtype=MX[x.dtype])
    return mx.array(x)


def to_numpy(x) -> np.ndarray:
    """An mx.array as NumPy, bit for bit (bfloat16 through float32, which holds every bfloat16 exactly)."""
    if not isinstance(x, mx.array):
        return np.asarray(x)
    if x.dtype == mx.bfloat16:
        return np.array(x.astype(mx.float32)).astype(ml_dtypes.bfloat16)
    return np.array(x)


def scalar(value, dtype: mx.Dtype) -> mx.array:
    """A Python number as a 0-d array of dtype (the spec's ct.type(value))."""
    return mx.array(value, dtype=dtype)
