"""The named case grid: every feature of the contract, small enough to ship.

A Case is data only (config, sizes, which inputs it has, call options).
`make_tensors` and `make_inputs` turn it into float64 arrays from fixed seeds,
so every backend, test and vector file sees the same numbers.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any

import numpy as np

import weights
from weights import AttentionConfig
from weights.contract import cache_widths
from weights.dtypes import is_float

DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: AttentionConfig
    B: int = 2
    T: int = 5
    S: int = 5
    self_attention: bool = True  # key and value are the query (else separate inputs)
    mask: str | None = None  # None | "padding" | "random" | "random_bts" | "random_ts" | "empty_rows"
    bias: str | None = None  # None | "random" | "neg_inf"
    is_causal: bool = False
    causal_alignment: str = "top_left"
    training: bool = False  # with an explicit dropout mask
    return_weights: bool = True
    input_scale: float = 1.0  # > 1 makes large logits
    # The modern inputs (all off by default: a plain case's vectors are unchanged)
    # None (the defaults) | "far" | "per_batch" | "packed" (with segment ids) | "explicit" | "left_padded"
    # (with a cache: past_key_positions)
    positions: str | None = None
    first_position: int = 0  # positions "explicit": the first new key's position (see _modern_inputs)
    P: int = 0  # cache length: past_key / past_value of P positions
    return_cache: bool = False
    # topk_indices (attention over selected keys): None | "shared" (B, T, k) | "per_kv_head" (B, K, T, k) |
    # "empty_row" (shared, query 0 of row 0 selecting only keys the other masks hide); top_k: k
    selection: str | None = None
    top_k: int = 0
    # near-ties (issue 39 item 3): tokens 4, 6, 8, ... repeat token 2 up to this relative perturbation, so with
    # no RoPE on the index key their index scores tie up to about it for every query; 0: none
    near_ties: float = 0.0

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())

    @property
    def S_total(self) -> int:
        """Keys that masks, bias, causal and windows see: the cache's and the new ones."""
        return self.P + self.S

    def options(self, dtype: str) -> dict[str, Any]:
        options = {
            "is_causal": self.is_causal, "causal_alignment": self.causal_alignment,
            "return_weights": self.return_weights, "dtype": dtype, "training": self.training,
        }
        if self.return_cache:
            options["return_cache"] = True
        return options


def _cfg(**kw) -> AttentionConfig:
    base = dict(num_heads=2, query_dim=8, head_dim=4)
    base.update(kw)
    return AttentionConfig(**base)


def _grid() -> list[Case]:
    cross = dict(self_attention=False, T=4, S=6)
    return [
        Case("self_basic", _cfg()),
        Case("cross_basic", _cfg(), **cross),
        Case("cross_dims", _cfg(query_dim=6, key_dim=5, value_dim=7, head_dim=3), **cross),
        Case("value_head_dim", _cfg(head_dim=3, value_head_dim=5), **cross),
        Case("out_dim", _cfg(out_dim=3)),
        Case("no_query_bias", _cfg(use_query_bias=False)),
        Case("no_key_bias", _cfg(use_key_bias=False), **cross),
        Case("no_value_bias", _cfg(use_value_bias=False), **cross),
        Case("no_output_bias", _cfg(use_output_bias=False)),
        Case("no_biases", _cfg(use_query_bias=False, use_key_bias=False, use_value_bias=False, use_output_bias=False)),
        Case("custom_scale", _cfg(scale=0.3)),
        Case("gqa", _cfg(num_heads=4, num_kv_heads=2, head_dim=3), **cross),
        Case("mqa", _cfg(num_heads=4, num_kv_heads=1, head_dim=3), **cross),
        Case("query_len_1", _cfg(), self_attention=False, T=1, S=5),
        Case("key_len_1", _cfg(), self_attention=False, T=4, S=1),
        Case("causal_square", _cfg(), is_causal=True),
        Case("causal_top_left", _cfg(), is_causal=True, **cross),
        Case("causal_bottom_right", _cfg(), is_causal=True, causal_alignment="bottom_right", **cross),
        Case("causal_bottom_right_long_query", _cfg(), is_causal=True, causal_alignment="bottom_right",
             self_attention=False, T=6, S=4, mask=None),
        Case("padding_mask", _cfg(), mask="padding", **cross),
        Case("mask_bnts", _cfg(), mask="random", **cross),
        Case("mask_bts", _cfg(), mask="random_bts", **cross),
        Case("mask_ts", _cfg(), mask="random_ts", **cross),
        Case("bias", _cfg(), bias="random", **cross),
        Case("bias_neg_inf", _cfg(), bias="neg_inf", **cross),
        Case("mask_and_bias_causal", _cfg(num_heads=4, num_kv_heads=2), mask="padding", bias="random", is_causal=True),
        Case("masked_rows_zero", _cfg(masked_row="zero"), mask="empty_rows", **cross),
        Case("masked_rows_uniform", _cfg(masked_row="uniform"), mask="empty_rows", **cross),
        Case("masked_rows_nan", _cfg(masked_row="nan"), mask="empty_rows", **cross),
        Case("large_logits", _cfg(scale=1.0), input_scale=6.0),
        Case("dropout_train", _cfg(dropout=0.25), training=True, **cross),
        Case("no_weights", _cfg(), return_weights=False, mask="padding", **cross),
    ] + _modern_grid() + _topk_grid() + _indexer_grid() + _long_grid() + _mrope_grid() + _differential_grid() + _sharing_grid() + _v4_grid()


def _modern_grid() -> list[Case]:
    """Rope, cache, windows, softcap, QK-norm, sinks, packed segments, and their combinations."""
    cross = dict(self_attention=False, T=4, S=6)
    causal = dict(is_causal=True)
    decode = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True, self_attention=False)
    # llama3 / yarn with a short original context (16), so that positions past it (positions="far")
    # and head_dim 8's four frequencies reach every branch of the rules.
    llama3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    return [
        Case("rope_half", _cfg(rope={}), T=6, S=6, **causal),
        Case("rope_interleaved", _cfg(rope={"interleaved": True}), **cross),
        Case("rope_partial", _cfg(head_dim=8, rope={"rotary_dim": 4, "theta": 100.0}), **causal),
        Case("rope_llama3", _cfg(head_dim=8, rope={"scaling": llama3}), positions="far", **causal),
        Case("rope_yarn", _cfg(head_dim=8, rope={"interleaved": True, "scaling": yarn}), positions="per_batch",
             **cross),
        Case("rope_linear_per_batch", _cfg(rope={"scaling": {"type": "linear", "factor": 2.0}}),
             positions="per_batch", **causal),
        Case("decode_cache", _cfg(num_heads=4, num_kv_heads=2, rope={}), T=1, S=1, P=5, return_weights=False,
             **decode),
        Case("cache_window_gqa", _cfg(num_heads=4, num_kv_heads=2, rope={}, window_left=2), T=3, S=3, P=4,
             **decode),
        Case("return_cache_no_past", _cfg(rope={}), return_cache=True, **causal),
        Case("window_left_causal", _cfg(window_left=2), T=7, S=7, **causal),
        Case("window_right", _cfg(window_right=1), **cross),
        Case("window_both_bottom_right", _cfg(window_left=1, window_right=1), mask="padding",
             causal_alignment="bottom_right", **cross),
        Case("softcap", _cfg(scale=1.0, logit_softcap=2.0), bias="neg_inf", input_scale=4.0, **cross),
        Case("softcap_masked_rows", _cfg(logit_softcap=5.0, masked_row="uniform"), mask="empty_rows", **cross),
        Case("qk_norm_rms_head", _cfg(num_heads=4, num_kv_heads=2, qk_norm={"type": "rms"}), **causal),
        Case("qk_norm_layer_all", _cfg(qk_norm={"type": "layer", "scope": "all", "eps": 1e-5}), **cross),
        Case("sinks", _cfg(num_heads=4, num_kv_heads=2, use_sinks=True), mask="padding", **causal),
        Case("sinks_masked_rows", _cfg(use_sinks=True, masked_row="nan"), mask="empty_rows", **cross),
        Case("segments_packed", _cfg(rope={}), T=7, S=7, positions="packed", **causal),
        # RoPE is relative: a port that rotates a packed row at 0..T-1 instead of the restarted positions
        # gets the same attention output; only the keys it stores (the cache a packed prefill writes) show it
        Case("segments_packed_cache", _cfg(num_heads=4, num_kv_heads=2, rope={}), T=7, S=7, positions="packed",
             return_cache=True, **causal),
        Case("modern_everything",
             _cfg(num_heads=4, num_kv_heads=2, head_dim=8, window_left=3, logit_softcap=8.0, use_sinks=True,
                  qk_norm={"type": "rms", "scope": "all"},
                  rope={"rotary_dim": 6, "interleaved": True, "scaling": yarn}),
             T=3, S=3, P=4, positions="far", mask="padding", bias="random", **decode),
    ] + _frontier_grid()


