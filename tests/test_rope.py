"""weights.rope's frequency rules against transformers' own (modeling_rope_utils),
and against the formulas written out here where transformers is not installed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from weights import AttentionConfig
from weights.config import Rope
from weights.rope import attention_factor, inverse_frequencies

SCALINGS = [
    None,
    {"type": "linear", "factor": 4.0},
    {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    # Llama 4 Scout (Meta's args.py: use_scaled_rope gives factor 16, high_freq_factor 1; low is 1): a step
    {"type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
     "original_max_position_embeddings": 8192},
    {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0},
    # gpt-oss's unrounded ramp (the grid's edge_yarn_ramp_ends)
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 4.0, "beta_slow": 1.0,
     "truncate": False},
]


def _rope(scaling, theta=150000.0, rotary_dim=64):
    return Rope.from_value({"theta": theta, "rotary_dim": rotary_dim, "scaling": scaling})


def _transformers_frequencies(scaling, theta, rotary_dim):
    """transformers' ROPE_INIT_FUNCTIONS on a LlamaConfig carrying the same rope settings."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {"rope_type": "default" if scaling is None else scaling["type"], "rope_theta": theta}
    if scaling is not None:
        parameters.update({k: v for k, v in scaling.items() if k != "type"})
    config = transformers.LlamaConfig(hidden_size=rotary_dim * 2, num_attention_heads=2, head_dim=rotary_dim,
                                      max_position_embeddings=4 * 8192, rope_parameters=parameters)
    if scaling is None:
        inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2) / rotary_dim)
        return inv_freq, 1.0
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["type"]](config, "cpu")
    return inv_freq.double().numpy(), float(factor)


def _id(scaling):
    if scaling is None:
        return "none"
    return "-".join([scaling["type"], f"{scaling['factor']:g}", str(scaling.get("original_max_position_embeddings", "")),
                     "mscale" if "mscale" in scaling else "", "untruncated" if scaling.get("truncate") is False
                     else ""]).replace("--", "-").rstrip("-")


@pytest.mark.parametrize("scaling", SCALINGS, ids=_id)
def test_frequencies_match_transformers(scaling):
    theta, R = 150000.0, 64
    expected, expected_factor = _transformers_frequencies(scaling, theta, R)
    got = inverse_frequencies(_rope(scaling, theta, R))
    # transformers computes in float32: agreement to float32 rounding, relative
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=0)
    assert attention_factor(_rope(scaling, theta, R)) == pytest.approx(expected_factor, rel=1e-6)


