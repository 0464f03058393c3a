"""DeepSeek V4's attention layer (config.compressed, issue 41) in keras.ops: impl_numpy/compressed.py stage by
stage, the same stage names, the same call and cache (docs/spec-frontier.md#deepseek-v4). Runs on Keras's
tensorflow, jax and torch backends (backend.py's primitives where a keras.ops call computes float64 in float32:
matmul, mean, maximum).

compressed_attention(config, tensors, x, positions, past=None, return_cache=, return_selection=, trace=): x
(B, T, D) a tensor or NumPy array (float32 or float64; float16 / bfloat16 by the reference's rule: each stage
computed in float32 and stored in 16 bits at the reference's boundaries), positions (T,), past / present dicts of
tensors named as impl_numpy.compressed.cache_names. Eager; validated by the reference's own check
(impl_numpy.compressed.check_compressed_call, on shapes). Differentiable by each Keras
backend's autodiff (the selection a constant, as impl_numpy/compressed_backward.py has it); the mirror of
multi_head_attention
refuses config.compressed (weights.contract.check_call).

On Keras's TensorFlow backend alone, as the regular call's in-place cache and chunked path: in_place=True (past the
caller's buffers, impl_numpy.compressed.buffer_shapes, as tf.Variables written in place: compress_in_place,
write_ring, attend_blocks; the writes are tf_only.write_rows') and chunk_size= (attend_blockwise, impl_torch's
stages and skips in keras.ops). Keras's jax and torch backends refuse both (IN_PLACE_UNSUPPORTED,
CHUNKED_UNSUPPORTED).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from impl_numpy.compressed import blockwise_schedule, check_compressed_call, check_in_place_call, ring_positions
from weights import AttentionConfig, validate_tensors
from weights.call import record
from weights.contract import check_chunk_size
from weights.rope import rope_tables

from . import backend as bk
from . import functional as F
from ._keras import BACKEND, TENSORFLOW, keras

ops = keras.ops


def _ct(x) -> str:
    return F.compute_dtype(F.dtype_name(x))


def matmul(x, kernel):
    """x @ kernel in the compute dtype, stored in x's dtype."""
    ct = _ct(x)
    return ops.cast(bk.matmul(ops.cast(x, ct), ops.cast(kernel, ct)), F.dtype_name(x))


def rms(x, scale, eps: float):
    ct = _ct(x)
    xc = ops.cast(x, ct)
    y = xc / ops.sqrt(bk.mean(xc * xc, axis=-1, keepdims=True) + bk.constant(eps, ct))
    return ops.cast(y if scale is None else y * ops.cast(scale, ct), F.dtype_name(x))


def turn(x, positions, config: AttentionConfig):
    inv_freq, factor = rope_tables(config.rope)
    angles = F.rope_angles(positions[None], inv_freq, F.dtype_name(x))  # (1, 1, L, R/2)
    return F.rope_last(x, angles, config.rope.rotary_dim, True, factor)


def _slot_softmax(g):
    """Softmax over the slots (axis 2), per feature."""
    e = ops.exp(g - ops.max(g, axis=2, keepdims=True))
    return e / ops.sum(e, axis=2, keepdims=True)