def _frontier_grid() -> list[Case]:
    """ALiBi, local chunks, the query temperature, the QKV clip, output gates, the QK-norm variants (per-head
    weights, after RoPE), the value norm, LongRoPE and proportional RoPE, latent attention, and all of them
    together."""
    cross = dict(self_attention=False, T=4, S=6)
    causal = dict(is_causal=True)
    decode = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True, self_attention=False)
    longrope = {"type": "longrope", "factor": 8.0, "original_max_position_embeddings": 16,
                "short_factor": [1.0, 1.3, 2.1], "long_factor": [1.5, 4.0, 9.0]}
    return [
        Case("alibi_causal", _cfg(num_heads=6, num_kv_heads=2, alibi=True), T=6, S=6, mask="padding", **causal),
        # the cache's keys at positions 0..P-1: ALiBi's distances and the chunks count from there
        Case("alibi_chunk_decode", _cfg(num_heads=4, num_kv_heads=2, rope={}, alibi=True, local_chunk=4), T=3, S=3,
             P=5, **decode),
        Case("local_chunk_per_batch", _cfg(local_chunk=3), T=7, S=7, positions="per_batch", **causal),
        Case("query_temperature", _cfg(rope={}, qk_norm={"type": "rms"},
                                       query_temperature={"beta": 0.5, "floor": 3.0, "offset": 1}),
             positions="far", **causal),
        # c 0.45, not 0.5: no pre-clip value within 16-bit rounding of +-c, so no gate flips between the 16-bit and
        # the float64 reference (at 0.5 the bfloat16 reference's own error on the key gradients was 47% of them:
        # an allowance a zero gradient passes; tests/test_not_judged.py)
        Case("qkv_clip", _cfg(qkv_clip=0.45, qk_norm={"type": "rms"}), input_scale=2.0, **cross),
        # N*V == O: a port that gates the projected output instead of the context runs, and is caught
        Case("output_gate_element", _cfg(value_head_dim=3, out_dim=6, output_gate={"scope": "element", "bias": True}),
             **cross),
        Case("output_gate_head", _cfg(num_heads=4, num_kv_heads=2, output_gate={"scope": "head"}), **causal),
        Case("qk_norm_per_head_layer", _cfg(num_heads=4, num_kv_heads=2, qk_norm={"type": "layer", "per_head": True}),
             **cross),
        # weighted, so that the order shows: a weightless RMS norm over a head commutes with RoPE (a rotation
        # keeps the norm), Llama 4's included
        Case("norm_after_rope_chunked", _cfg(rope={"interleaved": True}, local_chunk=4,
                                             qk_norm={"type": "rms", "eps": 1e-5, "after_rope": True}), T=7, S=7,
             **causal),
        # Gemma 4's pieces: the weightless value norm and proportional RoPE (half of the pairs turn, over the head)
        Case("value_norm", _cfg(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm={"type": "rms"},
                                value_norm={"type": "rms", "weight": False},
                                rope={"scaling": {"type": "proportional", "partial_rotary_factor": 0.5}}), **causal),
        # LongRoPE's two tables: a call within the original context (short) and one past it (long)
        Case("rope_longrope_short", _cfg(head_dim=8, rope={"rotary_dim": 6, "scaling": longrope}), T=6, S=6, **causal),
        Case("rope_longrope_long", _cfg(head_dim=8, rope={"rotary_dim": 6, "scaling": longrope}), positions="far",
             **cross),
        # multi-head latent attention: DeepSeek V3's shape (query rank, interleaved RoPE on 2 of 6 features), and
        # a decode step over a latent cache without a query rank, with Mistral 4's query temperature
        Case("latent_mla", _cfg(num_heads=4, head_dim=6, value_head_dim=4, use_value_bias=False,
                                rope={"interleaved": True}, latent={"query_rank": 6, "kv_rank": 5, "rope_dim": 2}),
             T=6, S=6, **causal),
        Case("latent_decode", _cfg(num_heads=4, num_kv_heads=2, head_dim=6, value_head_dim=3, use_value_bias=False,
                                   rope={}, latent={"query_rank": None, "kv_rank": 4, "rope_dim": 4},
                                   query_temperature={"beta": 0.3, "floor": 4.0}), T=2, S=2, P=5, **decode),
        Case("frontier_everything",
             _cfg(num_heads=4, num_kv_heads=2, head_dim=8, rope={"rotary_dim": 4}, alibi=True, local_chunk=5,
                  query_temperature={"beta": 0.1, "floor": 4.0, "offset": 0}, qkv_clip=0.8, use_sinks=True,
                  output_gate={"scope": "element"}, logit_softcap=10.0),
             T=3, S=3, P=4, positions="far", mask="padding", **decode),
    ] + _edge_grid()


def _edge_grid() -> list[Case]:
    """The contract's thresholds, a case on each side (issue 38, item 3), and the features the other cases never
    reach: a weightless QK-norm, a weighted value norm, ALiBi / chunks / the temperature over a cache whose keys a
    query sees under explicit positions, causal with T < S and T > S over a cache.

    Each position is computed from the config it tests (`first_position`), never typed, and
    tests/test_edge_cases.py asserts that each case sits where its comment says, so an edit cannot drift it off
    its edge. The window's first and last visible keys (p - left, p + right) and a chunk boundary inside one call
    are the existing window_left_causal, window_both_bottom_right, local_chunk_per_batch and
    norm_after_rope_chunked (the test asserts those too)."""
    causal = dict(is_causal=True)
    decode = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True, self_attention=False)
    # LongRoPE: the long table iff the call's largest position + 1 > original_max_position_embeddings; the
    # attention factor given, and not the one the LongRoPE rule would compute from factor (sqrt(1.75) here)
    longrope = {"type": "longrope", "factor": 8.0, "original_max_position_embeddings": 16, "attention_factor": 1.1,
                "short_factor": [1.0, 1.3, 2.1], "long_factor": [1.5, 4.0, 9.0]}
    longrope_cfg = _cfg(head_dim=8, rope={"rotary_dim": 6, "scaling": longrope})
    original = longrope["original_max_position_embeddings"]
    T = 4  # self attention: the largest position is first_position + T - 1
    # llama3 over theta 100 (wavelengths 2 pi 100^(i/4): 6.3, 19.9, 62.8, 199) with original 32 / high_freq_factor 4
    # = 8 and original / low_freq_factor = 32: pair 0 below the ramp, pair 1 on it, pairs 2 and 3 past it
    llama3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    # YaRN without rounding (gpt-oss's truncate false): over theta 100 and original 64 the ramp runs from dimension
    # 0.81 (beta_fast 4) to 2.02 (beta_slow 1): pair 0 before it, pairs 1 and 2 on it, pair 3 past it
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 4.0, "beta_slow": 1.0,
            "truncate": False}
    # Llama 4's temperature (offset 1): the floor step is where position + offset reaches floor
    temperature = {"beta": 0.5, "floor": 6.0, "offset": 1}
    step = int(temperature["floor"]) - temperature["offset"]  # the first position of step 1
    # a decode step of two queries across a chunk boundary: the first at the chunk's last position C - 1 (it sees
    # the chunk's first key, the cache's key 0, and its last, itself), the second at C (it sees itself alone);
    # the temperature's floor step (offset 0, Ministral 3 / Mistral 4) at C too
    chunk = 4
    # ALiBi's decode step: its new keys `gap` positions past the cache's end (the cache's keys at 0..P-1)
    alibi_cache, gap = 3, 4
    return [
        # LongRoPE's threshold: largest position + 1 == original (short table) and == original + 1 (long table)
        Case("edge_longrope_at_original", longrope_cfg, B=1, T=T, S=T, positions="explicit",
             first_position=original - T, **causal),
        Case("edge_longrope_past_original", longrope_cfg, B=1, T=T, S=T, positions="explicit",
             first_position=original - T + 1, **causal),
        # the temperature's floor step: positions step - 2 .. step + 1, two on each side of it (NoPE: a Llama 4
        # layer without RoPE, as the temperature's own layers are)
        Case("edge_temperature_floor_step", _cfg(query_temperature=temperature), B=1, T=T, S=T,
             positions="explicit", first_position=step - 2, **causal),
        # the ramps' ends: pairs on each side of each end (llama3 is continuous there, so a pair exactly on an
        # end shows nothing a pair beside it does not)
        Case("edge_llama3_ramp_ends", _cfg(head_dim=8, rope={"theta": 100.0, "scaling": llama3}), B=1,
             positions="far", **causal),
        Case("edge_yarn_ramp_ends", _cfg(head_dim=8, rope={"theta": 100.0, "scaling": yarn}), B=1, T=3, S=4,
             self_attention=False, positions="far"),
        # Llama 4's RoPE layer (a weightless QK-norm after RoPE, local chunks) decoding across a chunk boundary,
        # with the temperature's floor step in the same step: the cache's keys visible to the first query
        Case("edge_chunk_decode", _cfg(num_heads=4, num_kv_heads=2, rope={}, local_chunk=chunk,
                                       qk_norm={"type": "rms", "eps": 1e-5, "weight": False, "after_rope": True},
                                       query_temperature={"beta": 0.5, "floor": float(chunk), "offset": 0}),
             T=2, S=2, P=chunk - 1, positions="explicit", first_position=chunk - 1, **decode),
        # ALiBi over a cache at explicit positions `gap` past the cache's end (its keys at 0..P-1, all visible): a
        # port that measures distances by index (query i at P + S - T + i) instead of position is off by `gap` on
        # every cache key; T=2 < S=3, bottom-right
        Case("edge_alibi_decode_positions", _cfg(num_heads=4, num_kv_heads=2, alibi=True), T=2, S=3, P=alibi_cache,
             positions="explicit", first_position=alibi_cache + gap, **decode),
        # a weighted value norm over a cache, causal with T=3 > S=2 new keys (the ALiBi case has T < S; a cache's
        # other alignment, top-left, is refused: weights.contract.check_cache_alignment)
        Case("edge_value_norm_cache_long_query", _cfg(value_norm={"type": "rms", "weight": True}), T=3, S=2, P=2,
             **decode),
    ]


