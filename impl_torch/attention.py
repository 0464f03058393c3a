"""The call: validate, then run functional.py's stages, or SDPA's fused core
(sdpa.py) where the caller asks for it and it gives the same numbers.

Mirrors impl_numpy/attention.py (prepare -> Call, qkv_heads,
multi_head_attention with the same arguments and return convention). Kept
apart from functional.py so that imports point one way: this module and
sdpa.py import the stages; the stages import neither.

Which path honours which feature:
- the stages (the default, and every call with weights, a trace or a dropout
  mask): every feature of the contract.
- SDPA (use_sdpa=True): masks, bias, causal, windows, local chunks and
  segment ids (one bool mask, built by functional.allowed_mask), ALiBi
  (its bias joins the call's in SDPA's float mask), with the clip, RoPE,
  QK-norm (before or after RoPE), the value norm, the query temperature and
  the cache applied before it
  (qkv_heads) and the output gate after it. Softcap and sinks have no SDPA
  counterpart: a config with either takes the stages instead.
- latent attention (MLA, config.latent): the stages run the expanded form
  (latent_heads, expand_latent: impl_numpy/latent.py, traced as
  weights.call.LATENT_STAGES); SDPA and an in-place cache (cache_length=,
  untraced) run the absorbed form (absorb_latent: one shared head of width
  C + R over [latent | rotary key], the latent as values, then
  functional.expand_values), through SDPA or, for softcap and sinks, the
  stage functions. The cache is the normed latent (B, 1, P+S, C) and the
  rotated shared key (B, 1, P+S, R) on every path. A decode step over a
  selection (one query, topk_indices or the indexer's) gathers the selected
  rows and attends to them alone (_selected_columns, impl_numpy's). One
  query over SPLIT_MIN_KEYS keys or more (whole cache or gathered) runs the
  stage functions with the shared key read as its two parts, never joined
  (splits_keys, absorbed_logits: the keys as the rows of its products;
  absorbed_attend), on SDPA's path too.
torch has no chunked path (no chunk_size argument): SDPA's kernels already
work blockwise.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from weights import DTYPES, AttentionConfig, WeightsFormatError, validate_tensors
from weights.call import record
from weights.contract import (
    CallShapes,
    Plan,
    check_bias_values,
    check_call,
    check_indexer_call,
    check_position_values,
    check_topk_values,
    in_place_buffer_error,
)
from weights.rope import mrope_axes, rope_tables

from . import functional as F
from .convert import TORCH_DTYPES, compute_dtype, dtype_name, to_torch, torch_dtype
from .sdpa import sdpa_attend


@dataclasses.dataclass
class Call:
    """One validated call, every tensor on the weights' device in its storage dtype
    (ids and positions integer)."""

    shapes: CallShapes
    params: dict[str, torch.Tensor]
    query: torch.Tensor  # (B, T, Dq)
    key: torch.Tensor  # (B, S, Dk)
    value: torch.Tensor  # (B, S, Dv)
    allowed: torch.Tensor | None  # mask AND causal AND window AND segments (B|1, N|1, T, S_total|1), or None
    bias4: torch.Tensor | None  # (B|1, N|1, T|1, S_total|1), compute dtype
    keep: torch.Tensor | None  # dropout keep-mask (B, N, T, S_total), or None
    dtype: torch.dtype
    plain_causal: bool  # SDPA's own is_causal stands for the whole mask (allowed then omits the causal part)
    positions: torch.Tensor | None = None  # (B|1, T) int64 where the config reads positions (config.reads_positions)
    key_positions: torch.Tensor | None = None  # (B|1, S)
    past_key: torch.Tensor | None = None  # (B, K, P, H); with cache_length the caller's buffer (B, K, C, H)
    past_value: torch.Tensor | None = None  # (B, K, P, V); with cache_length (B, K, C, V)
    cache_length: int | None = None  # P of an in-place cache (past_key/past_value are buffers), else None
    past_key_positions: torch.Tensor | None = None  # (B|1, P) the cached keys' positions (default 0..P-1), or None
    selection: torch.Tensor | None = None  # config.indexer's selection (B, T, k) or (B, K, T, k) int64
    selected: bool = False  # a selection (topk_indices or the indexer's) joined the mask (impl_numpy's Call.selected)
    present_index_keys: torch.Tensor | None = None  # (B, P+S, J); with cache_length the caller's buffer (B, C, J)
    # kv_shared (issue 42): the cache's last S = T entries, the queries' own keys and values (B, K, S, H|V)
    shared_key: torch.Tensor | None = None
    shared_value: torch.Tensor | None = None

    @property
    def every_key_position(self) -> torch.Tensor | None:
        """(B|1, P+S): the cache's keys at past_key_positions (0..P-1 by default), then key_positions (where
        the config reads positions)."""
        if self.key_positions is None:
            return None
        return F.all_key_positions(self.key_positions, self.shapes.P, self.past_key_positions)

    def temperature_positions(self, config: AttentionConfig) -> torch.Tensor:
        """(B|1, T): the positions the query temperature reads (functional.temperature_positions)."""
        return F.temperature_positions(self.positions, config.query_temperature.position, self.shapes.P,
                                       self.shapes.T)

    def alibi_bias(self, config: AttentionConfig) -> torch.Tensor:
        """ALiBi's (B|1, N, T, P+S) bias in compute dtype (functional.alibi_bias)."""
        return F.alibi_bias(self.params["alibi.slopes"], self.positions, self.every_key_position, self.dtype,
                            config.alibi_bias_dtype)


# Why a differential layer whose fully masked rows are NaN (masked_row "nan") takes the stages: the NaN row's context
# reaches the differential norm's backward, whose cotangent for that row is NaN, and SDPA's backward multiplies the
# masked keys' zero weights by it (0 * NaN: NaN key gradients, random_differential_993172); the stages' selects
# drop it, as the spec's backward does.
DIFFERENTIAL_NAN_ROWS = ("masked_row nan with differential: a NaN row's cotangent reaches the fused kernel's "
                         "backward, which multiplies the masked keys' zero weights by it (the stages drop it)")