def compress(config, params, prefix: str, x, p0: int, past, rec, projected=None):
    c = config.compressed
    m, cache = c.ratio, "index_" if prefix.startswith("indexer") else ""
    width = params[f"{prefix}.norm.scale"].shape[0]
    B, dtype = x.shape[0], F.dtype_name(x)
    ct = _ct(x)
    kv, gate = project_compressor(params, prefix, x, rec) if projected is None else projected
    if past is not None:
        kv = ops.concatenate([past[f"{cache}window_kv"], kv], axis=1)
        gate = ops.concatenate([past[f"{cache}window_gate"], gate], axis=1)
    first = p0 - (p0 % m)
    n = kv.shape[1] // m
    present = {f"{cache}window_kv": kv[:, n * m:], f"{cache}window_gate": gate[:, n * m:]}
    win_kv = ops.reshape(kv[:, :n * m], (B, n, m, kv.shape[-1]))
    bias = ops.cast(params[f"{prefix}.position_bias"], ct)
    win_gate = ops.cast(ops.reshape(gate[:, :n * m], (B, n, m, kv.shape[-1])), ct) + bias  # compute dtype
    if c.overlap:
        if past is not None and past[f"{cache}overlap_kv"].shape[1]:
            prev_kv = past[f"{cache}overlap_kv"][:, None]
            prev_gate = ops.cast(past[f"{cache}overlap_gate"][:, None], ct) + bias[:, :width]
        else:
            prev_kv = ops.zeros((B, 1, m, width), dtype)
            prev_gate = ops.full((B, 1, m, width), -math.inf, ct)
        before_kv = ops.concatenate([prev_kv, win_kv[:, :n - 1, :, :width]], axis=1)[:, :n]
        before_gate = ops.concatenate([prev_gate, win_gate[:, :n - 1, :, :width]], axis=1)[:, :n]
        slots_kv = ops.concatenate([before_kv, win_kv[..., width:]], axis=2)
        slots_gate = ops.concatenate([before_gate, win_gate[..., width:]], axis=2)
        if n:
            present[f"{cache}overlap_kv"] = win_kv[:, n - 1, :, :width]
            present[f"{cache}overlap_gate"] = gate[:, (n - 1) * m:n * m, :width]
        else:
            empty = ops.zeros((B, 0, width), dtype)
            present[f"{cache}overlap_kv"] = empty if past is None else past[f"{cache}overlap_kv"]
            present[f"{cache}overlap_gate"] = empty if past is None else past[f"{cache}overlap_gate"]
    else:
        slots_kv, slots_gate = win_kv, win_gate
    weights = rec(f"{prefix}.weights", ops.cast(_slot_softmax(slots_gate) if n else slots_gate, dtype))
    pooled = rec(f"{prefix}.pool", ops.cast(ops.sum(ops.cast(weights, ct) * ops.cast(slots_kv, ct), axis=2), dtype))
    normed = rec(f"{prefix}.norm", rms(pooled, params[f"{prefix}.norm.scale"], c.eps))
    starts = bk.to_tensor(np.asarray(first + m * np.arange(n), np.int64))
    new = rec(f"{prefix}.rope", turn(normed[:, None], starts, config)[:, 0])
    old = ops.zeros((B, 0, width), dtype) if past is None else past[f"{cache}entries"]
    present[f"{cache}entries"] = ops.concatenate([old, new], axis=1)
    return present


def project_compressor(params, prefix: str, x, rec):
    kv = rec(f"{prefix}.project", matmul(x, params[f"{prefix}.kernel"]))
    return kv, rec(f"{prefix}.gate", matmul(x, params[f"{prefix}.gate.kernel"]))


def compress_in_place(config, params, prefix: str, x, p0: int, buffers, rec, write) -> int:
    """impl_numpy.compressed.compress_in_place: the buffers (tf.Variables) written by write(buffer, value, start,
    axis) (tf_only.write_rows); every read of a buffer happens before the writes."""
    c = config.compressed
    m, cache = c.ratio, "index_" if prefix.startswith("indexer") else ""
    T, r0, E0 = x.shape[1], p0 % m, p0 // m
    kv, gate = project_compressor(params, prefix, x, rec)
    n = (r0 + T) // m
    window_kv, window_gate = buffers[f"{cache}window_kv"], buffers[f"{cache}window_gate"]
    if n:
        width = params[f"{prefix}.norm.scale"].shape[0]
        past = {f"{cache}window_kv": window_kv[:, :r0], f"{cache}window_gate": window_gate[:, :r0]}
        if c.overlap:
            held = m if p0 >= m else 0
            past[f"{cache}overlap_kv"] = buffers[f"{cache}overlap_kv"][:, :held]
            past[f"{cache}overlap_gate"] = buffers[f"{cache}overlap_gate"][:, :held]
        past[f"{cache}entries"] = ops.zeros((x.shape[0], 0, width), F.dtype_name(x))
        present = compress(config, params, prefix, x, p0, past, rec, projected=(kv, gate))
        write(buffers[f"{cache}entries"], present[f"{cache}entries"], E0, 1)
        if c.overlap:
            write(buffers[f"{cache}overlap_kv"], present[f"{cache}overlap_kv"], 0, 1)
            write(buffers[f"{cache}overlap_gate"], present[f"{cache}overlap_gate"], 0, 1)
    rest = r0 + T - n * m
    new = min(rest, T)
    write(window_kv, kv[:, T - new:], rest - new, 1)
    write(window_gate, gate[:, T - new:], rest - new, 1)
    return E0 + n


