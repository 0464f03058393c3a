"""Hand-written vector-Jacobian product of DeepSeek V4's layer (config.compressed, impl_numpy/compressed.py).

    compressed_attention_vjp(config, tensors, x, positions, past=None, *, d_output, gradient_magnitudes=False)

returns (output, grads) or (output, grads, magnitudes): the gradient of sum(output * d_output) with respect to
the layer's input x ("query", the suite's name for it), every canonical tensor, and with a cache every
past_<name> (impl_numpy.compressed.cache_names). A module of its own beside compressed.py, as backward.py is
beside attention.py: compressed.py stays the forward's spec, read stage by stage by the mirrors.

The forward is compressed.py's, its pieces kept; the backward walks it in reverse, each block naming the stage
it undoes: output, output.group, derotate, attend, softmax (and sinks), mask, logits, the keys' split (window
keys | entries), key.rope, key (norm, projection), the compressor (rope, norm, pool, the gate's softmax over
the slots, the overlap's halves, position_bias, the open window's buffer, projections), query.rope,
query.norm, query, query.down. csa's indexer selects: its selection is a constant (a top-k is piecewise
constant; DeepSeek trains the indexer with a loss of its own), so every indexer.* tensor and the index_*
cache get zero gradients, as backward._fold gives the indexer's tensors of an ordinary layer. Checked
against central finite differences of compressed_attention in float64 (tests/test_compressed_v4_backward.py).

gradient_magnitudes=True also returns, per gradient element, the size of the terms it is summed from (as
backward.gradient_magnitudes does for the ordinary layer): the same pass on absolute values, every
difference in the backward turned into a sum, the nonlinear stages' factors (the norms' 1/rms and normalised
x, the softmax weights, cos and sin) the true forward's. The tolerance policy scales by it.

Computed in the tensors' dtype (the spec's float64; the mirrors' float32 is judged against float64). In 16 bits
(float16, bfloat16: the suite's same-dtype reference, compare._expected_compressed) by the precision rule of
compressed.py: the arithmetic in float32, the forward's stored stages rounded to the dtype where compressed.py
rounds them, and so is each stored value's cotangent and each gradient (an autodiff of the forward in 16 bits
rounds a cotangent where the forward reads a stored 16-bit value in float32).
"""

from __future__ import annotations

import numpy as np

from weights import compute_dtype, validate_tensors
from weights.rope import rope_tables

from . import functional as F
from .backward import _rope_join, _rope_pair, _sink_weight
from .compressed import check_compressed_call, compressed_attention, turn