def plan(config: AttentionConfig, *, use_sdpa: bool, return_weights: bool, traced: bool, dropout: bool) -> Plan:
    """The path of a call: SDPA (sdpa.py) where the caller asks for it and it
    computes the same thing; the stages otherwise, each predicate named.
    dropout: a dropout keep-mask applies (training with a mask or a rate)."""
    if not use_sdpa:
        return Plan("stages", "use_sdpa is off (the default)")
    if return_weights or traced:
        return Plan("stages", "the weights or the trace are asked for (SDPA returns neither)")
    if dropout:
        return Plan("stages", "a dropout keep-mask is applied by the stages (SDPA draws its own)")
    if config.logit_softcap is not None:
        return Plan("stages", "a logit softcap has no SDPA counterpart")
    if config.use_sinks:
        return Plan("stages", "attention sinks have no SDPA counterpart")
    if config.differential is not None and config.masked_row == "nan":
        return Plan("stages", DIFFERENTIAL_NAN_ROWS)
    return Plan("sdpa", "use_sdpa, and nothing SDPA cannot compute")


def check_tensors(config: AttentionConfig, tensors) -> torch.dtype:
    """Names, shapes and the one dtype of canonical torch tensors; returns that dtype.

    Shapes and dtypes only (values are never read, so a call does not wait on
    the device; the layer and the adapter check values once, in NumPy, when
    they load tensors). Plain Python on the happy path, so torch.compile
    traces it; a problem is worded by weights.validate_tensors itself, run on
    shape-only NumPy stand-ins.
    """
    expected = config.tensor_shapes()
    names_ok = len(tensors) == len(expected) and all(name in tensors for name in expected)
    if names_ok and all(isinstance(t, torch.Tensor) for t in tensors.values()):
        dtypes = [t.dtype for t in tensors.values()]
        if (all(tuple(tensors[name].shape) == shape for name, shape in expected.items())
                and all(d == dtypes[0] for d in dtypes) and dtypes[0] in TORCH_DTYPES.values()):
            return dtypes[0]
    strangers = [f"{name} is a {type(t).__name__}, not a torch tensor"
                 for name, t in tensors.items() if not isinstance(t, torch.Tensor)]
    if strangers:
        raise WeightsFormatError("tensors: " + "; ".join(strangers))
    stand_ins = {}
    for name, t in tensors.items():
        try:
            np_dtype = DTYPES.get(dtype_name(t.dtype)) or np.dtype(dtype_name(t.dtype))
        except TypeError:
            np_dtype = np.dtype(object)
        stand_ins[name] = np.broadcast_to(np.zeros((), np_dtype), tuple(t.shape))
    validate_tensors(config, stand_ins)  # raises, in the format's words
    found = {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()}
    raise AssertionError(f"check_tensors found a problem that validate_tensors did not: {found}")


def _check_bias_values(bias: torch.Tensor) -> None:
    """The contract's NaN / +inf check on bias values. It needs the values on
    the host, so torch.compile skips it (it would split the graph)."""
    if torch.compiler.is_compiling():
        return
    bad = torch.isnan(bias) | torch.isposinf(bias)
    if bool(bad.any()):
        check_bias_values(bias[bad][:1].double().cpu().numpy())  # raises, in the contract's words


def _longrope_max_position(config: AttentionConfig, call) -> int | None:
    """The call's largest position (its queries' and new keys'), which picks LongRoPE's table
    (weights.rope.uses_long_table); None for every other rule (no read of the positions to the host)."""
    scaling = config.rope.scaling
    if scaling is None or scaling.type != "longrope":
        return None
    given = [int(x.max()) for x in (call.positions, call.key_positions) if x is not None and x.numel()]
    return max(given) if given else None


def _check_position_values(config: AttentionConfig, positions: torch.Tensor | None) -> None:
    """The contract's check of the positions a query temperature reads (position + offset >= 0). It reads
    one value (the least) on the host, so torch.compile skips it (it would split the graph)."""
    if config.query_temperature is None or positions is None or positions.numel() == 0:
        return
    if torch.compiler.is_compiling():
        return
    check_position_values(config, positions.min().reshape(1).cpu().numpy())  # raises, in the contract's words


