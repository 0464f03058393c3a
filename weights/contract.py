"""The call contract, checked on shapes and dtype names only.

Every implementation calls `check_call` before computing, so a bad input gets
the same words from NumPy, torch, Keras and JAX. Nothing here touches values
except `check_bias_values` and `check_mask_values`, which take NumPy-convertible
arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .config import AttentionConfig
from .dtypes import extremes_finite, for_value_checks

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
MASK_RANKS_HELP = "(T, S), (B, T, S), (B, 1, T, S) or (B, N, T, S)"


@dataclasses.dataclass(frozen=True)
class CallShapes:
    """Sizes of one call, and the rank-4 shapes its mask and bias take.

    S is the length of the new keys and values (the key/value inputs), P the
    cache's (past_key / past_value; 0 without a cache): masks, bias, causal,
    windows, segment ids and the weights see S_total = P + S keys.
    capacity: with cache_length, the buffers' length C (P = cache_length,
    the new keys written at P .. P+S-1); None for a cache passed whole."""

    B: int
    T: int
    S: int
    mask_shape: tuple[int, int, int, int] | None
    bias_shape: tuple[int, int, int, int] | None
    P: int = 0
    capacity: int | None = None

    @property
    def S_total(self) -> int:
        return self.P + self.S


def _shape(x) -> tuple[int, ...] | None:
    return None if x is None else tuple(int(d) for d in x)


def broadcast_shape(argument: str, shape: Sequence[int], B: int, N: int, T: int, S: int) -> tuple[int, int, int, int]:
    """Rank-4 (B|1, N|1, T|1, S|1) view of a mask or bias shape.

    Rank 2 is (T, S), rank 3 is (B, T, S) (a head axis is inserted, NOT a
    leading one as NumPy broadcasting would do), rank 4 is as given.
    """
    shape = tuple(shape)
    if len(shape) == 2:
        full = (1, 1) + shape
    elif len(shape) == 3:
        full = (shape[0], 1) + shape[1:]
    elif len(shape) == 4:
        full = shape
    else:
        raise ValueError(f"{argument} must have shape {MASK_RANKS_HELP}: got rank {len(shape)} shape {shape}")
    for got, want in zip(full, (B, N, T, S)):
        if got not in (1, want):
            raise ValueError(
                f"{argument} has shape {shape}, which does not broadcast to (B, N, T, S) = {(B, N, T, S)}"
                f"; accepted: {MASK_RANKS_HELP}"
            )
    return full  # type: ignore[return-value]


def _is_integer(dtype_name: str | None) -> bool:
    return dtype_name is not None and dtype_name.startswith(("int", "uint"))


def check_ids(argument: str, shape, dtype_name: str | None, B: int, L: int, letter: str) -> None:
    """An integer array of shape (L,) or (B, L): positions and segment ids."""
    shape = _shape(shape)
    if not _is_integer(dtype_name) or shape not in ((L,), (B, L)):
        extra = " (positions of shape (3, B, L) need rope.mrope_section)" if len(shape) == 3 else ""
        raise ValueError(f"{argument} must be an integer array of shape ({letter},) or (B, {letter}) = ({L},) or "
                         f"({B}, {L}): got dtype {dtype_name} shape {shape}{extra}")


def check_mrope_ids(argument: str, shape, dtype_name: str | None, B: int, L: int, letter: str) -> None:
    """Multimodal RoPE's positions (rope.mrope_section): integer, (3, L) or (3, B, L), one row per axis
    (temporal, height, width). One position per token ((L,) or (B, L)) is refused, naming the field, as a
    rank-3 array is without it (check_ids)."""
    shape = _shape(shape)
    if not _is_integer(dtype_name) or shape not in ((3, L), (3, B, L)):
        raise ValueError(f"{argument} must be an integer array of shape (3, {letter}) or (3, B, {letter}) = (3, {L}) "
                         f"or (3, {B}, {L}) with rope.mrope_section (temporal, height, width rows): got dtype "
                         f"{dtype_name} shape {shape}")


def check_topk_indices(shape, dtype_name: str | None, B: int, K: int, T: int) -> None:
    """topk_indices: integer, (B, T, k) (one selection for every head) or (B, K, T, k) (one per kv head), k >= 1."""
    shape = _shape(shape)
    if (not _is_integer(dtype_name) or len(shape) not in (3, 4) or shape[0] != B or shape[-2] != T
            or (len(shape) == 4 and shape[1] != K) or shape[-1] < 1):
        raise ValueError(f"topk_indices must be an integer array of shape (B, T, k) or (B, K, T, k) = ({B}, {T}, k) "
                         f"or ({B}, {K}, {T}, k), k >= 1: got dtype {dtype_name} shape {shape}")


def check_topk_values(topk_indices, P: int, S: int) -> None:
    """Each selected key indexes the cache's P keys first, then the S new ones (0 .. P+S-1); -1 pads an unused
    slot (FlashMLA's sparse kernels' convention). Any other value is refused, naming it."""
    values = np.asarray(topk_indices)
    if not values.size:
        return
    low, high = int(values.min()), int(values.max())
    if low < -1 or high >= P + S:
        bad = low if low < -1 else high
        raise ValueError(f"topk_indices must hold key indices in -1..{P + S - 1} (the cache's {P} keys, then the "
                         f"{S} new ones; -1 an unused slot): got {bad}")


def _check_cache(config: AttentionConfig, past_key_shape, past_key_dtype, past_value_shape, past_value_dtype,
                 B: int) -> int:
    """past_key (B, K, P, H) and past_value (B, K, P, V), both or neither; returns P. A latent layer's cache
    (cache_widths): past_key (B, 1, P, C), its normed latent, and past_value (B, 1, P, R), its rotated shared
    key, as transformers' DeepSeek V3 attention caches them."""
    if (past_key_shape is None) != (past_value_shape is None):
        given = "past_key" if past_value_shape is None else "past_value"
        raise ValueError(f"past_key and past_value must be given together: got {given} alone")
    if past_key_shape is None:
        return 0
    (K, key_width, key_letter), (_, value_width, value_letter) = cache_widths(config)
    pk, pv = _shape(past_key_shape), _shape(past_value_shape)
    heads = "1" if config.latent is not None else "K"
    for name, shape, dtype_name, width, letter in (("past_key", pk, past_key_dtype, key_width, key_letter),
                                                   ("past_value", pv, past_value_dtype, value_width, value_letter)):
        if dtype_name is None or "float" not in dtype_name:
            raise ValueError(f"{name} must be a float array: got dtype {dtype_name}")
        if len(shape) != 4 or shape[0] != B or shape[1] != K or shape[3] != width:
            what = (" (a latent layer caches its normed latent in past_key and its rotated shared key in "
                    "past_value)" if config.latent is not None else "")
            raise ValueError(f"{name} must have shape (B, {heads}, P, {letter}) = ({B}, {K}, P, {width}){what}: "
                             f"got {shape}")
    if pk[2] != pv[2]:
        raise ValueError(f"past_key and past_value must hold the same number of positions P: got {pk[2]} and {pv[2]}")
    return pk[2]


