"""What a `mha bench` worker gets from a framework, and what every
framework's runner shares: a Runner (the paths to time, a large matmul, a
memory counter), a Path_ (one thing to time), Unsupported (a shape a backend
cannot run), and the window and decode families' inputs and yardstick
(window_chunk, decode_cache, decode_buffers, DECODE_OPTIONS,
cache_read_path). numpy.py, torch.py, tf.py and jax.py each hold one
framework's runner; conformance.bench.runners names them (RUNNERS).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from conformance.bench.shapes import QUICK_CHUNK, Shape, framework_chunk


@dataclasses.dataclass
class Path_:
    """A thing to time: `call()` runs it once, synchronised, and returns the output."""

    name: str  # e.g. "ours.sdpa.eager", "native.keras_mha.xla"
    kind: str  # "ours" | "native"
    mode: str  # "eager" | "compiled"
    pass_: str  # "forward" | "forward+backward"
    call: Callable[[], object]
    ts_arrays: float = 0.0  # (B, N, T, S) float32 arrays alive at the peak (memory guard); 0 if chunked/flash
    note: str = ""  # kernel, compiler or chunk size, shown in the table
    compare: bool = False  # compare the output with the NumPy reference
    flops: int | None = None  # work to count instead of the shape's attention FLOPs (the cache read: its elements)


class Unsupported(Exception):
    """A backend cannot run a shape the way the bench needs: its rows say why, as skipped."""


@functools.lru_cache(maxsize=1)
def decode_cache(shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """The decode family's cache, past_key (B, K, P, H) and past_value (B, K, P, H), float32,
    the same for every backend (and the NumPy reference); the last shape's is kept."""
    rng = np.random.default_rng(2)
    size = (shape.B, shape.kv_heads, shape.P, shape.H)
    return rng.standard_normal(size, dtype=np.float32), rng.standard_normal(size, dtype=np.float32)


def window_chunk(shape: Shape, quick: bool, large_batch: int, small_batch: int) -> int:
    """chunk_size of a chunked path on the window family: the shape's own in a real run, QUICK_CHUNK
    under --quick (smaller than the quick window, so hidden key blocks are skipped there too)."""
    return min(shape.T, QUICK_CHUNK) if quick else framework_chunk(shape, large_batch, small_batch)


def cache_read_path(shape: Shape, mode: str, call: Callable[[], object], how: str) -> Path_:
    """The decode family's yardstick: one pass over the cache (past_key and past_value), a sum in
    the backend's own framework, timed like every path and beside them."""
    return Path_("cache.read", "reference", mode, "forward", call, flops=shape.cache_bytes // 4,
                 note=f"{how} over past_key and past_value ({shape.cache_bytes / 2**20:.0f} MiB)")


DECODE_OPTIONS = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True)  # the new token sees the cache


def decode_buffers(shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """The decode family's cache as in-place buffers (cache_length=P): capacity P + 1, the first P
    positions decode_cache's, the last one the step's own (each timed call writes it again, with the
    same values: every call computes the same step)."""
    buffers = []
    for past in decode_cache(shape):
        B, K, P, H = past.shape
        buffer = np.zeros((B, K, P + 1, H), np.float32)
        buffer[:, :, :P] = past
        buffers.append(buffer)
    return buffers[0], buffers[1]


@dataclasses.dataclass
class Runner:
    """What a worker needs from a framework: kept to one function per framework."""

    info: dict
    matmul: Callable[[int], Callable[[], object]]  # n -> a callable doing one n x n float32 matmul
    paths: Callable[[Shape, object, dict, object], list[Path_]]  # (shape, config, tensors, x) -> paths
    to_numpy: Callable[[object], np.ndarray]
    memory: Callable[[Callable[[], object]], tuple[int | None, str, object]]  # call -> (peak bytes, method, out)


def float32_only(backend: str, dtype: str) -> None:
    if dtype != "float32":
        raise RuntimeError(f"{backend} is benchmarked in float32 only (bfloat16: torch and jax)")
