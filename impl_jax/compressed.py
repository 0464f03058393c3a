"""DeepSeek V4's attention layer (config.compressed, issue 41) in JAX: impl_numpy/compressed.py stage by stage, the
same stage names, the same call and cache (docs/spec-frontier.md#deepseek-v4).

compressed_attention(config, tensors, x, positions, past=None, return_cache=, return_selection=, trace=): x
(B, T, D) an array (float32; float64 with JAX's x64 mode on), positions (T,), past / present dicts of arrays named
as impl_numpy.compressed.cache_names. Eager (not jitted: the number of windows a call closes is a Python int),
every product at HIGHEST precision. The call is validated by the reference's own check
(impl_numpy.compressed.check_compressed_call, on shapes). Differentiable (jax.vjp: the
selection a constant, as impl_numpy/compressed_backward.py has it). float16 / bfloat16 by the reference's rule: each
stage computed in float32 and stored in 16 bits, at the reference's boundaries. The mirror of multi_head_attention
refuses config.compressed (weights.contract.check_call).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from impl_numpy.compressed import blockwise_schedule, check_compressed_call, check_in_place_call, ring_positions
from weights import AttentionConfig, compute_dtype, validate_tensors
from weights.call import record
from weights.contract import check_chunk_size
from weights.rope import rope_tables

from . import functional as F

HIGHEST = lax.Precision.HIGHEST


def _mm(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def _es(spec, a, b):
    return jnp.einsum(spec, a, b, precision=HIGHEST)


def _ct(dtype):
    return compute_dtype(np.dtype(dtype))


def matmul(x, kernel):
    """x @ kernel in the compute dtype, stored in x's dtype."""
    ct = _ct(x.dtype)
    return _mm(x.astype(ct), kernel.astype(ct)).astype(x.dtype)


def rms(x, scale, eps: float):
    xc = x.astype(_ct(x.dtype))
    y = xc / jnp.sqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
    return (y if scale is None else y * scale.astype(y.dtype)).astype(x.dtype)


def turn(x, positions, config: AttentionConfig):
    inv_freq, factor = rope_tables(config.rope)
    angles = F.rope_angles(positions[None], inv_freq, x.dtype)  # (1, 1, L, R/2)
    return F.rope_last(x, angles, config.rope.rotary_dim, True, factor)


def compress(config, params, prefix: str, x, p0: int, past, rec, projected=None):
    c = config.compressed
    m, cache = c.ratio, "index_" if prefix.startswith("indexer") else ""
    width = params[f"{prefix}.norm.scale"].shape[0]
    B = x.shape[0]
    ct = _ct(x.dtype)
    kv, gate = project_compressor(params, prefix, x, rec) if projected is None else projected
    if past is not None:
        kv = jnp.concatenate([past[f"{cache}window_kv"], kv], axis=1)
        gate = jnp.concatenate([past[f"{cache}window_gate"], gate], axis=1)
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
            prev_kv = jnp.zeros((B, 1, m, width), x.dtype)
            prev_gate = jnp.full((B, 1, m, width), -jnp.inf, ct)
        before_kv = jnp.concatenate([prev_kv, win_kv[:, :-1, :, :width]], axis=1)[:, :n]
        before_gate = jnp.concatenate([prev_gate, win_gate[:, :-1, :, :width]], axis=1)[:, :n]
        slots_kv = jnp.concatenate([before_kv, win_kv[..., width:]], axis=2)
        slots_gate = jnp.concatenate([before_gate, win_gate[..., width:]], axis=2)
        if n:
            present[f"{cache}overlap_kv"] = win_kv[:, -1, :, :width]
            present[f"{cache}overlap_gate"] = gate[:, (n - 1) * m:n * m, :width]
        else:
            empty = jnp.zeros((B, 0, width), x.dtype)
            present[f"{cache}overlap_kv"] = empty if past is None else past[f"{cache}overlap_kv"]
            present[f"{cache}overlap_gate"] = empty if past is None else past[f"{cache}overlap_gate"]
    else:
        slots_kv, slots_gate = win_kv, win_gate
    weights = rec(f"{prefix}.weights", jax.nn.softmax(slots_gate, axis=2).astype(x.dtype))  # over the slots
    pooled = rec(f"{prefix}.pool", (weights.astype(ct) * slots_kv.astype(ct)).sum(axis=2).astype(x.dtype))
    normed = rec(f"{prefix}.norm", rms(pooled, params[f"{prefix}.norm.scale"], c.eps))
    starts = first + m * jnp.arange(n)
    new = rec(f"{prefix}.rope", turn(normed[:, None], starts, config)[:, 0])
    old = jnp.zeros((B, 0, width), x.dtype) if past is None else past[f"{cache}entries"]
    present[f"{cache}entries"] = jnp.concatenate([old, new], axis=1)
    return present


