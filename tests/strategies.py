"""Hypothesis strategies for configs and calls: small sizes, every option.

configs() draws every classic field; with modern=True also the modern ones (weights/config.py): rope (any
even rotary_dim, half-split or interleaved, any theta, no scaling or linear, llama3 or yarn), qk_norm (rms or
layer, per head or over all heads), window_left / window_right, logit_softcap and use_sinks, and the frontier
fields (alibi, local_chunk, query_temperature, qkv_clip, output_gate, value_norm; qk_norm's weight, per_head and
after_rope), each one on or off by itself.

calls() draws lengths of 1 to 6 and, one draw in five, 7 to 40 (LONG), so a length crosses the key blocks of
a small chunk_size many times; shrinking goes to the short ones. With modern=True also the modern inputs
where weights/contract.py check_call allows them: positions and key_positions ((L,) or (B, L), any integers),
a cache past_key / past_value of P positions (the mask, bias and dropout mask then cover S_total = P + S
keys, and is_causal or a window align bottom_right, as check_cache_alignment requires), and packed
segment_ids with key_segment_ids.

A test that compares with a formulation written for the classic layer (tests/formulations.py) draws with
modern=False, the default.
"""

from __future__ import annotations

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from weights import AttentionConfig

LONG = 40  # the longest length drawn (T, S and the cache's P)


@st.composite
def lengths(draw, low: int = 1) -> int:
    """low..6, and one draw in five 7..LONG."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.integers(7, LONG))
    return draw(st.integers(low, 6))


@st.composite
def rope_scalings(draw):
    kind = draw(st.sampled_from([None, "linear", "llama3", "yarn"]))
    if kind is None:
        return None
    factor = draw(st.floats(1.0, 40.0))
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    # a short original context, so that the positions drawn (up to a few hundred) pass it
    original = draw(st.integers(4, 64))
    if kind == "llama3":
        low = draw(st.floats(0.5, 2.0))
        return {"type": "llama3", "factor": factor, "low_freq_factor": low,
                "high_freq_factor": low + draw(st.floats(0.25, 4.0)), "original_max_position_embeddings": original}
    scaling = {"type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    if draw(st.booleans()):
        scaling.update(beta_fast=draw(st.floats(8.0, 64.0)), beta_slow=draw(st.floats(0.5, 2.0)),
                       truncate=draw(st.booleans()))
    extra = draw(st.sampled_from(["none", "attention_factor", "mscale"]))
    if extra == "attention_factor":
        scaling["attention_factor"] = draw(st.floats(0.5, 2.0))
    elif extra == "mscale":
        scaling.update(mscale=draw(st.floats(0.5, 1.5)), mscale_all_dim=draw(st.floats(0.5, 1.5)))
    return scaling


@st.composite
def modern_fields(draw, head_dim: int, qk_norm_eps=(1e-6, 1e-5, 1e-2)) -> dict:
    """AttentionConfig's modern fields, each on or off by itself."""
    fields: dict = {}
    if head_dim >= 2 and draw(st.booleans()):
        fields["rope"] = {"rotary_dim": draw(st.sampled_from(range(2, head_dim + 1, 2))),
                          "interleaved": draw(st.booleans()),
                          "theta": draw(st.sampled_from([10000.0, 100.0, 500000.0]) | st.floats(2.0, 1e6)),
                          "scaling": draw(rope_scalings())}
    if draw(st.booleans()):
        scope = draw(st.sampled_from(["head", "all"]))
        weight = draw(st.integers(0, 3)) > 0
        fields["qk_norm"] = {"type": draw(st.sampled_from(["rms", "layer"])), "scope": scope,
                             "eps": draw(st.sampled_from(qk_norm_eps)), "weight": weight,
                             "per_head": scope == "head" and weight and draw(st.booleans()),
                             "after_rope": draw(st.integers(0, 3)) == 0}
    if draw(st.booleans()):
        fields["window_left"] = draw(st.integers(-1, 8))
        fields["window_right"] = draw(st.integers(-1, 8))
    if draw(st.booleans()):
        fields["logit_softcap"] = draw(st.floats(0.5, 50.0))
    fields["use_sinks"] = draw(st.booleans())
    # the frontier fields (docs/spec-frontier.md), each on one draw in three
    if draw(st.integers(0, 2)) == 0:
        fields["alibi"] = True
    if draw(st.integers(0, 2)) == 0:
        fields["local_chunk"] = draw(st.integers(1, 8))
    if draw(st.integers(0, 2)) == 0:
        fields["query_temperature"] = {"beta": draw(st.sampled_from([0.1, 0.5, -0.2])),
                                       "floor": draw(st.sampled_from([1.0, 3.0, 8192.0])),
                                       "offset": draw(st.integers(0, 1))}
    if draw(st.integers(0, 2)) == 0:
        fields["qkv_clip"] = draw(st.sampled_from([0.1, 0.5, 8.0]))
    if draw(st.integers(0, 3)) == 0:
        fields["value_norm"] = {"type": draw(st.sampled_from(["rms", "layer"])),
                                "scope": draw(st.sampled_from(["head", "all"])), "weight": draw(st.booleans())}
    if draw(st.integers(0, 2)) == 0:
        fields["output_gate"] = {"scope": draw(st.sampled_from(["element", "head"])), "bias": draw(st.booleans())}
    return fields


