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
"""

from __future__ import annotations

import functools
import math

import numpy as np

from impl_numpy.compressed import check_compressed_call
from weights import AttentionConfig, validate_tensors
from weights.call import record
from weights.rope import rope_tables

from . import backend as bk
from . import functional as F
from ._keras import BACKEND, keras

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


def compress(config, params, prefix: str, x, p0: int, past, rec):
    c = config.compressed
    m, cache = c.ratio, "index_" if prefix.startswith("indexer") else ""
    width = params[f"{prefix}.norm.scale"].shape[0]
    B, dtype = x.shape[0], F.dtype_name(x)
    ct = _ct(x)
    kv = rec(f"{prefix}.project", matmul(x, params[f"{prefix}.kernel"]))
    gate = rec(f"{prefix}.gate", matmul(x, params[f"{prefix}.gate.kernel"]))
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


def compressed_attention(config: AttentionConfig, tensors, x, positions, past=None, *, return_cache: bool = False,
                         return_selection: bool = False, trace: list | None = None, jit: dict | None = None,
                         in_place: bool = False):
    """impl_numpy.compressed.compressed_attention in keras.ops. jit: on Keras's jax backend, XLA compiler options
    ({}: XLA's own) to run the layer with as one jax.jit program (not with trace); None, other backends and a
    trace: eagerly."""
    if in_place:  # docs/spec-frontier.md, "The in-place cache"
        raise ValueError("in_place must be False in the Keras mirror of DeepSeek V4's layer (keras.ops cannot write "
                         "into a caller's tensor on its three backends: ops.slice_update returns a new one, the copy "
                         "the in-place cache avoids; numpy, torch, jax and mlx have it): got True")
    validate_tensors(config, {k: np.asarray(ops.convert_to_numpy(v)) if ops.is_tensor(v) else np.asarray(v)
                              for k, v in tensors.items()})  # names, shapes, one dtype, finite
    x = x if ops.is_tensor(x) else bk.to_tensor(np.asarray(x))
    dtype = F.dtype_name(x)
    p0 = check_compressed_call(config, x, np.asarray(positions), past)
    p = {k: ops.cast(bk.to_tensor(np.asarray(v)) if not ops.is_tensor(v) else v, dtype) for k, v in tensors.items()}
    if jit is not None and trace is None and BACKEND == "jax":  # one compiled program (eager jax compiles every op per shape)
        import jax

        run = jax.jit(functools.partial(layer, config, p0=p0, return_cache=return_cache,
                                        return_selection=return_selection), compiler_options=jit or None)
        return run(p, x, past)
    return layer(config, p, x, past, p0=p0, return_cache=return_cache, return_selection=return_selection,
                 trace=trace)


def layer(config: AttentionConfig, p, x, past, *, p0: int, return_cache: bool, return_selection: bool,
          trace: list | None = None):
    """compressed_attention's computation on checked tensors (jax.jit-able on Keras's jax backend: shapes and p0
    decide every branch)."""
    B, T, _ = x.shape
    positions_np = np.arange(p0, p0 + T)
    positions = bk.to_tensor(positions_np)
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    c, N, H = config.compressed, config.num_heads, config.head_dim
    W = config.window_left + 1
    dtype, ct = F.dtype_name(x), _ct(x)
    q_latent = rec("query.down", rms(matmul(x, p["query.down.kernel"]), p["query.down.norm.scale"], c.eps))
    q = rec("query", ops.cast(bk.einsum("btr,rnh->bnth", ops.cast(q_latent, ct), ops.cast(p["query.kernel"], ct)),
                              dtype))
    q = rec("query.norm", rms(q, None, c.eps))
    q = rec("query.rope", turn(q, positions, config))
    k = rec("key", rms(matmul(x, p["key.kernel"][:, 0]), p["key.norm.scale"], c.eps)[:, None])
    k = rec("key.rope", turn(k, positions, config))
    keys = k if past is None else ops.concatenate([past["key"], k], axis=2)
    key_pos = np.arange(p0 + T - keys.shape[2], p0 + T)
    in_window = (key_pos[None] <= positions_np[:, None]) & (key_pos[None] > positions_np[:, None] - W)  # NumPy
    present = {"key": keys[:, :, max(keys.shape[2] - (W - 1), 0):] if W > 1 else keys[:, :, :0]}
    selection = None
    allowed = bk.to_tensor(np.broadcast_to(in_window[None], (B,) + in_window.shape).copy())
    if c.kind != "sliding":
        present.update(compress(config, p, "compressor", x, p0, past, rec))
        entries = present["entries"]
        E = entries.shape[1]
        visible_np = np.arange(E)[None] < ((positions_np + 1) // c.ratio)[:, None]
        visible = bk.to_tensor(visible_np)
        shown = bk.to_tensor(np.broadcast_to(visible_np[None], (B, T, E)).copy())
        if c.kind == "csa":
            present.update(compress(config, p, "indexer.compressor", x, p0, past, rec))
            selection = select(config, p, x, q_latent, positions, present["index_entries"], visible, rec)
            if selection.shape[-1]:  # (F.selection_mask takes a max over the k slots: none before an entry)
                shown = F.selection_mask(selection, 1, E)[:, 0]
        keys = ops.concatenate([keys, ops.broadcast_to(entries[:, None], (B, 1, E, H))], axis=2)
        allowed = ops.concatenate([allowed, shown], axis=2)
    logits = rec("logits", F.logits(q, keys, config.effective_scale))
    masked = rec("mask", F.mask(logits, allowed[:, None], None))
    w = rec("softmax", F.softmax(masked, config.masked_row, p.get("sinks")))
    ctx = rec("attend", F.attend(w, keys))
    ctx = rec("derotate", turn(ctx, bk.to_tensor(-positions_np), config))
    G = c.output_groups
    grouped = ops.reshape(ops.transpose(ctx, (0, 2, 1, 3)), (B, T, G, N * H // G))
    grouped = bk.einsum("btgf,gfr->btgr", ops.cast(grouped, ct), ops.cast(p["output.group.kernel"], ct))
    grouped = rec("output.group", ops.cast(grouped, dtype))
    out = rec("output", matmul(ops.reshape(grouped, (B, T, -1)), p["output.kernel"]))
    result = (out,) + ((selection,) if return_selection else ()) + ((present,) if return_cache else ())
    return result[0] if len(result) == 1 else result