def prepare(config, tensors, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, return_weights, dtype, positions=None, key_positions=None, past_key=None,
            past_value=None, segment_ids=None, key_segment_ids=None, return_cache=False, cache_length=None,
            materializes_scores=True, sdpa=False, past_key_positions=None, topk_indices=None,
            past_index_keys=None, trace: list | None = None) -> Call:
    """Validate a call and cast everything to the storage dtype. sdpa: the
    core will run through SDPA; when SDPA's own is_causal can apply (the
    Call's plain_causal), the (T, S) causal mask is not built at all. With
    config.indexer the indexer's selection joins the mask (run_indexer); a trace receives its stages first."""
    stored = check_tensors(config, tensors)
    dtype = stored if dtype is None else torch_dtype(dtype)
    device = next(iter(tensors.values())).device  # where the weights live; every input follows them
    query = to_torch(query, device)
    keys_given = key is not None or value is not None  # else self-attention: the keys are the queries
    key = query if key is None else to_torch(key, device)
    value = key if value is None else to_torch(value, device)
    # Only the inputs given (a plain call has few): check_call's shape and dtype arguments of each.
    given = {name: to_torch(x, device) for name, x in (
        ("mask", mask), ("bias", bias), ("dropout_mask", dropout_mask), ("positions", positions),
        ("key_positions", key_positions), ("past_key", past_key), ("past_value", past_value),
        ("segment_ids", segment_ids), ("key_segment_ids", key_segment_ids),
        ("past_key_positions", past_key_positions), ("topk_indices", topk_indices))
        if x is not None and not (cache_length is not None and name in ("past_key", "past_value"))}
    if cache_length is not None:
        # Buffers written in place are never moved or converted (that would copy the whole cache, and the
        # copy would be written): check_call sees their shapes as given; past_key_buffers refuses the rest.
        for name, x in (("past_key", past_key), ("past_value", past_value)):
            if x is not None:
                given[name] = x if isinstance(x, torch.Tensor) else to_torch(x)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not x.is_floating_point() and x.dtype != dtype:
            raise ValueError(f"{name} must be a float array: got dtype {dtype_name(x.dtype)}")
    meta = {}
    for name, x in given.items():
        meta[f"{name}_shape"], meta[f"{name}_dtype"] = tuple(x.shape), dtype_name(x.dtype)
    shapes = check_call(
        config, query_shape=tuple(query.shape), key_shape=tuple(key.shape), value_shape=tuple(value.shape), **meta,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        return_weights=return_weights, return_cache=return_cache, cache_length=cache_length,
        # The memory guard reads /proc/meminfo: done eagerly, skipped while
        # torch.compile traces (it would break the graph), and on a GPU whose
        # memory the host's MemAvailable does not describe.
        materializes_scores=materializes_scores and not torch.compiler.is_compiling() and query.device.type == "cpu",
        scores_itemsize=torch.finfo(compute_dtype(dtype)).bits // 8, keys_given=keys_given,
    )
    _check_position_values(config, given.get("positions"))
    selection = given.get("topk_indices")
    if selection is not None and not torch.compiler.is_compiling():  # (a value read would break the graph)
        check_topk_values(selection.cpu().numpy(), shapes.P, shapes.S)
    check_indexer_call(config, selection is not None, past_index_keys, shapes, cache_length)
    T, S_total = shapes.T, shapes.S_total
    in_place = shapes.capacity is not None
    if in_place:
        past_key, past_value = past_key_buffers(past_key, past_value, dtype, device)
        refuse_autograd(query, key, value, tensors, given.get("bias"), past_key, past_value)
    mask_t, bias_t, keep_t = given.get("mask"), given.get("bias"), given.get("dropout_mask")
    if bias_t is not None:
        _check_bias_values(bias_t)
        bias_t = bias_t.to(compute_dtype(dtype)).reshape(shapes.bias_shape)
    params = {name: t.to(dtype) for name, t in tensors.items()}
    if training and keep_t is None and config.dropout > 0:
        keep_t = F.dropout_keep_mask((shapes.B, config.num_heads, T, S_total), config.dropout, seed, device)
    if not training:
        keep_t = None
    segment_ids, key_segment_ids = given.get("segment_ids"), given.get("key_segment_ids")
    if segment_ids is not None and key_segment_ids is None:
        key_segment_ids = segment_ids  # self-attention without a cache: the keys are the queries (check_call)
    windowed = config.window_left >= 0 or config.window_right >= 0
    # ALiBi's bias and the local chunks go into SDPA's attn_mask, which its own is_causal cannot join
    plain_causal = (sdpa and is_causal and mask_t is None and selection is None and config.indexer is None
                    and bias_t is None and not windowed
                    and not config.alibi and config.local_chunk is None
                    and segment_ids is None and (causal_alignment == "top_left" or T == S_total))
    positions_t = key_positions_t = past_key_positions_t = None
    if config.reads_positions:  # RoPE, ALiBi, local chunks and the temperature read the positions
        positions_t = F.default_positions(given.get("positions"), shapes.P, T, device)
        key_positions_t = F.default_positions(given.get("key_positions"), shapes.P, shapes.S, device)
        if "past_key_positions" in given:
            past_key_positions_t = F.default_positions(given["past_key_positions"], 0, shapes.P, device)
    axes = None if config.rope is None else mrope_axes(config.rope)
    if axes is not None:  # multimodal RoPE: each rotating pair's position, (B|1, L, R/2); nothing reads the cache's
        positions_t = F.mrope_positions(given.get("positions"), shapes.P, T, axes, device)
        key_positions_t = F.mrope_positions(given.get("key_positions"), shapes.P, shapes.S, axes, device)
        past_key_positions_t = None
    mask4 = None if mask_t is None else mask_t.reshape(shapes.mask_shape)
    index = None
    if config.indexer is not None:  # impl_numpy.attention.run_indexer: the keys every other mask shows, any head's
        every_key = None if key_positions_t is None else F.all_key_positions(key_positions_t, shapes.P,
                                                                              past_key_positions_t)
        index_allowed = F.allowed_mask(mask4, T, S_total, is_causal, causal_alignment,
                                       window_left=config.window_left, window_right=config.window_right,
                                       segment_ids=segment_ids, key_segment_ids=key_segment_ids,
                                       local_chunk=config.local_chunk, positions=positions_t,
                                       key_positions=every_key, device=device)
        index = run_indexer(config, params, query.to(dtype), key.to(dtype), dtype, index_allowed, shapes,
                            given.get("positions"), given.get("key_positions"), past_index_keys, in_place,
                            rec=lambda stage, value: record(trace, stage, value))
        selection = index[0]
    if selection is not None:  # the selection joins the mask (impl_numpy.attention.prepare): (B, 1|N, T, S_total)
        selected = F.selection_mask(selection, config.num_heads, S_total)
        mask4 = selected if mask4 is None else mask4 & selected
    # One query aligned bottom-right (a decode step) sees every key: its causal mask hides nothing, so
    # none is built (nor applied to the (B, N, 1, S) logits, nor handed to SDPA, which then runs unmasked).
    hides_nothing = causal_alignment == "bottom_right" and T == 1
    allowed = F.allowed_mask(mask4, T, S_total, is_causal and not plain_causal and not hides_nothing, causal_alignment,
                             window_left=config.window_left, window_right=config.window_right,
                             segment_ids=segment_ids, key_segment_ids=key_segment_ids,
                             local_chunk=config.local_chunk, positions=positions_t,
                             key_positions=None if key_positions_t is None else
                             F.all_key_positions(key_positions_t, shapes.P, past_key_positions_t), device=device)
    query, key, value = (x.to(dtype) for x in (query, key, value))
    call = Call(shapes=shapes, params=params, query=query, key=key, value=value, allowed=allowed, bias4=bias_t,
                keep=keep_t, dtype=dtype, plain_causal=plain_causal, positions=positions_t,
                key_positions=key_positions_t, past_key_positions=past_key_positions_t,
                selected=selection is not None)
    if index is not None:
        call.selection, call.present_index_keys = index
    if in_place:
        # the buffers themselves (their infinities are not checked: that would read the whole cache every token)
        call.past_key, call.past_value, call.cache_length = past_key, past_value, shapes.P
    elif "past_key" in given:
        call.past_key, call.past_value = given["past_key"].to(dtype), given["past_value"].to(dtype)
    if config.kv_shared:
        share_cache(call)
    return call


