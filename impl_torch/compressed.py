"""DeepSeek V4's attention layer (config.compressed, issue 41) in PyTorch: impl_numpy/compressed.py stage by stage,
the same stage names, the same call and cache (docs/spec-frontier.md#deepseek-v4).

compressed_attention(config, tensors, x, positions, past=None, return_cache=, return_selection=, trace=): tensors a
dict of the canonical tensors (NumPy arrays or torch tensors), x (B, T, D) a tensor, positions (T,), past / present
dicts of tensors named as impl_numpy.compressed.cache_names. The call is validated by the reference's own check
(impl_numpy.compressed.check_compressed_call, on shapes). Differentiable by autograd (the selection a constant, as
impl_numpy/compressed_backward.py has it), in float32, float64, and float16 / bfloat16 by the reference's rule
(each stage computed in float32 and stored in 16 bits, at the reference's boundaries); the mirror of
multi_head_attention refuses config.compressed (weights.contract.check_call)."""

from __future__ import annotations

import numpy as np
import torch

from impl_numpy.compressed import blockwise_schedule, check_compressed_call, check_in_place_call, ring_positions
from weights import AttentionConfig, validate_tensors
from weights.call import record
from weights.contract import check_chunk_size
from weights.rope import rope_tables

from . import functional as F
from .convert import compute_dtype, to_numpy, to_torch


def _tensor(x, dtype, device):
    return to_torch(x, device).to(dtype)


