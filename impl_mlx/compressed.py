"""DeepSeek V4's attention layer (config.compressed, issue 41) in MLX: impl_numpy/compressed.py stage by stage, the
same stage names, the same call and cache (docs/spec-frontier.md#deepseek-v4).

compressed_attention(config, tensors, x, positions, past=None, return_cache=, return_selection=, trace=): x (B, T,
D) an mx.array or NumPy array (float32, or float64 on the CPU device), positions (T,), past / present dicts of
mx.arrays named as impl_numpy.compressed.cache_names. exp through functional.exp and RoPE's cos / sin through
functional.rope (float64-accurate in float64), selects through functional.where. The call is validated by the
reference's own check (impl_numpy.compressed.check_compressed_call, on shapes). Differentiable (mx.vjp; the
selection a constant, as impl_numpy/compressed_backward.py has it). float16 / bfloat16 by the reference's rule: each
stage computed in float32 and stored in 16 bits, at the reference's boundaries. chunk_size=: the block-wise path
(attend_blockwise, impl_torch.compressed's blocks and skips), with the copying cache or in place, differentiable. The
mirror of multi_head_attention refuses config.compressed (weights.contract.check_call)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from impl_numpy.compressed import blockwise_schedule, check_compressed_call, check_in_place_call, ring_positions
from weights import AttentionConfig, validate_tensors
from weights.call import record
from weights.contract import check_chunk_size
from weights.rope import rope_tables

from . import functional as F
from .convert import ct as compute_of
from .convert import scalar, to_mx, to_numpy


def matmul(x: mx.array, kernel: mx.array) -> mx.array:
    ct = compute_of(x.dtype)
    return (x.astype(ct) @ kernel.astype(ct)).astype(x.dtype)


def rms(x: mx.array, scale, eps: float) -> mx.array:
    ct = compute_of(x.dtype)
    xc = x.astype(ct)
    y = xc / mx.sqrt((xc * xc).mean(axis=-1, keepdims=True) + scalar(eps, ct))
    return (y if scale is None else y * scale.astype(ct)).astype(x.dtype)


def turn(x: mx.array, positions: mx.array, config: AttentionConfig) -> mx.array:
    inv_freq, factor = rope_tables(config.rope)
    angles = F.rope_angles(positions[None], inv_freq, x.dtype)  # (1, 1, L, R/2)
    return F.rope_last(x, angles, config.rope.rotary_dim, True, factor)


def _slot_softmax(g: mx.array) -> mx.array:
    """Softmax over the slots (axis 2), exp float64-accurate (functional.exp)."""
    e = F.exp(g - g.max(axis=2, keepdims=True))
    return e / e.sum(axis=2, keepdims=True)


def compress(config, params, prefix: str, x: mx.array, p0: int, past, rec, projected=None):
    c = config.compressed
    m, cache = c.ratio, "index_" if prefix.startswith("indexer") else ""
    width = params[f"{prefix}.norm.scale"].shape[0]
    B = x.shape[0]
    ct = compute_of(x.dtype)
    kv, gate = project_compressor(params, prefix, x, rec) if projected is None else projected
    if past is not None:
        kv = mx.concatenate([past[f"{cache}window_kv"], kv], axis=1)
        gate = mx.concatenate([past[f"{cache}window_gate"], gate], axis=1)
    first = p0 - (p0 % m)
    n = kv.shape[1] // m
    present = {f"{cache}window_kv": kv[:, n * m:], f"{cache}window_gate": gate[:, n * m:]}
    win_kv = kv[:, :n * m].reshape(B, n, m, kv.shape[-1])
    bias = params[f"{prefix}.position_bias"].astype(ct)
    win_gate = gate[:, :n * m].reshape(B, n, m, kv.shape[-1]).astype(ct) + bias  # compute dtype
    if c.overlap:
        if past is not None and past[f"{cache}overlap_kv"].shape[1]:
            prev_kv = past[f"{cache}overlap_kv"][:, None]
            prev_gate = past[f"{cache}overlap_gate"][:, None].astype(ct) + bias[:, :width]
        else:
            prev_kv = mx.zeros((B, 1, m, width), dtype=x.dtype)
            prev_gate = mx.full((B, 1, m, width), -mx.inf, dtype=ct)
        before_kv = mx.concatenate([prev_kv, win_kv[:, :-1, :, :width]], axis=1)[:, :n]
        before_gate = mx.concatenate([prev_gate, win_gate[:, :-1, :, :width]], axis=1)[:, :n]
        slots_kv = mx.concatenate([before_kv, win_kv[..., width:]], axis=2)
        slots_gate = mx.concatenate([before_gate, win_gate[..., width:]], axis=2)
        if n:
            present[f"{cache}overlap_kv"] = win_kv[:, -1, :, :width]
            present[f"{cache}overlap_gate"] = gate[:, (n - 1) * m:n * m, :width]
        else:
            empty = mx.zeros((B, 0, width), dtype=x.dtype)
            present[f"{cache}overlap_kv"] = empty if past is None else past[f"{cache}overlap_kv"]
            present[f"{cache}overlap_gate"] = empty if past is None else past[f"{cache}overlap_gate"]
    else:
        slots_kv, slots_gate = win_kv, win_gate
    weights = rec(f"{prefix}.weights", (_slot_softmax(slots_gate) if n else slots_gate).astype(x.dtype))
    pooled = rec(f"{prefix}.pool", (weights.astype(ct) * slots_kv.astype(ct)).sum(axis=2).astype(x.dtype))
    normed = rec(f"{prefix}.norm", rms(pooled, params[f"{prefix}.norm.scale"], c.eps))
    starts = first + m * mx.arange(n)
    new = rec(f"{prefix}.rope", turn(normed[:, None], starts, config)[:, 0])
    old = mx.zeros((B, 0, width), dtype=x.dtype) if past is None else past[f"{cache}entries"]
    present[f"{cache}entries"] = mx.concatenate([old, new], axis=1)
    return present


def project_compressor(params, prefix: str, x: mx.array, rec):
    kv = rec(f"{prefix}.project", matmul(x, params[f"{prefix}.kernel"]))
    return kv, rec(f"{prefix}.gate", matmul(x, params[f"{prefix}.gate.kernel"]))


def compress_in_place(config, params, prefix: str, x: mx.array, p0: int, buffers, rec) -> int:
    """impl_numpy.compressed.compress_in_place: the buffers written by slice assignment (MLX applies it to the
    caller's array objects)."""
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
        past[f"{cache}entries"] = mx.zeros((x.shape[0], 0, width), dtype=x.dtype)
        present = compress(config, params, prefix, x, p0, past, rec, projected=(kv, gate))
        buffers[f"{cache}entries"][:, E0:E0 + n] = present[f"{cache}entries"]
        if c.overlap:
            buffers[f"{cache}overlap_kv"][...] = present[f"{cache}overlap_kv"]
            buffers[f"{cache}overlap_gate"][...] = present[f"{cache}overlap_gate"]
    rest = r0 + T - n * m
    new = min(rest, T)
    if new:
        window_kv[:, rest - new:rest] = kv[:, T - new:]
        window_gate[:, rest - new:rest] = gate[:, T - new:]
    return E0 + n


def attend_blocks(w: mx.array, blocks: list) -> mx.array:
    """impl_numpy.compressed.attend_blocks: F.attend over each block of keys, summed."""
    B, N, T, S = w.shape
    ct = compute_of(w.dtype)
    wc = w.astype(ct).reshape(B, 1, N * T, S)
    ctx, start = None, 0
    for block in blocks:
        part = wc[..., start:start + block.shape[2]] @ block.astype(ct)
        ctx, start = part if ctx is None else ctx + part, start + block.shape[2]
    return ctx.astype(w.dtype).reshape(B, N, T, blocks[0].shape[-1])


def _key_block(parts: list, s0: int, s1: int) -> mx.array:
    """Keys s0 .. s1 - 1 of the window's parts ((B, 1, S_i, H) each, read as one along S, as
    impl_numpy.chunked.KeyParts reads them): a slice within one part, a copy of the few keys of a block that
    straddles two."""
    pieces, offset = [], 0
    for part in parts:
        end = offset + part.shape[2]
        if s0 < end and s1 > offset:
            pieces.append(part[:, :, max(s0 - offset, 0):min(s1, end) - offset])
        offset = end
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


def attend_blockwise(config: AttentionConfig, q: mx.array, window_keys: list, key_pos: np.ndarray,
                     positions: np.ndarray, entries: mx.array | None, selection: mx.array | None, sinks,
                     chunk_size: int) -> mx.array:
    """impl_numpy.compressed.attend_blockwise in MLX (impl_torch.compressed.attend_blockwise's blocks and skips):
    the stages from the logits to the context block by block with an online softmax started at the sink, never a
    (T, W + E) array. key_pos and positions are NumPy (the call's, known before any array is read): which window
    and entry blocks a query block visits and skips is impl_numpy.compressed.blockwise_schedule's, decided on them
    on the host; csa's from the selection's values, read on the host once (a constant of the backward, as
    impl_mlx/chunked.py reads a selection's mask). The same blocks, the same skips, the same recurrence. Differentiable by mx.vjp as
    impl_mlx/chunked.py's core: a hidden logit selected by functional.where (its gradient 0), the running max a
    constant (mx.stop_gradient: the result does not depend on it), the sink's gradient through its exp(sink -
    max) term of the running sum. exp through functional.exp (float64-accurate in float64). Returns the context
    (B, N, T, H) in q's dtype."""
    B, N, T, H = q.shape
    dtype, ct = q.dtype, compute_of(q.dtype)
    E = 0 if entries is None else entries.shape[1]
    ents = None if entries is None else entries[:, None]  # (B, 1, E, H): one kv head
    sink = None if sinks is None else sinks.astype(ct).reshape(1, N, 1, 1)
    chosen_all = None if selection is None else np.array(selection)  # (B, T, k) on the host: no gradient
    minus_inf, zero = scalar(-np.inf, ct), scalar(0, ct)
    context = []
    for t0, t1, blocks in blockwise_schedule(config, key_pos, positions, E, chunk_size, chosen_all):
        t = t1 - t0
        qb = q[:, :, t0:t1]
        if sink is None:
            m = mx.full((B, N, t, 1), -np.inf, dtype=ct)
            l = mx.zeros((B, N, t, 1), dtype=ct)
        else:  # the sink joins every row first: max = sink, sum = exp(sink - sink) = 1 (its gradient), numerator 0
            m = mx.broadcast_to(mx.stop_gradient(sink), (B, N, t, 1))
            l = mx.broadcast_to(F.exp(sink - mx.stop_gradient(sink)), (B, N, t, 1))
        acc = mx.zeros((B, N, t, H), dtype=ct)

        def step(kb, hidden, m, l, acc):
            """One key block (B, 1, s, H), its hidden logits ((B|1, 1, t, s) bool or None): the running state."""
            x = F.logits(qb, kb, config.effective_scale).astype(ct)  # (B, N, t, s), the stage's
            if hidden is not None:
                x = F.where(mx.broadcast_to(hidden, x.shape), mx.broadcast_to(minus_inf, x.shape), x)
            m_new = mx.stop_gradient(mx.maximum(m, x.max(axis=-1, keepdims=True)))
            m_safe = mx.where(m_new == -np.inf, zero, m_new)  # a row that has seen no key yet
            e = F.exp(x - m_safe)  # hidden -> exactly 0
            correction = F.exp(m - m_safe)  # 0 where m was -inf
            pv = (e.reshape(B, 1, N * t, -1) @ kb.astype(ct)).reshape(B, N, t, H)
            return m_new, l * correction + e.sum(axis=-1, keepdims=True), acc * correction + pv

        for source, b0, b1, hidden in blocks:  # the window's key blocks, then the entries'
            hidden = None if hidden is None else mx.array(hidden)
            kb = _key_block(window_keys, b0, b1) if source == "window" else ents[:, :, b0:b1]
            m, l, acc = step(kb, hidden, m, l, acc)
        context.append((acc / l).astype(dtype))
    return mx.concatenate(context, axis=2)


def select(config, params, x, q_latent, positions, entries, visible, rec) -> mx.array:
    c = config.compressed
    I, J = c.index_heads, c.index_head_dim
    ct = compute_of(x.dtype)
    q = mx.einsum("btr,rij->bitj", q_latent.astype(ct), params["indexer.query.kernel"].astype(ct))
    q = rec("indexer.query", turn(q.astype(x.dtype), positions, config))
    dots = mx.einsum("bitj,bej->btie", q.astype(ct), entries.astype(ct))
    w = (x.astype(ct) @ params["indexer.weights.kernel"].astype(ct)) * scalar(I ** -0.5, ct)
    w = rec("indexer.weights", w.astype(x.dtype))
    score = (mx.maximum(dots, scalar(0, ct)) * scalar(J ** -0.5, ct) * w.astype(ct)[..., None]).sum(axis=2)
    score = rec("indexer.score", F.where(mx.broadcast_to(visible[None], score.shape), score,
                                         mx.full(score.shape, -mx.inf, dtype=score.dtype)))
    k = min(c.index_topk, score.shape[-1])
    order = mx.argsort(-score, axis=-1)[..., :k].astype(mx.int64)  # stable from 0.32 (impl_mlx/indexer.py): ties, the earlier
    chosen = mx.take_along_axis(mx.broadcast_to(visible[None], score.shape), order, axis=-1)
    # a constant of the backward (the spec's: no gradient through the top-k); mx.vjp refuses indices in its graph
    return rec("indexer.selection", mx.stop_gradient(mx.where(chosen, order, mx.array(-1, dtype=mx.int64))))


def compressed_attention(config: AttentionConfig, tensors, x, positions, past=None, *, return_cache: bool = False,
                         return_selection: bool = False, trace: list | None = None,
                         in_place: bool = False, chunk_size: int | None = None):
    """impl_numpy.compressed.compressed_attention in MLX; in_place: past is the caller's buffers (mx.arrays of
    x's dtype, impl_numpy.compressed.buffer_shapes), written by slice assignment (MLX applies it to the caller's
    array objects), returned as the present cache. chunk_size: the block-wise path (attend_blockwise), with the
    copying cache or in place; no trace."""
    validate_tensors(config, {k: to_numpy(v) if isinstance(v, mx.array) else np.asarray(v)
                              for k, v in tensors.items()})  # names, shapes, one dtype, finite values
    chunk_size = check_chunk_size(chunk_size, traced=trace is not None)
    x = x if isinstance(x, mx.array) else to_mx(np.asarray(x))
    buffers = None
    if in_place:
        if trace is not None:
            raise ValueError("trace must be None with in_place (the in-place call attends to its ring of keys in "
                             "slot order, not the stages' order: trace the copying call): got a list")
        p0 = check_in_place_call(config, x, np.asarray(positions), past)
        for name, buffer in past.items():
            if not isinstance(buffer, mx.array) or buffer.dtype != x.dtype:
                what = f"a {type(buffer).__name__}" if not isinstance(buffer, mx.array) else f"dtype {buffer.dtype}"
                raise ValueError(f"past[{name!r}] with in_place is written in place: it must be an mx.array of the "
                                 f"storage dtype {x.dtype}: got {what}")
        buffers, past = past, None
    else:
        p0 = check_compressed_call(config, x, np.asarray(positions), past)
    dtype = x.dtype
    # mx.arrays kept as given (through NumPy they would leave the graph mx.vjp differentiates: the adapter's gradients)
    p = {k: (v if isinstance(v, mx.array) else to_mx(np.asarray(v))).astype(dtype) for k, v in tensors.items()}
    positions = mx.arange(p0, p0 + x.shape[1])
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    c, N, H = config.compressed, config.num_heads, config.head_dim
    B, T, _ = x.shape
    W = config.window_left + 1
    ct = compute_of(dtype)
    q_latent = rec("query.down", rms(matmul(x, p["query.down.kernel"]), p["query.down.norm.scale"], c.eps))
    q = rec("query", mx.einsum("btr,rnh->bnth", q_latent.astype(ct), p["query.kernel"].astype(ct)).astype(dtype))
    q = rec("query.norm", rms(q, None, c.eps))
    q = rec("query.rope", turn(q, positions, config))
    k = rec("key", rms(matmul(x, p["key.kernel"][:, 0]), p["key.norm.scale"], c.eps)[:, None])
    k = rec("key.rope", turn(k, positions, config))
    if buffers is None:
        keys = k if past is None else mx.concatenate([past["key"], k], axis=2)
        key_pos_np = np.arange(p0 + T - keys.shape[2], p0 + T)
        present = {"key": keys[:, :, max(keys.shape[2] - (W - 1), 0):] if W > 1 else keys[:, :, :0]}
    else:  # the ring's held keys, then the call's: blocks, never concatenated; the ring written once attended to
        ring = buffers["key"]
        blocks = [ring[:, :, :min(p0, W - 1)], k]
        key_pos_np = np.concatenate([ring_positions(p0, W), np.arange(p0, p0 + T)])
        present = buffers
    blockwise = chunk_size is not None  # attend_blockwise: no (T, Pw + T) mask, no (T, E) one for hca
    window_keys = [keys] if buffers is None else list(blocks)  # (the window's keys alone, before the entries)
    if not blockwise:
        key_pos = mx.array(key_pos_np).astype(positions.dtype)
        in_window = (key_pos[None] <= positions[:, None]) & (key_pos[None] > positions[:, None] - W)
        allowed = mx.broadcast_to(in_window[None], (B,) + tuple(in_window.shape))
    selection = entries = None
    if c.kind != "sliding":
        if buffers is None:
            present.update(compress(config, p, "compressor", x, p0, past, rec))
            entries = present["entries"]
        else:
            count = compress_in_place(config, p, "compressor", x, p0, buffers, rec)  # writes, then the read
            entries = buffers["entries"][:, :count]
        E = entries.shape[1]
        if c.kind == "csa" or not blockwise:  # (the indexer's scores are (B, T, E) in any case)
            visible = mx.arange(E)[None] < ((positions + 1) // c.ratio)[:, None]
            shown = mx.broadcast_to(visible[None], (B, T, E))
        if c.kind == "csa":
            if buffers is None:
                present.update(compress(config, p, "indexer.compressor", x, p0, past, rec))
                index_entries = present["index_entries"]
            else:
                count = compress_in_place(config, p, "indexer.compressor", x, p0, buffers, rec)
                index_entries = buffers["index_entries"][:, :count]
            selection = select(config, p, x, q_latent, positions, index_entries, visible, rec)
            if not blockwise:
                shown = F.selection_mask(selection, 1, E)[:, 0]
        if buffers is None and not blockwise:
            keys = mx.concatenate([keys, mx.broadcast_to(entries[:, None], (B, 1, E, H))], axis=2)
        if not blockwise:
            allowed = mx.concatenate([allowed, shown], axis=2)
    if blockwise:
        ctx = attend_blockwise(config, q, window_keys, key_pos_np, np.arange(p0, p0 + T), entries,
                               selection if c.kind == "csa" else None, p.get("sinks"), chunk_size)
    elif buffers is None:
        logits = rec("logits", F.logits(q, keys, config.effective_scale))
    else:  # in place: each block's logits joined (the keys and the entries stay in their buffers)
        blocks += [] if entries is None else [entries[:, None]]
        logits = mx.concatenate([F.logits(q, b, config.effective_scale) for b in blocks], axis=-1)
    if not blockwise:
        masked = rec("mask", F.mask(logits, allowed[:, None], None))
        w = rec("softmax", F.softmax(masked, config.masked_row, p.get("sinks")))
        ctx = rec("attend", F.attend(w, keys)) if buffers is None else attend_blocks(w, blocks)
    if buffers is not None and W > 1:  # now the ring may take the call's last W - 1 keys (a slot read is overwritten)
        last = min(T, W - 1)
        slots = mx.array(np.arange(p0 + T - last, p0 + T) % (W - 1))
        ring[:, :, slots] = k[:, :, T - last:]
    ctx = rec("derotate", turn(ctx, -positions, config))
    G = c.output_groups
    grouped = ctx.transpose(0, 2, 1, 3).reshape(B, T, G, N * H // G)
    grouped = mx.einsum("btgf,gfr->btgr", grouped.astype(ct), p["output.group.kernel"].astype(ct))
    grouped = rec("output.group", grouped.astype(dtype))
    out = rec("output", matmul(grouped.reshape(B, T, -1), p["output.kernel"]))
    result = (out,) + ((selection,) if return_selection else ()) + ((present,) if return_cache else ())
    return result[0] if len(result) == 1 else result
