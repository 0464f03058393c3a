"""Heads sharding (kind="heads"): a rank's query heads and the kv heads they read, column-parallel
projections, the row-parallel output projection summed by one all_reduce, QK-norm of scope "all" with
its statistics summed over the ranks (the package docstring says more)."""

from __future__ import annotations

import torch

from weights.rope import rope_tables

from .. import functional as F
from ..convert import compute_dtype
from .autograd import _AllReduceSum


def _norm_all(config, p, q, k, heads, kvh, owned, dtype):
    """QK-norm of scope "all" (functional.norm over every head's features) on heads-sharded projections
    q (B, T, n_local*H) and k (B, S, k_local*H): each statistic is this rank's sum over its own heads
    (for k: the kv heads it owns), summed over ranks by one all_reduce for q and k together, so that
    autograd runs the same collectives in the same order on every rank."""
    n = config.qk_norm
    H = config.head_dim
    ct = compute_dtype(dtype)
    yq, yk = q.to(ct), k.to(ct)
    k_cols = torch.tensor([i * H + j for i in owned for j in range(H)], dtype=torch.int64)

    def summed(a, b):  # (B, T, 1) and (B, S, 1): sums over every head's features, all ranks
        sq, sk = a.sum(dim=-1, keepdim=True), b.index_select(-1, k_cols).sum(dim=-1, keepdim=True)
        total = _AllReduceSum.apply(torch.cat([sq.reshape(-1), sk.reshape(-1)]))
        return total[: sq.numel()].reshape(sq.shape), total[sq.numel():].reshape(sk.shape)

    widths = (config.num_heads * H, config.num_kv_heads * H)
    if n.type == "layer":
        mq, mk = summed(yq, yk)
        yq, yk = yq - mq / widths[0], yk - mk / widths[1]
    vq, vk = summed(yq * yq, yk * yk)
    yq = yq / torch.sqrt(vq / widths[0] + n.eps) * p["query.norm.scale"].index_select(0, heads).to(ct).reshape(-1)
    yk = yk / torch.sqrt(vk / widths[1] + n.eps) * p["key.norm.scale"].index_select(0, kvh).to(ct).reshape(-1)
    if "query.norm.bias" in p:
        yq = yq + p["query.norm.bias"].index_select(0, heads).to(ct).reshape(-1)
        yk = yk + p["key.norm.bias"].index_select(0, kvh).to(ct).reshape(-1)
    return yq.to(dtype), yk.to(dtype)