def _topk_grid() -> list[Case]:
    """Attention over selected keys (topk_indices, issue 39 item 1): one selection for every head over a cache (the
    indices count the cache's keys first), one per kv head ANDed with causal and a window, a latent (MLA) decode
    step (the absorbed form on the fused paths), and a query whose selection leaves it no visible key. -1 pads
    the odd queries' slots and the even ones repeat a key (_selection)."""
    decode = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True, self_attention=False)
    return [
        Case("topk_shared_cache", _cfg(num_heads=4, num_kv_heads=2, rope={}), T=3, S=3, P=5, selection="shared",
             top_k=4, **decode),
        Case("topk_per_kv_head_window", _cfg(num_heads=4, num_kv_heads=2, window_left=3), T=7, S=7, is_causal=True,
             selection="per_kv_head", top_k=4),
        Case("topk_latent_decode", _cfg(num_heads=4, head_dim=6, value_head_dim=3, use_value_bias=False, rope={},
                                        latent={"query_rank": None, "kv_rank": 4, "rope_dim": 4}),
             T=1, S=1, P=6, return_weights=False, selection="shared", top_k=3, **decode),
        Case("topk_empty_row", _cfg(), self_attention=False, T=4, S=6, is_causal=True, selection="empty_row",
             top_k=3),
    ]


def _indexer_grid() -> list[Case]:
    """The lightning indexer in the call (config.indexer, issue 39): the attention sees the indexer's selection.
    DeepSeek V3.2's on a latent (MLA) layer, per query from the normed query latent (half-split RoPE on 4 of 8
    features, a LayerNorm on the key, head weights, ReLU): a causal prefill of 9 tokens keeping k = 3 (every
    query past the third drops keys), and a decode step of one token over a cache of 8 with its index keys
    (past_index_keys; the absorbed form on the fused paths and the in-place cache). MiniMax M3's per kv head
    on a GQA layer: blocks of 2 keys, 2 kept, the query's own block always (local_blocks 1), per-head RMS
    norms, no weights, no ReLU, score scale 1, 10 tokens. A DSA indexer on the query input, without RoPE, over
    tokens built with near-ties at the k-th place. Float32 alone in a plain check (CHECK_ONE_DTYPE)."""
    decode = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True, self_attention=False)
    latent = {"query_rank": 6, "kv_rank": 6, "rope_dim": 4}
    dsa = {"heads": 4, "head_dim": 8, "topk": 3, "key_norm": {"type": "layer", "eps": 1e-6},
           "rope": {"rotary_dim": 4, "theta": 500.0}}
    mla = dict(num_heads=4, head_dim=8, use_value_bias=False, rope={"rotary_dim": 4}, latent=latent, indexer=dsa)
    m3 = {"heads": 2, "head_dim": 8, "topk": 2, "query_source": "input", "query_norm": {"type": "rms"},
          "key_norm": {"type": "rms"}, "rope": {"rotary_dim": 4}, "head_weights": False, "relu": False,
          "score_scale": 1.0, "per_kv_head": True, "block_size": 2, "local_blocks": 1}
    return [
        Case("indexer_dsa_prefill", _cfg(**mla), T=9, S=9, is_causal=True),
        Case("indexer_dsa_decode", _cfg(**mla), T=1, S=1, P=8, return_weights=False, **decode),
        Case("indexer_m3_blocks", _cfg(num_heads=4, num_kv_heads=2, head_dim=8, rope={"rotary_dim": 4}, indexer=m3),
             T=10, S=10, is_causal=True),
        # near-ties at the k-th place (issue 39 item 3): tokens 4, 6, 8, 10 repeat token 2 up to a relative 5e-3
        # (near_ties), a few bfloat16 steps, so they survive every dtype's rounding of the inputs, and with no
        # RoPE on the index key their scores tie for each query up to ~1e-4 of the scores' size: far above a
        # float64 (or float32) rounding, so the reference's selection is the same on every machine
        # (tests/test_indexer_call.py), and below a 16-bit one, so 16-bit backends keep the other key of a tie
        # (measured: NumPy 1 swap in float16, 5 in bfloat16), admissible under the top-k rule.
        Case("indexer_ties_near", _cfg(num_heads=4, head_dim=8, rope={"rotary_dim": 4},
                                       indexer={**dsa, "query_source": "input", "rope": None}),
             T=12, S=12, is_causal=True, near_ties=5e-3),
    ]


def _mrope_grid() -> list[Case]:
    """Multimodal RoPE (rope.mrope_section, issue 42): positions (3, B, T), one row per axis (temporal, height,
    width), laid out as Qwen2-VL's get_rope_index lays them out (_mrope_positions): text, a vision span, text.
    Qwen2-VL's contiguous sections (2, 3, 3 of 8 pairs, t smaller as its 16, 24, 24) over an image of 1 x 2 x 3
    patches in a causal prefill; Qwen3-VL's interleaved sections (4, 2, 2 as its 24, 20, 20) over a video of 2 x
    2 x 2 in a decode of 5 tokens over a cache of 4. Unequal sections and grids: a port that swaps the
    sections' order, or h and w, or does not interleave, turns some pair by another axis. Float32 alone in a
    plain check (CHECK_ONE_DTYPE)."""
    causal = dict(is_causal=True)
    decode = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True, self_attention=False)
    return [
        Case("mrope_image", _cfg(num_heads=4, num_kv_heads=2, head_dim=16, rope={"mrope_section": [2, 3, 3]}),
             T=8, S=8, positions="mrope_image", **causal),
        Case("mrope_interleaved_video_decode",
             _cfg(num_heads=4, num_kv_heads=2, head_dim=16,
                  rope={"mrope_section": [4, 2, 2], "mrope_interleaved": True}),
             T=5, S=5, P=4, positions="mrope_video", **decode),
    ]


# The vision spans of the mrope cases: (temporal, height, width) patches after merging.
MROPE_GRIDS = {"mrope_image": (1, 2, 3), "mrope_video": (2, 2, 2)}


