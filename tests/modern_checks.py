"""What the torch, Keras and JAX modern-feature tests share: the rope scalings,
the small config they build on, the decoding configs and their float64
reference, and the table of bad modern calls (each mirror's error must be
the reference's)."""

from __future__ import annotations

import functools

import numpy as np

import impl_numpy
import weights
from conformance.suite.cases import Case, cast_inputs, cast_tensors

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CROSS = dict(self_attention=False, T=4, S=6)
DECODE = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True, self_attention=False)


def cfg(**kw) -> weights.AttentionConfig:
    return weights.AttentionConfig(**{"num_heads": 2, "query_dim": 8, "head_dim": 4, **kw})


DECODE_CONFIGS = {
    "rope_norm_gqa": cfg(num_heads=4, num_kv_heads=2, rope={}, qk_norm={"type": "rms"}),
    "window_interleaved": cfg(rope={"interleaved": True, "rotary_dim": 2}, window_left=2),
    "everything": cfg(num_heads=4, num_kv_heads=2, head_dim=8, window_left=3, logit_softcap=5.0, use_sinks=True,
                      qk_norm={"type": "layer", "scope": "all"},
                      rope={"rotary_dim": 6, "interleaved": True, "scaling": YARN}),
    # the frontier: a latent layer (its cache the latent and the rotary key) with ALiBi, chunks of 3 positions,
    # Mistral 4's temperature and an element gate
    "latent_frontier": cfg(num_heads=4, head_dim=6, value_head_dim=4, use_value_bias=False, rope={"interleaved": True},
                           latent={"query_rank": 5, "kv_rank": 3, "rope_dim": 2}, alibi=True, local_chunk=3,
                           query_temperature={"beta": 0.2, "floor": 2.0}, output_gate={"scope": "element"}),
    # Falcon-RW's ALiBi, rounded to bfloat16 (alibi_bias_dtype): random slopes, so the product rounds
    "alibi_rounded": cfg(num_heads=4, num_kv_heads=2, alibi=True, alibi_bias_dtype="bfloat16"),
}
PROMPT, TOTAL = 3, 7  # the first call holds 3 tokens, then 4 steps of one

# past_key_positions (tests/test_cache_positions.py on the reference, test_mirrors_modern.py on each mirror's
# paths): the last row left-padded by 2 (conformance.suite.cases' positions "left_padded").
CACHE_POSITION_CASES = {
    # RoPE with ALiBi and chunks of 4 over a cache of 6: ALiBi's distances and the chunks read every cached
    # key's position
    "cache_positions_alibi_chunk": Case("cache_positions_alibi_chunk",
                                        cfg(num_heads=4, num_kv_heads=2, rope={}, alibi=True, local_chunk=4),
                                        T=3, S=3, P=6, positions="left_padded", mask="padding", **DECODE),
    # the temperature from the cache index (Llama 4's NoPE layers), with chunks from the positions
    "cache_positions_temperature": Case(
        "cache_positions_temperature",
        cfg(num_heads=4, num_kv_heads=2, local_chunk=4,
            query_temperature={"beta": 0.5, "floor": 3.0, "offset": 1, "position": "cache_index"}),
        T=2, S=2, P=7, positions="left_padded", **DECODE),
}


@functools.cache
def decode_reference(config_name: str, dtype: str, *, perturb_norms: bool = False):
    """The full causal call (self attention over TOTAL tokens): float64 reference
    output, present_key/value and logits, and the NumPy reference's own error in
    `dtype` (the policy's floor for 16-bit). perturb_norms: move the norm scales
    and sinks away from their initial 1 and 0 first."""
    config = DECODE_CONFIGS[config_name]
    tensors = weights.init(config, seed=7, dtype="float64")
    rng = np.random.default_rng(7)
    if perturb_norms:
        for name in tensors:
            if ".norm." in name or name == "sinks":
                tensors[name] = tensors[name] + 0.3 * rng.standard_normal(tensors[name].shape)
    x = rng.standard_normal((2, TOTAL, config.query_dim))
    x, tensors = cast_inputs({"x": x}, dtype)["x"], cast_tensors(tensors, dtype)
    x64, t64 = x.astype(np.float64), cast_tensors(tensors, "float64")
    trace = []
    out, _, pk, pv = impl_numpy.multi_head_attention(config, t64, x64, is_causal=True, return_weights=True,
                                                     return_cache=True, trace=trace)
    errors = {}
    if dtype in ("float16", "bfloat16"):
        low = impl_numpy.multi_head_attention(config, tensors, x, is_causal=True, return_cache=True, trace=[])
        errors = {name: float(np.nanmax(np.abs(got.astype(np.float64) - want)))
                  for name, got, want in zip(("output", "present_key", "present_value"), low, (out, pk, pv))}
    want = {"output": out, "present_key": pk, "present_value": pv}
    stages = {e.stage: e.value for e in trace}
    return tensors, x, want, stages.get("alibi", stages["logits"]), errors  # ALiBi's bias is part of the logits