def write_ring(ring, k, p0: int, W: int, write) -> None:
    """The call's last min(T, W - 1) keys into the ring's slots position % (W - 1) (impl_numpy.compressed's
    `ring[:, :, positions[T - last:] % (W - 1)] = k[:, :, T - last:]`): consecutive positions, so one run of
    slots, or two where it wraps past slot W - 2."""
    T = k.shape[2]
    last = min(T, W - 1)
    start = (p0 + T - last) % (W - 1)
    head = min(last, W - 1 - start)
    write(ring, k[:, :, T - last:T - last + head], start, 2)
    write(ring, k[:, :, T - last + head:], 0, 2)


def attend_blocks(w, blocks: list):
    """impl_numpy.compressed.attend_blocks: F.attend over each block of keys, summed."""
    B, N, T, S = w.shape
    ct = _ct(w)
    wc = bk.reshape(ops.cast(w, ct), (B, 1, N * T, S))
    ctx, start = None, 0
    for block in blocks:
        part = bk.matmul(wc[..., start:start + block.shape[2]], ops.cast(block, ct))
        ctx, start = part if ctx is None else ctx + part, start + block.shape[2]
    return bk.reshape(ops.cast(ctx, F.dtype_name(w)), (B, N, T, blocks[0].shape[-1]))


def _key_block(parts: list, s0: int, s1: int):
    """Keys s0 .. s1 - 1 of the window's parts ((B, 1, S_i, H) each, read as one along S): a slice within one
    part, the few keys of a block that straddles two joined."""
    pieces, offset = [], 0
    for part in parts:
        end = offset + part.shape[2]
        if s0 < end and s1 > offset:
            pieces.append(part[:, :, max(s0 - offset, 0):min(s1, end) - offset])
        offset = end
    return pieces[0] if len(pieces) == 1 else ops.concatenate(pieces, axis=2)


def attend_blockwise(config: AttentionConfig, q, window_keys: list, key_pos: np.ndarray, positions: np.ndarray,
                     entries, selection: np.ndarray | None, sinks, chunk_size: int):
    """impl_numpy.compressed.attend_blockwise (impl_torch.compressed's, stage for stage) in keras.ops, eagerly on
    Keras's TensorFlow backend: the stages from the logits to the context block by block with an online softmax
    started at the sink, never a (T, W + E) array. key_pos, positions and csa's selection are NumPy (the host
    decides which window and entry blocks a query block skips, impl_numpy.compressed.blockwise_schedule: a skipped
    block is neither read nor multiplied). The same blocks, the same skips, the same recurrence; differentiable by
    the backend's autodiff (a select keeps a hidden logit's gradient 0). Returns the context (B, N, T, H) in q's dtype."""
    B, N, T, H = q.shape
    dtype, ct = F.dtype_name(q), _ct(q)
    E = 0 if entries is None else entries.shape[1]
    ents = None if entries is None else entries[:, None]  # (B, 1, E, H): one kv head
    sink = None if sinks is None else bk.reshape(ops.cast(sinks, ct), (1, N, 1, 1))
    minus_inf, zero = bk.constant(-math.inf, ct), bk.constant(0.0, ct)
    context = []
    for t0, t1, blocks in blockwise_schedule(config, key_pos, positions, E, chunk_size, selection):
        t = t1 - t0
        qb = q[:, :, t0:t1]
        if sink is None:
            m, l = ops.full((B, N, t, 1), -math.inf, ct), ops.zeros((B, N, t, 1), ct)
        else:  # the sink joins every row first: max = sink, sum = exp(0) = 1, numerator 0
            m, l = ops.broadcast_to(sink, (B, N, t, 1)), ops.ones((B, N, t, 1), ct)
        acc = ops.zeros((B, N, t, H), ct)

        def step(kb, hidden, m, l, acc):
            """One key block (B, 1, s, H), its hidden logits ((B|1, 1, t, s) bool NumPy or None): the running
            state."""
            x = ops.cast(F.logits(qb, kb, config.effective_scale), ct)  # (B, N, t, s), the stage's
            if hidden is not None:
                x = bk.where(bk.to_tensor(hidden), minus_inf, x)
            m_new = bk.maximum(m, ops.max(x, axis=-1, keepdims=True))
            m_safe = bk.where(ops.equal(m_new, minus_inf), zero, m_new)  # a row that has seen no key yet
            e = ops.exp(x - m_safe)  # hidden -> exactly 0
            correction = ops.exp(m - m_safe)  # 0 where m was -inf
            pv = bk.reshape(bk.matmul(bk.reshape(e, (B, 1, N * t, e.shape[-1])), ops.cast(kb, ct)), (B, N, t, H))
            return m_new, l * correction + ops.sum(e, axis=-1, keepdims=True), acc * correction + pv

        for source, b0, b1, hidden in blocks:  # the window's key blocks, then the entries'
            kb = _key_block(window_keys, b0, b1) if source == "window" else ents[:, :, b0:b1]
            m, l, acc = step(kb, hidden, m, l, acc)
        context.append(ops.cast(acc / l, dtype))
    return context[0] if len(context) == 1 else ops.concatenate(context, axis=2)


