"""DeepSeek V4's attention layer (issue 41): the executable spec of config.compressed.

docs/spec-frontier.md#deepseek-v4 states each stage and the decisions on what transformers' deepseek_v4 leaves
ill-defined; this module is its executable form, stage by stage with trace names. One call:

    compressed_attention(config, tensors, x, positions, past=None, return_cache=False, ...)

x (B, T, D): the layer's input (hidden states). positions (T,) int: the call's absolute positions, which must be
p0, p0 + 1, ..., p0 + T - 1 with p0 the number of tokens before the call (a cache of W - 1 keys no longer says
it): p0 = 0 without a cache, and with one the cache must hold exactly what p0 tokens leave (cache_shapes).

The cache (past / present, a dict of arrays, names in cache_names(config); a call returns present_<name> for
past_<name> of the next): `key` (B, 1, min(p, W - 1), H): the last W - 1 keys after norm and RoPE, read as
key and as value; and for csa / hca: `entries` (B, p // m, H): the entries emitted so far; `window_kv` and
`window_gate` (B, p % m, cH): the open window's projections and raw gates (c = 2 with overlap, else 1);
with overlap `overlap_kv` and `overlap_gate` (B, m or 0, H): the last closed window's first-half
projections and raw gates (0 rows before a window has closed); csa repeats them with the prefix `index_` for
its indexer's compressor (width J). Every array in the tensors' dtype (float64 is the spec's). With in_place=True
the cache is the caller's buffers instead (buffer_shapes: a ring of W - 1 keys, the entries with room, the open
windows by slot), written by the call and returned as the present cache (docs/spec-frontier.md, "The in-place
cache").

16 bits (float16, bfloat16) follow the project's precision rule (functional.py): every stage's result is stored in
the storage dtype, its arithmetic (products and their sums, the norms' mean and root, the gates' softmax, the
pool, RoPE) runs in the compute dtype, float32. Rounded to storage: each projection (x @ kernel, the query's and
the indexer's up-projections, output.group, output), each norm's result, the compressor's gate weights, its pool
and its entries, RoPE's result, the index weights, the logits, the softmax's weights, the context; not rounded:
the gate plus its position bias (inside the gates' softmax) and the index scores (compute dtype, as
impl_numpy.indexer's). In float32 and float64 the compute dtype is the dtype: every rounding is the identity.
"""

from __future__ import annotations

import numpy as np

from weights import AttentionConfig, compute_dtype, validate_tensors
from weights.call import record
from weights.config import COMPRESSED_CACHE
from weights.contract import check_chunk_size
from weights.dtypes import is_float
from weights.rope import rope_tables

from . import functional as F
from .chunked import QUERY_ROWS, KeyParts


def cache_names(config: AttentionConfig) -> list[str]:
    """The cache's names for this layer (past_<name> in, present_<name> out)."""
    c = config.compressed
    if c.kind == "sliding":
        return ["key"]
    own = [n for n in COMPRESSED_CACHE if c.overlap or not n.startswith("overlap")]
    return ["key", *own, *([f"index_{n}" for n in own] if c.kind == "csa" else [])]