def cache_widths(config: AttentionConfig) -> tuple[tuple[int, int, str], tuple[int, int, str]]:
    """The cache's (heads, width, letter) for past_key / present_key and past_value / present_value:
    (K, H) and (K, V); a latent layer's (1, C) (its normed latent) and (1, R) (its rotated shared key)."""
    if config.latent is not None:
        return (1, config.latent.kv_rank, "C"), (1, config.latent.rope_dim, "R")
    return (config.num_kv_heads, config.head_dim, "H"), (config.num_kv_heads, config.value_head_dim, "V")


def check_cache_length(cache_length, capacity: int | None, S: int) -> int:
    """cache_length= of a call (an in-place cache): an integer P with 0 <= P
    and P + S <= the buffers' capacity C. capacity: past_key's length (None
    without past_key). Returns P."""
    if isinstance(cache_length, (bool, np.bool_)) or not isinstance(cache_length, (int, np.integer)):
        raise ValueError(f"cache_length must be an integer: got {cache_length!r}")
    if capacity is None:
        raise ValueError(f"cache_length={cache_length} was given without past_key/past_value (the buffers "
                         "it counts positions in)")
    if cache_length < 0 or cache_length + S > capacity:
        raise ValueError(f"cache_length must be between 0 and C - S = {capacity} - {S} = {capacity - S} (the "
                         f"buffers hold C = {capacity} positions and the call writes S = {S} more): got "
                         f"{cache_length}")
    return int(cache_length)