def select(config, params, x, q_latent, positions, entries, visible, rec):
    c = config.compressed
    I, J = c.index_heads, c.index_head_dim
    dtype, ct = F.dtype_name(x), _ct(x)
    q = bk.einsum("btr,rij->bitj", ops.cast(q_latent, ct), ops.cast(params["indexer.query.kernel"], ct))
    q = rec("indexer.query", turn(ops.cast(q, dtype), positions, config))
    dots = bk.einsum("bitj,bej->btie", ops.cast(q, ct), ops.cast(entries, ct))
    w = bk.matmul(ops.cast(x, ct), ops.cast(params["indexer.weights.kernel"], ct)) * bk.constant(I ** -0.5, ct)
    w = rec("indexer.weights", ops.cast(w, dtype))
    relu = bk.maximum(dots, bk.constant(0.0, ct))
    score = ops.sum(relu * bk.constant(J ** -0.5, ct) * ops.cast(w, ct)[..., None], axis=2)  # compute dtype
    shown = ops.broadcast_to(visible[None], score.shape)
    score = rec("indexer.score", bk.where(shown, score, bk.constant(-math.inf, ct)))
    k = min(c.index_topk, score.shape[-1])
    order = ops.cast(bk.argsort_stable(-score)[..., :k], "int64")  # ties: the earlier entry
    chosen = ops.take_along_axis(shown, order, axis=-1)
    return rec("indexer.selection", bk.where(chosen, order, bk.constant(-1, "int64")))


# Why the in-place cache and the block-wise path are TensorFlow's alone in this mirror, as the regular call's
# (impl_tf.call.IN_PLACE_UNSUPPORTED, impl_tf.attention.CHUNKED_UNSUPPORTED): the buffers are the caller's
# tf.Variables written by XLA (tf_only.write_rows); the block-wise path's skips are decided on the host between
# eager ops (csa's from its selection), where the keras-jax column runs the layer as one jax.jit program.
IN_PLACE_UNSUPPORTED = (
    f"in_place (DeepSeek V4's in-place cache) needs Keras's TensorFlow backend (keras runs on {BACKEND}), as "
    "cache_length does: the buffers are written into the caller's tf.Variables by XLA; on jax an array cannot be "
    "written in place (a keras.Variable.assign replaces it whole), and the torch form is not written; pass the "
    "cache as past without in_place (the cache copied)"
)
CHUNKED_UNSUPPORTED = (
    f"chunk_size (DeepSeek V4's block-wise path) needs Keras's TensorFlow backend (keras runs on {BACKEND}), as "
    "the regular chunked path does: its blocks are eager keras.ops calls whose skips are decided on the host "
    "(csa's from the selection's values), which the keras-jax column's one jax.jit program cannot read "
    "(impl_jax's and impl_torch's block-wise paths are their own mirrors'); call without chunk_size"
)


