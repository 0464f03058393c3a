"""A hand-written port of DeepSeek V4's attention (config.compressed), and the bugs a port of transformers'
deepseek_v4 makes in it. `port(config, tensors, x, bug=None)` -> output (B, T, O), a causal prefill from
position 0; with bug=None it reproduces impl_numpy.compressed (tests/test_compressed_v4.py), so a caught
mutant is caught because of its bug.

Written independently of impl_numpy/compressed.py: one query at a time, from its own prefix of tokens (the
entries of the windows that closed within tokens 0..t, computed afresh: no cache, no visibility mask), the
top-k by a Python sort, RoPE through complex numbers.
"""

from __future__ import annotations

import numpy as np

from weights.rope import rope_tables

MUTANTS = {
    "sinks_dropped": "the per-head sink left out of the softmax",
    "entries_one_token_early": "an entry visible to the query before its window's last token (w < (t + 2) // m)",
    "hca_gate_mean": "HCA's softmax gate over the window replaced by a plain mean of its tokens",
    "csa_overlap_dropped": "CSA's entry pooled over its own window's m slots only (the previous half dropped)",
    "derotation_missing": "the context's rotary features not turned back by the query's position",
    "window_one_too_wide": "the sliding window one key too wide (W + 1 keys)",
    "query_norm_missing": "the weightless RMS norm of each query head (after q_b) left out",
    "derotation_plus_t": "the context's rotary features turned by +t instead of back by -t",
    "entry_positions_one_window_late": "an entry turned by RoPE at its window's end (w + 1) m, not its start w m",
    "entries_one_token_late": "an entry visible one token after its window's last token (w < t // m)",
    "yarn_dropped": "the compress table's YaRN left out (csa / hca turned by plain frequencies: the wrong table)",
    "yarn_attention_factor_applied": "YaRN's attention factor 0.1 ln(factor) + 1 applied (V4 forces 1)",
    "indexer_pairing_swapped": "the indexer's RoPE pairs half-split (i, i + R/2) instead of interleaved",
    "decode_drops_buffer": "a decode step that closes a window pools only the new token, not the open window's "
                           "buffered ones (the rows from DECODE_FROM on: a prefill of DECODE_FROM, then one at a time)",
    "topk_lowest": "csa's top-k keeps the lowest index scores (an ascending sort where a descending one was meant)",
    "topk_one_rank_late": "csa's top-k keeps ranks 2 .. k + 1 (the best entry skipped: a slice off by one)",
}
DECODE_FROM = 13  # decode_drops_buffer: the tokens before came in one prefill call


def _rms(x, scale, eps):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if scale is None else y * scale