def check_shared_call(keys_given: bool, past_key_shape, P: int, T: int, key_positions_shape,
                      past_key_positions_shape) -> int:
    """A kv_shared layer's call (issue 42: Gemma 3n's num_kv_shared_layers): no key or value input (the layer has
    no projection for them), a cache of at least T entries (another layer's keys and values after their norm and
    RoPE, the queries' own T tokens last, as that layer appended them), which the call reads and never appends
    to. Returns the cache's length before the queries' tokens, P - T: the call runs as one whose new keys are the
    cache's last T entries (S = T, S_total = P), so the queries sit at P - T .. P - 1 by default."""
    if keys_given:
        raise ValueError("key and value must not be given with kv_shared (the layer has no key or value "
                         "projection: its keys and values are past_key/past_value, another layer's cache)")
    if past_key_shape is None:
        raise ValueError("kv_shared needs past_key and past_value (the cache of the layer whose keys and values "
                         "this one reads): got none")
    if P < T:
        raise ValueError(f"kv_shared needs a cache of at least the queries' T = {T} tokens (the sharing layer "
                         f"appended them last): got a cache of {P}")
    for name, shape in (("key_positions", key_positions_shape), ("past_key_positions", past_key_positions_shape)):
        if shape is not None:
            raise ValueError(f"{name} is not taken with kv_shared (the cache's keys were turned by the layer that "
                             f"made them): got shape {_shape(shape)}")
    return P - T


def check_cache_alignment(config: AttentionConfig, P: int | None, is_causal, causal_alignment: str) -> None:
    """A cache of P > 0 keys puts the queries after them, so is_causal and a
    window need causal_alignment='bottom_right'. P None: a length known only
    at run time (impl_jax's traced cache_length), judged as if P > 0, in the
    same sentence without "(P=...)"."""
    windowed = config.window_left >= 0 or config.window_right >= 0
    if (P is None or P > 0) and (is_causal or windowed) and causal_alignment != "bottom_right":
        cache = "a cache" if P is None else f"a cache (P={P})"
        raise ValueError(f"a call with {cache} aligns its queries after the cached keys: "
                         f"{'is_causal' if is_causal else 'a window'} needs causal_alignment='bottom_right': "
                         f"got {causal_alignment!r}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The path a mirror's call takes, decided in one place per mirror (its
    attention.plan, built from named predicates as PyTorch's
    select_sdp_backend is): "stages" (functional.py, the spec, stage by
    stage), "fused" (logits .. attend as one computation), "sdpa" (torch's
    scaled_dot_product_attention) or "chunked" (online softmax over key
    blocks, chunk_size=). why: the predicate that chose it, in words a
    report can show."""

    path: str
    why: str


PATHS = ("stages", "fused", "sdpa", "chunked")


def check_indexer_call(config, topk_given: bool, past_index_keys, shapes: CallShapes,
                       cache_length) -> None:
    """A layer with an indexer selects its keys itself: topk_indices with it is refused (a layer that takes
    another's selection, GLM-5's shared layers, has no indexer), and its cache is past_index_keys (B, P, J),
    or with cache_length the caller's buffer (B, C, J) whose first P positions are the cache (J: the index
    cache's width, Indexer.cache_width: 2J with block_pool gated)."""
    if config.indexer is None:
        if past_index_keys is not None:
            raise ValueError("past_index_keys is given but config.indexer is null (no indexer, no index cache)")
        return
    if topk_given:
        raise ValueError("topk_indices is given but config.indexer selects the keys itself: pass one of them (a layer "
                         "that reuses another's selection, GLM-5's shared layers, has no indexer)")
    B, P, J = shapes.B, shapes.P, config.indexer.cache_width  # J, or 2J with block_pool gated
    if past_index_keys is None:
        if P:
            raise ValueError(f"past_index_keys is missing: a call with a cache of P={P} keys and config.indexer "
                             f"needs the index keys of those P tokens, (B, P, J) = ({B}, {P}, {J})")
        return
    shape = tuple(np.shape(past_index_keys))
    if cache_length is None:
        if shape != (B, P, J):
            raise ValueError(f"past_index_keys must have shape (B, P, J) = ({B}, {P}, {J}) (P: past_key's length): "
                             f"got {shape}")
    elif len(shape) != 3 or shape[0] != B or shape[2] != J or shape[1] < P + shapes.S:
        raise ValueError(f"past_index_keys must be a buffer of shape (B, C, J) = ({B}, C, {J}) with C >= "
                         f"cache_length + S = {P + shapes.S} (an in-place cache): got {shape}")