def compressed_attention(config: AttentionConfig, tensors, x, positions, past=None, *, return_cache: bool = False,
                         return_selection: bool = False, trace: list | None = None, jit: dict | None = None,
                         in_place: bool = False, chunk_size: int | None = None):
    """impl_numpy.compressed.compressed_attention in keras.ops. jit: on Keras's jax backend, XLA compiler options
    ({}: XLA's own) to run the layer with as one jax.jit program (not with trace); None, other backends and a
    trace: eagerly. On Keras's TensorFlow backend alone (NotImplementedError elsewhere: IN_PLACE_UNSUPPORTED,
    CHUNKED_UNSUPPORTED): in_place, past the caller's buffers (impl_numpy.compressed.buffer_shapes) as
    tf.Variables of the storage dtype, written in place by the call (XLA: tf_only.write_rows) and returned as the
    present cache (inference only, no trace); chunk_size, the block-wise path (attend_blockwise), with the copying
    cache or in place, no trace."""
    chunk_size = check_chunk_size(chunk_size, traced=trace is not None)
    if in_place and not TENSORFLOW:
        raise NotImplementedError(IN_PLACE_UNSUPPORTED)
    if chunk_size is not None and not TENSORFLOW:
        raise NotImplementedError(CHUNKED_UNSUPPORTED)
    validate_tensors(config, {k: np.asarray(ops.convert_to_numpy(v)) if ops.is_tensor(v) else np.asarray(v)
                              for k, v in tensors.items()})  # names, shapes, one dtype, finite
    x = x if ops.is_tensor(x) else bk.to_tensor(np.asarray(x))
    dtype = F.dtype_name(x)
    buffers = None
    if in_place:  # docs/spec-frontier.md, "The in-place cache"
        if trace is not None:
            raise ValueError("trace must be None with in_place (the in-place call attends to its ring of keys in "
                             "slot order, not the stages' order: trace the copying call): got a list")
        p0 = check_in_place_call(config, x, np.asarray(positions), past)
        from .tf_only import compressed_buffers

        compressed_buffers(past, dtype, F.dtype_name)
        buffers, past = past, None
    else:
        p0 = check_compressed_call(config, x, np.asarray(positions), past)
    p = {k: ops.cast(bk.to_tensor(np.asarray(v)) if not ops.is_tensor(v) else v, dtype) for k, v in tensors.items()}
    if jit is not None and trace is None and BACKEND == "jax":  # one compiled program (eager jax compiles every op per shape)
        import jax

        run = jax.jit(functools.partial(layer, config, p0=p0, return_cache=return_cache,
                                        return_selection=return_selection), compiler_options=jit or None)
        return run(p, x, past)
    return layer(config, p, x, past, p0=p0, return_cache=return_cache, return_selection=return_selection,
                 trace=trace, buffers=buffers, chunk_size=chunk_size)