def project_compressor(params, prefix: str, x, rec):
    kv = rec(f"{prefix}.project", matmul(x, params[f"{prefix}.kernel"]))
    return kv, rec(f"{prefix}.gate", matmul(x, params[f"{prefix}.gate.kernel"]))


def compress_in_place(config, params, prefix: str, x, p0: int, buffers: dict, rec) -> int:
    """impl_numpy.compressed.compress_in_place in JAX: each write an .at[].set of a static slice, the dict's
    buffers replaced by the written ones (under jax.jit with the buffers donated XLA writes them in place)."""
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
        past[f"{cache}entries"] = jnp.zeros((x.shape[0], 0, width), x.dtype)
        present = compress(config, params, prefix, x, p0, past, rec, projected=(kv, gate))
        name = f"{cache}entries"
        buffers[name] = buffers[name].at[:, E0:E0 + n].set(present[name])
        if c.overlap:
            buffers[f"{cache}overlap_kv"] = present[f"{cache}overlap_kv"]
            buffers[f"{cache}overlap_gate"] = present[f"{cache}overlap_gate"]
    rest = r0 + T - n * m
    new = min(rest, T)
    if new:
        buffers[f"{cache}window_kv"] = window_kv.at[:, rest - new:rest].set(kv[:, T - new:])
        buffers[f"{cache}window_gate"] = window_gate.at[:, rest - new:rest].set(gate[:, T - new:])
    return E0 + n


def attend_blocks(w, blocks: list):
    """impl_numpy.compressed.attend_blocks: F.attend over each block of keys, summed."""
    B, N, T, S = w.shape
    ct = _ct(w.dtype)
    wc = w.astype(ct).reshape(B, 1, N * T, S)
    ctx, start = None, 0
    for block in blocks:
        part = _mm(wc[..., start:start + block.shape[2]], block.astype(ct))
        ctx, start = part if ctx is None else ctx + part, start + block.shape[2]
    return ctx.astype(w.dtype).reshape(B, N, T, blocks[0].shape[-1])


def _key_block(parts: list, s0: int, s1: int):
    """Keys s0 .. s1 - 1 of the window's parts ((B, 1, S_i, H) each, read as one along S, as
    impl_numpy.chunked.KeyParts reads them): a slice within one part, the few keys of a block that straddles two
    joined."""
    pieces, offset = [], 0
    for part in parts:
        end = offset + part.shape[2]
        if s0 < end and s1 > offset:
            pieces.append(part[:, :, max(s0 - offset, 0):min(s1, end) - offset])
        offset = end
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=2)