def run_indexer(config: AttentionConfig, params, query, key, dtype, allowed, shapes: CallShapes, positions,
                key_positions, past_index_keys, in_place: bool, rec=lambda stage, value: value):
    """impl_numpy.attention.run_indexer in torch: (selection, present_index_keys), under torch.no_grad() (the
    selection is piecewise constant; the indexer's tensors get no gradient from the output). allowed: every
    other mask (B|1, N|1, T|1, S_total|1) or None, any head's key offered to the selection. In place: the
    new index keys written into the caller's buffer at P..P+S-1, the buffer returned whole."""
    from .indexer import lightning_indexer

    T, S, P = shapes.T, shapes.S, shapes.P
    index_mask = None
    if allowed is not None:
        index_mask = allowed.any(dim=1, keepdim=True).expand(allowed.shape[0], 1, T, P + S)
    in_place = in_place and past_index_keys is not None
    if in_place and (not isinstance(past_index_keys, torch.Tensor) or past_index_keys.dtype != dtype
                     or past_index_keys.device != query.device):
        raise in_place_buffer_error("past_index_keys", f"be a torch tensor of the storage dtype "
                                    f"{dtype_name(dtype)} on {query.device}", f"a {type(past_index_keys).__name__}")
    # in place, the indexer writes the new index keys into the buffer at P..P+S-1 and scores over its first P+S
    # rows (no copy of the index cache a step); present_index_keys is then the buffer, whole
    with torch.no_grad():
        result = lightning_indexer(config, {n: t.detach() for n, t in params.items()}, query.detach(), key.detach(),
                                   positions=positions, key_positions=key_positions, past_index_keys=past_index_keys,
                                   mask=index_mask, is_causal=False, dtype=dtype_name(dtype), device=query.device,
                                   precision=config.indexer.scoring_precision,
                                   fp8_scale_format=config.indexer.fp8_scale_format,
                                   cache_length=P if in_place else None, rec=rec)
    return result["topk_indices"], result["present_index_keys"]


def past_key_buffers(past_key, past_value, dtype: torch.dtype, device: torch.device):
    """The buffers of an in-place cache (cache_length=), as given: torch tensors
    of the storage dtype on the weights' device (a cast, a NumPy array or a
    transfer would write a copy the caller never sees)."""
    for name, buffer in (("past_key", past_key), ("past_value", past_value)):
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != dtype or buffer.device != device:
            what = (f"a {type(buffer).__name__}" if not isinstance(buffer, torch.Tensor) else
                    f"dtype {dtype_name(buffer.dtype)}" if buffer.dtype != dtype else f"a tensor on {buffer.device}")
            raise in_place_buffer_error(name, f"be a torch tensor of the storage dtype {dtype_name(dtype)} on {device}",
                                        what)
    return past_key, past_value


def refuse_autograd(query, key, value, tensors, bias, past_key, past_value) -> None:
    """An in-place cache is for inference: autograd would record writes into
    buffers that earlier steps' graphs hold (and the caller reuses), so a call
    it would record is refused."""
    if not torch.is_grad_enabled():
        return
    inputs = {"query": query, "key": None if key is query else key, "value": None if value is key else value,
              "bias": bias, "past_key": past_key, "past_value": past_value, **tensors}
    asking = [name for name, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if asking:
        raise ValueError("cache_length writes past_key/past_value in place, for inference only: call it under "
                         "torch.no_grad(), or pass the cache whole (past_key without cache_length) to differentiate "
                         f"through it: got {', '.join(asking)} requiring grad with gradients enabled")


def qkv_heads(config: AttentionConfig, call: Call, rec=lambda stage, value: value):
    """project -> [clip] -> [norm] -> split_heads -> [rope] -> [norm after rope] -> [query temperature] -> [cache
    appended]: q (B, N, T, H), k (B, K, S_total, H), v (B, K, S_total, V) (k and v: the
    present cache)."""
    if config.kv_shared:
        return shared_heads(config, call, rec)
    p, N, K = call.params, config.num_heads, config.num_kv_heads
    q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias")))  # (B, T, N*H)
    k = rec("key.project", F.project(call.key, p["key.kernel"], p.get("key.bias")))  # (B, S, K*H)
    v = rec("value.project", F.project(call.value, p["value.kernel"], p.get("value.bias")))  # (B, S, K*V)
    if config.qkv_clip is not None:
        q = rec("query.clip", F.clip(q, config.qkv_clip))
        k = rec("key.clip", F.clip(k, config.qkv_clip))
        v = rec("value.clip", F.clip(v, config.qkv_clip))
    n = config.qk_norm
    if n is not None and not n.after_rope:
        q = rec("query.norm", F.norm(q, p.get("query.norm.scale"), p.get("query.norm.bias"), n.type, n.eps, N,
                                     n.scope))
        k = rec("key.norm", F.norm(k, p.get("key.norm.scale"), p.get("key.norm.bias"), n.type, n.eps, K, n.scope))
    if config.value_norm is not None:
        vn = config.value_norm
        v = rec("value.norm", F.norm(v, p.get("value.norm.scale"), p.get("value.norm.bias"), vn.type, vn.eps, K,
                                     vn.scope))
    if config.key_multiplier != 1.0:
        k = rec("key.multiplier", F.multiply(k, config.key_multiplier))  # (B, S, K*H)
    if config.value_scale != 1.0:
        v = rec("value.scale", F.multiply(v, config.value_scale))  # (B, S, K*V)
    q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S, H)
    v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S, V)
    if config.rope is not None:
        inv_freq, factor = rope_tables(config.rope, _longrope_max_position(config, call))
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved
        q = rec("query.rope", F.rope(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved, factor))
        k = rec("key.rope", F.rope(k, F.rope_angles(call.key_positions, inv_freq, call.dtype), R, interleaved, factor))
    if n is not None and n.after_rope:  # Llama 4's rope layers: the (weightless) norm of the turned q and k
        q = rec("query.norm", F.norm_heads(q, p.get("query.norm.scale"), p.get("query.norm.bias"), n.type, n.eps,
                                           n.scope))
        k = rec("key.norm", F.norm_heads(k, p.get("key.norm.scale"), p.get("key.norm.bias"), n.type, n.eps, n.scope))
    if config.query_temperature is not None:
        t = config.query_temperature
        factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
        q = rec("query.temperature", F.temperature(q, factor))
    if call.cache_length is not None:  # in place: the new keys written after the P cached ones, no copy
        P, S = call.cache_length, k.shape[2]
        call.past_key[:, :, P:P + S].copy_(k)
        call.past_value[:, :, P:P + S].copy_(v)
        return q, call.past_key[:, :, :P + S], call.past_value[:, :, :P + S]  # (B, K, P+S, .) views
    if call.past_key is not None:  # the cache holds keys after norm and rope (as Hugging Face and ONNX store it)
        k = _append(call.past_key, k)  # (B, K, P+S, H)
        v = _append(call.past_value, v)  # (B, K, P+S, V)
    return q, k, v


