"""Multi-head latent attention (MLA; weights.config.Latent) in JAX, the stages before attention in both
forms: mirrors impl_numpy/latent.py.

The expanded form is the spec and what transformers computes: the query's projections, the latent's
projection and norm, RoPE on each query head's rotary features and on the one rotary key every head shares,
the cache (the normed latent and the rotated key, as transformers' DeepSeek V3 attention caches them), then
the latent (cache included) up-projected to each head's key features and values, and the keys joined with
the shared rotary key (expand). The stages run it.

The absorbed form never expands the cache: the key up-projection is folded into the query
(functional.absorb_query), attention runs as one shared head of width C + R over [latent | rotary key] with
the latent as values (absorbed), and the value up-projection is applied to the attended latent
(functional.expand_values). attention.py takes it on the fused, chunked and in-place paths, as impl_numpy's
attention.py does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from weights import AttentionConfig
from weights.rope import rope_tables

from . import functional as F
from . import fused
from .call import Call
from .heads import present


def latent_heads(config: AttentionConfig, call: Call, precision: str = "highest", rec=lambda stage, value: value,
                 *, append: bool = True, whole: bool = False):
    """-> q (B, N, T, H) after RoPE (and the temperature), latent (B, 1, S_total, C) and rotary key (B, 1,
    S_total, R): the present cache (append=False: the new keys' alone, S; an in-place cache: heads.present,
    the buffers written, whole with whole=True)."""
    p, N, L, pr = call.params, config.num_heads, config.latent, precision
    C, R = L.kv_rank, L.rope_dim
    if L.query_rank is not None:
        qd = rec("query.down", F.project(call.query, p["query.down.kernel"], p.get("query.down.bias"),
                                         pr))  # (B, T, Qr)
        qd = rec("query.down_norm", F.norm(qd, p["query.down.norm.scale"], None, "rms", L.eps, 1, "head"))
        q = rec("query.project", F.project(qd, p["query.kernel"], None, pr))  # (B, T, N*H)
    else:
        q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias"), pr))  # (B, T, N*H)
    both = rec("latent.project", F.project(call.key, p["latent.kernel"], p.get("latent.bias"), pr))  # (B, S, C+R)
    latent = rec("latent.norm", F.norm(both[..., :C], p["latent.norm.scale"], None, "rms", L.eps, 1, "head"))
    q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    _, factor = rope_tables(config.rope)
    interleaved = config.rope.interleaved
    q = rec("query.rope", F.rope_last(q, call.rope_angles(config, call.positions), R, interleaved, factor))
    rotary = rec("key.rope", F.rope(F.split_heads(both[..., C:], 1), call.rope_angles(config, call.key_positions),
                                    R, interleaved, factor))  # (B, 1, S, R): one key for every head
    if config.query_temperature is not None:
        t = config.query_temperature
        factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
        q = rec("query.temperature", F.temperature(q, factor))
    latent = F.split_heads(latent, 1)  # (B, 1, S, C)
    return (q, *present(call, latent, rotary, append=append, whole=whole))


def expand(config: AttentionConfig, call: Call, latent, rotary, precision: str = "highest",
           rec=lambda stage, value: value):
    """The expanded form's keys and values: the latent (B, 1, S_total, C) up-projected per head, the keys
    joined with the shared rotary key (B, 1, S_total, R). -> k (B, K, S_total, H), v (B, K, S_total, V)."""
    p, K, pr = call.params, config.num_kv_heads, precision
    k = rec("key.project", F.project(latent[:, 0], p["key.kernel"], None, pr))  # (B, S_total, K*(H-R))
    v = rec("value.project", F.project(latent[:, 0], p["value.kernel"], None, pr))  # (B, S_total, K*V)
    k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S_total, H-R)
    v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S_total, V)
    return rec("key.join", F.join_keys(k, rotary)), v


def absorbed(config: AttentionConfig, call: Call, q, latent, rotary, precision: str = "highest"):
    """The absorbed form's heads: q (B, N, T, C + R) through the key up-projection, one shared key head
    [latent | rotary key] (B, 1, S_total, C + R) and the latent as its values (B, 1, S_total, C); the
    attended latent then goes through functional.expand_values."""
    q = F.absorb_query(q, call.params["key.kernel"], config.latent.rope_dim, precision)
    return q, jnp.concatenate([latent, rotary], axis=-1), latent


# The gather runs where the call has at least this many keys (S_total). Below it the masked core reads a
# few rows anyway, and the gather's program (a sort and the gathers) is one more to compile per case in a
# cold `mha check`, whose selection cases have 7-12 keys (measured: +0.15-0.4 s of CPU on the jax column).
GATHER_MIN_KEYS = 64


def gathers_selection(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str) -> bool:
    """impl_numpy.chunked._selected_columns's conditions in JAX: a one-token call over a selection (topk_indices
    or the indexer's) whose keys may be gathered instead of masked, the core's result unchanged to round-off:
    no window, local chunks, ALiBi, segments, bias or dropout, causal (if at all) bottom-right, a static P, k
    below S_total (else nothing to drop), S_total at least GATHER_MIN_KEYS, and masked_row "zero" (a fully masked row's "uniform" 1/S_total and
    "nan" fill weigh every key of S_total, and the stages' gradient of either reaches every value)."""
    idx = call.topk
    return (idx is not None and call.shapes.T == 1 and idx.shape[-1] < call.shapes.S_total
            and call.shapes.S_total >= GATHER_MIN_KEYS
            and call.bias4 is None and call.keep is None and call.segment_ids is None and not config.alibi
            and config.local_chunk is None and config.window_left < 0 and config.window_right < 0
            and (not is_causal or causal_alignment == "bottom_right") and config.masked_row == "zero"
            and not call.traced_length)


def decodes_in_blocks(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str,
                      whole: bool) -> bool:
    """Whether the fused path's absorbed step runs as fused.absorbed_decode: one query over an in-place cache
    read whole (whole), of at least fused.DECODE_MIN_KEYS positions, nothing hidden from it but the
    positions past P + S (call.allowed without the tail is None: no mask, selection, window, local chunks or
    segments, causal only bottom-right), and no bias, dropout, softcap, ALiBi or sinks."""
    return (whole and call.cache_length is not None and call.shapes.T == 1
            and call.shapes.capacity >= fused.DECODE_MIN_KEYS and call.topk is None
            and call.bias4 is None and call.keep is None and config.logit_softcap is None and not config.alibi
            and "sinks" not in call.params
            and call.allowed(config, is_causal, causal_alignment, tail=False) is None)


# An in-place buffer's selected rows are gathered this many slots at a time, in a loop (_gather_in_loop).
GATHER_BLOCK = 256


def _gather_in_loop(x, safe):
    """x[rows, 0, safe] -> (B, Ks, k, F), min(GATHER_BLOCK, k) slots per turn of a fori_loop (the last block
    clamped back to end at k: its overlap is gathered twice, the same rows). Why a loop: XLA CPU fuses the
    in-place write of the buffer (dynamic_update_slice) into a gather that reads it, and then copies the
    buffer twice to keep the unwritten one for that fusion (compiled HLO, jax 0.10.2, P 65536: two (1, 1,
    65537, 512) copies and two of the rotary buffer; the sparse step 81-98 ms of CPU). Inside a loop the
    buffer is an operand the write cannot fuse into: no copy, 7.7 ms. (An optimisation barrier is dropped
    by the CPU pipeline; gathering the cached rows before the write copied the buffers too.)"""
    B, Ks, k = safe.shape
    block = min(GATHER_BLOCK, k)
    rows = jnp.arange(B)[:, None, None]
    out = jnp.zeros((B, Ks, k, x.shape[-1]), x.dtype)

    def body(i, out):
        start = jnp.minimum(i * block, k - block)
        at = jax.lax.dynamic_slice_in_dim(safe, start, block, axis=2)  # (B, Ks, block)
        return jax.lax.dynamic_update_slice_in_dim(out, x[rows, 0, at], start, axis=2)

    return jax.lax.fori_loop(0, -(-k // block), body, out)


def kept_slots(idx):
    """A selection's slots (B, Ks, k) sorted, and which of them gather_selected keeps: those that select a key
    (not -1), each key once (the first of its slots; equal keys are adjacent once sorted)."""
    idx = jnp.sort(idx, axis=-1)  # -1 slots first
    first = jnp.concatenate([jnp.ones((*idx.shape[:-1], 1), dtype=bool), idx[..., 1:] != idx[..., :-1]], axis=-1)
    return idx, (idx >= 0) & first


def gather_selected(config: AttentionConfig, call: Call, q, latent, rotary, allowed, precision: str = "highest"):
    """The absorbed form over the selected keys alone (gathers_selection): each batch row's (and selection
    head's) k selected rows of the latent and the rotary key, gathered by index, not the whole cache masked.
    impl_numpy gathers the union of every row's selected columns (np.flatnonzero); under jax.jit a shape
    cannot depend on values, so each row gathers its own k (static) instead, sorted, and a slot is kept
    where it selects a key (-1 selects none), where it is the first of its key (a key selected twice is
    selected once: the mask's meaning) and where `allowed` (the call's mask, the selection in it) shows the
    key to the head. The core over them computes what it computes over every key with the others masked (a
    masked key's weight is exactly 0).
    q (B, N, 1, H), latent (B, 1, S_x, C), rotary (B, 1, S_x, R) (S_x: S_total, or an in-place buffer's
    capacity: the selection indexes S_total alone), allowed (B|1, N|1, 1, S_x) or None
    -> q (B, N, 1, C + R), keys (B, Ks, k, C + R), values (B, Ks, k, C), allowed (B, 1|N, 1, k), Ks the
    selection's heads (1, or one per kv head: query head n reads n // G)."""
    idx = call.topk
    idx = (idx[:, None] if idx.ndim == 3 else idx)[:, :, 0]  # (B, Ks, k): the one query's selection
    B, Ks, k = idx.shape
    N = q.shape[1]
    idx, keep = kept_slots(idx)  # (B, Ks, k) sorted, and the slots that select a key once
    safe = jnp.maximum(idx, 0)  # a dropped slot reads key 0, weight 0 (keep)
    rows = jnp.arange(B)[:, None, None]
    if call.cache_length is not None:  # the written buffers, read in a loop (_gather_in_loop says why)
        lat, rot = _gather_in_loop(latent, safe), _gather_in_loop(rotary, safe)
    else:
        lat, rot = latent[rows, 0, safe], rotary[rows, 0, safe]  # (B, Ks, k, C), (B, Ks, k, R)
    if allowed is not None:
        shown = jnp.broadcast_to(allowed[:, :, 0], (B, allowed.shape[1], allowed.shape[3]))  # (B, 1|N, S_x)
        if shown.shape[1] == 1:
            keep = keep & shown[rows, 0, safe]  # (B, Ks, k)
            keep = keep if Ks == 1 else jnp.repeat(keep, N // Ks, axis=1)  # (B, 1|N, k)
        else:  # per head: head n reads its kv head's selection n // G
            G = N // Ks
            keep = jnp.repeat(keep, G, axis=1) & shown[rows, jnp.arange(N)[None, :, None], jnp.repeat(safe, G, axis=1)]
    q = F.absorb_query(q, call.params["key.kernel"], config.latent.rope_dim, precision)  # (B, N, 1, C + R)
    return q, jnp.concatenate([lat, rot], axis=-1), lat, keep[:, :, None]
