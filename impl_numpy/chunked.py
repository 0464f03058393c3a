"""Exact attention over key blocks with an online softmax (no (T, S) array).

Keys are taken in blocks of `chunk_size` columns and queries in blocks of
min(chunk_size, QUERY_ROWS) rows, so the largest temporary is
(B, N, rows, chunk). For each query block a running max m, running sum l and
running numerator acc are rescaled as each key block arrives (Milakov &
Gimelshein 2018, the recurrence flash-attention uses), unless every logit is
known to be small enough to need no max (logits_bounded). Key blocks that the
causal mask hides entirely are never computed, nor read: a NaN in a hidden
key or value reaches no row here, while the stages' attend matmul spreads it
through 0 * NaN; with a selection (topk_indices, skip_masked) so are the key
blocks the mask, the selection in it, hides from every query of a block.
Otherwise the result equals the stages' to round-off.

This is also the plain call's fast engine (attention.py hands fused_forward
the call when no trace and no weights are asked for), so it is written for
speed as well as clarity: fused_forward folds the scale into its query
projection (T*H products instead of T*S), one block buffer is reused for
every block's logits and worked on in place, and the context is written
straight into merge_heads' (B, T, N, V) layout. NumPy's elementwise passes
run on one core while its BLAS matmuls use both, so each pass over a block
counts; exp is the largest part of the work that is not a matmul: about 2 ns
per element here, longer than the element's 4*H = 256 matmul FLOPs take at
the BLAS rate.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from weights import compute_dtype
from weights.contract import check_chunk_size

from . import functional as F
from .heads import qkv_heads
from .latent import latent_heads

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
# each thread's blocks are small (and OpenBLAS's worker, still spinning after
# the BLAS-threaded projections, holds a core: fused_forward).
THREADED_MIN_SCORES = 12 * 2**20

# Plain calls with at least this many matmul FLOPs (fused_forward) run every
# stage on THREADS threads, BLAS held to one thread each; below it, BLAS's own
# threads for the projections (fused_forward says why). Measured here,
# float32, right after an OpenBLAS call (its idle worker still spinning):
# B 16 T=S 256 (22.5 GFLOP) 15% faster on threads, gpt2 13%, vit-b16 13%;
# on eight shapes of 0.6-10.5 GFLOP, bert-base among them, slower in all
# but one of 24 measurements (bert-base 39-63%), as the spin outlasts the
# call (conformance/bench/scripts/threads_ab.py, three runs, figures in docs/performance.md).
THREADED_MIN_FLOPS = 16 * 10**9
# A call whose logits are all known, before any is computed, to lie within
# +-LOGIT_BOUND needs no running max: exp(logit) itself neither overflows
# (e^60 * S * max|v| stays far below float32's 3.4e38) nor underflows (e^-60 is
# a normal float32), so every block's exp, sum and numerator simply add up.
# That drops the max pass, the subtraction and the rescaling of earlier
# blocks (see logits_bounded): measured 1.3 ms of the 13 ms core at bert-base,
# 7% of the whole call at `long`. The test is on |q_i| |k_j|, which can exceed
# every |q_i . k_j| by far, so some calls that would fit take the running
# max; either way the result is the same to round-off.
LOGIT_BOUND = 60.0
SKIP_MAX_WHEN_BOUNDED = True  # False: always the running max (tests of both ways, timing A/B)

# Scratch buffers (workspace) kept between calls: at most this many bytes in
# all. bert-base's two (q, k, v and the context; the core's block buffers)
# take 25 MiB; larger calls allocate afresh, where the faults weigh less
# against their work. Memory figures (mha bench) release them first, so
# that a call's own buffers count in its peak.
WORKSPACE_KEEP_BYTES = 32 * 2**20

THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

_executor = None
_setup_lock = threading.Lock()
_threaded_lock = threading.Lock()  # one threaded core at a time: the BLAS limit is process-wide
_kept: list[np.ndarray] = []  # workspace buffers not in use, the one unused longest first
_kept_lock = threading.Lock()


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
    a millisecond, against the tens of milliseconds of a call big enough to
    thread) is made each time: one made once missed a BLAS loaded after it
    (torch's or TensorFlow's own, imported later), whose threads then ran
    unheld inside ours."""
    from threadpoolctl import ThreadpoolController

    with _threaded_lock, ThreadpoolController().limit(limits=1, user_api="blas"):
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


def release_workspace() -> None:
    """Free the buffers kept between calls (workspace below)."""
    with _kept_lock:
        _kept.clear()


def kept_workspace_bytes() -> int:
    """The bytes of the buffers kept between calls, now."""
    with _kept_lock:
        return sum(buffer.nbytes for buffer in _kept)