def latent_heads(config: AttentionConfig, call: Call, rec=lambda stage, value: value):
    """A latent layer's (MLA, impl_numpy/latent.py) stages before attention: [query.down -> query.down_norm]
    -> query.project, latent.project -> latent.norm, query.split_heads -> query.rope (its last R features) ->
    key.rope (the shared rotary key) -> [query temperature] -> [cache appended]. -> q (B, N, T, H), latent
    (B, 1, S_total, C) and rotary key (B, 1, S_total, R): the present cache (in place: views of the buffers
    after the new latent and rotary key are written at P .. P+S-1)."""
    p, N, L = call.params, config.num_heads, config.latent
    C, R = L.kv_rank, L.rope_dim
    if L.query_rank is not None:
        qd = rec("query.down", F.project(call.query, p["query.down.kernel"], p.get("query.down.bias")))  # (B, T, Qr)
        qd = rec("query.down_norm", F.norm(qd, p["query.down.norm.scale"], None, "rms", L.eps, 1, "head"))
        q = rec("query.project", F.project(qd, p["query.kernel"], None))  # (B, T, N*H)
    else:
        q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias")))  # (B, T, N*H)
    both = rec("latent.project", F.project(call.key, p["latent.kernel"], p.get("latent.bias")))  # (B, S, C+R)
    latent = rec("latent.norm", F.norm(both[..., :C], p["latent.norm.scale"], None, "rms", L.eps, 1, "head"))
    q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    inv_freq, factor = rope_tables(config.rope, _longrope_max_position(config, call))
    interleaved = config.rope.interleaved
    q = rec("query.rope", F.rope_last(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved,
                                      factor))
    rotary = rec("key.rope", F.rope(F.split_heads(both[..., C:], 1),
                                    F.rope_angles(call.key_positions, inv_freq, call.dtype), R, interleaved,
                                    factor))  # (B, 1, S, R): one key for every head
    if config.query_temperature is not None:
        t = config.query_temperature
        factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
        q = rec("query.temperature", F.temperature(q, factor))
    latent = F.split_heads(latent, 1)  # (B, 1, S, C)
    if call.cache_length is not None:  # in place: the new latent and rotary key written after the P cached ones
        P, S = call.cache_length, latent.shape[2]
        call.past_key[:, :, P:P + S].copy_(latent)
        call.past_value[:, :, P:P + S].copy_(rotary)
        return q, call.past_key[:, :, :P + S], call.past_value[:, :, :P + S]  # (B, 1, P+S, .) views
    if call.past_key is not None:  # the cache: the normed latent and the rotated shared key
        latent = _append(call.past_key, latent)  # (B, 1, P+S, C)
        rotary = _append(call.past_value, rotary)  # (B, 1, P+S, R)
    return q, latent, rotary


def expand_latent(config: AttentionConfig, call: Call, latent: torch.Tensor, rotary: torch.Tensor,
                  rec=lambda stage, value: value):
    """The expanded form's keys and values (the stages): the latent (B, 1, S_total, C) up-projected per head,
    the keys joined with the shared rotary key (B, 1, S_total, R). -> k (B, K, S_total, H), v (B, K, S_total,
    V)."""
    p, K = call.params, config.num_kv_heads
    k = rec("key.project", F.project(latent[:, 0], p["key.kernel"], None))  # (B, S_total, K*(H-R))
    v = rec("value.project", F.project(latent[:, 0], p["value.kernel"], None))  # (B, S_total, K*V)
    k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S_total, H-R)
    v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S_total, V)
    return rec("key.join", F.join_keys(k, rotary)), v


def absorb_latent(config: AttentionConfig, call: Call, q: torch.Tensor, latent: torch.Tensor,
                  rotary: torch.Tensor):
    """The absorbed form's query, key and value (SDPA and the in-place cache): the key up-projection folded
    into the query, one shared head of width C + R over [latent | rotary key], the latent as its values.
    -> q (B, N, T, C+R), k (B, 1, S_total, C+R), v (B, 1, S_total, C); functional.expand_values takes the
    attended latent to each head's values."""
    q = F.absorb_query(q, call.params["key.kernel"], config.latent.rope_dim)  # (B, N, T, C+R)
    return q, torch.cat([latent, rotary], dim=-1), latent


# A one-query absorbed call (a decode step; T 1) over at least this many keys, the whole cache or the gathered
# selection, runs its core as the stages (logits .. attend) with the key read as its two parts, [latent |
# rotary] (absorbed_logits), on the SDPA path too: not torch.cat of the whole cache per step and SDPA over one
# shared head of width C + R. Measured (2-core AMD EPYC VM, 2026-11-30, loaded, one thread, process CPU time,
# min of 5, torch 2.13 CPU with MKL; N 16, C 512, R 64, 65537 keys): the concatenation 70 ms and SDPA 125 ms
# against the two products 25 + 4 ms, the softmax 1 ms and the attend 22 ms. Below it (the grid's decode
# cases, at most a few hundred keys) SDPA keeps the call: the `sdpa` column still checks SDPA's absorbed form.
SPLIT_MIN_KEYS = 1024
# absorbed_logits' keys per product, the keys the rows: (s, C) x (C, N T), then (s, R) x (R, N T) added into the
# same rows of one block's buffer, turned and scaled into the result's columns. Measured (2-core AMD EPYC VM,
# 2026-11-30, torch 2.13 with MKL; N 16, C 512, R 64, 65537 keys): idle, two threads, min of 15 (prototypes): q as the
# rows (16, 576) x (576, S) 25.6 ms, the keys as the rows in one product 17.3 ms, in blocks of 4096 keys 14.3 ms;
# loaded (load average 3-5), one thread, process CPU time, min of 10: the logits 29-30 ms in blocks of 2048-4096
# keys, 32 ms at 8192 (q as the rows in blocks of 4096: 33-34.5 ms), the whole step 58-59 ms at 1024-4096 keys and
# 62-66 ms from 8192 up; two threads, loaded, CPU time: q as the rows in blocks of 4096 up to 279 ms, the keys as
# the rows 35-70 ms. 4096 rather than 2048 (one thread's best by 1 ms): half the products, so half the parallel
# regions where two threads wait for each other on a loaded machine.
KEY_BLOCK = 4096