class _Pass:
    """One pass (true or magnitude): the forward with its pieces kept, then the backward. In magnitude mode
    (mag) the tensors, x, the cache and d_output are absolute values, every difference a sum, and the norms'
    xhat and 1/rms, the softmaxes' weights and the rope's cos and sin the true pass's (true_kept)."""

    def __init__(self, config, p, x, past, positions, p0, selection, mag=False, true_kept=None, storage=None):
        self.config, self.c, self.mag = config, config.compressed, mag
        # s: a stored value's rounding to the storage dtype (16 bits), computed on in float32; else the identity
        self.s = (lambda a: a) if storage is None or mag else (lambda a: np.asarray(a).astype(storage).astype(
            np.float32))
        A = np.abs if mag else (lambda a: a)
        self.p = {name: A(t) for name, t in p.items()}
        self.x = A(x)
        self.past = None if past is None else {name: A(a) for name, a in past.items()}
        self.positions, self.p0, self.selection = positions, p0, selection
        self.kept = true_kept if mag else {}
        self.grads: dict[str, np.ndarray] = {}

    # -- the stages' pieces, both directions -------------------------------------------------------------------

    def rms(self, name, x, scale):
        """x / sqrt(mean(x^2) + eps) (times scale): the true pass keeps xhat and 1/rms under name."""
        if not self.mag:
            r = 1 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + self.c.eps)
            self.kept[name] = (x * r, r)
        xhat = np.abs(self.kept[name][0]) if self.mag else self.kept[name][0]
        return xhat if scale is None else xhat * scale

    def rms_back(self, name, dy, scale, scale_name=None):
        """y = xhat s, xhat = x r: ds = sum(dy xhat); dx = r (dxhat - xhat mean(dxhat xhat)), dxhat = dy s."""
        xhat, r = self.kept[name]
        xhat = np.abs(xhat) if self.mag else xhat
        dxhat = dy
        if scale is not None:
            self.grads[scale_name] = (dy * xhat).reshape(-1, scale.shape[0]).sum(axis=0)
            dxhat = dy * scale
        inner = xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
        return r * (dxhat + inner if self.mag else dxhat - inner)

    def turn(self, x, positions):
        """compressed.turn (interleaved RoPE on the last rotary_dim features); magnitude mode: |cos|, |sin|, every
        difference a sum. turn(x, -t) undoes turn(x, t) (cos even, sin odd, the attention factor on both: its
        VJP is the rotation's transpose, f R(-t)), so the backward of turn at t is turn at -t."""
        if not self.mag:
            return turn(x, positions, self.config)
        inv_freq, factor = rope_tables(self.config.rope)
        angles = F.rope_angles(np.asarray(positions)[None], inv_freq, x.dtype)
        c, s = np.abs(np.cos(angles) * factor), np.abs(np.sin(angles) * factor)
        R = self.config.rope.rotary_dim
        H = x.shape[-1]
        x1, x2 = _rope_pair(x[..., H - R:], R, True)
        return np.concatenate([x[..., :H - R], _rope_join(x1 * c + x2 * s, x2 * c + x1 * s, x[..., H:], True)], -1)

    def softmax_back(self, w, dw, axis):
        """y = softmax(z): dz = w (dw - sum(dw w)); returns (dz, sum(dw w))."""
        row = (dw * w).sum(axis=axis, keepdims=True)
        return w * (dw + row if self.mag else dw - row), row

    # -- the compressor ------------------------------------------------------------------------------------------

    def compress(self, prefix):
        """compressed.compress's forward with its pieces kept: the entries (old | new), (B, E, width)."""
        c, p, past, x = self.c, self.p, self.past, self.x
        m, cache = c.ratio, "index_" if prefix.startswith("indexer") else ""
        width = p[f"{prefix}.norm.scale"].shape[0]
        B = x.shape[0]
        s = self.s
        kv, gate = s(x @ p[f"{prefix}.kernel"]), s(x @ p[f"{prefix}.gate.kernel"])  # (B, T, c*width)
        buffered = 0 if past is None else past[f"{cache}window_kv"].shape[1]
        if past is not None:  # the open window's buffered tokens come first
            kv = np.concatenate([past[f"{cache}window_kv"], kv], axis=1)
            gate = np.concatenate([past[f"{cache}window_gate"], gate], axis=1)
        n = kv.shape[1] // m  # windows that close in this call
        win_kv = kv[:, :n * m].reshape(B, n, m, kv.shape[-1])
        win_gate = gate[:, :n * m].reshape(B, n, m, kv.shape[-1]) + p[f"{prefix}.position_bias"]
        from_past = False
        if c.overlap:
            from_past = past is not None and past[f"{cache}overlap_kv"].shape[1] > 0
            if from_past:
                prev_kv = past[f"{cache}overlap_kv"][:, None]  # (B, 1, m, width)
                prev_gate = past[f"{cache}overlap_gate"][:, None] + p[f"{prefix}.position_bias"][:, :width]
            else:  # window 0 has no previous window: its slots weigh 0
                prev_kv = np.zeros((B, 1, m, width), x.dtype)
                prev_gate = np.full((B, 1, m, width), -np.inf, x.dtype)
            before_kv = np.concatenate([prev_kv, win_kv[:, :-1, :, :width]], axis=1)[:, :n]
            before_gate = np.concatenate([prev_gate, win_gate[:, :-1, :, :width]], axis=1)[:, :n]
            slots_kv = np.concatenate([before_kv, win_kv[..., width:]], axis=2)  # (B, n, 2m, width)
            slots_gate = np.concatenate([before_gate, win_gate[..., width:]], axis=2)
        else:
            slots_kv, slots_gate = win_kv, win_gate
        if not self.mag:  # the gate's softmax per feature over the slots (-inf slots weigh exactly 0)
            top = slots_gate.max(axis=2, keepdims=True) if n else slots_gate
            e = np.exp(slots_gate - top)
            self.kept[f"{prefix}.weights"] = s(e / e.sum(axis=2, keepdims=True))  # (B, n, slots, width)
        weights = self.kept[f"{prefix}.weights"]
        pooled = s((weights * slots_kv).sum(axis=2))  # (B, n, width)
        normed = s(self.rms(f"{prefix}.norm", pooled, p[f"{prefix}.norm.scale"]))
        starts = self.p0 - (self.p0 % m) + m * np.arange(n)
        new = s(self.turn(normed[:, None], starts)[:, 0])  # (B, n, width)
        old = np.zeros((B, 0, width), x.dtype) if past is None else past[f"{cache}entries"]
        self.kept[f"{prefix}.pieces"] = dict(slots_kv=slots_kv, starts=starts, n=n, buffered=buffered,
                                             from_past=from_past, old=old.shape[1], width=width, cache=cache)
        return np.concatenate([old, new], axis=1)

    def compress_back(self, prefix, d_entries):
        """compress undone: d_entries (B, E, width) -> d x (B, T, D); grads of the compressor's tensors and the
        cache's entries, open window and overlap."""
        c, p, x = self.c, self.p, self.x
        k = self.kept[f"{prefix}.pieces"]
        m, n, width, cache, B = c.ratio, k["n"], k["width"], k["cache"], x.shape[0]
        g, s = self.grads, self.s
        if self.past is not None:
            g[f"past_{cache}entries"] = d_entries[:, :k["old"]]
        # rope at the windows' first positions
        d_normed = s(self.turn(d_entries[:, None, k["old"]:], -k["starts"])[:, 0])  # (B, n, width)
        d_pooled = s(self.rms_back(f"{prefix}.norm", d_normed, p[f"{prefix}.norm.scale"], f"{prefix}.norm.scale"))
        # pool: pooled = sum over slots of weights * slots_kv
        weights = self.kept[f"{prefix}.weights"]
        d_slots_kv = s(weights * d_pooled[:, :, None])  # (B, n, slots, width)
        d_weights = s(d_pooled[:, :, None] * k["slots_kv"])
        d_slots_gate, _ = self.softmax_back(weights, d_weights, axis=2)
        cw = p[f"{prefix}.kernel"].shape[1]
        d_win_kv = np.zeros((B, n, m, cw), x.dtype)
        d_win_gate = np.zeros((B, n, m, cw), x.dtype)
        if c.overlap:  # slots = [the previous window's first halves | this window's second halves]
            d_win_kv[..., width:] = d_slots_kv[:, :, m:]
            d_win_gate[..., width:] = d_slots_gate[:, :, m:]
            d_win_kv[:, :n - 1, :, :width] = d_slots_kv[:, 1:, :m]
            d_win_gate[:, :n - 1, :, :width] = d_slots_gate[:, 1:, :m]
            if k["from_past"] and n:  # window 0's first halves: the cache's overlap (and position_bias's first half)
                g[f"past_{cache}overlap_kv"] = d_slots_kv[:, 0, :m]
                g[f"past_{cache}overlap_gate"] = d_slots_gate[:, 0, :m]
            if self.past is not None and not (k["from_past"] and n):  # no window closes here: nothing reads it
                g[f"past_{cache}overlap_kv"] = np.zeros_like(self.past[f"{cache}overlap_kv"])
                g[f"past_{cache}overlap_gate"] = np.zeros_like(self.past[f"{cache}overlap_gate"])
        else:
            d_win_kv, d_win_gate = d_slots_kv, d_slots_gate
        d_bias = d_win_gate.sum(axis=(0, 1))  # (m, c*width): slot j's bias
        if c.overlap and k["from_past"] and n:
            d_bias[:, :width] = d_bias[:, :width] + d_slots_gate[:, 0, :m].sum(axis=0)
        g[f"{prefix}.position_bias"] = d_bias
        # the open window's rows (the present cache's buffer) feed nothing of the output
        total = k["buffered"] + x.shape[1]
        d_kv = np.zeros((B, total, cw), x.dtype)
        d_gate = np.zeros((B, total, cw), x.dtype)
        d_kv[:, :n * m] = d_win_kv.reshape(B, n * m, cw)
        d_gate[:, :n * m] = d_win_gate.reshape(B, n * m, cw)
        if self.past is not None:
            g[f"past_{cache}window_kv"], g[f"past_{cache}window_gate"] = (d[:, :k["buffered"]] for d in (d_kv, d_gate))
        d_kv, d_gate = d_kv[:, k["buffered"]:], s(d_gate[:, k["buffered"]:])  # (B, T, c*width)
        g[f"{prefix}.kernel"] = s(np.einsum("btd,btf->df", x, d_kv))
        g[f"{prefix}.gate.kernel"] = s(np.einsum("btd,btf->df", x, d_gate))
        return s(d_kv @ p[f"{prefix}.kernel"].T) + s(d_gate @ p[f"{prefix}.gate.kernel"].T)

    # -- the layer -----------------------------------------------------------------------------------------------

    def run(self, d_out):
        config, c, p, x, past, positions = self.config, self.c, self.p, self.x, self.past, self.positions
        N, H = config.num_heads, config.head_dim
        B, T, _ = x.shape
        scale = abs(config.effective_scale) if self.mag else config.effective_scale
        d_out = np.abs(d_out) if self.mag else d_out
        # forward, the pieces kept
        s = self.s
        qd = s(x @ p["query.down.kernel"])  # (B, T, Qr)
        q_latent = s(self.rms("query.down.norm", qd, p["query.down.norm.scale"]))
        q0 = s(np.einsum("btr,rnh->bnth", q_latent, p["query.kernel"]))  # (B, N, T, H)
        q = s(self.turn(s(self.rms("query.norm", q0, None)), positions))
        kp = s(x @ p["key.kernel"][:, 0])  # (B, T, H)
        k = s(self.turn(s(self.rms("key.norm", kp, p["key.norm.scale"]))[:, None], positions))  # (B, 1, T, H)
        keys = k if past is None else np.concatenate([past["key"], k], axis=2)  # (B, 1, Pw + T, H)
        Pw = keys.shape[2] - T
        key_pos = np.arange(self.p0 + T - keys.shape[2], self.p0 + T)
        W = config.window_left + 1
        allowed = (key_pos[None] <= positions[:, None]) & (key_pos[None] > positions[:, None] - W)  # (T, Pw + T)
        allowed = np.broadcast_to(allowed[None], (B, T, keys.shape[2]))
        E = 0
        if c.kind != "sliding":
            entries = self.compress("compressor")  # (B, E, H)
            E = entries.shape[1]
            visible = np.arange(E)[None] < ((positions + 1) // c.ratio)[:, None]  # (T, E)
            shown = np.broadcast_to(visible[None], (B, T, E))
            if c.kind == "csa":  # the reference's selection, a constant
                shown = F.selection_mask(self.selection, 1, E)[:, 0]
            keys = np.concatenate([keys, np.broadcast_to(entries[:, None], (B, 1, E, H))], axis=2)
            allowed = np.concatenate([allowed, shown], axis=2)
        if not self.mag:
            logits = s(F.logits(q, keys, scale))
            masked = F.mask_stage(logits, allowed[:, None], None)
            self.kept["softmax"] = s(F.softmax(masked, config.masked_row, p.get("sinks")))  # (B, N, T, S)
            self.kept["sink"] = _sink_weight(masked, p["sinks"]) if "sinks" in p else None  # (B, N, T, 1)
            self.kept["allowed"] = allowed
        w = self.kept["softmax"]
        ctx = s(self.turn(s(F.attend(w, keys)), -positions))  # (B, N, T, H): derotate
        G = c.output_groups
        grouped = ctx.transpose(0, 2, 1, 3).reshape(B, T, G, N * H // G)
        og = s(np.einsum("btgf,gfr->btgr", grouped, p["output.group.kernel"]))  # (B, T, G, R)
        out = s(og.reshape(B, T, -1) @ p["output.kernel"])  # (B, T, O)

        g = self.grads
        # output: out = og @ Wo
        g["output.kernel"] = s(np.einsum("btf,bto->fo", og.reshape(B, T, -1), d_out))
        d_og = s(d_out @ p["output.kernel"].T).reshape(og.shape)
        # output.group: og[g] = grouped[g] @ Wog[g]
        g["output.group.kernel"] = s(np.einsum("btgf,btgr->gfr", grouped, d_og))
        d_grouped = s(np.einsum("btgr,gfr->btgf", d_og, p["output.group.kernel"]))
        d_ctx = d_grouped.reshape(B, T, N, H).transpose(0, 2, 1, 3)  # (B, N, T, H)
        # derotate: turned back by -t, so its VJP turns by +t
        d_ctx = s(self.turn(d_ctx, positions))
        # attend: ctx = w @ keys (the keys are the values; one kv head for all N)
        d_w = s(np.einsum("bnth,bsh->bnts", d_ctx, keys[:, 0]))
        d_keys = s(np.einsum("bnts,bnth->bsh", w, d_ctx))  # (B, S, H)
        # softmax (and sinks): d logit = w (dw - sum(dw w)); the sink, one more logit attending to nothing:
        # d sink = -sum over rows of w_sink sum(dw w)
        d_logits, row = self.softmax_back(w, d_w, axis=-1)
        if "sinks" in p:
            d_sink = self.kept["sink"] * row
            g["sinks"] = s((d_sink if self.mag else -d_sink).sum(axis=(0, 2, 3)))
        # mask: a hidden key's logit is -inf, read by nothing
        d_logits = s(np.where(self.kept["allowed"][:, None], d_logits, 0))
        # logits: scale q . keys
        d_q = s(scale * np.einsum("bnts,bsh->bnth", d_logits, keys[:, 0]))
        d_keys = s(d_keys + s(scale * np.einsum("bnts,bnth->bsh", d_logits, q)))
        # the keys' split: the window's keys (the cache's, then this call's), then the entries
        d_x = np.zeros_like(x)
        if E:
            d_x = d_x + self.compress_back("compressor", d_keys[:, Pw + T:])
        if past is not None:
            g["past_key"] = d_keys[:, None, :Pw]
        d_k = s(self.turn(d_keys[:, None, Pw:Pw + T], -positions)[:, 0])  # key.rope undone (B, T, H)
        d_kp = s(self.rms_back("key.norm", d_k, p["key.norm.scale"], "key.norm.scale"))
        g["key.kernel"] = s(np.einsum("btd,bth->dh", x, d_kp)[:, None])  # (D, 1, H)
        d_x = s(d_x + s(d_kp @ p["key.kernel"][:, 0].T))
        # query: rope, the weightless norm per head, the up-projection, the latent's norm, the down-projection
        d_q0 = s(self.rms_back("query.norm", s(self.turn(d_q, -positions)), None))  # (B, N, T, H)
        g["query.kernel"] = s(np.einsum("btr,bnth->rnh", q_latent, d_q0))
        d_latent = s(np.einsum("bnth,rnh->btr", d_q0, p["query.kernel"]))
        d_qd = s(self.rms_back("query.down.norm", d_latent, p["query.down.norm.scale"], "query.down.norm.scale"))
        g["query.down.kernel"] = s(np.einsum("btd,btr->dr", x, d_qd))
        g["query"] = s(d_x + s(d_qd @ p["query.down.kernel"].T))
        return out


def compressed_attention_vjp(config, tensors: dict[str, np.ndarray], x, positions, past=None, *, d_output,
                             gradient_magnitudes: bool = False, output_magnitude: bool = False, topk_indices=None):
    """(output, grads[, magnitudes[, output_magnitude]]) of compressed_attention at (x, positions, past) for the
    cotangent d_output (B, T, O). grads: "query" (the layer's input x), every canonical tensor (the indexer's
    zero: its selection is a constant), and with a cache past_<name> for every name of it (the index_* cache's
    zero). output_magnitude (with gradient_magnitudes): also the magnitude pass's forward output (B, T, O), each
    output element's term magnitude (every product of absolute values, the true pass's softmax weights, norms
    and rotations), the elementwise floor the tolerance policy gives every other layer's output (a rank-1
    output projection cancels: random_compressed_case(1403362), |output| 0.0069 of terms 1.05). topk_indices:
    csa's selection given (compressed_attention's), else the forward's own. Everything in the tensors' dtype."""
    dtype = validate_tensors(config, tensors)
    x = np.asarray(x)
    p0 = check_compressed_call(config, x, positions, past)
    x = x.astype(dtype, copy=False)
    past = None if past is None else {name: np.asarray(a).astype(dtype, copy=False) for name, a in past.items()}
    d_out = np.asarray(d_output).astype(dtype, copy=False)
    ct = compute_dtype(dtype)  # 16 bits: the pass in float32, stored values rounded to dtype (_Pass.s)
    storage = dtype if ct != dtype else None
    B, T = x.shape[:2]
    if d_out.shape != (B, T, config.out_dim):
        raise ValueError(f"d_output must have shape (B, T, O) = {(B, T, config.out_dim)}: got {d_out.shape}")
    selection = None
    if config.compressed.kind == "csa":  # the forward's own selection: a constant of the backward
        _, selection = compressed_attention(config, tensors, x, positions, past, return_selection=True,
                                            topk_indices=topk_indices)
    positions = np.arange(p0, p0 + T)
    p = {name: np.asarray(t).astype(dtype, copy=False).astype(ct, copy=False) for name, t in tensors.items()}
    x, d_out = x.astype(ct, copy=False), d_out.astype(ct, copy=False)
    past = None if past is None else {name: a.astype(ct, copy=False) for name, a in past.items()}
    true = _Pass(config, p, x, past, positions, p0, selection, storage=storage)
    out = true.run(d_out).astype(dtype, copy=False)
    grads = _ordered(config, true.grads, past, dtype)
    if not gradient_magnitudes:
        return out, grads
    mag = _Pass(config, p, x, past, positions, p0, selection, mag=True, true_kept=true.kept)
    out_mag = mag.run(d_out)
    magnitudes = _ordered(config, mag.grads, past, dtype)
    return (out, grads, magnitudes, out_mag) if output_magnitude else (out, grads, magnitudes)


def _ordered(config, raw: dict, past, dtype) -> dict[str, np.ndarray]:
    """query, every canonical tensor in the contract's order (the indexer's zero), then the cache's."""
    grads = {"query": raw["query"]}
    grads.update({name: raw[name] if name in raw else np.zeros(shape, dtype)
                  for name, shape in config.tensor_shapes().items()})
    if past is not None:
        grads.update({f"past_{name}": raw.get(f"past_{name}", np.zeros_like(a)) for name, a in past.items()})
    return {name: np.asarray(g).astype(dtype, copy=False).reshape(
        config.tensor_shapes().get(name, np.shape(g))) for name, g in grads.items()}