@contextlib.contextmanager
def workspace(dtype, *shapes):
    """Scratch arrays of these shapes, carved from one buffer that is kept
    for later calls (up to WORKSPACE_KEEP_BYTES in all, process-wide). Each
    buffer serves one caller at a time; nothing carved here may outlive the
    with block (the fast path returns no view of it).

    Why keep them: the first touch of each fresh page costs the kernel a page
    fault and the page's zeroing, and a fresh buffer is fresh pages (NumPy
    asks for huge pages from 4 MiB on, which fault less often but zero as
    much). Measured at bert-base (float32, 2 cores, AVX-512 EPYC, interleaved
    with the bench's 2048 matmul, two runs of 40 pairs): fresh buffers 65.2%
    and 70.1% of the matmul rate, kept ones 72.9% and 80.3%."""
    dtype = np.dtype(dtype)
    sizes = [int(np.prod(shape)) for shape in shapes]
    need = sum(sizes)
    with _kept_lock:
        fitting = [i for i, buffer in enumerate(_kept) if buffer.dtype == dtype and buffer.size >= need]
        flat = _kept.pop(min(fitting, key=lambda i: _kept[i].size)) if fitting else None  # the smallest that fits
    if flat is None:
        flat = np.empty(need, dtype=dtype)
    try:
        offsets = np.cumsum([0, *sizes])
        yield [flat[a:b].reshape(shape) for a, b, shape in zip(offsets[:-1], offsets[1:], shapes)]
    finally:
        if flat.nbytes <= WORKSPACE_KEEP_BYTES:
            with _kept_lock:
                _kept.append(flat)
                while sum(buffer.nbytes for buffer in _kept) > WORKSPACE_KEEP_BYTES:
                    _kept.pop(0)  # the one unused longest


class KeyParts:
    """Keys (or values) held as parts along S, (B, K, S_i, .) each, read as
    one (B, K, S, .) array by the core: a decode step's cache and new keys,
    not concatenated when no present cache is asked back. Slicing the S axis
    gives a view within one part, a copy of the few keys of a block that
    straddles two; slicing B or K slices every part."""

    def __init__(self, parts):
        self.parts = tuple(parts)
        first = self.parts[0]
        self.shape = (*first.shape[:2], sum(part.shape[2] for part in self.parts), *first.shape[3:])
        self.dtype = first.dtype

    def astype(self, dtype, copy=True):
        return KeyParts(part.astype(dtype, copy=copy) for part in self.parts)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)  # k[b0:b1], the batch split's bare slice
        b, h, keys = (index + (slice(None),) * 3)[:3]
        if keys == slice(None):
            return KeyParts(part[b, h] for part in self.parts)
        start, stop, _ = keys.indices(self.shape[2])
        pieces, offset = [], 0
        for part in self.parts:
            end = offset + part.shape[2]
            if start < end and stop > offset:
                pieces.append(part[b, h, max(start - offset, 0): min(stop, end) - offset])
            offset = end
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=2)


class JoinedKeys:
    """Keys held as two parts along their features, (B, K, S, H_1) and (B, K, S, H_2), read by the core as
    one (B, K, S, H_1 + H_2) array: a latent layer's absorbed key [latent | rotary key] in a decode step, not
    concatenated (a copy of the whole cache, P (C + R) values, per step). The core's logits matmul takes the
    parts one by one (logits_into); slicing B, K or S slices both."""

    def __init__(self, first, second):
        self.first, self.second = first, second
        self.shape = (*first.shape[:3], first.shape[3] + second.shape[3])
        self.dtype = first.dtype

    def astype(self, dtype, copy=True):
        return JoinedKeys(self.first.astype(dtype, copy=copy), self.second.astype(dtype, copy=copy))

    def __getitem__(self, index):
        return JoinedKeys(self.first[index], self.second[index])


# A block with at most this many query rows per kv head (G*t: a decode step's heads) has its two products
# taken with the keys as the rows, (s, H) x (H, G*t) and (V, s) x (s, G*t), and transposed back: OpenBLAS
# runs these skinny products faster that way round. Measured (2-core AMD EPYC VM, 2026-11-29, loaded, CPU
# time, min of 7, three rounds): 16 rows over 65537 keys, logits 42-44 ms one way, 32-35 the other; the
# attend (16, 65537) x (65537, 512) 50 ms (and twice over 1.1 s, its threads spinning) against 31-32.
FEW_ROWS = 32


def logits_into(x, q, k):
    """x = q k^T (the block's logits, already scaled: q carries the scale), q (B, K, G*t, H), k (B, K, s, H) a
    block of keys or of JoinedKeys (then q's features split as k's: the first part's product, the second's
    added)."""
    parts = ((q, k),) if not isinstance(k, JoinedKeys) else (
        (q[..., :k.first.shape[-1]], k.first), (q[..., k.first.shape[-1]:], k.second))
    for i, (qp, kp) in enumerate(parts):
        if q.shape[-2] <= FEW_ROWS:  # (s, H) x (H, G*t), transposed into x
            product = np.matmul(kp, qp.swapaxes(-1, -2)).swapaxes(-1, -2)
            if i == 0:
                x[...] = product
            else:
                x += product
        elif i == 0:
            np.matmul(qp, kp.swapaxes(-1, -2), out=x)
        else:
            x += np.matmul(qp, kp.swapaxes(-1, -2))
    return x