def matmul(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    ct = compute_dtype(x.dtype)
    return (x.to(ct) @ kernel.to(ct)).to(x.dtype)


def rms(x: torch.Tensor, scale: torch.Tensor | None, eps: float) -> torch.Tensor:
    xc = x.to(compute_dtype(x.dtype))
    y = xc / torch.sqrt(torch.mean(xc * xc, dim=-1, keepdim=True) + eps)
    return (y if scale is None else y * scale.to(y.dtype)).to(x.dtype)


def turn(x: torch.Tensor, positions: torch.Tensor, config: AttentionConfig) -> torch.Tensor:
    inv_freq, factor = rope_tables(config.rope)
    angles = F.rope_angles(positions[None], inv_freq, x.dtype)  # (1, 1, L, R/2)
    return F.rope_last(x, angles, config.rope.rotary_dim, True, factor)


def compress(config, params, prefix: str, x: torch.Tensor, p0: int, past, rec, projected=None):
    c = config.compressed
    m, cache = c.ratio, "index_" if prefix.startswith("indexer") else ""
    width = params[f"{prefix}.norm.scale"].shape[0]
    B = x.shape[0]
    ct = compute_dtype(x.dtype)
    kv, gate = project_compressor(params, prefix, x, rec) if projected is None else projected
    if past is not None:
        kv = torch.cat([past[f"{cache}window_kv"], kv], dim=1)
        gate = torch.cat([past[f"{cache}window_gate"], gate], dim=1)
    first = p0 - (p0 % m)
    n = kv.shape[1] // m
    present = {f"{cache}window_kv": kv[:, n * m:], f"{cache}window_gate": gate[:, n * m:]}
    win_kv = kv[:, :n * m].reshape(B, n, m, kv.shape[-1])
    bias = params[f"{prefix}.position_bias"].to(ct)
    win_gate = gate[:, :n * m].reshape(B, n, m, kv.shape[-1]).to(ct) + bias  # compute dtype
    if c.overlap:
        if past is not None and past[f"{cache}overlap_kv"].shape[1]:
            prev_kv = past[f"{cache}overlap_kv"][:, None]
            prev_gate = past[f"{cache}overlap_gate"][:, None].to(ct) + bias[:, :width]
        else:
            prev_kv = x.new_zeros((B, 1, m, width))
            prev_gate = x.new_full((B, 1, m, width), float("-inf"), dtype=ct)
        before_kv = torch.cat([prev_kv, win_kv[:, :-1, :, :width]], dim=1)[:, :n]
        before_gate = torch.cat([prev_gate, win_gate[:, :-1, :, :width]], dim=1)[:, :n]
        slots_kv = torch.cat([before_kv, win_kv[..., width:]], dim=2)
        slots_gate = torch.cat([before_gate, win_gate[..., width:]], dim=2)
        if n:
            present[f"{cache}overlap_kv"] = win_kv[:, -1, :, :width]
            present[f"{cache}overlap_gate"] = gate[:, (n - 1) * m:n * m, :width]
        else:
            empty = x.new_zeros((B, 0, width))
            present[f"{cache}overlap_kv"] = empty if past is None else past[f"{cache}overlap_kv"]
            present[f"{cache}overlap_gate"] = empty if past is None else past[f"{cache}overlap_gate"]
    else:
        slots_kv, slots_gate = win_kv, win_gate
    weights = rec(f"{prefix}.weights", torch.softmax(slots_gate, dim=2).to(x.dtype))  # per feature over the slots
    pooled = rec(f"{prefix}.pool", (weights.to(ct) * slots_kv.to(ct)).sum(dim=2).to(x.dtype))
    normed = rec(f"{prefix}.norm", rms(pooled, params[f"{prefix}.norm.scale"], c.eps))
    starts = first + m * torch.arange(n, device=x.device)
    new = rec(f"{prefix}.rope", turn(normed[:, None], starts, config)[:, 0])
    old = x.new_zeros((B, 0, width)) if past is None else past[f"{cache}entries"]
    present[f"{cache}entries"] = torch.cat([old, new], dim=1)
    return present


def project_compressor(params, prefix: str, x: torch.Tensor, rec):
    kv = rec(f"{prefix}.project", matmul(x, params[f"{prefix}.kernel"]))
    return kv, rec(f"{prefix}.gate", matmul(x, params[f"{prefix}.gate.kernel"]))


def compress_in_place(config, params, prefix: str, x: torch.Tensor, p0: int, buffers, rec) -> int:
    """impl_numpy.compressed.compress_in_place: the buffers written with Tensor.copy_ (index assignment)."""
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
        past[f"{cache}entries"] = x.new_zeros((x.shape[0], 0, width))
        present = compress(config, params, prefix, x, p0, past, rec, projected=(kv, gate))
        buffers[f"{cache}entries"][:, E0:E0 + n] = present[f"{cache}entries"]
        if c.overlap:  # compress()'s overlap halves are views of its concatenated rows, not of the buffers
            buffers[f"{cache}overlap_kv"].copy_(present[f"{cache}overlap_kv"])
            buffers[f"{cache}overlap_gate"].copy_(present[f"{cache}overlap_gate"])
    rest = r0 + T - n * m
    new = min(rest, T)
    window_kv[:, rest - new:rest] = kv[:, T - new:]
    window_gate[:, rest - new:rest] = gate[:, T - new:]
    return E0 + n


def in_place_buffers(buffers, x, tensors) -> None:
    """The buffers of an in-place call, as given: torch tensors of x's dtype on x's device (a cast, a NumPy array
    or a transfer would write a copy the caller never sees), and no autograd (inference only)."""
    for name, buffer in buffers.items():
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != x.dtype or buffer.device != x.device:
            what = (f"a {type(buffer).__name__}" if not isinstance(buffer, torch.Tensor) else
                    f"dtype {buffer.dtype}" if buffer.dtype != x.dtype else f"a tensor on {buffer.device}")
            raise ValueError(f"past[{name!r}] with in_place is written in place: it must be a torch tensor of the "
                             f"storage dtype {x.dtype} on {x.device}: got {what}")
    if torch.is_grad_enabled():
        asking = [n for n, t in {"x": x, **tensors, **buffers}.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        if asking:
            raise ValueError("in_place writes the cache's buffers, for inference only: call it under torch.no_grad(), "
                             f"or pass the cache as past without in_place to differentiate: got {', '.join(asking)} "
                             "requiring grad with gradients enabled")


def attend_blocks(w: torch.Tensor, blocks: list) -> torch.Tensor:
    """impl_numpy.compressed.attend_blocks: F.attend over each block of keys, summed."""
    B, N, T, S = w.shape
    ct = compute_dtype(w.dtype)
    wc = w.to(ct).reshape(B, 1, N * T, S)
    ctx, start = None, 0
    for block in blocks:
        part = torch.matmul(wc[..., start:start + block.shape[2]], block.to(ct))
        ctx, start = part if ctx is None else ctx + part, start + block.shape[2]
    return ctx.to(w.dtype).reshape(B, N, T, blocks[0].shape[-1])


def _key_block(parts: list, s0: int, s1: int) -> torch.Tensor:
    """Keys s0 .. s1 - 1 of the window's parts ((B, 1, S_i, H) each, read as one along S, as
    impl_numpy.chunked.KeyParts reads them): a view within one part, a copy of the few keys of a block that
    straddles two."""
    pieces, offset = [], 0
    for part in parts:
        end = offset + part.shape[2]
        if s0 < end and s1 > offset:
            pieces.append(part[:, :, max(s0 - offset, 0):min(s1, end) - offset])
        offset = end
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)


def attend_blockwise(config: AttentionConfig, q: torch.Tensor, window_keys: list, key_pos: np.ndarray,
                     positions: np.ndarray, entries: torch.Tensor | None, selection: torch.Tensor | None, sinks,
                     chunk_size: int) -> torch.Tensor:
    """impl_numpy.compressed.attend_blockwise in PyTorch: the stages from the logits to the context block by block
    with an online softmax started at the sink, never a (T, W + E) array. key_pos and positions are NumPy (the
    positions are the call's, known before any tensor is read): which window and entry blocks a query block visits
    and skips is impl_numpy.compressed.blockwise_schedule's, decided on them on the host (csa's from its selection,
    copied to the host once); each block's hidden mask goes to the device. The same blocks, the same skips, the
    same recurrence; differentiable by autograd (torch.where keeps a hidden logit's gradient 0). Returns the context (B, N, T, H) in q's dtype."""
    B, N, T, H = q.shape
    dtype, ct, device = q.dtype, compute_dtype(q.dtype), q.device
    E = 0 if entries is None else entries.shape[1]
    ents = None if entries is None else entries[:, None]  # (B, 1, E, H): one kv head
    sink = None if sinks is None else sinks.to(ct).reshape(1, N, 1, 1)
    chosen_all = None if selection is None else selection.detach().cpu().numpy()  # (B, T, k) on the host, once
    minus_inf = torch.tensor(float("-inf"), dtype=ct, device=device)
    zero = torch.tensor(0.0, dtype=ct, device=device)
    context = []
    for t0, t1, blocks in blockwise_schedule(config, key_pos, positions, E, chunk_size, chosen_all):
        t = t1 - t0
        qb = q[:, :, t0:t1]
        if sink is None:
            m = torch.full((B, N, t, 1), float("-inf"), dtype=ct, device=device)
            l = torch.zeros((B, N, t, 1), dtype=ct, device=device)
        else:  # the sink joins every row first: max = sink, sum = exp(0) = 1, numerator 0
            m, l = sink.expand(B, N, t, 1), torch.ones((B, N, t, 1), dtype=ct, device=device)
        acc = torch.zeros((B, N, t, H), dtype=ct, device=device)

        def step(kb, hidden, m, l, acc):
            """One key block (B, 1, s, H), its hidden logits ((B|1, 1, t, s) bool or None): the running state."""
            x = F.logits(qb, kb, config.effective_scale).to(ct)  # (B, N, t, s), the stage's
            if hidden is not None:
                x = torch.where(hidden, minus_inf, x)
            m_new = torch.maximum(m, x.amax(dim=-1, keepdim=True))
            m_safe = torch.where(m_new == float("-inf"), zero, m_new)  # a row that has seen no key yet
            e = torch.exp(x - m_safe)  # hidden -> exactly 0
            correction = torch.exp(m - m_safe)  # 0 where m was -inf
            pv = torch.matmul(e.reshape(B, 1, N * t, -1), kb.to(ct)).reshape(B, N, t, H)
            return m_new, l * correction + e.sum(dim=-1, keepdim=True), acc * correction + pv

        for source, b0, b1, hidden in blocks:  # the window's key blocks, then the entries' (the mask to the device)
            hidden = None if hidden is None else torch.from_numpy(hidden).to(device)
            kb = _key_block(window_keys, b0, b1) if source == "window" else ents[:, :, b0:b1]
            m, l, acc = step(kb, hidden, m, l, acc)
        context.append((acc / l).to(dtype))
    return torch.cat(context, dim=2)


def select(config, params, x, q_latent, positions, entries, visible, rec) -> torch.Tensor:
    c = config.compressed
    I, J = c.index_heads, c.index_head_dim
    ct = compute_dtype(x.dtype)
    q = torch.einsum("btr,rij->bitj", q_latent.to(ct), params["indexer.query.kernel"].to(ct))
    q = rec("indexer.query", turn(q.to(x.dtype), positions, config))
    dots = torch.einsum("bitj,bej->btie", q.to(ct), entries.to(ct))
    w = rec("indexer.weights", ((x.to(ct) @ params["indexer.weights.kernel"].to(ct)) * I ** -0.5).to(x.dtype))
    score = (torch.relu(dots) * J ** -0.5 * w.to(ct)[..., None]).sum(dim=2)  # compute dtype
    score = rec("indexer.score", score.masked_fill(~visible[None], float("-inf")))
    k = min(c.index_topk, score.shape[-1])
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]  # ties: the earlier entry
    chosen = torch.gather(visible[None].expand(x.shape[0], -1, -1), -1, order)
    return rec("indexer.selection", torch.where(chosen, order, -1))