@st.composite
def configs(draw, *, equal_dims: bool = False, masked_rows=("zero", "uniform", "nan"), dropout: bool = False,
            modern: bool = False, qk_norm_eps=(1e-6, 1e-5, 1e-2)):
    K = draw(st.integers(1, 3))
    G = draw(st.integers(1, 3))
    query_dim = draw(st.integers(1, 7))
    head_dim = draw(st.integers(1, 5)) if not modern else draw(st.integers(1, 8))  # 8: rotary_dim < head_dim too
    return AttentionConfig(
        num_heads=K * G,
        num_kv_heads=K,
        query_dim=query_dim,
        key_dim=query_dim if equal_dims else draw(st.integers(1, 7)),
        value_dim=query_dim if equal_dims else draw(st.integers(1, 7)),
        head_dim=head_dim,
        value_head_dim=draw(st.integers(1, 5)),
        out_dim=draw(st.integers(1, 6)),
        use_query_bias=draw(st.booleans()),
        use_key_bias=draw(st.booleans()),
        use_value_bias=draw(st.booleans()),
        use_output_bias=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        dropout=draw(st.sampled_from([0.0, 0.2])) if dropout else 0.0,
        masked_row=draw(st.sampled_from(masked_rows)),
        **(draw(modern_fields(head_dim, qk_norm_eps)) if modern else {}),
    )


def _ids(rng, B: int, L: int, per_batch: bool, documents: int) -> np.ndarray:
    """Packed segment ids: (L,) or (B, L) non-decreasing integers in 0..documents-1."""
    shape = (B, L) if per_batch else (L,)
    return np.sort(rng.integers(0, documents, size=shape), axis=-1).astype(np.int64)


def _positions(draw, rng, B: int, L: int, P: int) -> np.ndarray:
    kind = draw(st.sampled_from(["offset", "per_batch", "random"]))
    if kind == "offset":  # a later chunk of one sequence
        return (draw(st.integers(0, 300)) + P + np.arange(L)).astype(np.int64)  # (L,)
    if kind == "per_batch":  # rows at different offsets
        return (rng.integers(0, 300, size=(B, 1)) + P + np.arange(L)).astype(np.int64)  # (B, L)
    return rng.integers(0, 300, size=(B, L) if draw(st.booleans()) else (L,)).astype(np.int64)  # any integers