def splits_keys(config: AttentionConfig, call: Call, absorbed: bool, keys: int) -> bool:
    """Whether an absorbed call's core runs as the stages over the key's two parts (SPLIT_MIN_KEYS): one query,
    `keys` keys or more, SDPA's own causal flag not standing for a mask (plain_causal: no mask is built), no
    differential pair (its values are not the latent alone), and not under torch.compile (the key blocks are a
    Python loop over a size)."""
    return (absorbed and call.shapes.T == 1 and keys >= SPLIT_MIN_KEYS and not call.plain_causal
            and config.differential is None and not torch.compiler.is_compiling())


def absorbed_logits(q: torch.Tensor, latent: torch.Tensor, rotary: torch.Tensor, scale: float) -> torch.Tensor:
    """LOGITS of the absorbed form (F.logits' arithmetic) with its shared key held as two parts: q (B, N, T, C+R),
    latent (B, 1, S, C), rotary (B, 1, S, R) -> (B, N, T, S), q's first C features against the latent and its
    last R against the rotary key, added: q . [latent | rotary] without the join (a copy of the whole cache),
    in blocks of KEY_BLOCK keys, each cast to the compute dtype on its own, in compute dtype, stored. The keys
    are the rows of each product, (s, C) x (C, N T) (+ (s, R) x (R, N T)), each block turned to (N T, s) as the
    scale is applied (outside autograd: into one block's buffer and the result's columns, with out=)."""
    B, N, T, _ = q.shape
    C, S = latent.shape[-1], latent.shape[2]
    ct = compute_dtype(q.dtype)
    cols = q.to(ct).reshape(B, N * T, -1).transpose(1, 2).contiguous()  # (B, C+R, N T): each head's query a column
    q_lat, q_rot = cols[:, :C], cols[:, C:]  # (B, C, N T), (B, R, N T)
    if torch.is_grad_enabled() and (q.requires_grad or latent.requires_grad or rotary.requires_grad):
        blocks = []
        for start in range(0, S, KEY_BLOCK):
            lat = latent[:, 0, start:start + KEY_BLOCK].to(ct)  # (B, s, C)
            rot = rotary[:, 0, start:start + KEY_BLOCK].to(ct)  # (B, s, R)
            blocks.append(torch.baddbmm(torch.bmm(rot, q_rot), lat, q_lat))  # (B, s, N T)
        keys_first = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)  # (B, S, N T)
        return (keys_first.transpose(1, 2) * scale).contiguous().reshape(B, N, T, S).to(q.dtype)
    scores = torch.empty((B, N * T, S), dtype=ct, device=q.device)
    part = torch.empty((min(KEY_BLOCK, S), N * T), dtype=ct, device=q.device)  # a block's scores, keys as the rows
    for b in range(B):
        for start in range(0, S, KEY_BLOCK):
            lat = latent[b, 0, start:start + KEY_BLOCK].to(ct)  # (s, C)
            out = part[:lat.shape[0]]
            torch.mm(lat, q_lat[b], out=out)
            out.addmm_(rotary[b, 0, start:start + KEY_BLOCK].to(ct), q_rot[b])
            torch.mul(out.t(), scale, out=scores[b, :, start:start + KEY_BLOCK])  # turned to (N T, s) as it is scaled
    return scores.reshape(B, N, T, S).to(q.dtype)


# absorbed_attend takes the product as latent^T w^T, (C, S) x (S, N T), from this many torch threads on, F.attend's
# w (N T, S) x latent (S, C) below. Measured (2-core AMD EPYC VM, 2026-11-30, torch 2.13 with MKL; N 16, C 512, 65537
# keys, min of 15): two threads, idle 17.7 -> 10.9 ms, loaded (load average 3-5) 45 -> 36 ms wall; one thread
# (loaded, process CPU time) the other way, 22.8 ms as F.attend's against 29.7.
ATTEND_COLUMNS_MIN_THREADS = 2