def layer(config: AttentionConfig, p, x, past, *, p0: int, return_cache: bool, return_selection: bool,
          trace: list | None = None, buffers: dict | None = None, chunk_size: int | None = None):
    """compressed_attention's computation on checked tensors (jax.jit-able on Keras's jax backend: shapes and p0
    decide every branch). buffers: the in-place cache's tf.Variables (past None); chunk_size: the block-wise path
    (both eager, on TensorFlow)."""
    if buffers is not None and not TENSORFLOW:
        raise NotImplementedError(IN_PLACE_UNSUPPORTED)
    if chunk_size is not None and not TENSORFLOW:
        raise NotImplementedError(CHUNKED_UNSUPPORTED)
    B, T, _ = x.shape
    positions_np = np.arange(p0, p0 + T)
    positions = bk.to_tensor(positions_np)
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    c, N, H = config.compressed, config.num_heads, config.head_dim
    W = config.window_left + 1
    dtype, ct = F.dtype_name(x), _ct(x)
    write = None
    if buffers is not None:
        from .tf_only import write_rows as write
    q_latent = rec("query.down", rms(matmul(x, p["query.down.kernel"]), p["query.down.norm.scale"], c.eps))
    q = rec("query", ops.cast(bk.einsum("btr,rnh->bnth", ops.cast(q_latent, ct), ops.cast(p["query.kernel"], ct)),
                              dtype))
    q = rec("query.norm", rms(q, None, c.eps))
    q = rec("query.rope", turn(q, positions, config))
    k = rec("key", rms(matmul(x, p["key.kernel"][:, 0]), p["key.norm.scale"], c.eps)[:, None])
    k = rec("key.rope", turn(k, positions, config))
    if buffers is None:
        keys = k if past is None else ops.concatenate([past["key"], k], axis=2)
        key_pos = np.arange(p0 + T - keys.shape[2], p0 + T)
        present = {"key": keys[:, :, max(keys.shape[2] - (W - 1), 0):] if W > 1 else keys[:, :, :0]}
    else:  # the ring's held keys, then the call's: blocks, never concatenated; the ring written once attended to
        ring = buffers["key"]
        blocks = [ring[:, :, :min(p0, W - 1)], k]
        key_pos = np.concatenate([ring_positions(p0, W), positions_np])
        present = buffers
    blockwise = chunk_size is not None  # attend_blockwise: no (T, Pw + T) mask, no (T, E) one for hca
    window_keys = [keys] if buffers is None else list(blocks)  # (the window's keys alone, before the entries)
    if not blockwise:
        in_window = (key_pos[None] <= positions_np[:, None]) & (key_pos[None] > positions_np[:, None] - W)  # NumPy
        allowed = bk.to_tensor(np.broadcast_to(in_window[None], (B,) + in_window.shape).copy())
    selection = entries = None
    if c.kind != "sliding":
        if buffers is None:
            present.update(compress(config, p, "compressor", x, p0, past, rec))
            entries = present["entries"]
        else:
            count = compress_in_place(config, p, "compressor", x, p0, buffers, rec, write)  # writes, then the read
            entries = buffers["entries"][:, :count]
        E = entries.shape[1]
        visible_np = np.arange(E)[None] < ((positions_np + 1) // c.ratio)[:, None]
        if c.kind == "csa" or not blockwise:  # (the indexer's scores are (B, T, E) in any case)
            visible = bk.to_tensor(visible_np)
            shown = bk.to_tensor(np.broadcast_to(visible_np[None], (B, T, E)).copy())
        if c.kind == "csa":
            if buffers is None:
                present.update(compress(config, p, "indexer.compressor", x, p0, past, rec))
                index_entries = present["index_entries"]
            else:
                count = compress_in_place(config, p, "indexer.compressor", x, p0, buffers, rec, write)
                index_entries = buffers["index_entries"][:, :count]
            selection = select(config, p, x, q_latent, positions, index_entries, visible, rec)
            if selection.shape[-1] and not blockwise:  # (F.selection_mask takes a max over the k slots: none
                shown = F.selection_mask(selection, 1, E)[:, 0]  # before an entry)
        if buffers is None and not blockwise:
            keys = ops.concatenate([keys, ops.broadcast_to(entries[:, None], (B, 1, E, H))], axis=2)
        if not blockwise:
            allowed = ops.concatenate([allowed, shown], axis=2)
    if blockwise:
        chosen = None if c.kind != "csa" else np.asarray(ops.convert_to_numpy(selection))
        ctx = attend_blockwise(config, q, window_keys, key_pos, positions_np, entries, chosen, p.get("sinks"),
                               chunk_size)
    elif buffers is None:
        logits = rec("logits", F.logits(q, keys, config.effective_scale))
    else:  # in place: each block's logits joined (the keys and the entries stay in their buffers)
        blocks += [] if entries is None else [entries[:, None]]
        logits = ops.concatenate([F.logits(q, b, config.effective_scale) for b in blocks], axis=-1)
    if not blockwise:
        masked = rec("mask", F.mask(logits, allowed[:, None], None))
        w = rec("softmax", F.softmax(masked, config.masked_row, p.get("sinks")))
        ctx = rec("attend", F.attend(w, keys)) if buffers is None else attend_blocks(w, blocks)
    if buffers is not None and W > 1:  # now the ring may take the call's last W - 1 keys (a slot read is overwritten)
        write_ring(ring, k, p0, W, write)
    ctx = rec("derotate", turn(ctx, bk.to_tensor(-positions_np), config))
    G = c.output_groups
    grouped = ops.reshape(ops.transpose(ctx, (0, 2, 1, 3)), (B, T, G, N * H // G))
    grouped = bk.einsum("btgf,gfr->btgr", ops.cast(grouped, ct), ops.cast(p["output.group.kernel"], ct))
    grouped = rec("output.group", ops.cast(grouped, dtype))
    out = rec("output", matmul(ops.reshape(grouped, (B, T, -1)), p["output.kernel"]))
    result = (out,) + ((selection,) if return_selection else ()) + ((present,) if return_cache else ())
    return result[0] if len(result) == 1 else result