def modern_bad_calls() -> dict[str, dict]:
    """(id, changes to a valid call): config N 2, K 1, D 8, H 4, rope, window_left 2; query (2, 5, 8)."""
    B, T, K, H = 2, 5, 1, 4
    ints = lambda *shape: np.zeros(shape, dtype=np.int64)  # noqa: E731
    cache = dict(past_key=np.zeros((B, K, 3, H)), past_value=np.zeros((B, K, 3, H)))
    return {
        "positions_float": dict(positions=np.arange(T, dtype=np.float64)),
        "positions_shape": dict(positions=ints(T - 1)),
        "positions_batch": dict(positions=ints(B + 1, T)),
        "key_positions_shape": dict(key_positions=ints(B, T + 1)),
        "past_key_alone": dict(past_key=cache["past_key"]),
        "past_value_alone": dict(past_value=cache["past_value"]),
        "past_key_heads": dict(cache, past_key=np.zeros((B, K + 1, 3, H))),
        "past_key_width": dict(cache, past_key=np.zeros((B, K, 3, H + 1))),
        "past_lengths": dict(cache, past_value=np.zeros((B, K, 2, H))),
        "past_key_int": dict(cache, past_key=ints(B, K, 3, H)),
        "window_with_cache_top_left": dict(cache),
        "causal_with_cache_top_left": dict(cache, is_causal=True),
        "segment_ids_shape": dict(segment_ids=ints(T - 1)),
        "segment_ids_float": dict(segment_ids=np.zeros(T)),
        "key_segment_ids_missing_with_cache": dict(cache, causal_alignment="bottom_right", segment_ids=ints(T)),
        "key_segment_ids_alone": dict(key_segment_ids=ints(T)),
        "key_segment_ids_shape": dict(segment_ids=ints(T), key_segment_ids=ints(T + 1)),
        "return_cache_not_bool": dict(return_cache="yes"),
        "mask_over_new_keys_only": dict(cache, causal_alignment="bottom_right", mask=np.ones((T, T), dtype=bool)),
        "dropout_mask_over_new_keys_only": dict(cache, causal_alignment="bottom_right", training=True,
                                                dropout_mask=np.ones((B, 2, T, T), dtype=bool)),
        "cache_length_without_cache": dict(cache_length=0),
        "cache_length_past_capacity": dict(cache, causal_alignment="bottom_right", cache_length=0),
        "cache_length_negative": dict(cache, causal_alignment="bottom_right", cache_length=-1),
        "cache_length_not_int": dict(cache, causal_alignment="bottom_right", cache_length=1.0),
        "topk_indices_float": dict(topk_indices=np.zeros((B, T, 2))),
        "topk_indices_heads": dict(topk_indices=ints(B, K + 1, T, 2)),
        "topk_indices_length": dict(topk_indices=ints(B, T + 1, 2)),
        "topk_indices_empty": dict(topk_indices=ints(B, T, 0)),
    }


SPARE = 2  # positions an in-place decode's buffers hold past the TOTAL tokens (never read into a result)