def compressed_attention(config: AttentionConfig, tensors, x, positions, past=None, *, return_cache: bool = False,
                         return_selection: bool = False, trace: list | None = None, in_place: bool = False,
                         chunk_size: int | None = None):
    """impl_numpy.compressed.compressed_attention in PyTorch; in_place: past is the caller's buffers (torch
    tensors of x's dtype on its device, impl_numpy.compressed.buffer_shapes), written by the call, returned as
    the present cache (inference only). chunk_size: the block-wise path (attend_blockwise), with the copying
    cache or in place; no trace."""
    validate_tensors(config, {k: to_numpy(v.detach()) if isinstance(v, torch.Tensor) else np.asarray(v)
                              for k, v in tensors.items()})  # names, shapes, one dtype, finite values
    chunk_size = check_chunk_size(chunk_size, traced=trace is not None)
    x = x if isinstance(x, torch.Tensor) else to_torch(np.asarray(x))
    buffers = None
    if in_place:
        if trace is not None:
            raise ValueError("trace must be None with in_place (the in-place call attends to its ring of keys in "
                             "slot order, not the stages' order: trace the copying call): got a list")
        p0 = check_in_place_call(config, x, np.asarray(positions), past)
        in_place_buffers(past, x, tensors)
        buffers, past = past, None
    else:
        p0 = check_compressed_call(config, x, np.asarray(positions), past)
    dtype, device = x.dtype, x.device
    p = {k: _tensor(v, dtype, device) for k, v in tensors.items()}
    positions = torch.arange(p0, p0 + x.shape[1], device=device)
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    c, N, H = config.compressed, config.num_heads, config.head_dim
    B, T, _ = x.shape
    W = config.window_left + 1
    ct = compute_dtype(dtype)
    q_latent = rec("query.down", rms(matmul(x, p["query.down.kernel"]), p["query.down.norm.scale"], c.eps))
    q = rec("query", torch.einsum("btr,rnh->bnth", q_latent.to(ct), p["query.kernel"].to(ct)).to(dtype))
    q = rec("query.norm", rms(q, None, c.eps))
    q = rec("query.rope", turn(q, positions, config))
    k = rec("key", rms(matmul(x, p["key.kernel"][:, 0]), p["key.norm.scale"], c.eps)[:, None])
    k = rec("key.rope", turn(k, positions, config))
    if buffers is None:
        keys = k if past is None else torch.cat([past["key"], k], dim=2)
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
        key_pos = torch.from_numpy(key_pos_np).to(device)
        in_window = (key_pos[None] <= positions[:, None]) & (key_pos[None] > positions[:, None] - W)
        allowed = in_window[None].expand(B, -1, -1)
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
            visible = torch.arange(E, device=device)[None] < ((positions + 1) // c.ratio)[:, None]
            shown = visible[None].expand(B, -1, -1)
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
            keys = torch.cat([keys, entries[:, None].expand(B, 1, E, H)], dim=2)
        if not blockwise:
            allowed = torch.cat([allowed, shown], dim=2)
    if blockwise:
        ctx = attend_blockwise(config, q, window_keys, key_pos_np, np.arange(p0, p0 + T), entries,
                               selection if c.kind == "csa" else None, p.get("sinks"), chunk_size)
    elif buffers is None:
        logits = rec("logits", F.logits(q, keys, config.effective_scale))
    else:  # in place: each block's logits joined (the keys and the entries stay in their buffers)
        blocks += [] if entries is None else [entries[:, None]]
        logits = torch.cat([F.logits(q, b, config.effective_scale) for b in blocks], dim=-1)
    if not blockwise:
        masked = rec("mask", F.mask(logits, allowed[:, None], None))
        w = rec("softmax", F.softmax(masked, config.masked_row, p.get("sinks")))
        ctx = rec("attend", F.attend(w, keys)) if buffers is None else attend_blocks(w, blocks)
    if buffers is not None and W > 1:  # now the ring may take the call's last W - 1 keys (a slot read is overwritten)
        last = min(T, W - 1)
        ring[:, :, positions[T - last:] % (W - 1)] = k[:, :, T - last:]
    ctx = rec("derotate", turn(ctx, -positions, config))
    G = c.output_groups
    grouped = ctx.transpose(1, 2).reshape(B, T, G, N * H // G)
    grouped = torch.einsum("btgf,gfr->btgr", grouped.to(ct), p["output.group.kernel"].to(ct))
    grouped = rec("output.group", grouped.to(dtype))
    out = rec("output", matmul(grouped.reshape(B, T, -1), p["output.kernel"]))
    result = (out,) + ((selection,) if return_selection else ()) + ((present,) if return_cache else ())
    return result[0] if len(result) == 1 else result
