"""The NumPy runner of `mha bench`: impl_numpy's paths (the fused path,
chunked, the hand-written backward, an in-place cache) beside plain NumPy
attention written the obvious way, tracemalloc's peak memory.
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np

from conformance.bench.frameworks.runner import (
    DECODE_OPTIONS,
    Path_,
    Runner,
    cache_read_path,
    decode_buffers,
    decode_cache,
    float32_only,
    window_chunk,
)
from conformance.bench.measure import tracemalloc_memory
from conformance.bench.shapes import CHUNK_SIZE


def _numpy_blas() -> str:
    """The OpenBLAS kernel NumPy runs (OPENBLAS_CORETYPE changes it)."""
    import ctypes
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "*openblas*"))
    for lib in libs:
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            with contextlib.suppress(OSError, AttributeError):
                f = getattr(ctypes.CDLL(lib), name)
                f.restype = ctypes.c_char_p
                return f"OpenBLAS {f().decode()}"
    return "unknown"


def numpy_runner(device: str, quick: bool, dtype: str = "float32") -> Runner:
    from impl_numpy.attention import multi_head_attention
    from impl_numpy.backward import multi_head_attention_vjp

    if device != "cpu":
        raise RuntimeError("numpy runs on the CPU only")
    float32_only("numpy", dtype)

    def naive(x, p, N, causal):
        """Plain float32 attention, written the obvious way (the NumPy 'native')."""
        B, T, D = x.shape
        H = D // N
        q = (x @ p["query.kernel"].reshape(D, D) + p["query.bias"].reshape(D)).reshape(B, T, N, H).transpose(0, 2, 1, 3)
        k = (x @ p["key.kernel"].reshape(D, D) + p["key.bias"].reshape(D)).reshape(B, T, N, H).transpose(0, 2, 1, 3)
        v = (x @ p["value.kernel"].reshape(D, D) + p["value.bias"].reshape(D)).reshape(B, T, N, H).transpose(0, 2, 1, 3)
        s = (q @ k.transpose(0, 1, 3, 2)) * np.float32(1 / math.sqrt(H))  # (B, N, T, S)
        if causal:
            s = np.where(np.tril(np.ones((T, T), bool)), s, np.float32(-np.inf))
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = (s @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
        return o @ p["output.kernel"].reshape(D, D) + p["output.bias"]

    def paths(shape, config, tensors, x):
        c = shape.causal
        if shape.family == "window":
            chunk = window_chunk(shape, quick, CHUNK_SIZE, CHUNK_SIZE)
            return [Path_("ours.chunked", "ours", "eager", "forward",
                          lambda: multi_head_attention(config, tensors, x, is_causal=c, chunk_size=chunk),
                          note=f"chunk_size={chunk}, window_left={shape.window_left}", compare=True)]
        if shape.family == "decode":
            pk, pv = decode_cache(shape)
            bk, bv = decode_buffers(shape)
            return [Path_("ours", "ours", "eager", "forward",
                          lambda: multi_head_attention(config, tensors, x, past_key=pk, past_value=pv, **DECODE_OPTIONS),
                          note="fused path, return_cache", compare=True),
                    Path_("ours.in_place", "ours", "eager", "forward",
                          lambda: multi_head_attention(config, tensors, x, past_key=bk, past_value=bv,
                                                       cache_length=shape.P, **DECODE_OPTIONS),
                          note="fused path, cache_length (buffers written in place)", compare=True),
                    cache_read_path(shape, "eager", lambda: (np.sum(pk), np.sum(pv)), "np.sum")]
        g = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
        out = []
        if not shape.long:
            out.append(Path_("ours", "ours", "eager", "forward", lambda: multi_head_attention(config, tensors, x, is_causal=c),
                             ts_arrays=4, compare=True))
        if c or shape.long:
            chunk = min(CHUNK_SIZE, shape.T)
            out.append(Path_("ours.chunked", "ours", "eager", "forward",
                             lambda: multi_head_attention(config, tensors, x, is_causal=c, chunk_size=chunk),
                             note=f"chunk_size={chunk}", compare=True))
        out.append(Path_("native.naive", "native", "eager", "forward", lambda: naive(x, tensors, shape.N, c), ts_arrays=3))
        if not shape.sweep and not shape.long:
            out.append(Path_("ours.vjp", "ours", "eager", "forward+backward",
                             lambda: multi_head_attention_vjp(config, tensors, x, d_output=g, is_causal=c)[0],
                             ts_arrays=7, note="hand-written backward"))
        return out

    def matmul(n):
        a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
        c = np.empty_like(a)
        return lambda: np.matmul(a, a, out=c)

    info = {"version": np.__version__, "blas": _numpy_blas(),
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"), "threads": "BLAS default"}

    def memory(call):
        from impl_numpy.chunked import release_workspace

        release_workspace()  # the buffers the fast path keeps between calls are allocated, and counted, in this one
        return tracemalloc_memory(call)

    return Runner(info, matmul, paths, np.asarray, memory)