def _heads(config, leaves, xs, others, options, dtype, rank, world):
    from ..attention import prepare

    N, K = config.num_heads, config.num_kv_heads
    G = N // K
    n_local = N // world
    n0, n1 = rank * n_local, (rank + 1) * n_local
    kv_heads = sorted({n // G for n in range(n0, n1)})  # the kv heads this rank's query heads read
    call = prepare(config, leaves, xs["query"], xs.get("key"), xs.get("value"), mask=others.get("mask"),
                   bias=others.get("bias"), dropout_mask=others.get("dropout_mask"),
                   is_causal=bool(options.get("is_causal", False)),
                   causal_alignment=options.get("causal_alignment", "top_left"),
                   training=bool(options.get("training", False)), seed=options.get("seed"),
                   return_weights=bool(options.get("return_weights", False)), dtype=dtype,
                   positions=others.get("positions"), key_positions=others.get("key_positions"),
                   past_key=xs.get("past_key"), past_value=xs.get("past_value"),
                   segment_ids=others.get("segment_ids"), key_segment_ids=others.get("key_segment_ids"),
                   return_cache=bool(options.get("return_cache", False)), materializes_scores=False)
    p = call.params
    heads = torch.arange(n0, n1)
    kvh = torch.tensor(kv_heads)

    def cols(name, index):  # a kernel (D, heads, width) or bias (heads, width): these heads
        if name not in p:
            return None
        t = p[name]
        return t.index_select(1 if name.endswith("kernel") else 0, index)

    q = F.project(call.query, cols("query.kernel", heads), cols("query.bias", heads))  # (B, T, n_local*H)
    k = F.project(call.key, cols("key.kernel", kvh), cols("key.bias", kvh))  # (B, S, k_local*H)
    v = F.project(call.value, cols("value.kernel", kvh), cols("value.bias", kvh))  # (B, S, k_local*V)
    if config.qk_norm is not None and config.qk_norm.scope == "all":
        # kv head h is counted by the first rank that holds it (a replicated head is summed once)
        owned = [i for i, h in enumerate(kv_heads) if (h * G) // n_local == rank]
        q, k = _norm_all(config, p, q, k, heads, kvh, owned, dtype)
    elif config.qk_norm is not None:  # scope "head": per head, scale (H,) shared by the heads
        nq = config.qk_norm
        q = F.norm(q, p["query.norm.scale"], p.get("query.norm.bias"), nq.type, nq.eps, n_local, nq.scope)
        k = F.norm(k, p["key.norm.scale"], p.get("key.norm.bias"), nq.type, nq.eps, len(kv_heads), nq.scope)
    q, k, v = F.split_heads(q, n_local), F.split_heads(k, len(kv_heads)), F.split_heads(v, len(kv_heads))
    if config.rope is not None:

        inv_freq, factor = rope_tables(config.rope)
        R, inter = config.rope.rotary_dim, config.rope.interleaved
        q = F.rope(q, F.rope_angles(call.positions, inv_freq, dtype), R, inter, factor)  # (B, n_local, T, H)
        k = F.rope(k, F.rope_angles(call.key_positions, inv_freq, dtype), R, inter, factor)
    if call.past_key is not None:
        k = torch.cat([call.past_key.index_select(1, kvh), k], dim=2)  # (B, k_local, P+S, H)
        v = torch.cat([call.past_value.index_select(1, kvh), v], dim=2)
    present = (k, v)
    # Query head n reads kv head n // G; where this rank's heads do not form whole groups of its kv heads
    # (K < n without K dividing n), each query head gets its own copy of its kv head.
    reads = [n // G - kv_heads[0] for n in range(n0, n1)]
    groups = n_local // len(kv_heads) if n_local % len(kv_heads) == 0 else 0
    if not groups or reads != [i // groups for i in range(n_local)]:
        index = torch.tensor(reads)
        k, v = k.index_select(1, index), v.index_select(1, index)  # (B, n_local, S_total, H)

    def local(t):  # a rank-4 (B|1, N|1, T|1, S|1) mask / bias / keep: these heads
        return t if t is None or t.shape[1] == 1 else t.index_select(1, heads)

    x = F.logits(q, k, config.effective_scale)  # (B, n_local, T, S_total)
    if config.logit_softcap is not None:
        x = F.softcap(x, config.logit_softcap)
    x = F.mask_stage(x, local(call.allowed), local(call.bias4))
    w = F.softmax(x, config.masked_row, None if "sinks" not in p else p["sinks"].index_select(0, heads))
    ctx = F.merge_heads(F.attend(F.dropout(w, local(call.keep), config.dropout), v))  # (B, T, n_local*V)
    ct = compute_dtype(dtype)
    kernel = p["output.kernel"].index_select(0, heads)  # (n_local, V, O): row-parallel
    partial = torch.einsum(F.OUTPUT, ctx.to(ct), kernel.reshape(-1, kernel.shape[-1]).to(ct))  # (B, T, O)
    total = _AllReduceSum.apply(partial)  # the heads' partial outputs summed once, in the compute dtype
    if "output.bias" in p:
        total = total + p["output.bias"].to(ct)  # once, after the sum
    out = total.to(dtype)
    piece = {"output": out.detach(), "kv_heads": kv_heads}
    if options.get("return_weights"):
        piece["weights"] = w.detach()
    if options.get("return_cache"):
        piece["present_key"], piece["present_value"] = (t.detach() for t in present)
    return piece, out