def _mrope_positions(B: int, L: int, start: int, grid: tuple[int, int, int]) -> np.ndarray:
    """(3, B, L) int64 as Qwen2-VL's get_rope_index lays them out: row b holds 1 + b text tokens (one position,
    the same on every axis), then a vision span of t x h x w patches at (s + t, s + h, s + w) from its first
    position s, then text again from s + max(h, w) (transformers 5.23); start: the first token's position (the
    cache's length)."""
    out = np.zeros((3, B, L), dtype=np.int64)
    for b in range(B):
        columns, nxt = [], start
        for _ in range(1 + b):
            columns.append((nxt, nxt, nxt))
            nxt += 1
        columns += [(nxt + t, nxt + h, nxt + w) for t in range(grid[0]) for h in range(grid[1]) for w in range(grid[2])]
        nxt += max(grid[1:])
        while len(columns) < L:
            columns.append((nxt, nxt, nxt))
            nxt += 1
        out[:, b] = np.asarray(columns[:L], dtype=np.int64).T  # (3, L)
    return out


def _differential_grid() -> list[Case]:
    """Differential attention (config.differential: diffllama, issue 42): 8 query heads over 4 kv heads (GQA, so
    that a port pairing kv heads (2g, 2g+1) instead of (g, g + K/2) shows), RoPE, a causal prefill with padding,
    lambda_init of layer 2 (0.8 - 0.6 exp(-0.6)); a decode step of one token over a cache of 5 (every path's
    cache, the in-place one included), lambda_init of layer 5. Neither is layer 0's 0.2 (tests/mutants.py).
    Float32 alone in a plain check (CHECK_ONE_DTYPE)."""
    decode = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True, self_attention=False)
    diff = dict(num_heads=8, num_kv_heads=4, query_dim=16, rope={})
    return [
        Case("differential_gqa", _cfg(**diff, differential={"lambda_init": 0.8 - 0.6 * math.exp(-0.3 * 2)}), T=6,
             S=6, mask="padding", is_causal=True),
        Case("differential_decode", _cfg(**diff, value_head_dim=3, differential={"lambda_init": 0.8 - 0.6 * math.exp(
            -0.3 * 5), "eps": 1e-6}), T=1, S=1, P=5, return_weights=False, **decode),
    ]


def _sharing_grid() -> list[Case]:
    """Issue 42's knobs: MiMo-V2-Flash's value scale and Falcon-H1's key multiplier, together, on a MiMo-shaped
    layer (V != H, partial RoPE, sinks, GQA) decoding over a cache (the present cache holds the multiplied keys
    and scaled values, as both models store them). The multipliers are not powers of two, so a port that drops
    one is off by more than rounding. Float32 alone in a plain check (CHECK_ONE_DTYPE)."""
    decode = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True, self_attention=False)
    mimo = dict(num_heads=4, num_kv_heads=2, head_dim=6, value_head_dim=4, rope={"rotary_dim": 2}, use_sinks=True)
    return [
        Case("knobs_value_scale_key_multiplier", _cfg(**mimo, key_multiplier=2.7, value_scale=0.61), T=2, S=2, P=3,
             **decode),
        # Gemma 3n's shared-KV layer decoding two tokens: no key or value projection, the query's norm and RoPE,
        # scale 1, a window; the cache (7 entries, the queries' own two last) read and given back unchanged
        Case("kv_shared_decode", _cfg(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm={"type": "rms"}, rope={},
                                      scale=1.0, window_left=4, kv_shared=True), T=2, S=0, P=7, **decode),
    ]


def _v4_grid() -> list[Case]:
    """DeepSeek V4's compressed attention (config.compressed, issue 41), run through each backend's
    impl_*/compressed.py: a csa prefill of 12 tokens (windows of 2 with overlap close at every odd position, the
    indexer's top-2 drops entries from position 5 on, the sliding window of 4 keys hides most keys, YaRN on the
    compress table as V4's), an hca decode of 4 tokens at positions 9..12 over the cache of 9 earlier ones
    (two windows of 4 closed, one buffered token; the window 8..11 closes in the call and token 12 opens the
    next, so the present cache holds a buffered token too) and a sliding prefill of 10
    tokens (no entries: the window of 4 keys and the sinks; the window drops keys from position 4 on). The layer's
    input is `query` (B, T, D), its absolute positions `positions` (T,), the cache past_<name> (impl_numpy.compressed's
    cache_names): the float64 reference's own cache of the P earlier tokens. Forward and gradients (of x, every
    tensor and the cache: impl_numpy.compressed_backward), the present cache (every array of cache_names) and csa's
    selection (the top-k rule). Float32 alone in a plain check (CHECK_ONE_DTYPE)."""
    base = dict(num_heads=2, query_dim=16, head_dim=8, num_kv_heads=1, use_query_bias=False, use_key_bias=False,
                use_value_bias=False, use_output_bias=False, use_sinks=True, window_left=3)
    low_rank = {"query_rank": 6, "output_groups": 2, "output_rank": 4}
    yarn = {"theta": 160000.0, "rotary_dim": 4, "interleaved": True, "scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "attention_factor": 1.0}}
    csa = {"kind": "csa", **low_rank, "ratio": 2, "overlap": True, "index_heads": 2, "index_head_dim": 4,
           "index_topk": 2}
    hca = {"kind": "hca", **low_rank, "ratio": 4}
    main = {"theta": 10000.0, "rotary_dim": 4, "interleaved": True}  # V4's sliding layers: the plain "main" table
    # every case returns its present cache (judged per array: the cache is a by-product of the same call)
    v4 = dict(is_causal=True, return_weights=False, self_attention=False, return_cache=True)
    return [
        Case("v4_csa_prefill", _cfg(**base, rope=yarn, compressed=csa), T=12, S=12, **v4),
        Case("v4_hca_decode", _cfg(**base, rope=main, compressed=hca), T=4, S=4, P=9, **v4),
        # the sliding kind: no compressor, the window of 4 keys and the sinks alone; from position 4 on the window
        # drops keys (rows 4..9 see 4 of their 5..10 causal keys)
        Case("v4_sliding_prefill", _cfg(**base, rope=main, compressed={"kind": "sliding", **low_rank}), T=10, S=10,
             **v4),
    ]


def _compressed_inputs(case: Case) -> dict[str, np.ndarray]:
    """A V4 case's call (config.compressed): `query` the layer's input x (B, T, D), `positions` (T,) int64 the
    absolute positions P..P+T-1, and with P > 0 past_<name>: the float64 reference's cache after the P earlier
    tokens (drawn with x from the same stream), which a call at positions P.. must carry."""
    from impl_numpy.compressed import compressed_attention

    B, T, P = case.B, case.T, case.P
    x = np.random.default_rng(case.seed + 1).standard_normal((B, P + T, case.config.query_dim)) * case.input_scale
    inputs = {"query": x[:, P:], "positions": np.arange(P, P + T, dtype=np.int64)}
    if P:
        _, present = compressed_attention(case.config, make_tensors(case), x[:, :P], np.arange(P), return_cache=True)
        inputs.update({f"past_{name}": np.ascontiguousarray(a) for name, a in present.items()})
    return inputs


def _long_cfg(**kw) -> AttentionConfig:
    """A realistic length's shape, kept cheap: 4 heads of 8 features over 16 input features, 8 outputs."""
    return _cfg(**{"num_heads": 4, "head_dim": 8, "query_dim": 16, "out_dim": 8, **kw})


def _long_grid() -> list[Case]:
    """Realistic lengths in the default grid (`mha check`, the vectors): few, B 1, no weights returned (their
    (B, N, T, S) would be most of a vector file). The length the tolerance policy's logit term must hold at:
    ALiBi's bias grows with the distance, to slope * 255 here, on keys whose weight is e^-60 and less."""
    return [
        Case("long_alibi_256", _long_cfg(alibi=True), B=1, T=256, S=256, is_causal=True, return_weights=False),
    ]


def _long_profile() -> list[Case]:
    """`mha check --profile long` (tox -e full): T and S in the hundreds to thousands for ALiBi, windows, local
    chunks, LongRoPE and a latent decode step; forward and gradients, float32 and bfloat16 by default. Their
    vectors are written on demand (`mha vectors generate --profile long --out DIR`), not shipped."""
    decode = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True, self_attention=False,
                  return_weights=False)
    causal = dict(B=1, is_causal=True, return_weights=False)
    # LongRoPE with a 256-position original context: T 1024 reads the long table
    longrope = {"type": "longrope", "factor": 8.0, "original_max_position_embeddings": 256,
                "short_factor": [1.0, 1.2, 1.6, 2.1], "long_factor": [1.5, 3.0, 6.0, 9.0]}
    return [
        Case("long_alibi_2048", _long_cfg(alibi=True), T=2048, S=2048, **causal),
        Case("long_window_gqa", _long_cfg(num_kv_heads=2, rope={}, window_left=128), T=1024, S=1024, **causal),
        Case("long_chunks", _long_cfg(rope={}, local_chunk=256, qk_norm={"type": "rms"}), T=1024, S=1024, **causal),
        Case("long_longrope", _long_cfg(num_kv_heads=2, rope={"scaling": longrope}), T=1024, S=1024, **causal),
        Case("long_latent_decode", _long_cfg(num_kv_heads=2, head_dim=6, value_head_dim=4, use_value_bias=False,
                                             rope={}, latent={"query_rank": None, "kv_rank": 8, "rope_dim": 4}),
             B=1, T=1, S=1, P=2047, **decode),
    ]