def _one_visible_key(config: AttentionConfig, T: int, S_total: int, options: dict) -> list[int]:
    """For allow_empty_rows=False: a key each query row sees whatever the mask (causal and window allowing),
    the diagonal as the alignment places it, clipped to the keys; rejects the example where a row has none."""
    offset = S_total - T if options.get("causal_alignment") == "bottom_right" else 0
    keys = []
    for i in range(T):
        j = min(max(i + offset, 0), S_total - 1)
        visible = (not options.get("is_causal") or j <= i + offset) and (
            config.window_left < 0 or j >= i + offset - config.window_left) and (
            config.window_right < 0 or j <= i + offset + config.window_right)
        assume(visible)
        keys.append(j)
    return keys


@st.composite
def calls(draw, config: AttentionConfig, *, allow_empty_rows: bool = True, self_attention: bool | None = None,
          modern: bool = False):
    """(query, key, value, options) in float64 with a random mask/bias/causal; with modern=True also
    positions, a cache and segment ids (see the module's docstring)."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    B = draw(st.integers(1, 3))
    T = draw(lengths())
    same = self_attention if self_attention is not None else draw(st.booleans())
    same = same and config.query_dim == config.key_dim == config.value_dim
    S = T if same else draw(lengths())
    query = rng.standard_normal((B, T, config.query_dim))
    key = query if same else rng.standard_normal((B, S, config.key_dim))
    value = query if same else rng.standard_normal((B, S, config.value_dim))
    options: dict = {}
    K, N = config.num_kv_heads, config.num_heads
    P = draw(lengths()) if modern and draw(st.integers(0, 2)) == 0 else 0
    if P:
        options["past_key"] = rng.standard_normal((B, K, P, config.head_dim))
        options["past_value"] = rng.standard_normal((B, K, P, config.value_head_dim))
    S_total = P + S  # the keys a mask, bias and dropout mask cover
    mask_kind = draw(st.sampled_from(["none", "ts", "bts", "b1ts", "bnts", "padding"]))
    shape = {"ts": (T, S_total), "bts": (B, T, S_total), "b1ts": (B, 1, T, S_total), "bnts": (B, N, T, S_total),
             "padding": (B, 1, 1, S_total)}.get(mask_kind)
    if shape is not None:
        options["mask"] = rng.random(shape) < 0.7
    if draw(st.booleans()):
        b = rng.standard_normal((B, 1, T, S_total))
        if allow_empty_rows and draw(st.booleans()):
            b[rng.random(b.shape) < 0.2] = -np.inf
        options["bias"] = b
    windowed = config.window_left >= 0 or config.window_right >= 0
    if draw(st.booleans()):
        options["is_causal"] = True
        options["causal_alignment"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    elif windowed and draw(st.booleans()):
        options["causal_alignment"] = draw(st.sampled_from(["top_left", "bottom_right"]))  # where a window is placed
    if P and (options.get("is_causal") or windowed):
        options["causal_alignment"] = "bottom_right"  # the queries come after the cached keys
    if not allow_empty_rows:
        if options.get("causal_alignment") == "bottom_right" and T > S_total and not P:
            options["causal_alignment"] = "top_left"
        if "mask" in options:
            m = np.broadcast_to(options["mask"], np.broadcast_shapes(options["mask"].shape, (T, S_total))).copy()
            m[..., np.arange(T), _one_visible_key(config, T, S_total, options)] = True
            options["mask"] = m
        else:
            _one_visible_key(config, T, S_total, options)
    if modern:
        if draw(st.booleans()):
            options["positions"] = _positions(draw, rng, B, T, P)
        if draw(st.booleans()):
            options["key_positions"] = _positions(draw, rng, B, S, P)
        if allow_empty_rows and draw(st.booleans()):
            documents = draw(st.integers(1, 3))
            options["segment_ids"] = _ids(rng, B, T, draw(st.booleans()), documents)
            if same and not P and draw(st.booleans()):
                options["key_segment_ids"] = options["segment_ids"].copy()  # one packing for queries and keys
            else:
                options["key_segment_ids"] = _ids(rng, B, S_total, draw(st.booleans()), documents)
    if config.dropout > 0 and draw(st.booleans()):
        options["training"] = True
        options["dropout_mask"] = rng.random((B, N, T, S_total)) >= config.dropout
    return query, key, value, options