def _turn(v, position, config, bug=None, half_split=False):
    """Interleaved RoPE on v's last rotary_dim features at one position, through complex numbers."""
    inv_freq, factor = rope_tables(config.rope)
    R = config.rope.rotary_dim
    scaling = config.rope.scaling
    if bug == "yarn_dropped" and scaling is not None:
        inv_freq = config.rope.theta ** (-np.arange(0, R, 2) / R)
    if bug == "yarn_attention_factor_applied" and scaling is not None:
        factor = 0.1 * np.log(scaling.factor) + 1
    head, tail = v[..., :-R], v[..., -R:]
    if half_split:
        z = (tail[..., :R // 2] + 1j * tail[..., R // 2:]) * np.exp(1j * position * inv_freq) * factor
        return np.concatenate([head, z.real, z.imag], -1)
    z = (tail[..., 0::2] + 1j * tail[..., 1::2]) * np.exp(1j * position * inv_freq) * factor
    return np.concatenate([head, np.stack([z.real, z.imag], -1).reshape(tail.shape)], -1)


def _entries(config, p, prefix, xs, bug):
    """The entries of every window closed within xs (L, D), one at a time."""
    c = config.compressed
    m, width = c.ratio, p[f"{prefix}.norm.scale"].shape[0]
    kv, gate = xs @ p[f"{prefix}.kernel"], xs @ p[f"{prefix}.gate.kernel"]
    out = []
    for w in range(len(xs) // m):
        rows, bias = slice(w * m, w * m + m), p[f"{prefix}.position_bias"]
        if bug == "decode_drops_buffer" and w * m + m - 1 >= DECODE_FROM:  # closed by a one-token call: its last
            rows, bias = slice(w * m + m - 1, w * m + m), bias[-1:]  # token alone (the buffered ones are lost)
        if c.overlap:
            slot_kv = [kv[rows, width:]]
            slot_gate = [gate[rows, width:] + bias[:, width:]]
            if w > 0 and bug != "csa_overlap_dropped":
                before = slice(w * m - m, w * m)
                slot_kv.insert(0, kv[before, :width])
                slot_gate.insert(0, gate[before, :width] + p[f"{prefix}.position_bias"][:, :width])
            slot_kv, slot_gate = np.concatenate(slot_kv), np.concatenate(slot_gate)
        else:
            slot_kv, slot_gate = kv[rows], gate[rows] + bias
        if bug == "hca_gate_mean" and c.kind == "hca":
            pooled = slot_kv.mean(0)
        else:
            e = np.exp(slot_gate - slot_gate.max(0))
            pooled = (e / e.sum(0) * slot_kv).sum(0)
        start = (w + 1) * m if bug == "entry_positions_one_window_late" else w * m
        half = bug == "indexer_pairing_swapped" and prefix.startswith("indexer")
        out.append(_turn(_rms(pooled, p[f"{prefix}.norm.scale"], c.eps), start, config, bug, half))
    return np.array(out).reshape(-1, width)


def port(config, tensors, x, bug=None, *, return_selection=False, ties="earlier"):
    """-> output (B, T, O); with return_selection also csa's selection (B, T, k) in the contract's format: the
    kept entries, best first, -1 after (k = min(index_topk, the call's entries); sliding / hca: (B, T, 0)).
    ties: which of equal index scores csa's top-k keeps, "earlier" (the spec's) or "later" (not a bug under
    the top-k rule: a port whose top-k orders equal values otherwise, as torch.topk may)."""
    c, p = config.compressed, tensors
    N, H = config.num_heads, config.head_dim
    B, T, _ = x.shape
    W = config.window_left + 1 + (bug == "window_one_too_wide")
    out = np.zeros((B, T, config.out_dim))
    width = min(c.index_topk, T // c.ratio) if c.kind == "csa" else 0
    selection = np.full((B, T, width), -1, dtype=np.int64)
    for b in range(B):
        q_lat = _rms(x[b] @ p["query.down.kernel"], p["query.down.norm.scale"], c.eps)  # (T, Qr)
        keys = np.array([_turn(_rms(x[b, s] @ p["key.kernel"][:, 0], p["key.norm.scale"], c.eps), s, config, bug)
                         for s in range(T)])  # (T, H)
        for t in range(T):
            q = np.einsum("r,rnh->nh", q_lat[t], p["query.kernel"])
            if bug != "query_norm_missing":
                q = _rms(q, None, c.eps)
            q = _turn(q, t, config, bug)
            seen = keys[max(0, t - W + 1):t + 1]
            if c.kind != "sliding":
                prefix_len = t + 1 + {"entries_one_token_early": 1, "entries_one_token_late": -1}.get(bug, 0)
                entries = _entries(config, p, "compressor", x[b, :prefix_len], bug)
                if c.kind == "csa" and len(entries):
                    index = _entries(config, p, "indexer.compressor", x[b, :prefix_len], bug)
                    iq = _turn(np.einsum("r,rij->ij", q_lat[t], p["indexer.query.kernel"]), t, config, bug,
                               bug == "indexer_pairing_swapped")
                    w = x[b, t] @ p["indexer.weights.kernel"] * c.index_heads ** -0.5
                    score = (np.maximum(iq @ index.T, 0) * c.index_head_dim ** -0.5 * w[:, None]).sum(0)
                    ranked = sorted(range(len(entries)), key=lambda e: (-score[e], e if ties == "earlier" else -e))
                    if bug == "topk_lowest":
                        ranked = sorted(range(len(entries)), key=lambda e: (score[e], e))
                    kept = ranked[1:c.index_topk + 1] if bug == "topk_one_rank_late" else ranked[:c.index_topk]
                    selection[b, t, :len(kept)] = kept
                    entries = entries[sorted(kept)]
                seen = np.concatenate([seen, entries])
            logits = q @ seen.T * config.effective_scale  # (N, S)
            sink = p["sinks"][:, None] if "sinks" in p and bug != "sinks_dropped" else np.full((N, 1), -np.inf)
            top = np.maximum(logits.max(-1, keepdims=True), sink)
            e, s = np.exp(logits - top), np.exp(sink - top)
            ctx = (e / (e.sum(-1, keepdims=True) + s)) @ seen  # (N, H)
            if bug != "derotation_missing":
                ctx = _turn(ctx, t if bug == "derotation_plus_t" else -t, config, bug)
            G = c.output_groups
            grouped = np.einsum("gf,gfr->gr", ctx.reshape(G, N * H // G), p["output.group.kernel"])
            out[b, t] = grouped.reshape(-1) @ p["output.kernel"]
    return (out, selection) if return_selection else out