def in_place_buffer_error(name: str, must: str, got: str) -> ValueError:
    """The one wording every implementation gives for a past_key/past_value
    it cannot write in place (cache_length=): `must` says what the
    framework needs ("be a ...", "have ..."), `got` what was received."""
    return ValueError(f"{name} with cache_length is written in place: it must {must}: got {got}")


# Issue 41: a DeepSeek V4 layer is a call of its own in every backend, not a multi_head_attention: it takes one
# input and absolute positions (its cache of W - 1 keys no longer says how many tokens came before) and its cache is
# a dict of windows, entries and open compressor windows, where multi_head_attention's is past_key/past_value.
COMPRESSED_REFUSAL = ("config.compressed (a DeepSeek V4 layer) is not taken by multi_head_attention: call the "
                      "backend's compressed_attention(config, tensors, x, positions, past) (impl_numpy.compressed, "
                      "impl_torch.compressed, impl_jax.compressed, impl_mlx.compressed, impl_tf.compressed)")


def check_call(
    config: AttentionConfig,
    *,
    query_shape,
    key_shape=None,
    value_shape=None,
    mask_shape=None,
    mask_dtype: str | None = None,
    bias_shape=None,
    bias_dtype: str | None = None,
    dropout_mask_shape=None,
    dropout_mask_dtype: str | None = None,
    positions_shape=None,
    positions_dtype: str | None = None,
    key_positions_shape=None,
    key_positions_dtype: str | None = None,
    past_key_shape=None,
    past_key_dtype: str | None = None,
    past_value_shape=None,
    past_value_dtype: str | None = None,
    past_key_positions_shape=None,
    past_key_positions_dtype: str | None = None,
    segment_ids_shape=None,
    segment_ids_dtype: str | None = None,
    key_segment_ids_shape=None,
    key_segment_ids_dtype: str | None = None,
    topk_indices_shape=None,
    topk_indices_dtype: str | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    training: bool = False,
    seed: int | None = None,
    return_weights: bool = False,
    return_cache: bool = False,
    cache_length=None,
    materializes_scores: bool = True,
    scores_itemsize: int = 4,
    keys_given: bool = True,
) -> CallShapes:
    """Validate one call; ValueError names the argument and the value received.

    positions (T,) or (B, T) and key_positions (S,) or (B, S): integer RoPE
    positions of the queries and the new keys ((3, T) or (3, B, T), one row per
    axis, with rope.mrope_section: check_mrope_ids). past_key (B, K, P, H) and
    past_value (B, K, P, V): the cache (both or neither). past_key_positions
    (P,) or (B, P): the cached keys' positions (default 0..P-1), integer, only
    with a cache; read wherever key positions are (ALiBi, local chunks; RoPE
    was applied to the cached keys when they were new), e.g. a left-padded
    row's keys at index - pads. segment_ids (T,) or
    (B, T) and key_segment_ids (S_total,) or (B, S_total): packed sequences;
    key_segment_ids may be left out only in self-attention without a cache
    (keys_given false: the caller passed no key or value, so the keys are the
    queries, and S_total == T). Masks, bias and the dropout mask cover S_total
    keys.

    cache_length P (an in-place cache, as Hugging Face's StaticCache and
    torchtune's KVCache): past_key (B, K, C, H) and past_value (B, K, C, V)
    are caller-owned buffers whose first P positions are the cache; the call
    writes its S new keys and values (after norm and RoPE) at P .. P+S-1 and
    computes exactly what it would with past_key[:, :, :P] (S_total = P + S).
    Positions from P+S on are never part of a result; they must hold finite
    values (a zeroed buffer), since a backend may read them with weight 0.

    materializes_scores: the call will hold (B, N, T, S_total) arrays (every
    path but the chunked ones); it is refused up front when they cannot fit
    in the memory available, instead of ending in an out-of-memory kill."""
    if getattr(config, "compressed", None) is not None:
        raise ValueError(COMPRESSED_REFUSAL)
    q = _shape(query_shape)
    k = q if key_shape is None else _shape(key_shape)
    v = k if value_shape is None else _shape(value_shape)
    for name, shape, dim, dim_name in (
        ("query", q, config.query_dim, "query_dim"),
        ("key", k, config.key_dim, "key_dim"),
        ("value", v, config.value_dim, "value_dim"),
    ):
        if name != "query" and getattr(config, "kv_shared", False) and not keys_given:
            continue  # a kv_shared layer reads no key or value input: the query stands in (check_shared_call)
        if len(shape) != 3:
            raise ValueError(f"{name} must have shape (B, L, {dim_name}) = (B, L, {dim}): got rank {len(shape)} shape {shape}")
        if shape[2] != dim:
            raise ValueError(f"{name} must have {dim_name}={dim} features: got shape {shape}")
        if 0 in shape[:2]:
            raise ValueError(f"{name} is empty: got shape {shape}; empty batches and sequences are refused")
    if not (q[0] == k[0] == v[0]):
        raise ValueError(f"query, key and value must share the batch size B: got {q[0]}, {k[0]}, {v[0]}")
    if k[1] != v[1]:
        raise ValueError(f"key and value must share the length S: got key shape {k}, value shape {v}")
    B, T, S = q[0], q[1], k[1]
    N = config.num_heads
    P = _check_cache(config, past_key_shape, past_key_dtype, past_value_shape, past_value_dtype, B)
    capacity = None
    if cache_length is not None:
        capacity = P if past_key_shape is not None else None
        P = check_cache_length(cache_length, capacity, 0 if getattr(config, "kv_shared", False) else S)
    if getattr(config, "kv_shared", False):  # the cache's last T entries are the queries' own keys (issue 42)
        P = check_shared_call(keys_given, past_key_shape, P, T, key_positions_shape, past_key_positions_shape)
    S_total = P + S  # the keys masks, bias, causal, windows and the weights see
    mask4 = bias4 = None
    if mask_shape is not None:
        if mask_dtype != "bool":
            hint = " (an additive float mask goes in bias=)" if mask_dtype and "float" in mask_dtype else ""
            raise ValueError(f"mask must be bool with True = may attend: got dtype {mask_dtype}{hint}")
        mask4 = broadcast_shape("mask", _shape(mask_shape), B, N, T, S_total)
    if bias_shape is not None:
        if bias_dtype is None or "float" not in bias_dtype:
            raise ValueError(f"bias must be a float array: got dtype {bias_dtype}")
        bias4 = broadcast_shape("bias", _shape(bias_shape), B, N, T, S_total)
    ids = check_mrope_ids if config.rope is not None and config.rope.mrope_section is not None else check_ids
    if positions_shape is not None:
        ids("positions", positions_shape, positions_dtype, B, T, "T")
    if key_positions_shape is not None:
        ids("key_positions", key_positions_shape, key_positions_dtype, B, S, "S")
    if past_key_positions_shape is not None:
        if past_key_shape is None:
            raise ValueError("past_key_positions was given without past_key/past_value (the cache whose keys it "
                             "places)")
        ids("past_key_positions", past_key_positions_shape, past_key_positions_dtype, B, P, "P")
    if segment_ids_shape is not None:
        check_ids("segment_ids", segment_ids_shape, segment_ids_dtype, B, T, "T")
        if key_segment_ids_shape is None and keys_given:
            raise ValueError("key_segment_ids is required when key or value is passed (only self-attention, "
                             "where the keys are the queries, takes segment_ids for both): got segment_ids "
                             "and no key_segment_ids")
        if key_segment_ids_shape is None and S_total != T:
            raise ValueError(f"key_segment_ids is required when the keys are not the queries' positions: "
                             f"got segment_ids for T={T} queries and none for S_total={S_total} keys")
    if key_segment_ids_shape is not None:
        if segment_ids_shape is None:
            raise ValueError("key_segment_ids was given without segment_ids (the queries' ids)")
        check_ids("key_segment_ids", key_segment_ids_shape, key_segment_ids_dtype, B, S_total, "S_total")
    if topk_indices_shape is not None:
        check_topk_indices(topk_indices_shape, topk_indices_dtype, B, config.num_kv_heads, T)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise ValueError(f"is_causal must be true or false: got {is_causal!r}")
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {', '.join(CAUSAL_ALIGNMENTS)}: got {causal_alignment!r}")
    check_cache_alignment(config, P, is_causal, causal_alignment)
    if not isinstance(return_cache, (bool, np.bool_)):
        raise ValueError(f"return_cache must be true or false: got {return_cache!r}")
    if dropout_mask_shape is not None:
        if not training:
            raise ValueError("dropout_mask was given but training is false; pass training=True (CLI: --training)")
        if dropout_mask_dtype != "bool":
            raise ValueError(f"dropout_mask must be bool with True = keep: got dtype {dropout_mask_dtype}")
        if _shape(dropout_mask_shape) != (B, N, T, S_total):
            letters = "(B, N, T, S)" if P == 0 else "(B, N, T, S_total)"
            raise ValueError(f"dropout_mask must have shape {letters} = {(B, N, T, S_total)}: "
                             f"got {_shape(dropout_mask_shape)}")
    elif training and config.dropout > 0 and seed is None:
        raise ValueError(
            f"training with dropout={config.dropout} needs dropout_mask (a bool keep-mask) or seed; got neither"
        )
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise ValueError(f"seed must be an integer: got {seed!r}")
    if materializes_scores:
        check_scores_fit(B, N, T, S_total, scores_itemsize)
    return CallShapes(B=B, T=T, S=S, mask_shape=mask4, bias_shape=bias4, P=P, capacity=capacity)


