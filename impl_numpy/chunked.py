"""Exact attention over key blocks with an online softmax (no (T, S) array).

Keys are taken in blocks of `chunk_size` columns and queries in blocks of
min(chunk_size, QUERY_ROWS) rows, so the largest temporary is
(B, N, rows, chunk). For each query block a running max m, running sum l and
running numerator acc are rescaled as each key block arrives (Milakov &
Gimelshein 2018, the recurrence flash-attention uses). Key blocks that the
causal mask hides entirely are never computed, nor read: a NaN in a hidden
key or value reaches no row here, while the stages' attend matmul spreads it
through 0 * NaN. Otherwise the result equals the stages' to round-off.

This is also the plain call's fast engine (functional.py uses it when no trace
and no weights are asked for), so it is written for speed as well as
clarity: the caller folds the scale into its query projection (T*H products
instead of T*S), one block buffer is reused for every block's logits and
worked on in place, and the context is written straight into merge_heads'
(B, T, N, V) layout. NumPy's elementwise passes run on one core while its
BLAS matmuls use both, so each pass over a block counts; exp is the largest
part of the work that is not a matmul: about 2 ns per element here, longer
than the element's 4*H = 256 matmul FLOPs take at the BLAS rate.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from weights import compute_dtype

# Queries are taken in blocks of at most this many rows (keys in blocks of
# chunk_size): a causal query block computes a (rows x rows) triangle of hidden
# logits on its diagonal, so fewer rows waste less, while BLAS runs the
# per-head (rows x H) x (H x chunk) products well from about 128 rows on.
QUERY_ROWS = 128

# Calls with (B, N, T, S) of at least this many logits run their heads on
# THREADS threads (chunked_attention_core says why). Measured here, float32,
# one and two threads interleaved: the whole call 18% faster at gpt2 (50M
# logits), 19% at B 1 T=S 2048 (34M), 11% at vit-b16 (15M); no gain at
# bert-base (1.6M), 8-28% slower at B 1 T=S 512 and 1024 (2M, 8M), where
# each thread's blocks are small.
THREADED_MIN_SCORES = 12 * 2**20
THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

_executor = None
_controller = None
_setup_lock = threading.Lock()
_threaded_lock = threading.Lock()  # one threaded core at a time: the BLAS limit is process-wide


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _setup_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=max(1, THREADS), thread_name_prefix="mha-numpy")
        return _executor


@contextlib.contextmanager
def _threaded_section():
    """BLAS (NumPy's OpenBLAS, or MKL) held to one thread, process-wide, for
    the block, so that each of our threads runs its matmuls on its own core;
    serialised, so that concurrent callers cannot restore each other's limits
    in the wrong order. The controller (a scan of the loaded libraries, about
    a millisecond) is made once."""
    global _controller
    from threadpoolctl import ThreadpoolController

    with _setup_lock:
        if _controller is None:
            _controller = ThreadpoolController()
    with _threaded_lock, _controller.limit(limits=1, user_api="blas"):
        yield


def _block(array, axis_sizes, t0, t1, s0, s1):
    """Slice a rank-4 broadcastable array's T and S axes where they are full."""
    if array is None:
        return None
    T, S = axis_sizes
    ts = slice(t0, t1) if array.shape[2] == T else slice(None)
    ss = slice(s0, s1) if array.shape[3] == S else slice(None)
    return array[:, :, ts, ss]


def _masked_row_context(weight, keep, v, t0, t1, N, T, S, chunk_size, rate):
    """The context of query rows t0..t1 if each were a row with no allowed key:
    the masked-row policy's `weight` on every key (hidden ones included), then
    dropout, times v, as the stages compute it. (B, N, t, V)."""
    B, K, _, V = v.shape
    t = t1 - t0
    ctx = np.zeros((B, N, t, V), dtype=v.dtype)
    for s0 in range(0, S, chunk_size):
        s1 = min(S, s0 + chunk_size)
        w = np.full((B, N, t, s1 - s0), weight, dtype=v.dtype)
        if keep is not None:
            w = np.where(_block(keep, (T, S), t0, t1, s0, s1), w / rate, 0)
        ctx += np.matmul(w.reshape(B, K, -1, s1 - s0), v[:, :, s0:s1]).reshape(B, N, t, V)
    return ctx


def one_allocation(dtype, *shapes):
    """Arrays of these shapes carved from one allocation. The first touch of
    each fresh 4 KiB page is a page fault, which costs about what an exp costs
    per float32 element; NumPy asks the kernel for huge pages for allocations
    from 4 MiB on, so one large block faults a few hundred times less often
    than several 3 MiB arrays (bert-base's q, k, v and context)."""
    sizes = [int(np.prod(shape)) for shape in shapes]
    flat = np.empty(sum(sizes), dtype=dtype)
    offsets = np.cumsum([0, *sizes])
    return [flat[a:b].reshape(shape) for a, b, shape in zip(offsets[:-1], offsets[1:], shapes)]


def chunked_attention_core(config, q, k, v, *, mask, bias, keep, is_causal, causal_alignment, chunk_size, out=None):
    """q (B, N, T, H), k (B, K, S, H), v (B, K, S, V) -> context (B, N, T, V).

    q comes already multiplied by the scale, in the compute dtype (the caller
    folds the scale into its projection: T*H products instead of T*S). The
    context is a transposed view of a (B, T, N, V) array (`out` if given), so
    merge_heads is a free reshape.

    Large calls split their key/value heads (each with its G query heads)
    across THREADS threads, BLAS held to one thread meanwhile: NumPy's
    elementwise passes (exp above all) run on one core, so one thread leaves
    the other core idle for everything but the matmuls. Heads are independent,
    so the result is the single-threaded one's to round-off."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer: got {chunk_size!r}")
    B, N, T, H = q.shape
    K, S, V = k.shape[1], k.shape[2], v.shape[3]
    context = np.empty((B, T, N, V), dtype=k.dtype) if out is None else out  # merge_heads' layout
    parts = min(THREADS, K) if B * N * T * S >= THREADED_MIN_SCORES else 1
    options = dict(is_causal=is_causal, causal_alignment=causal_alignment, chunk_size=chunk_size)
    if parts <= 1:
        _core(config, q, k, v, mask=mask, bias=bias, keep=keep, context=context, **options)
        return context.transpose(0, 2, 1, 3)  # (B, N, T, V)
    G = N // K
    bounds = [K * i // parts for i in range(parts + 1)]

    def heads(k0, k1):  # kv heads k0..k1 and their query heads, written into context's own columns
        n0, n1 = k0 * G, k1 * G
        _core(config, q[:, n0:n1], k[:, k0:k1], v[:, k0:k1], mask=_heads(mask, N, n0, n1),
              bias=_heads(bias, N, n0, n1), keep=_heads(keep, N, n0, n1), context=context[:, :, n0:n1], **options)

    with _threaded_section():
        futures = [_pool().submit(heads, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        wait(futures)  # all of them, before BLAS gets its threads back
    for future in futures:
        future.result()  # re-raises a thread's exception here
    return context.transpose(0, 2, 1, 3)  # (B, N, T, V)


def _heads(array, N, n0, n1):
    """A rank-4 broadcastable (B|1, N|1, T|1, S|1) array's heads n0..n1 (all of a broadcast axis)."""
    return array if array is None or array.shape[1] != N else array[:, n0:n1]


def _core(config, q, k, v, *, mask, bias, keep, is_causal, causal_alignment, chunk_size, context):
    """The online softmax over key blocks for all of q's heads, into context (B, T, N, V)."""
    B, N, T, H = q.shape
    K, S, V = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    dtype = k.dtype
    ct = compute_dtype(dtype)
    rounds = ct != dtype  # 16-bit: stage results are rounded to the storage dtype
    offset = 0 if causal_alignment == "top_left" else S - T  # key j visible to query i iff j <= i + offset
    rate = ct.type(1.0 - config.dropout)
    kc, vc = k.astype(ct, copy=False), v.astype(ct, copy=False)
    rows = min(chunk_size, QUERY_ROWS, T)
    bias_masks = bias is not None and bool(np.isneginf(bias).any())
    # Reused by every block: its logits (worked on in place), its numerator and one product.
    scores, numerator, product = one_allocation(ct, B * N * rows * min(chunk_size, S), B * N * rows * V, B * N * rows * V)
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        t = t1 - t0
        # Causal: the keys after this block's last diagonal are hidden from every row in it.
        s_stop = min(S, max(0, t1 + offset)) if is_causal else S
        qb = q[:, :, t0:t1].reshape(B, K, G * t, H)  # (B, K, G*t, H); a copy only when G > 1
        acc = numerator[: B * N * t * V].reshape(B, K, G * t, V)  # running numerator
        m = l = None  # running max and sum, (B, N, t, 1); None before the first key block
        for s0 in range(0, s_stop, chunk_size):
            s1 = min(s_stop, s0 + chunk_size)
            s = s1 - s0
            # The stages of functional.py on one block (same rounding rule), in place in `scores`.
            x = scores[: B * N * t * s].reshape(B, K, G * t, s)
            np.matmul(qb, kc[:, :, s0:s1].swapaxes(-1, -2), out=x)  # logits, already scaled
            x = x.reshape(B, N, t, s)
            if rounds:
                x[...] = x.astype(dtype)
            if bias is not None:
                x += _block(bias, (T, S), t0, t1, s0, s1)
                if rounds:
                    x[...] = x.astype(dtype)
            allowed = _block(mask, (T, S), t0, t1, s0, s1)
            hidden = None if allowed is None else ~allowed
            if bias_masks:  # a -inf bias is a mask (functional.mask): a NaN logit there is hidden too
                neg = np.isneginf(_block(bias, (T, S), t0, t1, s0, s1))
                hidden = neg if hidden is None else hidden | neg
            if is_causal and s1 - 1 > t0 + offset:  # the block crosses the diagonal
                after = np.arange(s0, s1)[None, :] > np.arange(t0, t1)[:, None] + offset  # (t, s)
                hidden = after if hidden is None else hidden | after
            if hidden is not None:
                np.copyto(x, ct.type(-np.inf), where=hidden)
            # Online softmax: exp against the running max, earlier blocks rescaled when it grows.
            m_new = x.max(axis=-1, keepdims=True)
            if m is not None:
                np.maximum(m, m_new, out=m_new)
            m_safe = np.where(m_new == -np.inf, ct.type(0), m_new)  # a row that has seen no key yet
            x -= m_safe
            e = np.exp(x, out=x)  # masked -> exactly 0
            row_sum = e.sum(axis=-1, keepdims=True)
            if keep is not None:
                e /= rate
                np.copyto(e, ct.type(0), where=~_block(keep, (T, S), t0, t1, s0, s1))
            e = e.reshape(B, K, G * t, s)
            if m is None:
                np.matmul(e, vc[:, :, s0:s1], out=acc)
                l = row_sum
            else:
                pv = product[: B * N * t * V].reshape(B, K, G * t, V)
                np.matmul(e, vc[:, :, s0:s1], out=pv)
                correction = np.exp(m - m_safe)  # 0 where m was -inf
                l *= correction
                l += row_sum
                acc4 = acc.reshape(B, N, t, V)
                acc4 *= correction
                acc4 += pv.reshape(B, N, t, V)
            m = m_new
        acc = acc.reshape(B, N, t, V)
        if l is None:  # every key is hidden from every row of this block
            l = np.zeros((B, N, t, 1), dtype=ct)
            acc[...] = 0
        empty = l == 0  # (B, N, t, 1): rows with no allowed key
        any_empty = empty.any()
        if any_empty:
            l[empty] = 1
        acc /= l
        if any_empty and config.masked_row != "zero":  # "zero": acc is already 0 there
            weight = 1.0 / S if config.masked_row == "uniform" else np.nan
            acc = np.where(empty, _masked_row_context(weight, keep, vc, t0, t1, N, T, S, chunk_size, rate), acc)
        context[:, t0:t1] = acc.transpose(0, 2, 1, 3)  # (B, t, N, V), stored in dtype
