"""Sequence sharding (kind="sequence"): positions split into blocks (split, zigzag under causal) and a
rank's ring (_sequence): its rows projected, the key/value blocks going round by point-to-point ops
(in pieces without gradients, whole blocks shifted by _RingShift under autograd) and each block merged
by the online-softmax rule, in sub-blocks of CHUNK keys by QUERY_ROWS rows."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from weights.contract import broadcast_shape
from weights.rope import rope_tables

from .. import functional as F
from ..convert import compute_dtype
from .autograd import _Anchor, _RingShift
from .exchange import _SENT, _TAGS, _exchange

# A ring block is computed in sub-blocks of CHUNK key columns (options["chunk_size"] overrides) by
# min(CHUNK, QUERY_ROWS) query rows: impl_numpy/chunked.py's sizes, so that a rank's temporaries are the
# chunked call's, (B, N, 128, 512).
CHUNK = 512
QUERY_ROWS = 128


def split(length: int, parts: int, zigzag: bool) -> list[np.ndarray]:
    """Positions 0..length-1 in `parts` blocks: contiguous, or zigzag (2*parts chunks, block r = chunks r
    and 2*parts-1-r: early and late positions together, so causal work is even across ranks)."""
    positions = np.arange(length)
    if not zigzag:
        return np.array_split(positions, parts)
    chunks = np.array_split(positions, 2 * parts)
    return [np.concatenate([chunks[r], chunks[2 * parts - 1 - r]]) for r in range(parts)]


def _sequence(config, leaves, xs, others, options, dtype, rank, world):

    N, K, H, V = config.num_heads, config.num_kv_heads, config.head_dim, config.value_head_dim
    G = N // K
    ct = compute_dtype(dtype)
    p = {name: t.to(dtype) for name, t in leaves.items()}
    query = xs["query"].to(dtype)
    key = query if xs.get("key") is None else xs["key"].to(dtype)
    value = key if xs.get("value") is None else xs["value"].to(dtype)
    past_key, past_value = xs.get("past_key"), xs.get("past_value")
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    P = 0 if past_key is None else past_key.shape[2]
    S_total = P + S
    is_causal = bool(options.get("is_causal", False))
    offset = 0 if options.get("causal_alignment", "top_left") == "top_left" else S_total - T
    left, right = config.window_left, config.window_right
    zigzag = is_causal
    rows_of = [torch.from_numpy(i) for i in split(T, world, zigzag)]
    keys_of = [torch.from_numpy(np.concatenate([c, P + s]))
               for c, s in zip(split(P, world, zigzag), split(S, world, zigzag))]  # cache part, then new keys
    rows, my_keys = rows_of[rank], keys_of[rank]
    new_keys = my_keys[my_keys >= P] - P
    cached = my_keys[my_keys < P]

    grad = torch.is_grad_enabled()
    rope = None
    if config.rope is not None:
        inv_freq, factor = rope_tables(config.rope)
        R, inter = config.rope.rotary_dim, config.rope.interleaved

        def positions(given, index):  # (B|1, len): the given positions of these tokens, or P + index
            if given is None:
                return (P + index)[None]
            given = given.to(torch.int64)
            return (given[None] if given.ndim == 1 else given).index_select(1, index)

        def rope(t, given, index):
            return F.rope(t, F.rope_angles(positions(given, index), inv_freq, dtype), R, inter, factor)

    # The rank's own rows of the inputs (copies, dropped once projected); self-attention without a cache
    # takes its keys from the same rows, so one copy serves q, k and v.
    x_rows = query.index_select(1, rows)
    x_keys = x_rows if key is query and torch.equal(new_keys, rows) else key.index_select(1, new_keys)
    x_values = x_keys if value is key else value.index_select(1, new_keys)
    q = F.project(x_rows, p["query.kernel"], p.get("query.bias"))  # (B, t, N*H)
    del x_rows
    if config.qk_norm is not None:  # per position: the shard's rows are enough
        nq = config.qk_norm
        q = F.norm(q, p["query.norm.scale"], p.get("query.norm.bias"), nq.type, nq.eps, N, nq.scope)
    q = F.split_heads(q, N)  # (B, N, t, H)
    if rope is not None:
        q = rope(q, others.get("positions"), rows)

    def keys(x_keys):  # (B, K, s_total, H): projected, normed, rotated, the cache part first
        k = F.project(x_keys, p["key.kernel"], p.get("key.bias"))  # (B, s, K*H)
        if config.qk_norm is not None:
            k = F.norm(k, p["key.norm.scale"], p.get("key.norm.bias"), nq.type, nq.eps, K, nq.scope)
        k = F.split_heads(k, K)  # (B, K, s, H)
        if rope is not None:
            k = rope(k, others.get("key_positions"), new_keys)
        return k if past_key is None else torch.cat([past_key.to(dtype).index_select(2, cached), k], dim=2)

    def values(x_values):  # (B, K, s_total, V)
        v = F.split_heads(F.project(x_values, p["value.kernel"], p.get("value.bias")), K)  # (B, K, s, V)
        return v if past_value is None else torch.cat([past_value.to(dtype).index_select(2, cached), v], dim=2)

    # What each query row sees, taken per block: mask and bias rows here, their columns per block.
    def rows_here(t):
        return None if t is None else (t.index_select(2, rows) if t.shape[2] == T else t)

    def rank4(name, cast=None):  # a mask / bias as (B|1, N|1, T|1, S_total|1), its rows here
        if others.get(name) is None:
            return None
        t = others[name] if cast is None else others[name].to(cast)
        return rows_here(t.reshape(broadcast_shape(name, tuple(t.shape), B, N, T, S_total)))

    mask, bias = rank4("mask"), rank4("bias", ct)
    keep = None  # dropout's keep-mask, this rank's rows (B, N, t, S_total): functional.dropout per block
    if options.get("training"):
        keep = others.get("dropout_mask")
        if keep is None and config.dropout > 0:  # the unsharded call's own seeded stream, drawn whole on every rank
            keep = F.dropout_keep_mask((B, N, T, S_total), config.dropout, options.get("seed"), query.device)
        keep = rows_here(keep)
    rate = 1.0 - config.dropout
    q_ids = k_ids = None
    if others.get("segment_ids") is not None:
        ids = others["segment_ids"].to(torch.int64)
        kids = others.get("key_segment_ids", others["segment_ids"]).to(torch.int64)
        q_ids = (ids[None] if ids.ndim == 1 else ids).index_select(1, rows)  # (B|1, t)
        k_ids = (kids[None] if kids.ndim == 1 else kids).index_select(1, my_keys)  # (B|1, s_total): travels
    aligned = rows + offset  # (t,): each local query's aligned position

    def visible(at, index):  # (r, c) bool: causal and window for these aligned rows and key indices, or None
        vis = None
        i, j = at[:, None], index[None, :]
        for bound in ((j <= i) if is_causal else None, (j >= i - left) if left >= 0 else None,
                      (j <= i + right) if right >= 0 else None):
            if bound is not None:
                vis = bound if vis is None else vis & bound
        return vis

    t = len(rows)
    chunk = int(options.get("chunk_size") or CHUNK)
    row_chunk = min(chunk, QUERY_ROWS)
    parts = [(r0, min(t, r0 + row_chunk)) for r0 in range(0, t, row_chunk)]  # query rows, each with its own running state
    sinks = p.get("sinks")
    uniform = config.masked_row == "uniform"

    def new_states():
        """Each query part's running state [max, sum, numerator, the uniform policy's own sum under dropout];
        -> (states, the sums, the numerators). Without gradients every part's sum and numerator are views
        of one (B, N, t, 1) and one (B, N, t, V) array, updated in place: the merge allocates no new state
        per sub-block, and the result needs no concatenation at the end. Autograd gets new tensors per
        update instead (the two arrays are then None)."""
        l_all = None if grad else torch.zeros((B, N, t, 1), dtype=ct)
        acc_all = None if grad else torch.zeros((B, N, t, V), dtype=ct)
        states = []
        for r0, r1 in parts:
            if sinks is not None:  # the sink joins each row once, before any block: max = sink, sum = 1
                sink = sinks.to(ct).reshape(1, N, 1, 1)
                m = sink.detach().expand(B, N, r1 - r0, 1)
                l = torch.exp(sink - sink.detach()).expand(B, N, r1 - r0, 1)  # 1, with the sink's gradient
            else:
                m = torch.full((B, N, r1 - r0, 1), float("-inf"), dtype=ct)
                l = torch.zeros((B, N, r1 - r0, 1), dtype=ct)
            if grad:
                states.append([m, l, torch.zeros((B, N, r1 - r0, V), dtype=ct)])
            else:
                l_all[:, :, r0:r1] = l
                states.append([m, l_all[:, :, r0:r1], acc_all[:, :, r0:r1]])
        for (r0, r1), state in zip(parts, states):  # with dropout, a masked row's uniform context is its own
            state.append(torch.zeros((B, N, r1 - r0, V), dtype=ct) if uniform and keep is not None else None)
        return states, l_all, acc_all

    def rows_part(t_, r0, r1):  # a (B|1, N|1, t|1, ...) array's rows r0..r1
        return None if t_ is None else (t_[:, :, r0:r1] if t_.shape[2] == t else t_)

    scratch = []  # without gradients: one (B, N, rows, chunk) buffer for every sub-block's scores

    def logits(r0, r1, kc):
        """functional.logits of rows r0..r1 against kc (compute dtype, scaled, stored in the storage dtype),
        as one matmul per key/value head. Without gradients into the scratch buffer, scaled in place: under
        the fixed mmap threshold a fresh (B, N, 128, chunk) array per sub-block would be a fresh mapping,
        its pages faulted in and zeroed each time (the forward took 1.4x as long so)."""
        r, c = r1 - r0, kc.shape[2]
        qg = q[:, :, r0:r1].reshape(B, K, G * r, H).to(ct)  # (B, K, G*r, H): query head n reads kv head n // G
        kt = kc.to(ct).transpose(-1, -2)  # (B, K, H, c)
        if grad:
            x = torch.matmul(qg, kt) * config.effective_scale
        else:
            if not scratch:
                scratch.append(torch.empty(B * N * row_chunk * chunk, dtype=ct))
            x = torch.matmul(qg, kt, out=scratch[0][: B * N * r * c].view(B, K, G * r, c))
            x.mul_(config.effective_scale)
        return x.reshape(B, N, r, c).to(dtype)

    def fold(index, block_ids, c0, kc, vc):
        """Key columns c0.. of a block (kc (B, K, c, H), vc (B, K, c, V); index: the block's global key
        indices, block_ids its key segment ids) into every query part's running state; temporaries stay
        (B, N, rows, c)."""
        c1 = c0 + kc.shape[2]
        cols = index[c0:c1]
        mask_cols = None if mask is None else (mask.index_select(3, cols) if mask.shape[3] == S_total else mask)
        bias_cols = None if bias is None else (bias.index_select(3, cols) if bias.shape[3] == S_total else bias)
        keep_cols = None if keep is None else keep.index_select(3, cols)
        for (r0, r1), state in zip(parts, states):
            if state[3] is not None:  # weight 1/S_total on every key, hidden ones too, then dropout
                dropped = (rows_part(keep_cols, r0, r1).to(ct) / (rate * S_total)).reshape(B, K, G, r1 - r0, -1)
                state[3] = state[3] + torch.einsum(F.ATTEND, dropped, vc.to(ct)).reshape(B, N, r1 - r0, V)
            vis = visible(aligned[r0:r1], cols)
            if vis is not None and not bool(vis.any()):
                continue  # causal or the window hides these keys from every row here
            allowed = None if vis is None else vis[None, None]  # (1, 1, r, c)
            if mask_cols is not None:
                allowed = rows_part(mask_cols, r0, r1) if allowed is None else allowed & rows_part(mask_cols, r0, r1)
            if block_ids is not None:
                same = (q_ids[:, r0:r1, None] == block_ids[:, None, c0:c1])[:, None]  # (B|1, 1, r, c)
                allowed = same if allowed is None else allowed & same
            x = logits(r0, r1, kc)  # (B, N, r, c)
            if config.logit_softcap is not None:
                x = F.softcap(x, config.logit_softcap)
            if grad or bias_cols is not None:
                x = F.mask_stage(x, allowed, rows_part(bias_cols, r0, r1)).to(ct)
            else:  # functional.mask's select without a bias, in place on the scratch
                if allowed is not None:
                    x.masked_fill_(~allowed, float("-inf"))
                x = x.to(ct)
            # The online-softmax merge (impl_numpy/chunked.py's _core); the shifts are constants, not
            # functions of x (detached), so the gradient is the softmax's own.
            m, l, acc = state[:3]
            m_new = torch.maximum(m, x.amax(dim=-1, keepdim=True).detach())
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            # hidden -> exactly 0; without gradients in place (x is this sub-block's own temporary)
            e = torch.exp(x - m_safe) if grad else x.sub_(m_safe).exp_()
            correction = torch.exp(m - m_safe)  # 0 where m was -inf
            row_sum = e.sum(dim=-1, keepdim=True)  # before dropout: the softmax's denominator
            if keep_cols is not None:
                e = torch.where(rows_part(keep_cols, r0, r1), e / rate, 0.0)
            pv = torch.einsum(F.ATTEND, e.reshape(B, K, G, r1 - r0, c1 - c0), vc.to(ct))
            if grad:
                state[:3] = [m_new, l * correction + row_sum, acc * correction + pv.reshape(B, N, r1 - r0, V)]
            else:
                l.mul_(correction).add_(row_sum)
                acc.mul_(correction).add_(pv.reshape(B, N, r1 - r0, V))
                state[0] = m_new

    v_sum = torch.zeros((B, K, V), dtype=ct)  # every value row, for the "uniform" masked-row policy
    block_ids = k_ids
    send_to, recv_from = (rank + 1) % world, (rank - 1) % world
    present = None
    if grad:
        # Autograd: the rank's keys and values travel as one tensor, a function of k and v, whole blocks
        # shifted by _RingShift; every received block is kept for the backward.
        k, v = keys(x_keys), values(x_values)
        del x_keys, x_values
        packed = torch.cat([k.reshape(-1), v.reshape(-1)])
        present = (k, v) if options.get("return_cache") else None
        del k, v
        states, _, _ = new_states()
        received = [packed]
        for step in range(world):
            index = keys_of[(rank - step) % world]
            s = len(index)
            kb = packed[: B * K * s * H].view(B, K, s, H)
            vb = packed[B * K * s * H: B * K * s * (H + V)].view(B, K, s, V)
            if step < world - 1:  # waited for before the next block is used
                nxt = len(keys_of[(rank - step - 1) % world])
                packed = _RingShift.apply(packed, (B * K * nxt * (H + V),))
                received.append(packed)
                next_ids = None if block_ids is None else _exchange(block_ids, send_to, recv_from,
                                                                    (block_ids.shape[0], nxt), "ids")
            for c0 in range(0, s, chunk):
                if uniform:  # summed per piece, as without gradients: the same roundings either way
                    v_sum = v_sum + vb[:, :, c0:c0 + chunk].to(ct).sum(dim=2)
                fold(index, block_ids, c0, kb[:, :, c0:c0 + chunk], vb[:, :, c0:c0 + chunk])
            if step < world - 1:
                block_ids = next_ids
        l = torch.cat([state[1] for state in states], dim=2) if states else torch.zeros((B, N, 0, 1), dtype=ct)
        acc = torch.cat([state[2] for state in states], dim=2) if states else torch.zeros((B, N, 0, V), dtype=ct)
    else:
        # Without gradients a block travels in pieces of `chunk` keys, each [its keys (B, K, c, H) | its
        # values (B, K, c, V)] in a buffer of its own. At every piece of a step the rank sends its piece c to
        # rank+1, receives rank-1's piece c into a free buffer, folds its own piece c in meanwhile, and waits
        # for both: the piece just sent and folded is then free for the next receive. So a rank holds one
        # block and a piece or two, not two blocks, and the transfer still runs while the rank computes.
        # The rank's own block is written into its pieces, k and then v, each dropped once written.
        width = B * K * min(chunk, max(len(index) for index in keys_of) or 1) * (H + V)  # a whole piece

        def sizes(s):  # the key counts of a block's pieces
            return [min(chunk, s - c0) for c0 in range(0, s, chunk)]

        own = sizes(len(my_keys))
        pieces = [torch.empty(width, dtype=dtype) for _ in own]
        k = keys(x_keys)
        for i, c in enumerate(own):
            pieces[i][: B * K * c * H].view(B, K, c, H).copy_(k[:, :, i * chunk: i * chunk + c])
        present_key = k if options.get("return_cache") else None
        del k
        v = values(x_values)
        for i, c in enumerate(own):
            pieces[i][B * K * c * H: B * K * c * (H + V)].view(B, K, c, V).copy_(v[:, :, i * chunk: i * chunk + c])
        present = None if present_key is None else (present_key, v)
        del v, x_keys, x_values
        states, l_all, acc_all = new_states()  # after the inputs' rows are freed: not at the same time
        free = []  # piece buffers sent and folded, ready for a receive
        for step in range(world):
            index = keys_of[(rank - step) % world]
            here = sizes(len(index))
            last = step == world - 1
            coming = [] if last else sizes(len(keys_of[(rank - step - 1) % world]))
            next_ids = None
            if not last and block_ids is not None:
                next_ids = _exchange(block_ids, send_to, recv_from, (block_ids.shape[0], sum(coming)), "ids")
            arrived = []
            for i in range(max(len(here), len(coming))):
                ops = []
                if i < len(here) and not last:
                    sent = pieces[i][: B * K * here[i] * (H + V)].view(torch.uint8)
                    ops.append(dist.P2POp(dist.isend, sent, send_to, tag=_TAGS["kv"]))
                    _SENT["kv"] += sent.numel()
                if i < len(coming):
                    arrived.append(free.pop() if free else torch.empty(width, dtype=dtype))
                    ops.append(dist.P2POp(dist.irecv, arrived[-1][: B * K * coming[i] * (H + V)].view(torch.uint8),
                                          recv_from, tag=_TAGS["kv"]))
                requests = dist.batch_isend_irecv(ops) if ops else []
                if i < len(here):
                    c = here[i]
                    kc = pieces[i][: B * K * c * H].view(B, K, c, H)
                    vc = pieces[i][B * K * c * H: B * K * c * (H + V)].view(B, K, c, V)
                    if uniform:
                        v_sum = v_sum + vc.to(ct).sum(dim=2)
                    fold(index, block_ids, i * chunk, kc, vc)
                for request in requests:
                    request.wait()
                if i < len(here):
                    free.append(pieces[i])
            pieces = arrived
            if next_ids is not None:
                block_ids = next_ids
        # the pieces, the free buffers and the queries are done with: freed before the output's arrays
        pieces = arrived = free = kc = vc = q = None
        scratch.clear()
        l, acc = l_all, acc_all
    empty = l == 0  # rows with no visible key (never with sinks: the sink's 1 stays)
    ctx = acc / torch.where(empty, 1.0, l) if grad else acc.div_(torch.where(empty, 1.0, l))
    if config.masked_row == "uniform":
        if keep is not None:
            mean = torch.cat([state[3] for state in states], dim=2) if states else acc
        else:
            mean = (v_sum / S_total)[:, :, None, None, :].expand(B, K, G, 1, V).reshape(B, N, 1, V)
        ctx = torch.where(empty, mean, ctx)
    elif config.masked_row == "nan":
        ctx = ctx * torch.where(empty, float("nan"), 1.0)  # NaN in the gradient too, as the reference VJP
    ctx = F.merge_heads(ctx.to(dtype))  # (B, t, N*V)
    out = F.output(ctx, p["output.kernel"], p.get("output.bias"))  # (B, t, O)
    if torch.is_grad_enabled():
        out = _Anchor.apply(out, *received)
    piece = {"output": out.detach(), "rows": rows, "key_index": my_keys}
    if options.get("return_cache"):
        piece["present_key"], piece["present_value"] = (t_.detach() for t_ in present)
    return piece, out