def decode_in_place(step, tensors, x, zeros):
    """Decode x (B, TOTAL, D) into one buffer pair: the PROMPT tokens with cache_length 0, then each token
    with the tokens before it cached. zeros(shape) -> a zeroed buffer in the backend's own type, of
    capacity TOTAL + SPARE; step(tensors, x_part, past_key, past_value, P) -> (output, present_key,
    present_value) of a call with cache_length=P, is_causal, bottom_right and return_cache. Returns the
    outputs (B, TOTAL, O) and the last present buffers, as NumPy; and whether every step returned the
    buffers it was given (the same objects: written in place)."""
    B = x.shape[0]
    config_k = tensors["key.kernel"].shape[1:]  # (K, H)
    config_v = tensors["value.kernel"].shape[1:]
    if "latent.kernel" in tensors:  # a latent layer's cache (weights.contract.cache_widths): (1, C) and (1, R)
        C = tensors["latent.norm.scale"].shape[0]
        config_k, config_v = (1, C), (1, tensors["latent.kernel"].shape[1] - C)
    pk = zeros((B, config_k[0], TOTAL + SPARE, config_k[1]))
    pv = zeros((B, config_v[0], TOTAL + SPARE, config_v[1]))
    outputs, same = [], True
    bounds = [(0, PROMPT)] + [(i, i + 1) for i in range(PROMPT, TOTAL)]
    for start, stop in bounds:
        out, k, v = step(tensors, x[:, start:stop], pk, pv, start)
        same = same and k is pk and v is pv
        outputs.append(np.asarray(out))
        pk, pv = k, v
    return np.concatenate(outputs, axis=1), np.asarray(pk), np.asarray(pv), same


def check_in_place_decode(outputs, present_key, present_value, want, compare) -> None:
    """decode_in_place's results against decode_reference's float64 full causal call: the outputs, the
    buffers' first TOTAL positions; the SPARE positions past them still zero (never written).
    compare(name, got, want) asserts within the backend's tolerance."""
    compare("output", outputs, want["output"])
    compare("present_key", present_key[:, :, :TOTAL], want["present_key"])
    compare("present_value", present_value[:, :, :TOTAL], want["present_value"])
    assert present_key.shape[2] == present_value.shape[2] == TOTAL + SPARE
    assert not np.asarray(present_key[:, :, TOTAL:], np.float64).any(), "a position past the last token was written"
    assert not np.asarray(present_value[:, :, TOTAL:], np.float64).any(), "a position past the last token was written"


def decode_causal_masks_built(monkeypatch, functional, attention, compare) -> dict[int, int]:
    """A decode step after an 11-key cache, with T = 1 and T = 3 new queries (bottom-right causal, GQA 4 on
    2): each result compared by compare(name, got, want, T) with the float64 reference's, and the number of
    causal masks `functional.causal_mask` built for each T returned. One bottom-right query sees every key,
    so a fused path needs none for it (no select, no empty-row pass)."""
    built = []
    real = functional.causal_mask
    monkeypatch.setattr(functional, "causal_mask", lambda *a: built.append(a) or real(*a))
    config = cfg(num_heads=4, num_kv_heads=2)
    tensors = weights.init(config, seed=2, dtype="float64")
    rng = np.random.default_rng(6)
    pk, pv = rng.standard_normal((2, 2, 11, 4)), rng.standard_normal((2, 2, 11, 4))
    options = dict(past_key=pk, past_value=pv, is_causal=True, causal_alignment="bottom_right", return_cache=True)
    counts = {}
    for T in (1, 3):
        before = len(built)
        x = rng.standard_normal((2, T, 8))
        got = attention(config, tensors, x, **options)
        want = impl_numpy.multi_head_attention(config, tensors, x, trace=[], **options)
        for name, g, w in zip(("output", "present_key", "present_value"), got, want):
            compare(f"decode T={T} {name}", np.asarray(g), w, T)
        counts[T] = len(built) - before
    return counts


def indexer_refusals() -> dict[str, tuple[dict, str]]:
    """(id: (changes to the indexer_dsa_decode case's inputs, None removing one; the message's start)): a layer
    with an indexer refuses these alike in every mirror (weights.contract.check_indexer_call)."""
    B, P, J = 2, 8, 8
    return {
        "past_index_keys_missing": ({"past_index_keys": None}, "past_index_keys is missing: a call with a cache of P=8"),
        "past_index_keys_shape": ({"past_index_keys": np.zeros((B, P - 1, J))},
                                  r"past_index_keys must have shape \(B, P, J\) = \(2, 8, 8\)"),
        "topk_indices_with_indexer": ({"topk_indices": np.zeros((B, 1, 2), dtype=np.int64)},
                                      "topk_indices is given but config.indexer selects the keys itself"),
    }


def indexer_call(changes: dict) -> tuple:
    """(config, tensors, inputs, options) of the indexer_dsa_decode case in float32 with `changes`."""
    from conformance.suite.cases import CASES, make_inputs, make_tensors

    case = CASES["indexer_dsa_decode"]
    inputs = {name: x for name, x in (make_inputs(case) | changes).items() if x is not None}
    return case.config, make_tensors(case), inputs, case.options("float32")