def attend_blockwise(config: AttentionConfig, q, window_keys: list, key_pos: np.ndarray, positions: np.ndarray,
                     entries, selection, sinks, chunk_size: int):
    """impl_numpy.compressed.attend_blockwise in JAX: the stages from the logits to the context block by block with
    an online softmax started at the sink, never a (T, W + E) array; a Python loop over static blocks (key_pos and
    positions are NumPy: p0 and T are static, under jax.jit too). The window's and the entries' skips are
    impl_numpy.compressed.blockwise_schedule's, decided on those static positions, so a skipped block is never
    traced (absent from a jitted program, as from an eager run). csa's skip of an entry block no query selected depends on the selection's values: eagerly (a concrete
    array) the block is skipped as NumPy skips it; under jax.jit (a tracer) it cannot be, so the block is computed
    and every logit of it hidden (-inf: it adds exactly 0 to the running sum and numerator, the same result).
    Returns the context (B, N, T, H) in q's dtype."""
    B, N, T, H = q.shape
    dtype, ct = q.dtype, _ct(q.dtype)
    E = 0 if entries is None else entries.shape[1]
    ents = None if entries is None else entries[:, None]  # (B, 1, E, H): one kv head
    sink = None if sinks is None else sinks.astype(ct).reshape(1, N, 1, 1)
    traced = isinstance(selection, jax.core.Tracer)
    context = []
    # the shared host schedule; under jax.jit csa's selection is a tracer: the schedule's entry blocks then are every
    # visible one (no selection given), each with its not-selected logits hidden from the tracer below
    chosen = None if selection is None or traced else np.asarray(selection)
    for t0, t1, blocks in blockwise_schedule(config, key_pos, positions, E, chunk_size, chosen):
        t = t1 - t0
        qb = q[:, :, t0:t1]
        if sink is None:
            m = jnp.full((B, N, t, 1), -jnp.inf, ct)
            l = jnp.zeros((B, N, t, 1), ct)
        else:  # the sink joins every row first: max = sink, sum = exp(0) = 1, numerator 0
            m, l = jnp.broadcast_to(sink, (B, N, t, 1)), jnp.ones((B, N, t, 1), ct)
        acc = jnp.zeros((B, N, t, H), ct)

        def step(kb, hidden, m, l, acc):
            """One key block (B, 1, s, H), its hidden logits ((B|1, 1, t, s) bool or None): the running state."""
            x = F.logits(qb, kb, config.effective_scale).astype(ct)  # (B, N, t, s), the stage's
            if hidden is not None:
                x = jnp.where(hidden, -jnp.inf, x)
            m_new = jnp.maximum(m, x.max(axis=-1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0, m_new)  # a row that has seen no key yet
            e = jnp.exp(x - m_safe)  # hidden -> exactly 0
            correction = jnp.exp(m - m_safe)  # 0 where m was -inf
            pv = _mm(e.reshape(B, 1, N * t, -1), kb.astype(ct)).reshape(B, N, t, H)
            return m_new, l * correction + e.sum(axis=-1, keepdims=True), acc * correction + pv

        for source, b0, b1, hidden in blocks:  # the window's key blocks, then the entries'
            if source == "entries" and traced:  # csa under jax.jit: every visible block, what was not selected hidden
                hidden = ~(selection[:, t0:t1, :, None] == jnp.arange(b0, b1)).any(axis=2)[:, None]
            kb = _key_block(window_keys, b0, b1) if source == "window" else ents[:, :, b0:b1]
            m, l, acc = step(kb, hidden, m, l, acc)
        context.append((acc / l).astype(dtype))
    return jnp.concatenate(context, axis=2)


def select(config, params, x, q_latent, positions, entries, visible, rec):
    c = config.compressed
    I, J = c.index_heads, c.index_head_dim
    ct = _ct(x.dtype)
    q = _es("btr,rij->bitj", q_latent.astype(ct), params["indexer.query.kernel"].astype(ct))
    q = rec("indexer.query", turn(q.astype(x.dtype), positions, config))
    dots = _es("bitj,bej->btie", q.astype(ct), entries.astype(ct))
    w = rec("indexer.weights", (_mm(x.astype(ct), params["indexer.weights.kernel"].astype(ct)) * I ** -0.5
                                ).astype(x.dtype))
    score = (jax.nn.relu(dots) * J ** -0.5 * w.astype(ct)[..., None]).sum(axis=2)  # compute dtype
    score = rec("indexer.score", jnp.where(visible[None], score, -jnp.inf))
    k = min(c.index_topk, score.shape[-1])
    order = jnp.argsort(-score, axis=-1, stable=True)[..., :k]  # ties: the earlier entry
    chosen = jnp.take_along_axis(jnp.broadcast_to(visible[None], score.shape), order, axis=-1)
    return rec("indexer.selection", jnp.where(chosen, order, -1))


def compressed_attention(config: AttentionConfig, tensors, x, positions, past=None, *, return_cache: bool = False,
                         return_selection: bool = False, trace: list | None = None, jit: dict | None = None,
                         in_place: bool = False, chunk_size: int | None = None):
    """impl_numpy.compressed.compressed_attention in JAX. jit: XLA compiler options ({}: XLA's own) to run the
    layer with as one jax.jit program (not with trace); None: eagerly, op by op. chunk_size: the block-wise path
    (attend_blockwise), eager or jitted, copying or in place; no trace.

    in_place: past is the buffers (impl_numpy.compressed.buffer_shapes; JAX arrays of x's dtype). JAX arrays are
    immutable, so it needs return_cache=True: the present cache is the written buffers (a new dict). With jit the
    buffers are donated (donate_argnums: XLA writes them in place, and the given arrays are deleted: keep the
    returned ones); eagerly each write is a new array (.at[].set), the copy the in-place form exists to avoid."""
    validate_tensors(config, {k: np.asarray(v) for k, v in tensors.items()})  # names, shapes, one dtype, finite
    chunk_size = check_chunk_size(chunk_size, traced=trace is not None)
    x = jnp.asarray(x)
    if in_place:
        if trace is not None:
            raise ValueError("trace must be None with in_place (the in-place call attends to its ring of keys in "
                             "slot order, not the stages' order: trace the copying call): got a list")
        if not return_cache:
            raise ValueError("return_cache must be True with in_place in JAX (its arrays are immutable: the written "
                             "buffers are returned as the present cache): got False")
        p0 = check_in_place_call(config, x, np.asarray(positions), past)
        for name, buffer in past.items():
            if not isinstance(buffer, jax.Array) or buffer.dtype != x.dtype:
                what = f"a {type(buffer).__name__}" if not isinstance(buffer, jax.Array) else f"dtype {buffer.dtype}"
                raise ValueError(f"past[{name!r}] with in_place is written in place: it must be a jax array of the "
                                 f"storage dtype {x.dtype}: got {what}")
    else:
        p0 = check_compressed_call(config, x, np.asarray(positions), past)
    dtype = x.dtype
    p = {k: jnp.asarray(np.asarray(v)).astype(dtype) for k, v in tensors.items()}
    if not in_place:
        past = None if past is None else {k: jnp.asarray(v).astype(dtype) for k, v in past.items()}
    if trace is None and jit is not None:  # one compiled program (eager JAX compiles every op for every new shape)
        run = jax.jit(functools.partial(layer, config, p0=p0, return_cache=return_cache,
                                        return_selection=return_selection, in_place=in_place,
                                        chunk_size=chunk_size),
                      compiler_options=jit or None, donate_argnums=(2,) if in_place else ())
        return run(p, x, past)
    return layer(config, p, x, past, p0=p0, return_cache=return_cache, return_selection=return_selection,
                 trace=trace, in_place=in_place, chunk_size=chunk_size)


def layer(config: AttentionConfig, p, x, past, *, p0: int, return_cache: bool, return_selection: bool,
          trace: list | None = None, in_place: bool = False, chunk_size: int | None = None):
    """compressed_attention's computation on checked arrays (jax.jit-able: shapes and p0 decide every branch);
    in_place: past is the buffers, returned written as the present cache."""
    positions = jnp.arange(p0, p0 + x.shape[1])
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    c, N, H = config.compressed, config.num_heads, config.head_dim
    B, T, _ = x.shape
    W = config.window_left + 1
    dtype, ct = x.dtype, _ct(x.dtype)
    q_latent = rec("query.down", rms(matmul(x, p["query.down.kernel"]), p["query.down.norm.scale"], c.eps))
    q = rec("query", _es("btr,rnh->bnth", q_latent.astype(ct), p["query.kernel"].astype(ct)).astype(dtype))
    q = rec("query.norm", rms(q, None, c.eps))
    q = rec("query.rope", turn(q, positions, config))
    k = rec("key", rms(matmul(x, p["key.kernel"][:, 0]), p["key.norm.scale"], c.eps)[:, None])
    k = rec("key.rope", turn(k, positions, config))
    buffers = None
    if not in_place:
        keys = k if past is None else jnp.concatenate([past["key"], k], axis=2)
        key_pos_np = np.arange(p0 + T - keys.shape[2], p0 + T)
        present = {"key": keys[:, :, max(keys.shape[2] - (W - 1), 0):] if W > 1 else keys[:, :, :0]}
    else:  # the ring's held keys, then the call's: blocks, never concatenated; the ring written once attended to
        buffers, past = dict(past), None
        ring = buffers["key"]
        blocks = [ring[:, :, :min(p0, W - 1)], k]
        key_pos_np = np.concatenate([ring_positions(p0, W), np.arange(p0, p0 + T)])
        present = buffers
    blockwise = chunk_size is not None  # attend_blockwise: no (T, Pw + T) mask, no (T, E) one for hca
    window_keys = [keys] if buffers is None else list(blocks)  # (the window's keys alone, before the entries)
    if not blockwise:
        key_pos = jnp.asarray(key_pos_np)
        in_window = (key_pos[None] <= positions[:, None]) & (key_pos[None] > positions[:, None] - W)
        allowed = jnp.broadcast_to(in_window[None], (B,) + in_window.shape)
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
            visible = jnp.arange(E)[None] < ((positions + 1) // c.ratio)[:, None]
            shown = jnp.broadcast_to(visible[None], (B, T, E))
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
            keys = jnp.concatenate([keys, jnp.broadcast_to(entries[:, None], (B, 1, E, H))], axis=2)
        if not blockwise:
            allowed = jnp.concatenate([allowed, shown], axis=2)
    if blockwise:
        ctx = attend_blockwise(config, q, window_keys, key_pos_np, np.arange(p0, p0 + T), entries,
                               selection if c.kind == "csa" else None, p.get("sinks"), chunk_size)
    elif buffers is None:
        logits = rec("logits", F.logits(q, keys, config.effective_scale))
    else:  # in place: each block's logits joined (the keys and the entries read from their buffers)
        blocks += [] if entries is None else [entries[:, None]]
        logits = jnp.concatenate([F.logits(q, b, config.effective_scale) for b in blocks], axis=-1)
    if not blockwise:
        masked = rec("mask", F.mask(logits, allowed[:, None], None))
        w = rec("softmax", F.softmax(masked, config.masked_row, p.get("sinks")))
        ctx = rec("attend", F.attend(w, keys)) if buffers is None else attend_blocks(w, blocks)
    if buffers is not None and W > 1:  # now the ring may take the call's last W - 1 keys
        last = min(T, W - 1)
        buffers["key"] = ring.at[:, :, np.arange(p0 + T - last, p0 + T) % (W - 1)].set(k[:, :, T - last:])
    ctx = rec("derotate", turn(ctx, -positions, config))
    G = c.output_groups
    grouped = ctx.transpose(0, 2, 1, 3).reshape(B, T, G, N * H // G)
    grouped = _es("btgf,gfr->btgr", grouped.astype(ct), p["output.group.kernel"].astype(ct))
    grouped = rec("output.group", grouped.astype(dtype))
    out = rec("output", matmul(grouped.reshape(B, T, -1), p["output.kernel"]))
    result = (out,) + ((selection,) if return_selection else ()) + ((present,) if return_cache else ())
    return result[0] if len(result) == 1 else result
