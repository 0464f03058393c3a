"""The call contract, checked on shapes and dtype names only.

Every implementation calls `check_call` before computing, so a bad input gets
the same words from NumPy, torch, Keras and JAX. Nothing here touches values
except `check_bias_values` and `check_mask_values`, which take NumPy-convertible
arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .config import AttentionConfig
from .dtypes import for_value_checks

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
MASK_RANKS_HELP = "(T, S), (B, T, S), (B, 1, T, S) or (B, N, T, S)"


@dataclasses.dataclass(frozen=True)
class CallShapes:
    """Sizes of one call, and the rank-4 shapes its mask, bias and dropout mask take."""

    B: int
    T: int
    S: int
    mask_shape: tuple[int, int, int, int] | None
    bias_shape: tuple[int, int, int, int] | None


def _shape(x) -> tuple[int, ...] | None:
    return None if x is None else tuple(int(d) for d in x)


def broadcast_shape(argument: str, shape: Sequence[int], B: int, N: int, T: int, S: int) -> tuple[int, int, int, int]:
    """Rank-4 (B|1, N|1, T|1, S|1) view of a mask or bias shape.

    Rank 2 is (T, S), rank 3 is (B, T, S) (a head axis is inserted, NOT a
    leading one as NumPy broadcasting would do), rank 4 is as given.
    """
    shape = tuple(shape)
    if len(shape) == 2:
        full = (1, 1) + shape
    elif len(shape) == 3:
        full = (shape[0], 1) + shape[1:]
    elif len(shape) == 4:
        full = shape
    else:
        raise ValueError(f"{argument} must have shape {MASK_RANKS_HELP}: got rank {len(shape)} shape {shape}")
    for got, want in zip(full, (B, N, T, S)):
        if got not in (1, want):
            raise ValueError(
                f"{argument} has shape {shape}, which does not broadcast to (B, N, T, S) = {(B, N, T, S)}"
                f"; accepted: {MASK_RANKS_HELP}"
            )
    return full  # type: ignore[return-value]


def check_call(
    config: AttentionConfig,
    *,
    query_shape,
    key_shape=None,
    value_shape=None,
    mask_shape=None,
    mask_dtype: str | None = None,
    bias_shape=None,
    bias_dtype: str | None = None,
    dropout_mask_shape=None,
    dropout_mask_dtype: str | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    training: bool = False,
    seed: int | None = None,
    return_weights: bool = False,
    materializes_scores: bool = True,
    scores_itemsize: int = 4,
) -> CallShapes:
    """Validate one call; ValueError names the argument and the value received.

    materializes_scores: the call will hold (B, N, T, S) arrays (every path
    but impl_numpy's chunked one); it is refused up front when they cannot
    fit in the memory available, instead of ending in an out-of-memory kill."""
    q = _shape(query_shape)
    k = q if key_shape is None else _shape(key_shape)
    v = k if value_shape is None else _shape(value_shape)
    for name, shape, dim, dim_name in (
        ("query", q, config.query_dim, "query_dim"),
        ("key", k, config.key_dim, "key_dim"),
        ("value", v, config.value_dim, "value_dim"),
    ):
        if len(shape) != 3:
            raise ValueError(f"{name} must have shape (B, L, {dim_name}) = (B, L, {dim}): got rank {len(shape)} shape {shape}")
        if shape[2] != dim:
            raise ValueError(f"{name} must have {dim_name}={dim} features: got shape {shape}")
        if 0 in shape[:2]:
            raise ValueError(f"{name} is empty: got shape {shape}; empty batches and sequences are refused")
    if key_shape is not None and value_shape is None and config.value_dim != config.key_dim:
        pass  # unreachable: the feature check above already named value
    if not (q[0] == k[0] == v[0]):
        raise ValueError(f"query, key and value must share the batch size B: got {q[0]}, {k[0]}, {v[0]}")
    if k[1] != v[1]:
        raise ValueError(f"key and value must share the length S: got key shape {k}, value shape {v}")
    B, T, S = q[0], q[1], k[1]
    N = config.num_heads
    mask4 = bias4 = None
    if mask_shape is not None:
        if mask_dtype != "bool":
            hint = " (an additive float mask goes in bias=)" if mask_dtype and "float" in mask_dtype else ""
            raise ValueError(f"mask must be bool with True = may attend: got dtype {mask_dtype}{hint}")
        mask4 = broadcast_shape("mask", _shape(mask_shape), B, N, T, S)
    if bias_shape is not None:
        if bias_dtype is None or "float" not in bias_dtype:
            raise ValueError(f"bias must be a float array: got dtype {bias_dtype}")
        bias4 = broadcast_shape("bias", _shape(bias_shape), B, N, T, S)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise ValueError(f"is_causal must be true or false: got {is_causal!r}")
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {causal_alignment!r}")
    if dropout_mask_shape is not None:
        if not training:
            raise ValueError("dropout_mask was given but training is false; pass training=True (CLI: --training)")
        if dropout_mask_dtype != "bool":
            raise ValueError(f"dropout_mask must be bool with True = keep: got dtype {dropout_mask_dtype}")
        if _shape(dropout_mask_shape) != (B, N, T, S):
            raise ValueError(f"dropout_mask must have shape (B, N, T, S) = {(B, N, T, S)}: got {_shape(dropout_mask_shape)}")
    elif training and config.dropout > 0 and seed is None:
        raise ValueError(
            f"training with dropout={config.dropout} needs dropout_mask (a bool keep-mask) or seed; got neither"
        )
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise ValueError(f"seed must be an integer: got {seed!r}")
    if materializes_scores:
        check_scores_fit(B, N, T, S, scores_itemsize)
    return CallShapes(B=B, T=T, S=S, mask_shape=mask4, bias_shape=bias4)


# Arrays of (B, N, T, S) alive at once on the plain path: logits, masked
# logits, exp, weights (and the dropped weights in training).
SCORE_COPIES = 4


CHUNK_REFUSAL = (
    "chunk_size cannot be combined with return_weights or trace: the chunked path never forms the (T, S) weights"
)


def check_chunk_size(chunk_size, *, return_weights: bool = False, traced: bool = False) -> int | None:
    """chunk_size= of a call: None, or a positive integer, and not with
    return_weights or a trace. Each implementation checks it right after
    check_call, before computing anything."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer: got {chunk_size!r}")
    if return_weights or traced:
        raise ValueError(CHUNK_REFUSAL)
    return int(chunk_size)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, capped by RLIMIT_AS; None if unknown."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            available = soft if available is None else min(available, soft)
    except (ImportError, ValueError, OSError):
        pass
    return available