# Arrays of (B, N, T, S) alive at once on the plain path: logits, masked
# logits, exp, weights (and the dropped weights in training).
SCORE_COPIES = 4


CHUNK_REFUSAL = (
    "chunk_size cannot be combined with return_weights or trace: the chunked path never forms the (T, S) weights"
)


def check_chunk_size(chunk_size, *, return_weights: bool = False, traced: bool = False) -> int | None:
    """chunk_size= of a call: None, or a positive integer, and not with
    return_weights or a trace. Each implementation checks it right after
    check_call, before computing anything."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer: got {chunk_size!r}")
    if return_weights or traced:
        raise ValueError(CHUNK_REFUSAL)
    return int(chunk_size)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, capped by RLIMIT_AS; None if unknown."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            available = soft if available is None else min(available, soft)
    except (ImportError, ValueError, OSError):
        pass
    return available


def check_scores_fit(B: int, N: int, T: int, S: int, itemsize: int, available: int | None = None) -> None:
    need = B * N * T * S * itemsize * SCORE_COPIES
    available = available_memory_bytes() if available is None else available
    if available is not None and need > available:
        raise ValueError(
            f"the (B, N, T, S) = {(B, N, T, S)} attention scores need about {need / 2**30:.1f} GiB, more than the "
            f"{available / 2**30:.1f} GiB of memory available; use the chunked path (impl_numpy: chunk_size=) "
            "without return_weights, or a smaller batch"
        )


def check_input_values(**arrays) -> None:
    """query/key/value may hold NaN (it propagates) but not +-inf: an infinite
    logit is indistinguishable from a masked one, so a row could silently
    follow the masked-row policy instead of becoming NaN."""
    for name, array in arrays.items():
        if array is None:
            continue
        values = np.asarray(array)
        if values.dtype.kind == "f" or values.dtype.name == "bfloat16":
            values = for_value_checks(values)
            # all finite (the common case) proven by the extremes; else NaN may hide an inf: look at each element
            if values.size and not extremes_finite(values) and np.isinf(values).any():
                raise ValueError(f"{name} contains +-inf; NaN propagates but infinite inputs are refused "
                                 "(an infinite logit would look like a masked one)")


def check_position_values(config, positions) -> None:
    """With a query temperature, ln(1 + floor((position + offset) / floor)) needs position + offset >= 0
    (a model's positions count from 0): a smaller one is refused, naming the position."""
    temperature = getattr(config, "query_temperature", None)
    if temperature is None or positions is None or temperature.position == "cache_index":
        return  # (the cache index P + t is never negative)
    values = np.asarray(positions)
    if values.size and int(values.min()) + temperature.offset < 0:
        raise ValueError(f"positions must be >= {-temperature.offset} with a query_temperature (its log counts "
                         f"positions from 0): got {int(values.min())}")


def check_bias_values(bias) -> None:
    """-inf is allowed (it masks); NaN and +inf are not."""
    array = np.asarray(bias, dtype=np.float64)
    if np.isnan(array).any() or np.isposinf(array).any():
        raise ValueError("bias must not contain NaN or +inf (use -inf to mask a position)")