def attend_into(out, e, v):
    """out = e v (the block's unnormalised context): e (B, K, G*t, s), v (B, K, s, V); with at most FEW_ROWS
    rows as (V, s) x (s, G*t), transposed into out."""
    if e.shape[-2] <= FEW_ROWS:
        out[...] = np.matmul(v.swapaxes(-1, -2), e.swapaxes(-1, -2)).swapaxes(-1, -2)
        return out
    return np.matmul(e, v, out=out)


def logits_bounded(q, k, v, bias) -> bool:
    """True when every logit of this call lies within +-LOGIT_BOUND, known
    without computing one: |q_i . k_j| <= |q_i| |k_j| (Cauchy-Schwarz), taken
    per head over the largest query and key norms (q comes already scaled).
    Also asks that sum_j e^logit * |v_j| stays finite. A bias (ALiBi's run to
    -hundreds) takes the running max. NaN anywhere in q, k or v fails every
    comparison, so NaN takes the running max too, whose NaN rules are the
    stages' (functional.py). Costs two passes over q and k that square and
    sum in one go (einsum), and two reductions of v: about 1 ms at bert-base."""
    if bias is not None or isinstance(k, (KeyParts, JoinedKeys)):  # (parts: the running max, without the check's passes)
        return False
    B, N, T, H = q.shape
    K, S = k.shape[1], k.shape[2]
    if T == 0 or S == 0:
        return False
    ct = compute_dtype(k.dtype)
    q_norms = np.einsum("bnth,bnth->bnt", q, q, dtype=ct).max(axis=2)  # (B, N): largest squared norm per head
    k_norms = np.einsum("bksh,bksh->bks", k, k, dtype=ct).max(axis=2)  # (B, K)
    largest = float((q_norms.reshape(B, K, N // K) * k_norms[:, :, None]).max())  # bound on logit^2
    v_largest = max(abs(float(v.max())), abs(float(v.min()))) if v.size else 0.0
    return (largest <= LOGIT_BOUND**2
            and v_largest * S * np.exp(LOGIT_BOUND) <= float(np.finfo(ct).max) / 16)


def matmul_flops(config, B, T, S):
    """The call's matmul FLOPs: four projections, logits and attend (full T*S)."""
    N, K, H, V = config.num_heads, config.num_kv_heads, config.head_dim, config.value_head_dim
    projections = (T * config.query_dim * N * H + S * config.key_dim * K * H + S * config.value_dim * K * V
                   + T * N * V * config.out_dim)
    return 2 * B * (projections + N * T * S * (H + V))


def _run(tasks) -> None:
    """Run callables on the pool and wait for all of them; re-raise the first failure."""
    futures = [_pool().submit(task) for task in tasks]
    wait(futures)  # all of them, before the caller moves on (or BLAS gets its threads back)
    for future in futures:
        future.result()


def _row_parts(rows: int, parts: int):
    return [(rows * i // parts, rows * (i + 1) // parts) for i in range(parts)]


def fused_forward(config, call, *, is_causal, causal_alignment, chunk_size, return_cache=False):
    """The plain call's fast path (and chunk_size=): project, the fused core
    below, output. call: attention.prepare's validated call (inputs cast to
    the storage dtype; mask, bias, keep rank 4, broadcastable).
    -> (output (B, T, O), present_key, present_value) (None, None unless
    return_cache).

    A call with any modern feature (norm, rope, a cache, segments, softcap,
    windows, sinks, or return_cache) takes _fused_modern: the stages up to the
    present keys, then the same core, which skips the key blocks a window
    or the local chunks hide as it skips causally hidden ones.

    Calls of at least THREADED_MIN_FLOPS (float32/float64) run every stage on
    THREADS threads under one BLAS limit of one thread: the projections and
    the output split their rows, the core its heads (or its batch). Why not
    BLAS's own threads for the matmuls and ours for the core only: OpenBLAS's
    idle worker keeps spinning for 0.1-0.15 s after each multi-threaded call,
    holding one of the 2-core Xeon VM's two cores, so the core that followed
    BLAS-threaded projections ran its first 0.1 s on one core (measured: two
    threads' matmuls took 59.8 ms right after an OpenBLAS call, 44.6 ms 0.1 s
    later, 36 ms 0.15 s later, 35 ms in a process started with
    OPENBLAS_THREAD_TIMEOUT=4, which shortens the spin).
    Rows and heads are independent, so the result is the single-threaded
    one's to round-off."""
    if config.is_modern or call.modern or return_cache:
        return _fused_modern(config, call, is_causal=is_causal, causal_alignment=causal_alignment,
                             chunk_size=chunk_size, return_cache=return_cache)
    p, query, key, value = call.params, call.query, call.key, call.value
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    options = dict(mask=call.mask4, bias=call.bias4, keep=call.keep, is_causal=is_causal,
                   causal_alignment=causal_alignment, chunk_size=chunk_size)
    ct = compute_dtype(query.dtype)
    if THREADS < 2 or ct != query.dtype or matmul_flops(config, B, T, S) < THREADED_MIN_FLOPS:
        return _fused(config, p, query, key, value, parts=1, **options), None, None
    with _threaded_section():
        return _fused(config, p, query, key, value, parts=THREADS, **options), None, None


def _fused_modern(config, call, *, is_causal, causal_alignment, chunk_size, return_cache=True):
    """fused_forward for a call with modern features: the stages from the
    projections to the present keys (heads.qkv_heads), the scale folded
    into q after RoPE, the core (its heads on threads where the call is
    large), the output. -> (output, present_key, present_value)."""
    # A cache nobody asks back is never concatenated (a copy of the whole cache per step): the core
    # reads it and the new keys as parts.
    parts = call.past_key is not None and not return_cache and call.cache_length is None
    parts = parts and config.differential is None  # differential: value_pair reads every value (the cache's too)
    ct = compute_dtype(call.dtype)
    if config.latent is not None:  # the absorbed form (latent.py): one shared head of width C + R over the latent
        q, latent, rotary = latent_heads(config, call)  # (B, N, T, H), (B, 1, S_total, C), (B, 1, S_total, R)
        q = F.absorb_query(q, call.params["key.kernel"], config.latent.rope_dim)  # (B, N, T, C + R)
        parts = False
        cols = _selected_columns(config, call, is_causal, causal_alignment)
        if cols is None and call.shapes.T == 1:  # a decode step: the cache read in place, not joined into a copy
            k, v = JoinedKeys(latent, rotary), latent  # (B, 1, S_total, C + R) as two parts, (B, 1, S_total, C)
        elif cols is None:
            k, v = np.concatenate([latent, rotary], axis=-1), latent  # (B, 1, S_total, C + R), (B, 1, S_total, C)
        else:  # a decode step over a selection: the selected rows alone (a gather), not the whole cache masked
            v = latent[:, :, cols]  # (B, 1, s, C)
            k = JoinedKeys(v, rotary[:, :, cols])  # (B, 1, s, C + R) as two parts: no join of the gathered rows
            mask = call.mask4[..., cols]
    else:
        cols = None
        q, k, v = qkv_heads(config, call, append=not parts)  # (B, N, T, H), (B, K, S_total|S, H), (.., V)
    if parts:
        k, v = KeyParts((call.past_key, k)), KeyParts((call.past_value, v))  # (B, K, S_total, .) as parts
    present_value = v
    if config.differential is not None:  # each kv head's value joined with its pair's: (B, K, S_total, 2V)
        v = F.value_pair(v)
    q = q.astype(ct) * ct.type(config.effective_scale)
    positioned = config.alibi or config.local_chunk is not None
    ctx = chunked_attention_core(config, q, k, v, mask=call.mask4 if cols is None else mask, bias=call.bias4, keep=call.keep,
                                 is_causal=is_causal, causal_alignment=causal_alignment, chunk_size=chunk_size,
                                 sinks=call.params.get("sinks"), segment_ids=call.segment_ids,
                                 key_segment_ids=call.key_segment_ids, alibi_slopes=call.params.get("alibi.slopes"),
                                 positions=call.positions if positioned else None,
                                 key_positions=call.every_key_position if positioned else None,
                                 skip_masked=call.selected)  # (B, N, T, V)
    p = call.params
    if config.latent is not None:  # the attended latent through each head's value up-projection; the present cache
        ctx = F.expand_values(ctx, p["value.kernel"])  # (B, N, T, V)
        k, v = latent, rotary
    if config.differential is not None:  # the halves subtracted with lambda, normed, scaled: (B, N/2, T, 2V)
        ctx, v = F.differential_stage(config, p, ctx), present_value
    if config.output_gate is not None:
        ctx = F.gate(ctx, F.gate_project(call.query, p["gate.kernel"], p.get("gate.bias")), config.num_heads)
    if parts:
        k = v = None  # no present cache asked for
    return F.output(F.merge_heads(ctx), p["output.kernel"], p.get("output.bias")), k, v


def _selected_columns(config, call, is_causal, causal_alignment):
    """The keys any query of a one-token call over a selection may see (np.ndarray of column indices into
    S_total, ascending), or None where gathering them would change the result or not pay: more than one
    query, no selection, or a per-key feature other than the mask (a window, local chunks, ALiBi, segments,
    a bias, dropout, a top-left causal alignment, under which the one query sees key 0 alone, or masked_row
    "uniform", whose fully masked row weighs every key of S_total). The core over
    the gathered columns computes what it computes over every column with the others masked (a masked key's
    weight is exactly 0), reading the s selected rows instead of the S_total of the cache."""
    if (not call.selected or call.mask4 is None or call.shapes.T != 1 or call.bias4 is not None
            or call.keep is not None or call.segment_ids is not None or config.alibi
            or config.local_chunk is not None or config.window_left >= 0 or config.window_right >= 0
            or (is_causal and causal_alignment != "bottom_right")
            or config.masked_row == "uniform"):  # a fully masked row's 1/S spreads over every key, not the gathered
        return None
    seen = call.mask4.any(axis=(0, 1, 2))  # (S_total,) or (1,): any batch row or head sees the key
    if seen.shape[0] != call.shapes.S_total:
        return None
    cols = np.flatnonzero(seen)
    return cols if 0 < cols.size < seen.shape[0] else None


def _fused(config, p, query, key, value, *, mask, bias, keep, is_causal, causal_alignment, chunk_size, parts,
           core_threads=True, out=None):
    """fused_forward's stages; parts > 1: on `parts` threads, BLAS already held to one thread: batch slices, each
    from its projections to its output, where B >= parts; else each stage split (rows, heads) in turn.
    out: a (B, T, O) array to write the output into (float32/float64, parts == 1)."""
    from .functional import merge_heads, output, project, split_heads

    dtype = query.dtype
    ct = compute_dtype(dtype)
    N, K, H, V = config.num_heads, config.num_kv_heads, config.head_dim, config.value_head_dim
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    scale = ct.type(config.effective_scale)  # the logits' scale, folded into the queries: T*H products, not T*S
    core = dict(mask=mask, bias=bias, keep=keep, is_causal=is_causal, causal_alignment=causal_alignment,
                chunk_size=chunk_size)
    # q, k, v and the context in one buffer, kept between calls (workspace says why); 16-bit: the stages' own arrays
    buffers = (B, T, N * H), (B, S, K * H), (B, S, K * V), (B, T, N, V)
    if parts == 1:
        with workspace(ct, *buffers) if ct == dtype else contextlib.nullcontext([None] * 4) as outs:
            q = project(query, p["query.kernel"], p.get("query.bias"), outs[0]).astype(ct, copy=False)  # (B, T, N*H)
            q *= scale
            k = project(key, p["key.kernel"], p.get("key.bias"), outs[1])  # (B, S, K*H)
            v = project(value, p["value.kernel"], p.get("value.bias"), outs[2])  # (B, S, K*V)
            ctx = chunked_attention_core(config, split_heads(q, N), split_heads(k, K), split_heads(v, K), out=outs[3],
                                         threaded=core_threads, **core)  # (B, N, T, V)
            del q, k, v  # 16-bit: only the context and the output are alive during the output projection
            return output(merge_heads(ctx), p["output.kernel"], p.get("output.bias"), out)  # (B, T, O)

    if B >= parts:  # batch slices: no waiting between stages (measured faster than the split stages at gpt2, vit-b16)
        out = np.empty((B, T, config.out_dim), dtype=dtype)

        def batches(b0, b1):
            _fused(config, p, query[b0:b1], key[b0:b1], value[b0:b1], mask=_batch(mask, b0, b1),
                   bias=_batch(bias, b0, b1), keep=_batch(keep, b0, b1), is_causal=is_causal,
                   causal_alignment=causal_alignment, chunk_size=chunk_size, parts=1, core_threads=False,
                   out=out[b0:b1])

        _run([lambda a=a, b=b: batches(a, b) for a, b in _row_parts(B, parts)])
        return out

    with workspace(ct, *buffers) as (q, k, v, context):

        def rows_of(array):  # (B, L, F) -> (1, B*L, F); a copy only where the input is not contiguous
            return np.ascontiguousarray(array).reshape(1, -1, array.shape[-1])

        def project_rows(group, r0, r1):  # the stage on rows r0..r1 of (B*L, D), into the same rows of its output
            for name, x, y in group:
                rows = project(x[:, r0:r1], p[name + ".kernel"], p.get(name + ".bias"), y[:, r0:r1])
                if name == "query":
                    rows *= scale

        projections = [("query", rows_of(query), q.reshape(1, B * T, -1)),
                       ("key", rows_of(key), k.reshape(1, B * S, -1)),
                       ("value", rows_of(value), v.reshape(1, B * S, -1))]
        # one row split when T == S (self-attention, cross-attention of equal lengths); else one per length
        groups = [(projections, B * T)] if T == S else [(projections[:1], B * T), (projections[1:], B * S)]
        for group, rows in groups:
            _run([lambda g=group, a=a, b=b: project_rows(g, a, b) for a, b in _row_parts(rows, parts)])
        _run(_core_tasks(config, split_heads(q, N), split_heads(k, K), split_heads(v, K), context=context, parts=parts,
                         **core))
        merged = context.reshape(B * T, N * V)
        out = np.empty((B * T, config.out_dim), dtype=dtype)
        _run([lambda a=a, b=b: output(merged[None, a:b], p["output.kernel"], p.get("output.bias"), out[None, a:b])
              for a, b in _row_parts(B * T, parts)])
        return out.reshape(B, T, -1)


def chunked_attention_core(config, q, k, v, *, mask, bias, keep, is_causal, causal_alignment, chunk_size, out=None,
                           threaded=True, sinks=None, segment_ids=None, key_segment_ids=None, alibi_slopes=None,
                           positions=None, key_positions=None, skip_masked=False):
    """q (B, N, T, H), k (B, K, S, H), v (B, K, S, V) -> context (B, N, T, V).

    q comes already multiplied by the scale, in the compute dtype (the caller
    folds the scale into its projection: T*H products instead of T*S). The
    context is a transposed view of a (B, T, N, V) array (`out` if given), so
    merge_heads is a free reshape.

    Calls with at least THREADED_MIN_SCORES logits split their key/value
    heads (each with its G query heads), or else their batch, across THREADS
    threads, BLAS held to one thread meanwhile: NumPy's elementwise passes
    (exp above all) run on one core, so one thread leaves the other core idle
    for everything but the matmuls. Heads are independent, so the result is
    the single-threaded one's to round-off. threaded=False: this thread only.

    The config's softcap, window, ALiBi, local chunks and sinks apply here; sinks (N,), the
    segment ids ((T,) or (B, T), and (S,) or (B, S)), the ALiBi slopes (N,) and the positions
    ALiBi and the chunks read ((B|1, T) and every key's (B|1, S)) are arguments. skip_masked: a key block
    the mask hides from every query of a query block is skipped (a selection's: most blocks of a long cache)."""
    B, N, T, H = q.shape
    S, V = k.shape[2], v.shape[3]
    context = np.empty((B, T, N, V), dtype=k.dtype) if out is None else out  # merge_heads' layout
    parts = THREADS if threaded and B * N * T * S >= THREADED_MIN_SCORES else 1
    tasks = _core_tasks(config, q, k, v, mask=mask, bias=bias, keep=keep, is_causal=is_causal,
                        causal_alignment=causal_alignment, chunk_size=chunk_size, context=context, parts=parts,
                        sinks=sinks, segment_ids=segment_ids, key_segment_ids=key_segment_ids,
                        alibi_slopes=alibi_slopes, positions=positions, key_positions=key_positions,
                        skip_masked=skip_masked)
    if len(tasks) == 1:
        tasks[0]()
    else:
        with _threaded_section():
            _run(tasks)
    return context.transpose(0, 2, 1, 3)  # (B, N, T, V)


def _core_tasks(config, q, k, v, *, mask, bias, keep, is_causal, causal_alignment, chunk_size, context, parts,
                sinks=None, segment_ids=None, key_segment_ids=None, alibi_slopes=None, positions=None,
                key_positions=None, skip_masked=False):
    """The core as up to `parts` independent callables over kv heads (each
    with its G query heads), or over the batch when there are fewer kv heads
    than parts; each writes its own part of context (B, T, N, V)."""
    chunk_size = check_chunk_size(chunk_size)  # also here: chunked_attention_core is called directly too
    B, N = q.shape[:2]
    K = k.shape[1]
    G = N // K
    # Sinks need the running max (a sink logit is not bounded by |q| |k|). The bound check reads k once
    # and v twice to spare about three passes over the (B, N, T, S) logits: where the queries are few
    # against the keys' width (a decode step: N*T 32 against K*(H+2V) 3072) it costs more than it
    # saves (1.1 cache reads of a 2.3-read step at P 32768), so such calls take the running max.
    H, V = q.shape[3], v.shape[3]
    worth_checking = 3 * N * q.shape[2] >= K * (H + 2 * V)
    options = dict(is_causal=is_causal, causal_alignment=causal_alignment, chunk_size=chunk_size,
                   skip_masked=skip_masked and mask is not None,
                   bounded=SKIP_MAX_WHEN_BOUNDED and sinks is None and alibi_slopes is None and worth_checking
                   and logits_bounded(q, k, v, bias))
    q_ids = None if segment_ids is None else np.asarray(segment_ids).reshape(-1, q.shape[2])  # (B|1, T)
    k_ids = None if segment_ids is None else np.asarray(key_segment_ids).reshape(-1, k.shape[2])  # (B|1, S)

    def heads(k0, k1):  # kv heads k0..k1 and their query heads, written into context's own columns
        n0, n1 = k0 * G, k1 * G
        _core(config, q[:, n0:n1], k[:, k0:k1], v[:, k0:k1], mask=_heads(mask, N, n0, n1),
              bias=_heads(bias, N, n0, n1), keep=_heads(keep, N, n0, n1), context=context[:, :, n0:n1],
              sinks=None if sinks is None else sinks[n0:n1], q_ids=q_ids, k_ids=k_ids,
              slopes=None if alibi_slopes is None else alibi_slopes[n0:n1], q_pos=positions, k_pos=key_positions,
              **options)

    def batches(b0, b1):
        _core(config, q[b0:b1], k[b0:b1], v[b0:b1], mask=_batch(mask, b0, b1), bias=_batch(bias, b0, b1),
              keep=_batch(keep, b0, b1), context=context[b0:b1], sinks=sinks,
              q_ids=None if q_ids is None else _ids(q_ids, b0, b1),
              k_ids=None if k_ids is None else _ids(k_ids, b0, b1), slopes=alibi_slopes,
              q_pos=None if positions is None else _ids(positions, b0, b1),
              k_pos=None if key_positions is None else _ids(key_positions, b0, b1), **options)

    if parts > 1 and K >= parts:
        return [lambda a=a, b=b: heads(a, b) for a, b in _row_parts(K, parts)]
    if parts > 1 and B >= parts:
        return [lambda a=a, b=b: batches(a, b) for a, b in _row_parts(B, parts)]
    return [lambda: heads(0, K)]


def _heads(array, N, n0, n1):
    """A rank-4 broadcastable (B|1, N|1, T|1, S|1) array's heads n0..n1 (all of a broadcast axis)."""
    return array if array is None or array.shape[1] != N else array[:, n0:n1]


def _batch(array, b0, b1):
    """A rank-4 broadcastable (B|1, N|1, T|1, S|1) array's batch rows b0..b1 (all of a broadcast axis)."""
    return array if array is None or array.shape[0] == 1 else array[b0:b1]


def _ids(ids, b0, b1):
    """Segment ids (B|1, L): batch rows b0..b1 (all of a broadcast row)."""
    return ids if ids.shape[0] == 1 else ids[b0:b1]


def _core(config, q, k, v, *, mask, bias, keep, is_causal, causal_alignment, chunk_size, bounded, context,
          sinks=None, q_ids=None, k_ids=None, slopes=None, q_pos=None, k_pos=None, skip_masked=False):
    """The online softmax over key blocks for all of q's heads, into context (B, T, N, V).
    bounded (logits_bounded): every block's exp is taken against 0, not the running max.
    sinks (N,): the running max and sum start at the sink (exp(sink - sink) = 1), the numerator at 0.
    q_ids (B|1, T), k_ids (B|1, S): segment ids, compared block by block (no (T, S) array).
    slopes (N,) with q_pos (B|1, T), k_pos (B|1, S): ALiBi's bias, built block by block; q_pos and k_pos
    also give the local chunks (config.local_chunk)."""
    B, N, T, H = q.shape
    K, S, V = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    dtype = k.dtype
    ct = compute_dtype(dtype)
    rounds = ct != dtype  # 16-bit: stage results are rounded to the storage dtype
    offset = 0 if causal_alignment == "top_left" else S - T  # query i's aligned position is i + offset
    left, right = config.window_left, config.window_right  # key j visible iff i+offset-left <= j <= i+offset+right
    cap = None if config.logit_softcap is None else ct.type(config.logit_softcap)
    sink = None if sinks is None else sinks.astype(ct).reshape(1, N, 1, 1)
    slope = None if slopes is None else slopes.astype(ct).reshape(1, N, 1, 1)
    chunk = config.local_chunk
    rate = ct.type(1.0 - config.dropout)
    kc, vc = k.astype(ct, copy=False), v.astype(ct, copy=False)
    k_chunks = None if chunk is None else k_pos // chunk  # (B|1, S): each key's chunk of positions
    rows = min(chunk_size, QUERY_ROWS, T)
    bias_masks = bias is not None and bool(np.isneginf(bias).any())
    # Reused by every block: its logits (worked on in place), its numerator and one product.
    block_buffers = (B * N * rows * min(chunk_size, S),), (B * N * rows * V,), (B * N * rows * V,)
    with workspace(ct, *block_buffers) as (scores, numerator, product):
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            t = t1 - t0
            # Causal: the keys after this block's last diagonal are hidden from every row in it; a window
            # hides the keys past its right edge, and those before its left edge, from the whole block.
            s_stop = min(S, max(0, t1 + offset)) if is_causal else S
            if right >= 0:
                s_stop = min(s_stop, max(0, t1 - 1 + offset + right + 1))
            first = max(0, t0 + offset - left) if left >= 0 else 0  # the block's first visible key
            # blocks stay aligned to chunk_size (the same blocks as without a window); none if no key is visible
            s_start = s_stop if first >= s_stop else first - first % chunk_size
            qb = q[:, :, t0:t1].reshape(B, K, G * t, H)  # (B, K, G*t, H); a copy only when G > 1
            acc = numerator[: B * N * t * V].reshape(B, K, G * t, V)  # running numerator
            m = l = None  # running max and sum, (B, N, t, 1); None before the first key block
            if sink is not None:  # the sink joins every row first: max = sink, sum = 1, numerator 0
                m = np.broadcast_to(sink, (B, N, t, 1)).copy()
                l = np.ones((B, N, t, 1), dtype=ct)
                acc[...] = 0
            if chunk is not None:  # the chunks of positions this block's queries are in (every batch row's)
                q_chunks = q_pos[:, t0:t1] // chunk
                q_first, q_last = q_chunks.min(), q_chunks.max()
            for s0 in range(s_start, s_stop, chunk_size):
                s1 = min(s_stop, s0 + chunk_size)
                s = s1 - s0
                if chunk is not None:  # local chunks hide the block from every query of this one: skip it
                    block_chunks = k_chunks[:, s0:s1]
                    if block_chunks.max() < q_first or block_chunks.min() > q_last:
                        continue
                if skip_masked and not _block(mask, (T, S), t0, t1, s0, s1).any():
                    continue  # the mask (a selection) hides the block from every query of this one
                # The stages of functional.py on one block (same rounding rule), in place in `scores`.
                x = scores[: B * N * t * s].reshape(B, K, G * t, s)
                logits_into(x, qb, kc[:, :, s0:s1])  # logits, already scaled
                x = x.reshape(B, N, t, s)
                if rounds:
                    x[...] = x.astype(dtype)
                if cap is not None:  # functional.softcap, before mask and bias
                    x /= cap
                    np.tanh(x, out=x)
                    x *= cap
                    if rounds:
                        x[...] = x.astype(dtype)
                if slope is not None and config.alibi_bias_dtype is not None:  # Falcon-RW's rounded key form
                    x += F.alibi_bias(slopes, q_pos[:, t0:t1], k_pos[:, s0:s1], dtype, config.alibi_bias_dtype)
                    if rounds:
                        x[...] = x.astype(dtype)
                elif slope is not None:  # functional.alibi, after the softcap and before the mask
                    distance = np.abs(q_pos[:, t0:t1, None] - k_pos[:, None, s0:s1]).astype(ct)  # (B|1, t, s)
                    x -= slope * distance[:, None]
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
                if (left >= 0 and s0 < t1 - 1 + offset - left) or (right >= 0 and s1 - 1 > t0 + offset + right):
                    aligned = np.arange(t0, t1)[:, None] + offset  # (t, 1): the window crosses this block
                    j = np.arange(s0, s1)[None, :]
                    outside = np.zeros((t, s), dtype=bool)
                    if left >= 0:
                        outside |= j < aligned - left
                    if right >= 0:
                        outside |= j > aligned + right
                    hidden = outside if hidden is None else hidden | outside
                if chunk is not None:  # local chunks: only keys of the query's own chunk of positions
                    apart = (q_pos[:, t0:t1, None] // chunk != k_pos[:, None, s0:s1] // chunk)[:, None]
                    hidden = apart if hidden is None else hidden | apart
                if q_ids is not None:  # packed sequences: only keys of the query's own segment
                    other = (q_ids[:, t0:t1, None] != k_ids[:, None, s0:s1])[:, None]  # (B|1, 1, t, s)
                    hidden = other if hidden is None else hidden | other
                if hidden is not None:
                    np.copyto(x, ct.type(-np.inf), where=hidden)
                if not bounded:  # online softmax: exp against the running max, earlier blocks rescaled when it grows
                    m_new = x.max(axis=-1, keepdims=True)
                    if m is not None:
                        np.maximum(m, m_new, out=m_new)
                    m_safe = np.where(m_new == -np.inf, ct.type(0), m_new)  # a row that has seen no key yet
                    x -= m_safe
                # (bounded, logits_bounded: every logit within +-LOGIT_BOUND, exp against 0, nothing to rescale)
                e = np.exp(x, out=x)  # masked -> exactly 0
                row_sum = e.sum(axis=-1, keepdims=True)
                if keep is not None:
                    e /= rate
                    np.copyto(e, ct.type(0), where=~_block(keep, (T, S), t0, t1, s0, s1))
                e = e.reshape(B, K, G * t, s)
                if l is None:  # the first key block (without sinks)
                    attend_into(acc, e, vc[:, :, s0:s1])
                    l = row_sum
                else:
                    pv = product[: B * N * t * V].reshape(B, K, G * t, V)
                    attend_into(pv, e, vc[:, :, s0:s1])
                    acc4 = acc.reshape(B, N, t, V)
                    if not bounded:
                        correction = np.exp(m - m_safe)  # 0 where m was -inf
                        l *= correction
                        acc4 *= correction
                    l += row_sum
                    acc4 += pv.reshape(B, N, t, V)
                if not bounded:
                    m = m_new
            acc = acc.reshape(B, N, t, V)
            if l is None:  # every key is hidden from every row of this block
                l = np.zeros((B, N, t, 1), dtype=ct)
                acc[...] = 0
            empty = l == 0  # (B, N, t, 1): rows with no allowed key (never with sinks: the sink's 1 stays)
            any_empty = empty.any()
            if any_empty:
                l[empty] = 1
            acc /= l
            if any_empty and config.masked_row != "zero":  # "zero": acc is already 0 there
                weight = 1.0 / S if config.masked_row == "uniform" else np.nan
                acc = np.where(empty, _masked_row_context(weight, keep, vc, t0, t1, N, T, S, chunk_size, rate), acc)
            context[:, t0:t1] = acc.transpose(0, 2, 1, 3)  # (B, t, N, V), stored in dtype