def absorbed_attend(w: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """ATTEND of the absorbed form (F.attend's arithmetic, its values the latent): w (B, N, T, S), latent
    (B, 1, S, C) -> (B, N, T, C), taken as latent^T w^T, (C, S) x (S, N T), both transposed views (no copy),
    in compute dtype, stored; with fewer than ATTEND_COLUMNS_MIN_THREADS threads F.attend itself."""
    if torch.get_num_threads() < ATTEND_COLUMNS_MIN_THREADS:
        return F.attend(w, latent)
    B, N, T, S = w.shape
    ct = compute_dtype(w.dtype)
    ctx = torch.matmul(latent[:, 0].to(ct).transpose(1, 2), w.to(ct).reshape(B, N * T, S).transpose(1, 2))
    return ctx.transpose(1, 2).reshape(B, N, T, -1).to(w.dtype)  # (B, C, N T) -> (B, N, T, C)


# Present caches of at least this many bytes, on the CPU and outside autograd, are written into memory
# NumPy allocates (_append says why).
HUGE_PAGE_MIN_BYTES = 4 * 2**20


def _append(past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """torch.cat([past, new], dim=2), the present cache (a new tensor, as the contract returns it).

    A large one on the CPU, where no gradient is asked, goes into an array NumPy allocates: NumPy asks
    the kernel for transparent huge pages (madvise) from 4 MiB on, torch's CPU allocator does not, and
    the fresh pages' faults are most of a large copy's time (2-core Xeon VM, 2026-11-25, a 128 MiB
    cache: torch.cat 219 ms, the same copy into NumPy's memory 117 ms, a read of it 45 ms)."""
    # torch.compile traces torch.cat: the sizes (symbolic there) are looked at only outside it
    if (torch.compiler.is_compiling() or past.device.type != "cpu" or past.dtype not in _NUMPY_DTYPES
            or new.dtype != past.dtype or (torch.is_grad_enabled() and (past.requires_grad or new.requires_grad))):
        return torch.cat([past, new], dim=2)
    shape = (*past.shape[:2], past.shape[2] + new.shape[2], *past.shape[3:])
    if past.element_size() * int(np.prod(shape)) < HUGE_PAGE_MIN_BYTES:
        return torch.cat([past, new], dim=2)
    present = _numpy_backed(shape, past.dtype)
    present[:, :, : past.shape[2]] = past
    present[:, :, past.shape[2]:] = new
    return present


def _numpy_backed(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in memory NumPy allocates (huge pages where large)."""
    return torch.from_numpy(np.empty(shape, dtype=_NUMPY_DTYPES[dtype]))


_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def multi_head_attention(
    config: AttentionConfig,
    tensors: dict[str, torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    training: bool = False,
    dropout_mask: torch.Tensor | None = None,
    seed: int | None = None,
    positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    past_key: torch.Tensor | None = None,
    past_value: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    key_segment_ids: torch.Tensor | None = None,
    past_key_positions: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    past_index_keys: torch.Tensor | None = None,
    return_weights: bool = False,
    return_selection: bool = False,
    return_cache: bool = False,
    cache_length: int | None = None,
    dtype: str | torch.dtype | None = None,
    trace: list | None = None,
    use_sdpa: bool = False,
):
    """The forward pass. Returns output (B, T, O); with return_weights also
    weights (B, N, T, P+S) after softmax and before dropout; with
    return_cache also present_key (B, K, P+S, H) and present_value (B, K,
    P+S, V) (a latent layer's: (B, 1, P+S, C) and (B, 1, P+S, R)):
    (output[, weights][, present_key, present_value]).

    past_key_positions (P,) or (B, P): the cached keys' positions (default
    0..P-1), as impl_numpy's, on every path (the in-place cache included).
    topk_indices (B, T, k) or (B, K, T, k): the keys each query may see, as
    impl_numpy's; it joins the boolean mask, SDPA's attn_mask included.
    With config.indexer: the indexer's selection, past_index_keys,
    return_selection and present_index_keys as impl_numpy's (results
    (output[, weights][, selection][, present_key, present_value[,
    present_index_keys]])); the selection is made under torch.no_grad().

    tensors: the canonical tensors (impl_numpy's names and layouts) as torch
    tensors on one device; inputs, masks, bias, ids and the cache are moved
    to it. dtype: compute in this storage dtype (default: the tensors'
    dtype). use_sdpa: run logits..attend through
    F.scaled_dot_product_attention (sdpa.py) when nothing needs the (T, S)
    weights (no return_weights, no trace), no dropout mask applies and the
    config has neither softcap nor sinks; else, and by default, the stages.

    cache_length: an in-place cache (impl_numpy's). past_key (B, K, C, H)
    and past_value (B, K, C, V) are the caller's buffers, torch tensors of
    the storage dtype on the weights' device, whose first cache_length = P
    positions are the cache; the call writes its new keys and values at P ..
    P+S-1 (slice copies) and attends over views of the first P+S positions,
    on the stages and SDPA alike, so a step copies no cache; with
    return_cache, present_key and present_value are the buffers themselves
    (whole). The buffers are not checked for infinities. Inference only: a
    call autograd would record is refused (use torch.no_grad()).
    """
    # SDPA computes the core blockwise on its own: no (B, N, T, S) scores to guard.
    will_use_sdpa = plan(config, use_sdpa=use_sdpa, return_weights=return_weights, traced=trace is not None,
                         dropout=training and (dropout_mask is not None or config.dropout > 0)).path == "sdpa"
    call = prepare(
        config, tensors, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        positions=positions, key_positions=key_positions, past_key=past_key, past_value=past_value,
        segment_ids=segment_ids, key_segment_ids=key_segment_ids, return_weights=return_weights,
        return_cache=return_cache, cache_length=cache_length, dtype=dtype, materializes_scores=not will_use_sdpa,
        sdpa=will_use_sdpa, past_key_positions=past_key_positions, topk_indices=topk_indices,
        past_index_keys=past_index_keys, trace=trace,
    )
    if return_selection and call.selection is None:
        raise ValueError("return_selection needs config.indexer (a layer without one makes no selection)")
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    p = call.params
    allowed = call.allowed  # (B|1, N|1, T, S_total), or over the gathered columns alone (_selected_columns)
    # A latent layer runs the absorbed form on SDPA and on an in-place cache (never expanding the cache), the
    # expanded form (the spec's stages, traced by their names) otherwise.
    absorbed = config.latent is not None and trace is None and (will_use_sdpa or call.cache_length is not None)
    if config.latent is not None:
        q, present_key, present_value = latent_heads(config, call, rec)  # (B, N, T, H), (B, 1, S_total, C|R)
        cols = None if not absorbed else _selected_columns(config, call, is_causal, causal_alignment,
                                                           return_weights=return_weights,
                                                           segmented=segment_ids is not None)
        if cols is not None:  # a decode step over a selection: the selected rows alone (a gather), not the whole
            # cache masked (impl_numpy.chunked._fused_modern); the keys gathered before they are joined
            latent, rotary = present_key.index_select(2, cols), present_value.index_select(2, cols)  # (B, 1, s, .)
            allowed = call.allowed.index_select(-1, cols)  # (B|1, N|1, 1, s)
        else:
            latent, rotary = present_key, present_value  # (B, 1, S_total, C|R)
        split = splits_keys(config, call, absorbed, latent.shape[2])
        if split:  # the stages' core over [latent | rotary] read as two parts (absorbed_logits), not joined
            q = F.absorb_query(q, p["key.kernel"], config.latent.rope_dim)  # (B, N, 1, C+R)
            k, v = None, latent  # the latent is the values
        elif absorbed:
            q, k, v = absorb_latent(config, call, q, latent, rotary)  # (.., C+R), (B, 1, s|S_total, C+R), (.., C)
        else:
            k, v = expand_latent(config, call, present_key, present_value, rec)  # (B, K, S_total, H|V)
    else:
        split = False
        q, k, v = qkv_heads(config, call, rec)  # (B, N, T, H), (B, K, S_total, H), (B, K, S_total, V)
        present_key, present_value = k, v
    if config.differential is not None:  # each kv head's value joined with its pair's (the cache stays v)
        v = rec("value.pair", F.value_pair(v))  # (B, K, S_total, 2V)
    w = None
    if will_use_sdpa and not split:
        bias4 = call.bias4
        if config.alibi:  # ALiBi joins the call's bias in SDPA's float mask (a -inf there stays -inf)
            bias4 = call.alibi_bias(config) if bias4 is None else call.alibi_bias(config) + bias4
        ctx = sdpa_attend(config, q, k, v, allowed=allowed, bias=bias4,
                          plain_causal=call.plain_causal)  # (B, N, T, V)
    else:
        x = rec("logits", absorbed_logits(q, latent, rotary, config.effective_scale) if split
                else F.logits(q, k, config.effective_scale))  # (B, N, T, S_total)
        if config.logit_softcap is not None:
            x = rec("softcap", F.softcap(x, config.logit_softcap))
        if config.alibi:
            x = rec("alibi", F.alibi(x, call.alibi_bias(config)))
        x = rec("mask", F.mask_stage(x, allowed, call.bias4))
        w = rec("softmax", F.softmax(x, config.masked_row, p.get("sinks")))  # (B, N, T, S_total)
        wd = rec("dropout", F.dropout(w, call.keep, config.dropout))
        ctx = rec("attend", absorbed_attend(wd, v) if split else F.attend(wd, v))  # (B, N, T, V|C)
    if absorbed:  # the attended latent (B, N, T, C) through each head's value up-projection
        ctx = F.expand_values(ctx, p["value.kernel"])  # (B, N, T, V)
    if config.differential is not None:  # the halves subtracted with lambda, normed, scaled
        ctx = rec("differential", F.differential_stage(config, p, ctx))  # (B, N/2, T, 2V)
    if config.output_gate is not None:
        g = rec("gate.project", F.gate_project(call.query, p["gate.kernel"], p.get("gate.bias")))
        ctx = rec("gate", F.gate(ctx, g, config.num_heads))  # (B, N, T, V)
    ctx = rec("merge_heads", F.merge_heads(ctx))  # (B, T, N*V)
    out = rec("output", F.output(ctx, p["output.kernel"], p.get("output.bias")))  # (B, T, O)
    if not (return_weights or return_cache or return_selection):
        return out
    if call.cache_length is not None:
        present_key, present_value = call.past_key, call.past_value  # the buffers, whole
    result = (out,) + ((w,) if return_weights else ()) + ((call.selection,) if return_selection else ())
    if return_cache:
        result += (present_key, present_value) + ((call.present_index_keys,) if config.indexer is not None else ())
    return result


def _selected_columns(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str, *,
                      return_weights: bool, segmented: bool) -> torch.Tensor | None:
    """impl_numpy.chunked._selected_columns in torch: the keys any query of a one-token call over a selection
    may see (int64 column indices into S_total, ascending), or None where gathering them would change the
    result or not pay: more than one query, no selection, or a per-key feature other than the mask (a window,
    local chunks, ALiBi, segments, a bias, dropout, a top-left causal alignment, masked_row "uniform" or "nan",
    whose fully masked row's fill weighs every key of S_total, and the stages' gradient of it reaches every
    value), the weights asked for (they span S_total), or under
    torch.compile (the count of columns is data). The core over the gathered columns computes what it
    computes over every column with the others masked (a masked key's weight is exactly 0), reading the s
    selected rows instead of the S_total of the cache."""
    if (not call.selected or call.allowed is None or call.shapes.T != 1 or call.bias4 is not None
            or call.keep is not None or segmented or config.alibi or config.local_chunk is not None
            or config.window_left >= 0 or config.window_right >= 0 or (is_causal and causal_alignment != "bottom_right")
            or config.masked_row != "zero" or return_weights or torch.compiler.is_compiling()):
        return None
    if call.allowed.shape[-1] != call.shapes.S_total:
        return None
    seen = call.allowed.reshape(-1, call.shapes.S_total).any(dim=0)  # (S_total,): any batch row or head sees the key
    cols = torch.nonzero(seen).flatten()
    return cols if 0 < cols.numel() < seen.shape[0] else None


# -- issue 42: a kv_shared layer (mirrors impl_numpy.attention.share_cache and impl_numpy.heads.shared_heads) --

def share_cache(call: Call) -> None:
    """kv_shared: the given cache's last S = T entries become call.shared_key / shared_value, read, never
    written; the cache before them is call.past_key / past_value (an in-place cache's buffers stay whole)."""
    P, S = call.shapes.P, call.shapes.S
    call.shared_key, call.shared_value = call.past_key[:, :, P:P + S], call.past_value[:, :, P:P + S]
    if call.cache_length is None:
        call.past_key, call.past_value = call.past_key[:, :, :P], call.past_value[:, :, :P]


def shared_heads(config: AttentionConfig, call: Call, rec=lambda stage, value: value):
    """qkv_heads of a kv_shared layer: the query's stages alone (project -> [norm] -> split_heads -> [rope] ->
    [temperature]); k and v the given cache, nothing projected, normed, turned or written."""
    p, N = call.params, config.num_heads
    q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias")))  # (B, T, N*H)
    n = config.qk_norm
    if n is not None:  # before RoPE (config: after_rope is refused with kv_shared)
        q = rec("query.norm", F.norm(q, p.get("query.norm.scale"), p.get("query.norm.bias"), n.type, n.eps, N,
                                     n.scope))
    q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    if config.rope is not None:
        inv_freq, factor = rope_tables(config.rope, _longrope_max_position(config, call))
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved
        q = rec("query.rope", F.rope(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved, factor))
    if config.query_temperature is not None:
        t = config.query_temperature
        factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
        q = rec("query.temperature", F.temperature(q, factor))
    k, v = call.shared_key, call.shared_value  # (B, K, S, H), (B, K, S, V)
    if call.cache_length is not None:  # in place: the buffers' first P + S positions, as given
        P, S = call.cache_length, k.shape[2]
        return q, call.past_key[:, :, :P + S], call.past_value[:, :, :P + S]  # (B, K, P+S, .) views
    if call.past_key is not None:
        k = _append(call.past_key, k)  # (B, K, P+S, H): the cache given, whole
        v = _append(call.past_value, v)  # (B, K, P+S, V)
    return q, k, v