CASES: dict[str, Case] = {case.name: case for case in _grid()}
assert len(CASES) == len(_grid()), "case names must be unique"
# The default grid's realistic lengths (_long_grid): the tests that run every mutant over the grid leave them to
# tests/test_mutants_long.py, the bugs that need the length.
LONG_GRID: tuple[str, ...] = tuple(case.name for case in _long_grid())
# The long profile (`mha check --profile long`): not in CASES, so not in the default check, the shipped vectors or
# the tests that walk the grid. ALL_CASES finds a case of either by name.
LONG_CASES: dict[str, Case] = {case.name: case for case in _long_profile()}
PROFILES: dict[str, dict[str, Case]] = {"default": CASES, "long": LONG_CASES}
# the dtypes a profile's check runs when --dtypes is not given
PROFILE_DTYPES: dict[str, tuple[str, ...]] = {"default": DTYPE_NAMES, "long": ("float32", "bfloat16")}
# The default grid's cases that a plain `mha check` (no --dtypes) runs in float32 only: the edge group (a
# threshold is an integer comparison: float32 shows which side a port took) and the realistic lengths. Their
# vectors ship in all four dtypes (`mha verify`), the framework test envs run all four, and `mha check --dtypes
# float64 float32 float16 bfloat16` runs them all. Measured back to back (2026-11-29, 2-core AMD EPYC VM, a day
# whose grid before these nine cases took 52.8 s cold / 22.6 s warm): all four dtypes of the nine cases took a
# plain check to about 60 s cold / 40 s warm, float32 and bfloat16 to 54 / 30.4 s, float32 alone to 56.8 / 26.2 s.
CHECK_ONE_DTYPE: frozenset[str] = frozenset(case.name for case in (*_edge_grid(), *_topk_grid(), *_indexer_grid(),
                                                                   *_long_grid()))
CHECK_ONE_DTYPE = CHECK_ONE_DTYPE | frozenset(case.name for case in _mrope_grid())  # two cases, issue 42
CHECK_ONE_DTYPE = CHECK_ONE_DTYPE | {case.name for case in _differential_grid()}
CHECK_ONE_DTYPE |= frozenset(case.name for case in _sharing_grid())  # issue 42's cases
CHECK_ONE_DTYPE |= frozenset(case.name for case in _v4_grid())  # issue 41's three cases
ONE_DTYPE = "float32"
ALL_CASES: dict[str, Case] = {**CASES, **LONG_CASES}
# The grid's cases that multi_head_attention takes: all but DeepSeek V4's (config.compressed), which run through
# each backend's impl_*/compressed.py (one path); the mirrors' grid tests run these.
MHA_CASES: dict[str, Case] = {name: case for name, case in CASES.items() if case.config.compressed is None}
assert len(ALL_CASES) == len(CASES) + len(LONG_CASES), "case names must be unique across the profiles"