def check_scores_fit(B: int, N: int, T: int, S: int, itemsize: int, available: int | None = None) -> None:
    need = B * N * T * S * itemsize * SCORE_COPIES
    available = available_memory_bytes() if available is None else available
    if available is not None and need > available:
        raise ValueError(
            f"the (B, N, T, S) = {(B, N, T, S)} attention scores need about {need / 2**30:.1f} GiB, more than the "
            f"{available / 2**30:.1f} GiB of memory available; use the chunked path (impl_numpy: chunk_size=) "
            "without return_weights, or a smaller batch"
        )


def check_input_values(**arrays) -> None:
    """query/key/value may hold NaN (it propagates) but not +-inf: an infinite
    logit is indistinguishable from a masked one, so a row could silently
    follow the masked-row policy instead of becoming NaN."""
    for name, array in arrays.items():
        if array is None:
            continue
        values = np.asarray(array)
        if values.dtype.kind == "f" or values.dtype.name == "bfloat16":
            if np.isinf(for_value_checks(values)).any():
                raise ValueError(f"{name} contains +-inf; NaN propagates but infinite inputs are refused "
                                 "(an infinite logit would look like a masked one)")


def check_bias_values(bias) -> None:
    """-inf is allowed (it masks); NaN and +inf are not."""
    array = np.asarray(bias, dtype=np.float64)
    if np.isnan(array).any() or np.isposinf(array).any():
        raise ValueError("bias must not contain NaN or +inf (use -inf to mask a position)")