def test_frequencies_written_out():
    """The rules restated from their papers, independently of weights.rope's code."""
    R, theta = 8, 10000.0
    base = np.array([theta ** (-2 * i / R) for i in range(R // 2)])
    np.testing.assert_allclose(inverse_frequencies(_rope(None, theta, R)), base, rtol=1e-15)
    np.testing.assert_allclose(inverse_frequencies(_rope({"type": "linear", "factor": 2.0}, theta, R)), base / 2,
                               rtol=1e-15)
    # llama3 with original 16, low 1, high 4: wavelengths 2pi/f = 6.28 (between 16/4 and 16/1: blended),
    # 62.8, 628, 6283 (longer than 16: divided by the factor 8)
    llama3 = inverse_frequencies(_rope(SCALINGS[3], theta, R))
    smooth = (16 / (2 * math.pi / base[0]) - 1) / (4 - 1)
    assert llama3[0] == pytest.approx((1 - smooth) * base[0] / 8 + smooth * base[0], rel=1e-14)
    np.testing.assert_allclose(llama3[1:], base[1:] / 8, rtol=1e-15)
    # yarn with original 16, factor 4: the ramp runs over pair 0..1, so pair 0 keeps its frequency, the rest / 4
    yarn = inverse_frequencies(_rope(SCALINGS[6], theta, R))
    np.testing.assert_allclose(yarn, np.concatenate([base[:1], base[1:] / 4]), rtol=1e-15)
    assert attention_factor(_rope(SCALINGS[6], theta, R)) == pytest.approx(0.1 * math.log(4) + 1)
    # llama3 with equal factors (Scout's 1 and 1) over original 16: a step at wavelength 16, no blend; the
    # wavelengths 6.28 (kept) and 62.8, 628, 6283 (divided by 16)
    step = inverse_frequencies(_rope({"type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 1.0, "original_max_position_embeddings": 16}, theta, R))
    np.testing.assert_allclose(step, np.concatenate([base[:1], base[1:] / 16]), rtol=1e-15)


@pytest.mark.parametrize("field,value,words", [
    ("rope", {"rotary_dim": 3}, "rope.rotary_dim must be even"),
    ("rope", {"rotary_dim": 16}, "rope.rotary_dim must be at most head_dim"),
    ("rope", {"scaling": {"type": "ntk", "factor": 2.0}}, "rope.scaling.type must be one of"),
    ("rope", {"scaling": {"type": "llama3", "factor": 2.0}}, "rope.scaling (llama3) is missing"),
    ("rope", {"scaling": {"type": "llama3", "factor": 2.0, "low_freq_factor": 2.0, "high_freq_factor": 1.0,
                          "original_max_position_embeddings": 8}}, "high_freq_factor must be at least low_freq"),
    ("rope", {"spin": 1}, "rope has unknown fields"),
    ("logit_softcap", 0.0, "logit_softcap must be a finite number > 0"),
    ("window_left", -2, "window_left must be an integer >= -1"),
    ("qk_norm", {"type": "batch"}, "qk_norm.type must be one of"),
    ("qk_norm", {"type": "rms", "scope": "group"}, "qk_norm.scope must be one of"),
])
def test_bad_modern_config_is_one_line_naming_the_field(field, value, words):
    with pytest.raises(ValueError) as info:
        AttentionConfig(num_heads=2, query_dim=8, head_dim=4, **{field: value})
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_modern_config_round_trips_and_plain_files_stay_plain():
    config = AttentionConfig(num_heads=2, query_dim=8, head_dim=4, rope={"scaling": SCALINGS[6]},
                             qk_norm={"type": "layer", "scope": "all"}, logit_softcap=30.0, window_left=3,
                             use_sinks=True)
    again = AttentionConfig.from_json(config.to_json())
    assert again == config and again.rope.rotary_dim == 4
    assert again.rope.scaling.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    plain = AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    for name in ("rope", "qk_norm", "logit_softcap", "window_left", "window_right", "use_sinks"):
        assert f'"{name}"' not in plain.to_json() and f'"{name}"' in config.to_dict().__repr__().replace("'", '"')
    shapes = config.tensor_shapes()
    assert shapes["query.norm.scale"] == (2, 4) and shapes["key.norm.bias"] == (2, 4) and shapes["sinks"] == (2,)


def _longrope(R=64):
    """Phi-3.5-like: factor 32 (131072 / 4096), factor lists of R/2 entries rising towards the slow pairs."""
    rng = np.random.default_rng(17)
    return {"type": "longrope", "factor": 32.0, "original_max_position_embeddings": 4096,
            "short_factor": (1.0 + rng.random(R // 2) * 0.5).tolist(),
            "long_factor": (1.0 + np.linspace(0, 40, R // 2) + rng.random(R // 2)).tolist()}


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_longrope_matches_transformers(long):
    """transformers' _compute_longrope_parameters picks long_factor when seq_len > original (its longrope
    update passes seq_len = max(position_ids) + 1); weights.rope picks by the call's largest position."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from weights.rope import rope_tables

    theta, R = 10000.0, 64
    scaling = _longrope(R)
    parameters = {"rope_type": "longrope", "rope_theta": theta, **{k: v for k, v in scaling.items() if k != "type"}}
    config = transformers.LlamaConfig(hidden_size=R * 2, num_attention_heads=2, head_dim=R,
                                      max_position_embeddings=131072, rope_parameters=parameters)
    max_position = 4096 if long else 4095  # + 1 past the original 4096, or exactly at it
    expected, expected_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=max_position + 1)
    got, factor = rope_tables(_rope(scaling, theta, R), max_position)
    np.testing.assert_allclose(got, expected.double().numpy(), rtol=2e-6, atol=0)
    assert factor == pytest.approx(float(expected_factor), rel=1e-6)
    assert factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-12)
    wanted = scaling["long_factor" if long else "short_factor"]  # the rule written out
    np.testing.assert_allclose(got, theta ** (-np.arange(0, R, 2) / R) / np.asarray(wanted), rtol=1e-14)


@pytest.mark.parametrize("share", [0.25, 0.5, 1.0])
def test_proportional_matches_transformers(share):
    """Gemma 4's proportional RoPE: pairs over the whole head, the first share of them turning at
    theta^(-2i/H) / factor, the rest at 0."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, H = 1000000.0, 64
    scaling = {"type": "proportional", "partial_rotary_factor": share, "factor": 2.0}
    parameters = {"rope_type": "proportional", "rope_theta": theta, "partial_rotary_factor": share, "factor": 2.0}
    config = transformers.LlamaConfig(hidden_size=H * 2, num_attention_heads=2, head_dim=H,
                                      rope_parameters=parameters)
    expected, expected_factor = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu")
    got = inverse_frequencies(_rope(scaling, theta, H))
    np.testing.assert_allclose(got, expected.double().numpy(), rtol=2e-6, atol=0)
    assert attention_factor(_rope(scaling, theta, H)) == float(expected_factor) == 1.0
    turning = int(share * H // 2)
    written = np.where(np.arange(H // 2) < turning, theta ** (-np.arange(0, H, 2) / H), 0.0) / 2.0
    np.testing.assert_allclose(got, written, rtol=1e-14)


@pytest.mark.parametrize("scaling,words", [
    ({"type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16, "short_factor": [1, 1],
      "long_factor": [1, 1, 1]}, "rope.scaling.short_factor must have rotary_dim / 2 = 3 entries: got 2"),
    ({"type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16, "short_factor": [1, 1, 1],
      "long_factor": [1, 0, 1]}, "rope.scaling.long_factor must be a finite number > 0: got 0"),
    ({"type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16, "long_factor": [1, 1, 1]},
     "rope.scaling (longrope) is missing short_factor"),
    ({"type": "proportional", "partial_rotary_factor": 1.5}, "rope.scaling.partial_rotary_factor must lie in [0, 1]"),
])
def test_bad_longrope_and_proportional_are_one_line(scaling, words):
    with pytest.raises(ValueError) as info:
        AttentionConfig(num_heads=2, query_dim=8, head_dim=8, rope={"rotary_dim": 6, "scaling": scaling})
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


# -- multimodal RoPE (rope.mrope_section, issue 42) ---------------------------------------------------------------

def _transformers_axes(model: str, section, pairs: int) -> np.ndarray:
    """The axis transformers turns each pair by: its model's recomposition_frequencies applied to frequencies
    whose value is the axis (0, 1, 2), read back on the first half (the second half repeats it)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if model == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Embedding
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding as Embedding
    embedding = Embedding.__new__(Embedding)  # only recomposition_frequencies is called: it reads mrope_section
    embedding.mrope_section = list(section)
    labels = torch.arange(3, dtype=torch.float64)[:, None, None, None].expand(3, 1, 1, pairs).clone()  # (3,B,L,R/2)
    return embedding.recomposition_frequencies(labels)[0, 0, :pairs].numpy().astype(np.int64)


@pytest.mark.parametrize("model,section,interleaved", [
    ("qwen2_vl", (16, 24, 24), False), ("qwen2_vl", (2, 3, 3), False), ("qwen3_vl", (24, 20, 20), True),
    ("qwen3_vl", (4, 2, 2), True), ("qwen3_vl", (3, 3, 2), True)])
def test_mrope_axes_match_transformers(model, section, interleaved):
    """weights.rope.mrope_axes against transformers 5.23's Qwen2-VL (contiguous sections: also Qwen2.5-VL's
    rule, the same code) and Qwen3-VL (interleaved) frequency recomposition."""
    from weights.rope import mrope_axes

    pairs = sum(section)
    config = AttentionConfig(num_heads=2, query_dim=8, head_dim=2 * pairs,
                             rope={"mrope_section": list(section), "mrope_interleaved": interleaved})
    got = mrope_axes(config.rope)
    want = _transformers_axes(model, section, pairs)
    assert np.array_equal(got, want), f"{model} {section}: axes {got.tolist()} != transformers' {want.tolist()}"


@pytest.mark.parametrize("rope,words", [
    ({"mrope_section": [2, 1, 0]}, "rope.mrope_section must sum to rotary_dim / 2 = 2"),
    ({"mrope_section": [1, 1]}, "rope.mrope_section must be a list of 3 integers"),
    ({"mrope_section": [1, -1, 2]}, "rope.mrope_section must be a list of 3 integers"),
    ({"mrope_interleaved": True}, "rope.mrope_interleaved needs rope.mrope_section"),
    ({"mrope_section": [0, 1, 1], "mrope_interleaved": True}, "width section must fit interleaved"),
    ({"mrope_section": [1, 1, 0], "mrope_interleaved": 1}, "rope.mrope_interleaved must be true or false"),
])
def test_bad_mrope_config_is_one_line_naming_the_field(rope, words):
    with pytest.raises(ValueError) as info:
        AttentionConfig(num_heads=2, query_dim=8, head_dim=4, rope=rope)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("field,value", [("alibi", True), ("local_chunk", 2),
                                         ("query_temperature", {"beta": 0.5, "floor": 3.0})])
def test_mrope_refuses_the_stages_that_read_one_position(field, value):
    with pytest.raises(ValueError, match=f"rope.mrope_section cannot be combined with {field}"):
        AttentionConfig(num_heads=2, query_dim=8, head_dim=4, rope={"mrope_section": [1, 1, 0]}, **{field: value})


def test_mrope_round_trips_and_a_plain_rope_file_is_unchanged():
    config = AttentionConfig(num_heads=2, query_dim=8, head_dim=8,
                             rope={"mrope_section": [2, 1, 1], "mrope_interleaved": True})
    assert AttentionConfig.from_json(config.to_json()) == config
    plain = AttentionConfig(num_heads=2, query_dim=8, head_dim=8, rope={})
    assert "mrope" not in plain.to_json() and set(plain.rope.to_dict()) == {"theta", "rotary_dim", "interleaved",
                                                                             "scaling"}


def test_mrope_positions_shapes_are_checked_naming_the_argument():
    """With mrope_section: positions (3, L) or (3, B, L), one position per token refused; without it a rank-3
    positions is refused naming the field."""
    from weights.contract import check_call

    mrope = AttentionConfig(num_heads=2, query_dim=8, head_dim=4, rope={"mrope_section": [1, 1, 0]})
    plain = AttentionConfig(num_heads=2, query_dim=8, head_dim=4, rope={})
    check_call(mrope, query_shape=(2, 5, 8), positions_shape=(3, 2, 5), positions_dtype="int64")
    check_call(mrope, query_shape=(2, 5, 8), positions_shape=(3, 5), positions_dtype="int64")
    for config, argument, shape, words in (
            (mrope, "positions", (2, 5), "positions must be an integer array of shape (3, T) or (3, B, T)"),
            (mrope, "key_positions", (3, 1, 5), "key_positions must be an integer array of shape (3, S)"),
            (plain, "positions", (3, 2, 5), "need rope.mrope_section")):
        with pytest.raises(ValueError) as info:
            check_call(config, query_shape=(2, 5, 8), **{f"{argument}_shape": shape, f"{argument}_dtype": "int64"})
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_mrope_of_text_positions_is_plain_rope():
    """A text token's three positions are equal: multimodal RoPE then computes exactly what plain RoPE does
    (the same products position x frequency), every path of the reference."""
    import impl_numpy
    import weights

    plain = AttentionConfig(num_heads=2, query_dim=8, head_dim=8, rope={})
    mrope = AttentionConfig(num_heads=2, query_dim=8, head_dim=8, rope={"mrope_section": [2, 1, 1]})
    tensors = weights.init(plain, seed=3, dtype="float64")
    x = np.random.default_rng(4).standard_normal((2, 5, 8))
    positions = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 9]])
    for chunk_size in (None, 2):
        a = impl_numpy.multi_head_attention(plain, tensors, x, is_causal=True, positions=positions,
                                            chunk_size=chunk_size)
        b = impl_numpy.multi_head_attention(mrope, tensors, x, is_causal=True, chunk_size=chunk_size,
                                            positions=np.stack([positions] * 3))
        assert np.array_equal(a, b), f"chunk_size {chunk_size}: worst {np.abs(a - b).max()}"