def make_tensors(case: Case) -> dict[str, np.ndarray]:
    """The case's canonical tensors in float64 (cast per dtype by the caller)."""
    return weights.init(case.config, seed=case.seed, dtype="float64")


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """query, key, value (always explicit) and the case's mask, bias,
    dropout_mask, positions, key_positions, past_key, past_value, segment_ids,
    key_segment_ids.

    Masks other than "empty_rows" leave every query row at least one key, so a
    case only meets fully masked rows where it says so. Masks and biases cover
    every key, the cache's included (S_total = P + S).
    """
    c = case.config
    if c.compressed is not None:  # DeepSeek V4's layer: its own call (x, positions, its cache)
        return _compressed_inputs(case)
    rng = np.random.default_rng(case.seed + 1)
    B, T, N = case.B, case.T, c.num_heads
    S = case.S_total  # from here on: every key
    query = rng.standard_normal((B, T, c.query_dim)) * case.input_scale
    if case.near_ties:  # (a stream of their own: the draws after it stay)
        tie = np.random.default_rng(case.seed + 13)
        for j in range(4, T, 2):
            query[:, j] = query[:, 2] * (1 + case.near_ties * tie.standard_normal(c.query_dim))
    if case.self_attention:
        if not (T == case.S and case.P == 0 and c.query_dim == c.key_dim == c.value_dim):
            raise ValueError(f"case {case.name}: self attention needs T == S, no cache and equal input dims")
        key = value = query
    else:
        key = rng.standard_normal((B, case.S, c.key_dim)) * case.input_scale
        value = rng.standard_normal((B, case.S, c.value_dim)) * case.input_scale
    inputs: dict[str, np.ndarray] = {"query": query, "key": key.copy(), "value": value.copy()}
    if c.kv_shared:  # no key or value input: the keys and values are the cache (issue 42)
        del inputs["key"], inputs["value"]

    def with_one_allowed(m: np.ndarray) -> np.ndarray:
        m = m.copy()
        m[..., 0] = True  # key 0 always visible (before any causal mask, which keeps j=0 for top_left)
        return m

    if case.mask == "padding":
        lengths = rng.integers(1, S + 1, size=B)
        lengths[0] = S
        inputs["mask"] = (np.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    elif case.mask == "random":
        inputs["mask"] = with_one_allowed(rng.random((B, N, T, S)) < 0.6)
    elif case.mask == "random_bts":
        inputs["mask"] = with_one_allowed(rng.random((B, T, S)) < 0.6)
    elif case.mask == "random_ts":
        inputs["mask"] = with_one_allowed(rng.random((T, S)) < 0.6)
    elif case.mask == "empty_rows":
        m = with_one_allowed(rng.random((B, 1, T, S)) < 0.6)
        m[0, 0, min(1, T - 1), :] = False  # query 1 of batch 0: no key at all
        m[-1, 0, -1, :] = False
        inputs["mask"] = m
    elif case.mask is not None:
        raise ValueError(f"case {case.name}: unknown mask kind {case.mask!r}")
    if case.bias == "random":
        inputs["bias"] = rng.standard_normal((B, 1, T, S))
    elif case.bias == "neg_inf":
        b = rng.standard_normal((B, N, T, S))
        b[rng.random((B, N, T, S)) < 0.3] = -np.inf
        b[..., 0] = np.where(np.isinf(b[..., 0]), 0.0, b[..., 0])
        inputs["bias"] = b
    if case.training:
        inputs["dropout_mask"] = rng.random((B, N, T, S)) >= c.dropout
    inputs.update(_modern_inputs(case, np.random.default_rng(case.seed + 3)))
    if case.selection is not None:
        inputs["topk_indices"] = _selection(case, np.random.default_rng(case.seed + 5))
    return inputs


def _selection(case: Case, rng) -> np.ndarray:
    """topk_indices for case.selection, int64, over every key (the cache's first: 0..P+S-1).

    Each query's first slot is a key every other mask of the case shows it (its aligned position, or the one
    before: causal and a window of left >= 1 keep both), so no row is empty by chance; the rest are random. The
    last query and every second one before it leave the last half of their slots -1 and never select the last
    key (a port that reads -1 as Python's last index selects it, and the last query sees it); the others fill
    their k slots, the last repeating the first (a duplicate). "empty_row":
    query 0 of row 0 selects only keys after its aligned position (causal hides them), or only -1 where there
    are none."""
    c, B, T, k, S = case.config, case.B, case.T, case.top_k, case.S_total
    if k < 2:
        raise ValueError(f"case {case.name}: a selection needs top_k >= 2")
    heads = c.num_kv_heads if case.selection == "per_kv_head" else 1
    offset = S - T if case.causal_alignment == "bottom_right" else 0
    idx = np.empty((B, heads, T, k), dtype=np.int64)
    for b in range(B):
        for h in range(heads):
            for t in range(T):
                aligned = min(max(t + offset, 0), S - 1) if case.is_causal or c.window_left >= 0 else 0
                if (T - 1 - t) % 2:  # k slots, the last a repeat of the first
                    rest = rng.choice(np.delete(np.arange(S), aligned), size=k - 2, replace=False)
                    idx[b, h, t] = [aligned, *rest, aligned]
                else:  # the last query and every second one before it: half the slots -1, the last key unselected
                    first = max(aligned - 1, 0)  # visible too (causal, and a window of left >= 1)
                    pool = np.delete(np.arange(S - 1), first)
                    used = k - k // 2
                    idx[b, h, t] = [first, *rng.choice(pool, size=used - 1, replace=False), *[-1] * (k // 2)]
    if case.selection == "empty_row":
        hidden = np.arange(offset + 1, S)[:k]  # the keys causal hides from query 0
        idx[0, :, 0] = -1
        idx[0, :, 0, :hidden.size] = hidden
    return idx[:, 0] if heads == 1 else idx


def _modern_inputs(case: Case, rng) -> dict[str, np.ndarray]:
    """The cache (after projection, norm and rope, as a model stores it: unit-scale values), and the
    positions: "far" 37 places on, past a short original context; "per_batch" a different offset per
    row; "packed" two or three documents per row whose positions restart, with their segment ids;
    "explicit" from case.first_position on; "left_padded" (a cache) the last row left-padded by 2: every
    position, the cached keys' too (past_key_positions), 2 less, the pads at 0, as transformers' batched
    generation places them."""
    c, B, T, S, P = case.config, case.B, case.T, case.S, case.P
    inputs: dict[str, np.ndarray] = {}
    if P:
        (key_heads, key_width, _), (value_heads, value_width, _) = cache_widths(c)  # a latent layer's: C and R
        inputs["past_key"] = rng.standard_normal((B, key_heads, P, key_width))
        inputs["past_value"] = rng.standard_normal((B, value_heads, P, value_width))
    if case.positions == "far":
        inputs["positions"] = 37 + P + np.arange(T, dtype=np.int64)  # (T,)
        inputs["key_positions"] = 37 + P + np.arange(S, dtype=np.int64)  # (S,)
    elif case.positions == "per_batch":
        offsets = rng.integers(0, 60, size=(B, 1))
        inputs["positions"] = (offsets + P + np.arange(T)).astype(np.int64)  # (B, T)
        inputs["key_positions"] = (offsets + P + np.arange(S)).astype(np.int64)  # (B, S)
    elif case.positions == "explicit":
        # the new keys at first_position + arange(S); the queries too (top-left), or the last T of them
        # (bottom-right, T <= S: a decode step's queries are its last tokens)
        shift = case.S - T if case.causal_alignment == "bottom_right" and case.S >= T else 0
        inputs["positions"] = case.first_position + shift + np.arange(T, dtype=np.int64)  # (T,)
        inputs["key_positions"] = case.first_position + np.arange(S, dtype=np.int64)  # (S,)
    elif case.positions == "packed":
        if not (case.self_attention and P == 0):
            raise ValueError(f"case {case.name}: packed positions need self attention without a cache")
        ids = np.zeros((B, T), dtype=np.int64)
        positions = np.zeros((B, T), dtype=np.int64)
        for b in range(B):
            cuts = np.sort(rng.choice(np.arange(1, T), size=min(2, T - 1), replace=False))
            ids[b] = np.searchsorted(cuts, np.arange(T), side="right")  # 0, 0, 1, 1, 1, 2, ...
            starts = np.concatenate([[0], cuts])[ids[b]]
            positions[b] = np.arange(T) - starts  # restart per document
        # key and value are passed explicitly (as every case does), so their ids are too (check_call)
        inputs.update(segment_ids=ids, key_segment_ids=ids.copy(), positions=positions,
                      key_positions=positions.copy())
    elif case.positions == "left_padded":
        if not P:
            raise ValueError(f"case {case.name}: left_padded positions need a cache (P > 0)")
        pads = np.zeros((B, 1), dtype=np.int64)
        pads[-1] = min(2, P)
        inputs["past_key_positions"] = np.maximum(np.arange(P) - pads, 0)  # (B, P)
        inputs["positions"] = P + np.arange(T) - pads  # (B, T)
        inputs["key_positions"] = P + np.arange(S) - pads  # (B, S)
    elif case.positions in MROPE_GRIDS:  # multimodal RoPE: (3, B, L), the new keys at the queries' positions
        if S != T:
            raise ValueError(f"case {case.name}: mrope positions need S == T (the new keys are the queries' tokens)")
        inputs["positions"] = _mrope_positions(B, T, P, MROPE_GRIDS[case.positions])  # (3, B, T)
        inputs["key_positions"] = inputs["positions"].copy()  # (3, B, S)
    elif case.positions is not None:
        raise ValueError(f"case {case.name}: unknown positions kind {case.positions!r}")
    if P and c.indexer is not None:  # the indexer's cache: one key of J features per cached token (its own rng)
        inputs["past_index_keys"] = np.random.default_rng(case.seed + 7).standard_normal((B, P, c.indexer.cache_width))
    return inputs


def cast_inputs(inputs: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Float inputs to the case dtype (bias too); bool masks unchanged."""
    dt = weights.dtype_from_name(dtype)
    return {k: (v.astype(dt) if is_float(v.dtype) else v) for k, v in inputs.items()}


def cast_tensors(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    dt = weights.dtype_from_name(dtype)
    return {k: v.astype(dt) for k, v in tensors.items()}


def output_cotangent(case: Case) -> np.ndarray:
    """The fixed d_output for gradient checks, (B, T, O), float64."""
    rng = np.random.default_rng(case.seed + 2)
    return rng.standard_normal((case.B, case.T, case.config.out_dim))


def random_case(seed: int) -> Case:
    """A random point of the same feature space, for sweeps (name random_<seed>)."""
    rng = np.random.default_rng(seed)
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    K = int(rng.integers(1, 4))
    N = K * int(rng.integers(1, 4))
    self_attention = bool(rng.random() < 0.4)
    query_dim = int(rng.integers(1, 17))
    dims = (query_dim, query_dim) if self_attention else (int(rng.integers(1, 17)), int(rng.integers(1, 17)))
    config = AttentionConfig(
        num_heads=N, num_kv_heads=K, query_dim=query_dim, key_dim=dims[0], value_dim=dims[1],
        head_dim=int(rng.integers(1, 9)), value_head_dim=int(rng.integers(1, 9)), out_dim=int(rng.integers(1, 17)),
        use_query_bias=bool(rng.random() < 0.8), use_key_bias=bool(rng.random() < 0.8),
        use_value_bias=bool(rng.random() < 0.8), use_output_bias=bool(rng.random() < 0.8),
        scale=None if rng.random() < 0.7 else float(rng.uniform(0.05, 1.5)),
        dropout=pick([0.0, 0.0, 0.1, 0.4]), masked_row=pick(["zero", "uniform", "nan"]),
    )
    T = int(rng.integers(1, 9))
    S = T if self_attention else int(rng.integers(1, 9))
    mask = pick([None, None, "padding", "random", "random_bts", "random_ts", "empty_rows"])
    causal = bool(rng.random() < 0.35)
    case = Case(
        name=f"random_{seed}", config=config, B=int(rng.integers(1, 4)), T=T, S=S, self_attention=self_attention,
        mask=mask, bias=pick([None, None, "random", "neg_inf"]), is_causal=causal,
        causal_alignment=pick(["top_left", "bottom_right"]),
        training=config.dropout > 0 and bool(rng.random() < 0.7), return_weights=bool(rng.random() < 0.8),
        input_scale=pick([1.0, 1.0, 0.1, 3.0]),
    )
    # Half the cases draw the modern features too (drawn after the plain ones, from the same stream); two in
    # five the frontier ones, from a stream of their own (so the features drawn before they existed stay).
    case = _with_modern_features(case, rng, pick) if rng.random() < 0.5 else case
    frontier = np.random.default_rng([seed, 29])
    case = _with_frontier_features(case, frontier) if frontier.random() < 0.4 else case
    # Three in ten the sparse ones (issue 39): topk_indices or the lightning indexer, from a stream of their own
    sparse = np.random.default_rng([seed, 39])
    case = _with_sparse_features(case, sparse) if sparse.random() < 0.3 else case
    # Half the cases whose RoPE is the only stage reading positions turn it multimodal (issue 42), from a stream
    # of their own
    mrope = np.random.default_rng([seed, 42])
    return _with_mrope_features(case, mrope) if mrope.random() < 0.5 else case


def random_differential_case(seed: int) -> Case:
    """random_case(seed) made a differential layer (issue 42), for its own sweeps (name random_differential_<seed>):
    the heads doubled (N and K even), and what differential refuses or replaces dropped (dropout, the output
    gate, a latent layer, the indexer); lambda_init of a layer drawn in 0..31 and eps from a stream of their
    own. random_case's own draws are untouched."""
    case = random_case(seed)
    rng = np.random.default_rng([seed, 42])
    c = case.config
    layer = int(rng.integers(0, 32))
    config = c.replace(num_heads=2 * c.num_heads, num_kv_heads=2 * c.num_kv_heads, dropout=0.0, output_gate=None,
                       latent=None, indexer=None, differential={"lambda_init": 0.8 - 0.6 * math.exp(-0.3 * layer),
                                                                 "eps": float(rng.choice([1e-5, 1e-6]))})
    return dataclasses.replace(case, name=f"random_differential_{seed}", config=config, training=False)


def random_compressed_case(seed: int) -> Case:
    """A random DeepSeek V4 layer (config.compressed, issue 41), for the sweep's --compressed runs (name
    random_v4_<seed>), drawn from a stream of its own (default_rng([seed, 41])): random_case(seed) and every other
    draw are untouched. V4's layer refuses nearly every other field (weights.config's _resolve_compressed), so it
    is a case of its own, not a feature ANDed onto random_case's. Kind csa, hca or sliding; windows of m = 2-4
    tokens, with overlap or not; csa's indexer of 1-3 heads keeping 1-3 entries (fewer than a long call's visible
    ones: the top-k drops entries); a sliding window of 1-6 keys; sinks two times in three; RoPE on 2 or 4 of
    H = 4 or 8 features, the plain table or YaRN (attention factor 1, as V4 forces it) on csa and hca. Half the
    calls are a prefill from position 0 (T 1-12), half a decode of T 1-4 tokens at P 1-12 over the float64
    reference's own prefill of the P earlier tokens (_compressed_inputs), so windows close inside the call or
    stay open across it. No return_cache: compare.judge reads present_key / present_value alone (the V4 present
    cache's judge is another branch's); the cache's gradients (of every past_<name>) are judged."""
    rng = np.random.default_rng([seed, 41])
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    kind = pick(["csa", "hca", "sliding"])
    N, H = int(rng.integers(1, 4)), pick([4, 8])
    R = pick([2, 4])
    groups = pick([g for g in (1, 2, 4) if (N * H) % g == 0])
    compressed: dict[str, Any] = {"kind": kind, "query_rank": int(rng.integers(2, 9)), "output_groups": groups,
                                  "output_rank": int(rng.integers(1, 6))}
    rope: dict[str, Any] = {"theta": pick([10000.0, 160000.0]), "rotary_dim": R, "interleaved": True}
    if kind != "sliding":
        compressed.update(ratio=int(rng.integers(2, 5)), overlap=bool(rng.random() < 0.5))
        if rng.random() < 0.5:  # V4's "compress" table: YaRN with its attention factor forced to 1
            rope["scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                               "attention_factor": 1.0}
    if kind == "csa":
        compressed.update(index_heads=int(rng.integers(1, 4)), index_head_dim=pick([R, 4, 8]),
                          index_topk=int(rng.integers(1, 4)))
    config = _cfg(num_heads=N, head_dim=H, query_dim=int(rng.integers(4, 17)), num_kv_heads=1, use_query_bias=False,
                  use_key_bias=False, use_value_bias=False, use_output_bias=False,
                  use_sinks=bool(rng.random() < 2 / 3), window_left=int(rng.integers(0, 6)), rope=rope,
                  compressed=compressed)
    decode = bool(rng.random() < 0.5)
    T = int(rng.integers(1, 5)) if decode else int(rng.integers(1, 13))
    P = int(rng.integers(1, 13)) if decode else 0
    B = int(rng.integers(1, 3))
    input_scale = pick([1.0, 1.0, 0.1, 3.0])
    return_cache = bool(rng.random() < 0.5)  # drawn last: every earlier draw of a seed stays what it was
    return Case(f"random_v4_{seed}", config, B=B, T=T, S=T, P=P, is_causal=True, return_weights=False,
                self_attention=False, input_scale=input_scale, return_cache=return_cache)


# The long caches' lengths (random_long_cache_case): each range starts at a decode fast path's threshold, so a
# third of the draws reach the gathers of selected keys (64: impl_jax / impl_mlx / impl_tf GATHER_MIN_KEYS), a third
# the one-query paths from 1024 keys (impl_jax.fused.DECODE_MIN_KEYS, impl_jax.indexer.JIT_MIN_KEYS,
# impl_torch.attention.SPLIT_MIN_KEYS) and a third those from 4096 (impl_numpy.indexer / impl_tf.indexer
# DECODE_SCORES_MIN_KEYS, impl_tf.indexer.TOPK_FEW_MIN_KEYS).
LONG_CACHE_RANGES = ((64, 300), (1024, 1100), (4096, 4200))


def random_long_cache_case(seed: int) -> Case:
    """random_case(seed) as a step over a long cache (name random_long_<seed>), for the sweep's --long-cache runs:
    random_case's caches hold 1-4 keys, under every decode fast path's threshold, so its sweeps never take them.
    From a stream of its own (default_rng([seed, 43])): P in one of LONG_CACHE_RANGES, and three times in four a
    single query (T 1: a decode step; else random_case's T). The new keys are the queries' tokens where they were
    (S = T), and the call's inputs explicit (a cache needs them: self_attention False); packed positions, which
    refuse a cache, become the default ones; a causal call aligns bottom-right, as every call over a cache.
    Half the draws keep everything else random_case drew (masks, biases, windows, the frontier and sparse fields,
    latent layers, dropout), ANDed with the long cache: the fast paths must step aside where they cannot take a
    call. The other half clear what they step aside for (a mask, a bias, dropout, a window, local chunks, ALiBi,
    a softcap, sinks; masked_row "zero"), so that they run: the gathers of a selection, JAX's absorbed decode
    in blocks."""
    case = random_case(seed)
    rng = np.random.default_rng([seed, 43])
    low, high = LONG_CACHE_RANGES[int(rng.integers(len(LONG_CACHE_RANGES)))]
    P = int(rng.integers(low, high))
    T = 1 if rng.random() < 0.75 else case.T
    S = T if case.self_attention or case.S == case.T else case.S
    case = dataclasses.replace(case, name=f"random_long_{seed}", P=P, T=T, S=S, self_attention=False,
                               positions=None if case.positions == "packed" else case.positions,
                               causal_alignment="bottom_right")
    if rng.random() < 0.5:
        config = case.config.replace(window_left=-1, window_right=-1, local_chunk=None, alibi=False,
                                     logit_softcap=None, use_sinks=False, dropout=0.0, masked_row="zero")
        case = dataclasses.replace(case, config=config, mask=None, bias=None, training=False)
    return case


def _with_modern_features(case: Case, rng, pick) -> Case:
    H = case.config.head_dim
    features: dict[str, Any] = {}
    if H >= 2 and rng.random() < 0.6:
        scaling = pick([None, None, {"type": "linear", "factor": 2.0},
                        {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
                        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}])
        features["rope"] = {"rotary_dim": pick([H - H % 2, 2]), "interleaved": bool(rng.random() < 0.5),
                            "theta": pick([100.0, 10000.0]), "scaling": scaling}
    if rng.random() < 0.3:
        features["qk_norm"] = {"type": pick(["rms", "layer"]), "scope": pick(["head", "all"])}
    if rng.random() < 0.3:
        features["logit_softcap"] = pick([1.0, 5.0, 30.0])
    if rng.random() < 0.3:
        features["window_left"] = int(rng.integers(-1, 4))
        features["window_right"] = pick([-1, -1, 0, 2])
    if rng.random() < 0.3:
        features["use_sinks"] = True
    P = int(rng.integers(1, 5)) if not case.self_attention and rng.random() < 0.4 else 0
    kinds = [None, "far", "per_batch"] + (["packed"] if case.self_attention else [])
    return dataclasses.replace(
        case, config=dataclasses.replace(case.config, **features), P=P, positions=pick(kinds),
        return_cache=bool(rng.random() < 0.5),
        causal_alignment="bottom_right" if P else case.causal_alignment,  # decoding with a cache: bottom_right
    )


def _with_frontier_features(case: Case, rng) -> Case:
    """ALiBi, local chunks, the query temperature, the QKV clip and the output gate, each one in two; the value
    norm, the later QK-norms (weightless, per-head weights, after RoPE) and LongRoPE / proportional RoPE in
    place of a case's RoPE scaling less often."""
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    features: dict[str, Any] = {}
    if rng.random() < 0.5:
        features["alibi"] = True
    if rng.random() < 0.5:
        features["local_chunk"] = int(rng.integers(1, 6))
    if rng.random() < 0.5:
        features["query_temperature"] = {"beta": pick([0.1, 0.5]), "floor": pick([1.0, 3.0, 8192.0]),
                                         "offset": int(rng.integers(0, 2))}
    if rng.random() < 0.5:
        features["qkv_clip"] = pick([0.2, 0.6, 4.0])
    if rng.random() < 0.5:
        features["output_gate"] = {"scope": pick(["element", "head"]), "bias": bool(rng.random() < 0.5)}
    if rng.random() < 0.3:
        features["value_norm"] = {"type": pick(["rms", "layer"]), "scope": pick(["head", "all"]),
                                  "weight": bool(rng.random() < 0.5)}
    if rng.random() < 0.4:  # a QK-norm of the later kinds: weightless, per-head weights, after RoPE
        weight = bool(rng.random() < 0.6)
        features["qk_norm"] = {"type": pick(["rms", "layer"]), "weight": weight,
                               "per_head": weight and bool(rng.random() < 0.5), "after_rope": bool(rng.random() < 0.5)}
    rope = case.config.rope
    if rope is not None and rng.random() < 0.4:  # LongRoPE (either table, by the case's positions) or proportional
        pairs = rope.rotary_dim // 2
        scaling = pick([{"type": "longrope", "factor": 8.0, "original_max_position_embeddings": 16,
                         "short_factor": (1 + rng.random(pairs)).tolist(),
                         "long_factor": (1 + 8 * rng.random(pairs)).tolist()},
                        {"type": "proportional", "partial_rotary_factor": pick([0.25, 0.5, 1.0])}])
        features["rope"] = dict(rope.to_dict(), scaling=scaling)
    if rng.random() < 0.15:  # a latent layer (MLA): its own norms, no value bias, RoPE on R = 2 of H >= 3
        R = 2
        features.update(latent={"query_rank": pick([None, int(rng.integers(1, 9))]), "kv_rank": int(rng.integers(1, 9)),
                                "rope_dim": R}, rope={"interleaved": bool(rng.random() < 0.5), "theta": 10000.0},
                        head_dim=max(case.config.head_dim, R + 1), use_value_bias=False, qk_norm=None,
                        value_norm=None, qkv_clip=None)
    return dataclasses.replace(case, config=dataclasses.replace(case.config, **features)) if features else case


def _with_mrope_features(case: Case, rng) -> Case:
    """Multimodal RoPE (issue 42) on a case with RoPE whose other stages read no position (no ALiBi, local chunks,
    temperature or indexer) and whose new keys are its queries' tokens (S == T; positions of the default kinds):
    sections drawn at random over the rotary pairs (an empty one included), interleaved half the time where
    they fit, positions (3, B, T) with an image or a video span (_mrope_positions)."""
    c = case.config
    if (c.rope is None or c.alibi or c.local_chunk is not None or c.query_temperature is not None
            or c.indexer is not None or case.S != case.T or case.positions not in (None, "far", "per_batch",
                                                                                   "explicit")):
        return case
    pairs = c.rope.rotary_dim // 2
    interleaved = bool(rng.random() < 0.5)
    if interleaved:  # h and w at most the pairs 1, 4, ... and 2, 5, ... below rotary_dim / 2
        h, w = (int(rng.integers(0, len(range(axis, pairs, 3)) + 1)) for axis in (1, 2))
        section = [pairs - h - w, h, w]
    else:
        cuts = np.sort(rng.integers(0, pairs + 1, 2))
        section = [int(cuts[0]), int(cuts[1] - cuts[0]), int(pairs - cuts[1])]
    rope = dataclasses.replace(c.rope, mrope_section=tuple(section), mrope_interleaved=interleaved)
    return dataclasses.replace(case, config=c.replace(rope=rope),
                               positions="mrope_image" if rng.random() < 0.5 else "mrope_video")


def _with_sparse_features(case: Case, rng) -> Case:
    """Attention over selected keys (issue 39), ANDed with every mask the case already draws: half the time a
    caller's topk_indices ((B, T, k) or per kv head (B, K, T, k), -1 slots and a repeated key: _selection), half
    the time config.indexer (per query with head weights and ReLU as DeepSeek V3.2 / GLM-5, or per kv head as
    MiniMax M3; keys or blocks, local blocks; its query from the layer's query latent where the case is a latent
    layer with a query rank, else from the query input). A cross-attention case without a cache draws one (P of
    1-4, bottom-right: the selection's indices then count the cache's keys first) one time in two."""
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    c = case.config
    if not case.P and not case.self_attention and case.positions != "packed" and rng.random() < 0.5:
        case = dataclasses.replace(case, P=int(rng.integers(1, 5)), causal_alignment="bottom_right",
                                   return_cache=bool(rng.random() < 0.5))
    if rng.random() < 0.5:
        S = case.S_total
        if S < 2:
            return case
        return dataclasses.replace(case, selection=pick(["shared", "per_kv_head"]),
                                   top_k=int(rng.integers(2, min(S, 6) + 1)))
    if rng.random() < 0.3 and (c.latent is None or c.latent.query_rank is None):  # MLA: the indexer reads the latent
        c = dataclasses.replace(c, latent={"query_rank": int(rng.integers(1, 9)), "kv_rank": int(rng.integers(1, 9)),
                                           "rope_dim": 2},
                                rope={"interleaved": bool(rng.random() < 0.5), "theta": 10000.0},  # turns rope_dim
                                head_dim=max(c.head_dim, 3), use_value_bias=False, qk_norm=None, value_norm=None,
                                qkv_clip=None)
    per_kv_head = bool(rng.random() < 0.4)
    J = pick([2, 4, 8])
    R = pick([0, 2, J])
    block_size = pick([None, None, 1, 2, 3])
    topk = int(rng.integers(1, 5))
    indexer: dict[str, Any] = {
        "heads": c.num_kv_heads if per_kv_head else int(rng.integers(1, 5)), "head_dim": J, "topk": topk,
        "query_source": "latent" if c.latent is not None and c.latent.query_rank is not None and rng.random() < 0.8
        else "input",
        "query_norm": pick([None, {"type": "rms"}]), "key_norm": pick([None, {"type": "layer", "eps": 1e-6},
                                                                       {"type": "rms"}]),
        "rope": None if not R else {"rotary_dim": R, "interleaved": bool(rng.random() < 0.5),
                                    "theta": pick([50.0, 10000.0])},
        "rope_end": pick(["first", "last"]), "head_weights": not per_kv_head and bool(rng.random() < 0.8),
        "weight_scale": pick([None, None, 0.5]), "score_scale": pick([None, None, 1.0]),
        "relu": bool(rng.random() < 0.7), "per_kv_head": per_kv_head, "block_size": block_size,
        "local_blocks": 0 if block_size is None else int(rng.integers(0, min(topk, 2) + 1)),
    }
    return dataclasses.replace(case, config=dataclasses.replace(c, indexer=indexer))