def cache_shapes(config: AttentionConfig, batch: int, p: int) -> dict[str, tuple[int, ...]]:
    """What the cache holds after p tokens: name -> shape."""
    c, H, W = config.compressed, config.head_dim, config.window_left + 1
    shapes = {"key": (batch, 1, min(p, W - 1), H)}
    if c.kind == "sliding":
        return shapes
    m = c.ratio
    for prefix, width in [("", H)] + ([("index_", c.index_head_dim)] if c.kind == "csa" else []):
        shapes[f"{prefix}entries"] = (batch, p // m, width)
        shapes[f"{prefix}window_kv"] = shapes[f"{prefix}window_gate"] = (batch, p % m, c.slots * width)
        if c.overlap:
            shapes[f"{prefix}overlap_kv"] = shapes[f"{prefix}overlap_gate"] = (batch, m if p >= m else 0, width)
    return shapes


def check_compressed_call(config: AttentionConfig, x: np.ndarray, positions, past) -> int:
    """Validate a call; returns p0. ValueError names the argument and the value received."""
    p0 = _check_x_positions(config, x, positions)
    if past is None:
        if p0 != 0:
            raise ValueError(f"positions must start at 0 without a cache (the entries and the open window of the "
                             f"p0 tokens before are unknown, and windows are aligned to position 0): got p0={p0}")
        return p0
    expected = cache_shapes(config, x.shape[0], p0)
    given = {name: None if past.get(name) is None else tuple(past[name].shape) for name in expected}
    unknown = sorted(set(past) - set(expected))
    if unknown or any(given[n] != expected[n] for n in expected):
        bad = "; ".join([f"{n} unknown" for n in unknown] + [f"{n} {given[n]}, expected {expected[n]}"
                                                            for n in expected if given[n] != expected[n]])
        raise ValueError(f"past must hold the cache of the p0={p0} tokens before the call (cache_shapes): got {bad}")
    return p0


# --- the in-place cache (docs/spec-frontier.md, "The in-place cache") ----------------------------------------------


def buffer_shapes(config: AttentionConfig, batch: int, capacity: int) -> dict[str, tuple[int, ...]]:
    """The in-place cache's buffers for up to `capacity` tokens: name -> shape. `key` (B, 1, min(W - 1, capacity),
    H) a ring (the key at position t in slot t % (W - 1); a capacity below the window never wraps); `entries` (B, capacity // m, H) (entry w in row w); `window_kv`
    / `window_gate` (B, m, cH) (token t of the open window in slot t % m); `overlap_kv` / `overlap_gate`
    (B, m, H) (the last closed window's first halves, valid once a window has closed); csa's `index_` the
    same at J. Only the entries grow with the capacity."""
    c, H, W = config.compressed, config.head_dim, config.window_left + 1
    shapes = {"key": (batch, 1, min(W - 1, capacity), H)}
    if c.kind == "sliding":
        return shapes
    m = c.ratio
    for prefix, width in [("", H)] + ([("index_", c.index_head_dim)] if c.kind == "csa" else []):
        shapes[f"{prefix}entries"] = (batch, capacity // m, width)
        shapes[f"{prefix}window_kv"] = shapes[f"{prefix}window_gate"] = (batch, m, c.slots * width)
        if c.overlap:
            shapes[f"{prefix}overlap_kv"] = shapes[f"{prefix}overlap_gate"] = (batch, m, width)
    return shapes


def check_in_place_call(config: AttentionConfig, x, positions, buffers) -> int:
    """Validate an in-place call's shapes (check_compressed_call's checks of x and positions, then the buffers
    against buffer_shapes, the entries' rows at least the count after the call); returns p0. The backend checks
    what it can write (its own types, dtype, writeable). ValueError names the argument and the value received."""
    p0 = _check_x_positions(config, x, positions)
    if not isinstance(buffers, dict):
        raise ValueError(f"past with in_place must be the dict of buffers (buffer_shapes) the call writes: got "
                         f"{type(buffers).__name__}")
    B, T, m = x.shape[0], x.shape[1], getattr(config.compressed, "ratio", None)
    W = config.window_left + 1
    expected = buffer_shapes(config, B, W - 1 + T)  # every shape but the entries' rows and a short ring's
    unknown, missing = sorted(set(buffers) - set(expected)), sorted(set(expected) - set(buffers))
    if unknown or missing:
        raise ValueError(f"past with in_place must hold exactly the buffers {sorted(expected)}: got "
                         f"{'unknown ' + ', '.join(unknown) if unknown else ''}"
                         f"{'; ' if unknown and missing else ''}{'missing ' + ', '.join(missing) if missing else ''}")
    for name, shape in expected.items():
        got = tuple(getattr(buffers[name], "shape", ()))  # (not np.shape: it would convert a framework's array)
        if name.endswith("entries"):
            need = (p0 + T) // m
            if len(got) != 3 or got[0] != shape[0] or got[2] != shape[2] or got[1] < need:
                raise ValueError(f"past[{name!r}] with in_place must have shape ({shape[0]}, >= {need}, {shape[2]}) "
                                 f"(room for the (p0 + T) // m = ({p0} + {T}) // {m} entries after the call): got "
                                 f"{got}")
        elif name == "key" and len(got) == 4 and got[:2] + got[3:] == shape[:2] + shape[3:] and p0 + T <= got[2] < W - 1:
            continue  # a ring shorter than the window: the buffers' capacity is below it, and it never wraps
        elif got != shape:
            short = (f", or ({shape[0]}, 1, L, {shape[3]}) with p0 + T = {p0 + T} <= L < W - 1 = {W - 1} (a "
                     f"capacity below the window)" if name == "key" and p0 + T < W - 1 else "")
            raise ValueError(f"past[{name!r}] with in_place must have shape {shape} (buffer_shapes){short}: got {got}")
    return p0


def _check_x_positions(config: AttentionConfig, x, positions) -> int:
    """The layer, x and positions of a call; returns p0."""
    if config.compressed is None:
        raise ValueError("config.compressed must be set for compressed_attention (a DeepSeek V4 layer): got null")
    if x.ndim != 3 or x.shape[-1] != config.query_dim:
        raise ValueError(f"x must have shape (B, T, {config.query_dim}): got {tuple(x.shape)}")
    positions = np.asarray(positions)
    if positions.shape != (x.shape[1],) or positions.dtype.kind not in "iu":
        raise ValueError(f"positions must be an integer array of shape (T,) = ({x.shape[1]},): got "
                         f"{positions.dtype} {positions.shape}")
    p0 = int(positions[0]) if positions.size else 0
    if positions.size and not np.array_equal(positions, np.arange(p0, p0 + positions.size)):
        raise ValueError(f"positions must be consecutive (p0, p0 + 1, ...: windows are aligned to position 0 and "
                         f"every token's projections enter one): got {positions.tolist()}")
    if p0 < 0:
        raise ValueError(f"positions must start at p0 >= 0 (the number of tokens before the call): got p0={p0}")
    return p0


def ring_positions(p: int, W: int) -> np.ndarray:
    """The positions the key ring's first min(p, W - 1) slots hold after p tokens (slot s: the latest t < p with
    t % (W - 1) == s)."""
    held = np.arange(min(p, W - 1))
    return held if p <= W - 1 or W == 1 else p - 1 - (p - 1 - held) % (W - 1)


def cache_buffers(config: AttentionConfig, batch: int, capacity: int, dtype=np.float64) -> dict[str, np.ndarray]:
    """Zeroed buffers for an in-place cache of up to `capacity` tokens (buffer_shapes)."""
    return {name: np.zeros(shape, dtype) for name, shape in buffer_shapes(config, batch, capacity).items()}


def to_buffers(config: AttentionConfig, past: dict, p: int, capacity: int, dtype=None) -> dict[str, np.ndarray]:
    """A copying call's cache of p tokens (cache_shapes) written into new buffers of `capacity` tokens."""
    some = next(iter(past.values()))
    out = cache_buffers(config, some.shape[0], capacity, some.dtype if dtype is None else dtype)
    W = config.window_left + 1
    for name, a in past.items():
        a = np.asarray(a)
        if name == "key":
            if W > 1:  # the keys at p - held .. p - 1, in position order, into their slots
                out[name][:, :, np.arange(p - a.shape[2], p) % (W - 1)] = a
        else:  # entries, the open window's slots 0 .. p % m - 1, the overlap halves: their first rows
            out[name][:, :a.shape[1]] = a
    return out


def logical_cache(config: AttentionConfig, buffers: dict, p: int) -> dict[str, np.ndarray]:
    """What the buffers hold after p tokens, as the copying call's cache (cache_shapes): copies, in NumPy."""
    W = config.window_left + 1
    out = {}
    for name, shape in cache_shapes(config, buffers["key"].shape[0], p).items():
        a = np.asarray(buffers[name])
        if name == "key":
            pos = ring_positions(p, W)
            out[name] = a[:, :, np.sort(pos) % (W - 1)] if W > 1 else a[:, :, :0]
        else:
            out[name] = a[:, :shape[1]].copy()
    return out


def write_buffer(buffer, name: str, dtype) -> None:
    """A NumPy buffer the call can write: ValueError (weights.contract.in_place_buffer_error's wording) if not."""
    if not isinstance(buffer, np.ndarray) or buffer.dtype != dtype or not buffer.flags.writeable:
        what = (f"a {type(buffer).__name__}" if not isinstance(buffer, np.ndarray) else
                f"a read-only {buffer.dtype} array" if not buffer.flags.writeable else f"dtype {buffer.dtype}")
        raise ValueError(f"past[{name!r}] with in_place is written in place: it must be a writeable numpy array of "
                         f"the storage dtype {np.dtype(dtype).name}: got {what}")


def matmul(x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """x @ kernel in the compute dtype, stored in x's dtype."""
    ct = compute_dtype(x.dtype)
    return (x.astype(ct, copy=False) @ kernel.astype(ct, copy=False)).astype(x.dtype, copy=False)


def rms(x: np.ndarray, scale: np.ndarray | None, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over the last axis, times scale (None: weightless), in the compute dtype, stored
    in x's dtype."""
    ct = compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    y = xc / np.sqrt(np.mean(np.square(xc), axis=-1, keepdims=True) + ct.type(eps))
    return (y if scale is None else y * scale.astype(ct, copy=False)).astype(x.dtype, copy=False)


def turn(x: np.ndarray, positions: np.ndarray, config: AttentionConfig) -> np.ndarray:
    """Interleaved RoPE (config.rope's table) on the last rotary_dim features of x (B, heads, L, W) at
    positions (L,) (negative: turned back)."""
    inv_freq, factor = rope_tables(config.rope)
    angles = F.rope_angles(np.asarray(positions)[None], inv_freq, x.dtype)  # (1, 1, L, R/2)
    return F.rope_last(x, angles, config.rope.rotary_dim, True, factor)


def compress(config: AttentionConfig, params, prefix: str, x: np.ndarray, p0: int, past, rec, projected=None):
    """One compressor (prefix "compressor" or "indexer.compressor"): the entries of the windows that close in
    this call, (B, n, width), and the compressor's new cache. Window w holds tokens w*m .. w*m + m - 1 and
    closes when its last token arrives; its entry is a softmax gate per feature over its slots (the window's
    m tokens; with overlap also the previous window's m tokens' first halves: 2m slots) times the slots'
    projections, RMS-normed, then turned by RoPE at the window's first position w*m. projected: the call's
    (kv, gate) when the caller has projected x already (the in-place form)."""
    c = config.compressed
    m, cache = c.ratio, "index_" if prefix.startswith("indexer") else ""
    width = params[f"{prefix}.norm.scale"].shape[0]
    B = x.shape[0]
    ct = compute_dtype(x.dtype)
    kv, gate = project_compressor(params, prefix, x, rec) if projected is None else projected  # (B, T, c*width)
    if past is not None:  # the open window's buffered tokens come first
        kv = np.concatenate([past[f"{cache}window_kv"], kv], axis=1)
        gate = np.concatenate([past[f"{cache}window_gate"], gate], axis=1)
    first = p0 - (p0 % m)  # the position of the first buffered token: the open window's start
    n = kv.shape[1] // m  # windows that close in this call
    present = {f"{cache}window_kv": kv[:, n * m:], f"{cache}window_gate": gate[:, n * m:]}
    win_kv = kv[:, :n * m].reshape(B, n, m, kv.shape[-1])
    bias = params[f"{prefix}.position_bias"].astype(ct, copy=False)
    win_gate = gate[:, :n * m].reshape(B, n, m, kv.shape[-1]).astype(ct, copy=False) + bias  # slot j's bias, compute dtype
    if c.overlap:  # halves: [:width] enters the next window's entry, [width:] this window's
        if past is not None and past[f"{cache}overlap_kv"].shape[1]:
            prev_kv = past[f"{cache}overlap_kv"][:, None]  # (B, 1, m, width)
            prev_gate = past[f"{cache}overlap_gate"][:, None].astype(ct, copy=False) + bias[:, :width]
        else:  # window 0 has no previous window: its slots weigh 0
            prev_kv = np.zeros((B, 1, m, width), x.dtype)
            prev_gate = np.full((B, 1, m, width), -np.inf, ct)
        before_kv = np.concatenate([prev_kv, win_kv[:, :-1, :, :width]], axis=1)[:, :n]
        before_gate = np.concatenate([prev_gate, win_gate[:, :-1, :, :width]], axis=1)[:, :n]
        slots_kv = np.concatenate([before_kv, win_kv[..., width:]], axis=2)  # (B, n, 2m, width)
        slots_gate = np.concatenate([before_gate, win_gate[..., width:]], axis=2)
        if n:
            present[f"{cache}overlap_kv"] = win_kv[:, -1, :, :width]
            present[f"{cache}overlap_gate"] = gate[:, (n - 1) * m:n * m, :width]  # raw, as the buffer
        else:
            present[f"{cache}overlap_kv"] = (np.zeros((B, 0, width), x.dtype) if past is None
                                             else past[f"{cache}overlap_kv"])
            present[f"{cache}overlap_gate"] = (np.zeros((B, 0, width), x.dtype) if past is None
                                               else past[f"{cache}overlap_gate"])
    else:
        slots_kv, slots_gate = win_kv, win_gate
    new = pool(config, params, prefix, slots_kv, slots_gate, first, x.dtype, rec)  # (B, n, width)
    old = np.zeros((B, 0, width), x.dtype) if past is None else past[f"{cache}entries"]
    present[f"{cache}entries"] = np.concatenate([old, new], axis=1)
    return present


def project_compressor(params, prefix: str, x: np.ndarray, rec):
    """A compressor's projections of the call's tokens: (kv, raw gate), each (B, T, c*width)."""
    kv = rec(f"{prefix}.project", matmul(x, params[f"{prefix}.kernel"]))
    return kv, rec(f"{prefix}.gate", matmul(x, params[f"{prefix}.gate.kernel"]))


def pool(config: AttentionConfig, params, prefix: str, slots_kv, slots_gate, first: int, dtype, rec) -> np.ndarray:
    """The entries of n closing windows from their slots (B, n, slots, width) and gates plus position bias
    (compute dtype): a softmax per feature over the slots, the weighted sum, the RMS norm, RoPE at each window's
    first position first + w*m. (B, n, width) in dtype."""
    c = config.compressed
    ct = compute_dtype(dtype)
    n = slots_kv.shape[1]
    top = slots_gate.max(axis=2, keepdims=True) if n else slots_gate
    weights = np.exp(slots_gate - top)
    weights = rec(f"{prefix}.weights", (weights / weights.sum(axis=2, keepdims=True)).astype(dtype, copy=False))
    pooled = (weights.astype(ct, copy=False) * slots_kv.astype(ct, copy=False)).sum(axis=2)
    pooled = rec(f"{prefix}.pool", pooled.astype(dtype, copy=False))  # (B, n, width)
    normed = rec(f"{prefix}.norm", rms(pooled, params[f"{prefix}.norm.scale"], c.eps))
    starts = first + c.ratio * np.arange(n)
    return rec(f"{prefix}.rope", turn(normed[:, None], starts, config)[:, 0])  # (B, n, width)


def compress_in_place(config: AttentionConfig, params, prefix: str, x: np.ndarray, p0: int, buffers, rec) -> int:
    """compress() writing into the in-place buffers: the call's projections go to their open-window slots
    (t % m); a window that closes reads its buffered tokens (and the overlap halves) first, then its entry is
    written at row w of the entries and, with overlap, its first halves into the overlap buffers. Returns the
    entries' count after the call, (p0 + T) // m. Moves nothing that is already there: a step that closes no
    window writes its token's row and reads nothing."""
    c = config.compressed
    m, cache = c.ratio, "index_" if prefix.startswith("indexer") else ""
    T, r0, E0 = x.shape[1], p0 % m, p0 // m
    kv, gate = project_compressor(params, prefix, x, rec)
    n = (r0 + T) // m  # windows that close in this call
    window_kv, window_gate = buffers[f"{cache}window_kv"], buffers[f"{cache}window_gate"]
    if n:  # compress() on the open window's buffered tokens: its reads happen before any write below
        width = params[f"{prefix}.norm.scale"].shape[0]
        past = {f"{cache}window_kv": window_kv[:, :r0], f"{cache}window_gate": window_gate[:, :r0]}
        if c.overlap:
            held = m if p0 >= m else 0
            past[f"{cache}overlap_kv"] = buffers[f"{cache}overlap_kv"][:, :held]
            past[f"{cache}overlap_gate"] = buffers[f"{cache}overlap_gate"][:, :held]
        past[f"{cache}entries"] = np.zeros((x.shape[0], 0, width), x.dtype)
        present = compress(config, params, prefix, x, p0, past, rec, projected=(kv, gate))
        buffers[f"{cache}entries"][:, E0:E0 + n] = present[f"{cache}entries"]
        if c.overlap:
            buffers[f"{cache}overlap_kv"][...] = present[f"{cache}overlap_kv"]
            buffers[f"{cache}overlap_gate"][...] = present[f"{cache}overlap_gate"]
    rest = r0 + T - n * m  # the open window's tokens after the call: the call's last `rest`, in slots 0 .. rest-1
    new = min(rest, T)
    window_kv[:, rest - new:rest] = kv[:, T - new:]
    window_gate[:, rest - new:rest] = gate[:, T - new:]
    return E0 + n


def select(config: AttentionConfig, params, x, q_latent, positions, entries, visible, rec) -> np.ndarray:
    """csa's indexer: per query, the top index_topk visible entries by sum_i w_i(x) relu(q_i . K_e) / sqrt(J),
    w = x @ indexer.weights.kernel / sqrt(I), q from the query latent turned by RoPE at the query's position.
    Ties go to the earlier entry (a stable sort); an invisible entry never takes a slot. (B, T, k) int64, -1
    pads a slot a query has no visible entry for."""
    c = config.compressed
    I, J = c.index_heads, c.index_head_dim
    ct = compute_dtype(x.dtype)
    q = np.einsum("btr,rij->bitj", q_latent.astype(ct, copy=False), params["indexer.query.kernel"].astype(ct, copy=False))  # (B, I, T, J)
    q = rec("indexer.query", turn(q.astype(x.dtype, copy=False), positions, config))
    dots = np.einsum("bitj,bej->btie", q.astype(ct, copy=False), entries.astype(ct, copy=False))  # (B, T, I, E), compute dtype
    w = (x.astype(ct, copy=False) @ params["indexer.weights.kernel"].astype(ct, copy=False)) * ct.type(I ** -0.5)
    w = rec("indexer.weights", w.astype(x.dtype, copy=False))  # (B, T, I)
    # the scores stay in the compute dtype (impl_numpy.indexer's): (B, T, E)
    score = (np.maximum(dots, ct.type(0)) * ct.type(J ** -0.5) * w.astype(ct, copy=False)[..., None]).sum(axis=2)
    score = rec("indexer.score", np.where(visible[None], score, -np.inf))  # an entry not visible: -inf
    k = min(c.index_topk, score.shape[-1])
    order = np.argsort(-score, axis=-1, kind="stable")[..., :k]
    chosen = np.take_along_axis(visible[None].repeat(x.shape[0], 0), order, axis=-1)
    return rec("indexer.selection", np.where(chosen, order, -1).astype(np.int64))


def _given_selection(topk_indices, visible: np.ndarray, B: int, T: int, E: int) -> np.ndarray:
    """A given csa selection, checked: (B, T, k) integers in [-1, E); an entry the query cannot see (visible,
    (T, E)) is padding (-1), as the top-k rule counts it."""
    sel = np.asarray(topk_indices)
    if sel.ndim != 3 or sel.shape[:2] != (B, T) or sel.dtype.kind not in "iu" or (
            sel.size and (sel.min() < -1 or sel.max() >= E)):
        raise ValueError(f"topk_indices must be integers of shape (B, T, k) = ({B}, {T}, k) in [-1, {E}) (the "
                         f"entries after the call): got {sel.dtype} {sel.shape}")
    sel = sel.astype(np.int64)
    if E == 0:
        return np.full(sel.shape, -1, np.int64)
    seen = np.take_along_axis(np.broadcast_to(visible[None], (B, T, E)), np.maximum(sel, 0), axis=-1) & (sel >= 0)
    return np.where(seen, sel, -1)


def attend_blocks(w: np.ndarray, blocks: list) -> np.ndarray:
    """F.attend(w, concat(blocks)) without the concatenation: w (B, N, T, S), blocks (B, 1, S_i, H) with
    sum S_i = S; each block's sum in the compute dtype, added, stored in w's dtype."""
    B, N, T, S = w.shape
    ct = compute_dtype(w.dtype)
    wc = w.astype(ct, copy=False).reshape(B, 1, N * T, S)
    ctx, start = None, 0
    for block in blocks:
        part = np.matmul(wc[..., start:start + block.shape[2]], block.astype(ct, copy=False))
        ctx, start = part if ctx is None else ctx + part, start + block.shape[2]
    return ctx.astype(w.dtype, copy=False).reshape(B, N, T, blocks[0].shape[-1])


def blockwise_schedule(config: AttentionConfig, key_pos: np.ndarray, positions: np.ndarray, entry_count: int,
                       chunk_size: int, selection: np.ndarray | None = None):
    """The block-wise path's schedule, decided on the host from positions (and csa's selection's values) alone:
    which window-key and entry blocks each query block visits, and what the stages' mask hides in each. Every
    mirror's attend_blockwise walks this one schedule with its own arithmetic (impl_torch, impl_mlx, impl_tf,
    impl_jax: under jax.jit too, the positions being static). key_pos (S,) the window's keys' positions (any
    order: the in-place ring's slot order too); positions (T,) the queries'; entry_count E the entries after the
    call (0: sliding); selection (B, T, k) csa's as NumPy (-1 padding), or None (every visible entry).

    Yields, per query block of min(chunk_size, chunked.QUERY_ROWS, T) rows, (t0, t1, blocks): the block's rows
    t0 .. t1 - 1 and an iterator over the key blocks it visits in the order attended, the window's then the
    entries', each (source, b0, b1, hidden): source "window" (keys b0 .. b1 - 1 of the window's keys, read as one
    along S) or "entries" (entries b0 .. b1 - 1), at most chunk_size of them; hidden the NumPy bool of what the
    stages' mask hides there, (1, 1, t, b1 - b0), with a selection (B, 1, t, b1 - b0) (not selected), or None
    where it hides nothing. Skipped entirely, never yielded, for a query block at positions lo .. hi: a window key
    block none of whose positions lies in [lo - W + 1, hi]; an entry block at or past (hi + 1) // m (no query of
    the block sees it: entry w is visible to t iff w < (t + 1) // m); with a selection, an entry block no query of
    the block selected in any batch row."""
    T = len(positions)
    rows = max(1, min(chunk_size, QUERY_ROWS, T))
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        chosen = None if selection is None else selection[:, t0:t1]  # (B, t, k)
        yield t0, t1, _query_block_schedule(config, key_pos, positions[t0:t1], entry_count, chunk_size, chosen)


def _query_block_schedule(config: AttentionConfig, key_pos: np.ndarray, pos: np.ndarray, E: int, chunk_size: int,
                          chosen: np.ndarray | None):
    """blockwise_schedule's key blocks for one query block at positions pos (t,), its selection chosen (B, t, k)."""
    c, W, S = config.compressed, config.window_left + 1, len(key_pos)
    lo, hi = int(pos[0]), int(pos[-1])
    # the window's keys: the indices whose positions some query of the block sees, by blocks of chunk_size
    near = np.flatnonzero((key_pos >= lo - W + 1) & (key_pos <= hi))
    for s0 in (np.unique(near // chunk_size) * chunk_size).tolist():
        s1 = min(S, s0 + chunk_size)
        kp = key_pos[s0:s1]
        hidden = ~((kp[None] <= pos[:, None]) & (kp[None] > pos[:, None] - W))  # (t, s)
        yield "window", s0, s1, hidden[None, None] if hidden.any() else None
    # the entries: those visible to the block's last query, by blocks of chunk_size
    seen = min(E, (hi + 1) // c.ratio) if E else 0
    for e0 in range(0, seen, chunk_size):
        e1 = min(seen, e0 + chunk_size)
        if chosen is not None:
            picked = (chosen[..., None] == np.arange(e0, e1)).any(axis=2)  # (B, t, s): selected here
            if not picked.any():
                continue  # no query of the block selected an entry of this block
            yield "entries", e0, e1, ~picked[:, None]
        else:
            hidden = ~(np.arange(e0, e1)[None] < ((pos + 1) // c.ratio)[:, None])  # (t, s): not yet visible
            yield "entries", e0, e1, hidden[None, None] if hidden.any() else None


def attend_blockwise(config: AttentionConfig, q: np.ndarray, window_keys: list, key_pos: np.ndarray,
                     positions: np.ndarray, entries: np.ndarray | None, selection: np.ndarray | None, sinks,
                     chunk_size: int) -> np.ndarray:
    """The stages from the logits to the context (logits, mask, softmax with the sinks, attend) block by block with
    an online softmax, never a (T, W + E) array: q (B, N, T, H) turned; window_keys: the window's keys as parts
    along S ((B, 1, S_i, H) each: the cache's, then the call's; read as one by chunked.KeyParts, never
    concatenated), key_pos (S,) their positions (any order: the in-place ring's slot order too); entries
    (B, E, H) or None (sliding); selection (B, T, k) csa's (-1 padding) or None (hca: every visible entry).
    Returns the context (B, N, T, H) in q's dtype.

    The blocks visited and skipped are blockwise_schedule's (queries in blocks of min(chunk_size,
    chunked.QUERY_ROWS, T) rows, keys in blocks of chunk_size; a skipped block neither read nor multiplied);
    within a block, what the stages' mask hides is -inf. The running max, sum and numerator
    follow chunked.py's recurrence (Milakov & Gimelshein 2018): they start at the sink (max = sink, sum = 1,
    numerator 0) as the stages' softmax puts the sink in every row's denominator. Each block's logits are
    functional.logits' (the stage's rounding); the weights are never stored, so in 16 bits they are not rounded
    as the stages round them (chunked.py's rule): the same result to round-off in float32 and float64. Every
    row sees at least its own key (window_left >= 0), so no row is empty."""
    B, N, T, H = q.shape
    dtype, ct = q.dtype, compute_dtype(q.dtype)
    keys = KeyParts(window_keys) if len(window_keys) > 1 else window_keys[0]
    E = 0 if entries is None else entries.shape[1]
    ents = None if entries is None else entries[:, None]  # (B, 1, E, H): one kv head
    sink = None if sinks is None else sinks.astype(ct).reshape(1, N, 1, 1)
    context = np.empty((B, N, T, H), dtype)
    for t0, t1, blocks in blockwise_schedule(config, key_pos, positions, E, chunk_size, selection):
        t = t1 - t0
        qb = q[:, :, t0:t1]
        if sink is None:
            m = np.full((B, N, t, 1), -np.inf, ct)
            l = np.zeros((B, N, t, 1), ct)
        else:  # the sink joins every row first: max = sink, sum = exp(0) = 1, numerator 0
            m, l = np.broadcast_to(sink, (B, N, t, 1)).copy(), np.ones((B, N, t, 1), ct)
        acc = np.zeros((B, N, t, H), ct)

        def step(kb, hidden, m, l, acc):
            """One key block (B, 1, s, H), its hidden logits ((B|1, 1, t, s) bool or None): the running state."""
            x = F.logits(qb, kb, config.effective_scale).astype(ct, copy=False)  # (B, N, t, s), the stage's
            if hidden is not None:
                x = np.where(hidden, ct.type(-np.inf), x)
            m_new = np.maximum(m, x.max(axis=-1, keepdims=True))
            m_safe = np.where(m_new == -np.inf, ct.type(0), m_new)  # a row that has seen no key yet
            e = np.exp(x - m_safe)  # hidden -> exactly 0
            correction = np.exp(m - m_safe)  # 0 where m was -inf
            pv = np.matmul(e.reshape(B, 1, N * t, -1), kb.astype(ct, copy=False)).reshape(B, N, t, H)
            return m_new, l * correction + e.sum(axis=-1, keepdims=True), acc * correction + pv

        for source, b0, b1, hidden in blocks:  # the window's key blocks, then the entries'
            m, l, acc = step(keys[:, :, b0:b1] if source == "window" else ents[:, :, b0:b1], hidden, m, l, acc)
        context[:, :, t0:t1] = (acc / l).astype(dtype, copy=False)
    return context


def compressed_attention(config: AttentionConfig, tensors: dict[str, np.ndarray], x, positions, past=None, *,
                         return_cache: bool = False, return_selection: bool = False, trace: list | None = None,
                         topk_indices=None, in_place: bool = False, chunk_size: int | None = None):
    """The layer's output (B, T, O); with return_selection also csa's selection (B, T, k); with return_cache
    also the present cache (a dict: cache_names). topk_indices (csa only; (B, T, k) int, -1 padding): the entries
    each query attends to, in place of its indexer's top-k (which still runs: its cache and trace); the suite's
    reference for a port's own selection where it differs from this one's within the top-k rule.

    in_place: past is the caller's buffers (buffer_shapes: a ring of W - 1 keys, the entries with room for the
    call's, the open windows and overlap halves by slot; writeable NumPy arrays of the storage dtype), holding
    the p0 = positions[0] tokens before the call (cache_buffers, to_buffers); the call writes its keys, its
    tokens' projections and the entries of the windows it closes into them, reads no more than it needs, and
    gives the output of the copying call to round-off; with return_cache the present cache is the buffers
    themselves (logical_cache reads them as cache_shapes'). Inference only (no trace: the ring's keys are in
    slot order, not the stages' key order).

    chunk_size: the block-wise path (attend_blockwise): the window's keys and the entries attended in blocks of
    chunk_size with an online softmax, what the window, the entries' visibility and csa's selection hide from a
    whole query block skipped, no (T, W + E) array held (csa's indexer still scores every visible entry: its
    top-k reads each query's whole row of E = p // m scores). The stages' result to round-off; no trace (the
    stages' logits, mask and softmax are never whole). With in_place too."""
    dtype = validate_tensors(config, tensors)  # every array computes in the tensors' dtype
    chunk_size = check_chunk_size(chunk_size, traced=trace is not None)
    x = np.asarray(x)
    if not is_float(x.dtype):  # bfloat16 (ml_dtypes) included
        raise ValueError(f"x must be a float array: got dtype {x.dtype}")
    buffers = None
    if in_place:
        if trace is not None:
            raise ValueError("trace must be None with in_place (the in-place call attends to its ring of keys in "
                             "slot order, not the stages' order: trace the copying call): got a list")
        p0 = check_in_place_call(config, x, positions, past)
        for name, buffer in past.items():
            write_buffer(buffer, name, dtype)
        buffers, past = past, None
    else:
        p0 = check_compressed_call(config, x, positions, past)
    x = x.astype(dtype, copy=False)
    past = None if past is None else {name: np.asarray(a).astype(dtype, copy=False) for name, a in past.items()}
    positions = np.arange(p0, p0 + x.shape[1])
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    c, p, N, H = config.compressed, tensors, config.num_heads, config.head_dim
    B, T, _ = x.shape
    W = config.window_left + 1
    if topk_indices is not None and c.kind != "csa":
        raise ValueError(f"topk_indices must be None for a compressed layer of kind {c.kind} (only csa selects "
                         f"entries): got an array of shape {np.shape(topk_indices)}")
    # the low-rank query, a weightless RMS norm per head, RoPE on the last rotary_dim features
    ct = compute_dtype(dtype)
    q_latent = rec("query.down", rms(matmul(x, p["query.down.kernel"]), p["query.down.norm.scale"], c.eps))  # (B, T, Qr)
    q = np.einsum("btr,rnh->bnth", q_latent.astype(ct, copy=False), p["query.kernel"].astype(ct, copy=False))
    q = rec("query", q.astype(dtype, copy=False))  # (B, N, T, H)
    q = rec("query.norm", rms(q, None, c.eps))
    q = rec("query.rope", turn(q, positions, config))
    # one kv head, RMS-normed with its scale and turned: the key and the value
    k = rec("key", rms(matmul(x, p["key.kernel"][:, 0]), p["key.norm.scale"], c.eps)[:, None])  # (B, 1, T, H)
    k = rec("key.rope", turn(k, positions, config))
    if buffers is None:
        keys = k if past is None else np.concatenate([past["key"], k], axis=2)  # (B, 1, Pw + T, H)
        key_pos = np.arange(p0 + T - keys.shape[2], p0 + T)
        present = {"key": keys[:, :, max(keys.shape[2] - (W - 1), 0):] if W > 1 else keys[:, :, :0]}
    else:  # the ring's held keys in slot order, then the call's: blocks, never concatenated (a dense ring is the
        ring = buffers["key"]  # whole history); the call's keys are written into the ring once attended to
        blocks = [ring[:, :, :min(p0, W - 1)], k]
        key_pos = np.concatenate([ring_positions(p0, W), positions])
        present = buffers
    blockwise = chunk_size is not None  # attend_blockwise: no (T, Pw + T) mask, no (T, E) one for hca
    window_keys = [keys] if buffers is None else list(blocks)  # (the window's keys alone, before the entries)
    if not blockwise:
        in_window = (key_pos[None] <= positions[:, None]) & (key_pos[None] > positions[:, None] - W)  # (T, Pw + T)
    selection = entries = None
    if c.kind != "sliding":
        if buffers is None:
            present.update(compress(config, p, "compressor", x, p0, past, rec))
            entries = present["entries"]  # (B, E, H)
        else:
            count = compress_in_place(config, p, "compressor", x, p0, buffers, rec)  # writes, then the read
            entries = buffers["entries"][:, :count]
        E = entries.shape[1]
        if c.kind == "csa" or not blockwise:  # (the indexer's scores are (B, T, E) in any case)
            visible = np.arange(E)[None] < ((positions + 1) // c.ratio)[:, None]  # (T, E): entry w iff w < (t+1) // m
            allowed = np.broadcast_to(visible[None], (B, T, E))
        if c.kind == "csa":
            if buffers is None:
                present.update(compress(config, p, "indexer.compressor", x, p0, past, rec))
                index_entries = present["index_entries"]
            else:
                count = compress_in_place(config, p, "indexer.compressor", x, p0, buffers, rec)
                index_entries = buffers["index_entries"][:, :count]
            selection = select(config, p, x, q_latent, positions, index_entries, visible, rec)
            if topk_indices is not None:
                selection = _given_selection(topk_indices, visible, B, T, E)
            if not blockwise:
                allowed = F.selection_mask(selection, 1, E)[:, 0]  # (B, T, E)
        if buffers is None and not blockwise:
            keys = np.concatenate([keys, np.broadcast_to(entries[:, None], (B, 1, E, H))], axis=2)
        if not blockwise:
            allowed = np.concatenate([np.broadcast_to(in_window[None], (B, T, in_window.shape[1])), allowed], axis=2)
    elif not blockwise:
        allowed = np.broadcast_to(in_window[None], (B, T, in_window.shape[1]))
    if blockwise:
        ctx = attend_blockwise(config, q, window_keys, key_pos, positions, entries,
                               selection if c.kind == "csa" else None, p.get("sinks"), chunk_size)
    elif buffers is None:
        logits = rec("logits", F.logits(q, keys, config.effective_scale))  # (B, N, T, S)
    else:  # in place: each block's logits joined (the keys and the entries stay in their buffers)
        blocks += [] if entries is None else [entries[:, None]]
        logits = np.concatenate([F.logits(q, b, config.effective_scale) for b in blocks], axis=-1)
    if not blockwise:
        x_masked = rec("mask", F.mask_stage(logits, allowed[:, None], None))
        w = rec("softmax", F.softmax(x_masked, config.masked_row, p.get("sinks")))
        ctx = rec("attend", F.attend(w, keys)) if buffers is None else attend_blocks(w, blocks)  # the keys are the values
    if buffers is not None and W > 1:  # now the ring may take the call's last W - 1 keys (a slot the query read is
        last = min(T, W - 1)  # overwritten)
        ring[:, :, positions[T - last:] % (W - 1)] = k[:, :, T - last:]
    ctx = rec("derotate", turn(ctx, -positions, config))  # the rotary features turned back by the query's position
    G = c.output_groups
    grouped = ctx.transpose(0, 2, 1, 3).reshape(B, T, G, N * H // G)
    grouped = np.einsum("btgf,gfr->btgr", grouped.astype(ct, copy=False), p["output.group.kernel"].astype(ct, copy=False))
    grouped = rec("output.group", grouped.astype(dtype, copy=False))  # (B, T, G, R)
    out = rec("output", matmul(grouped.reshape(B, T, -1), p["output.kernel"]))  # (B, T, O)
    result = (out,) + ((selection,) if return_selection else ()) + ((present,) if return_cache else ())
    return result[0] if len(result) == 1 else result
