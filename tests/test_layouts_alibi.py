"""hf-bloom, hf-mpt and hf-falcon on real models: a tiny randomly initialised transformers model per
variant, saved with save_pretrained, one block converted with `mha convert --from LAYOUT --to
canonical FOLDER W.safetensors --layer 1`, and every installed core backend reproduces the block's
own output (its input captured at the attention module, its output at the output projection: BLOOM
adds the residual inside its attention module) for a causal sequence, and for a decode step on the
cache a previous call returned. Expected values are the model's own; the float64 reference on the
converted weights is held to them first.

Also measured here (docs/conventions.md, "ALiBi in transformers"): transformers' own decode step reads
the cache's keys at positions 0..P-1 as the contract does; Falcon's eager path adds the ALiBi bias
twice where its sdpa path adds it once; BLOOM's and MPT's slope rules side by side; where
transformers computes in float32 inside a float64 model. The models and those measurements are
conformance/native/conventions/alibi_models.py's (the ALiBi table of `mha check --conventions`);
the tests here hold them to what docs/conventions.md says.

Mutants of the slope readers (BLOOM's 6 heads given the power-of-two formula, Falcon-RW's slopes
without 1/sqrt(H)) are each shown to fail the policy.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from test_layouts_modern import _installed

from conformance.cli.commands import main as mha
from conformance.native.conventions import alibi_models as am
from conformance.suite.tolerance import compare, policy_for
from weights import alibi, layouts, load
from weights.layouts import alibi_models

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_transformers = [pytest.mark.torch, pytest.mark.tf, pytest.mark.jax,
                      pytest.mark.skipif(transformers is None, reason="needs torch and transformers (extra hf)")]

T = am.T  # tokens: ALiBi's distances reach 8, enough for a wrong slope to move every row
LAYER = am.LAYER  # the block converted: its input is another block's output, not the embedding
DOCS = Path(__file__).resolve().parents[1] / "docs" / "conventions.md"

_SMALL = dict(num_hidden_layers=2, vocab_size=64)
# variant -> (layout, model_type, config kwargs, path to the blocks, attention attribute, output projection):
# the conventions table's BLOOM, MPT and Falcon-RW, and Falcon's two RoPE variants
MODELS = {
    **am.MODELS,
    "falcon-mq": ("hf-falcon", "falcon", dict(hidden_size=32, num_attention_heads=4, multi_query=True,
                                              rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                                              **_SMALL), "transformer.h", "self_attention", "dense"),
    "falcon-new": ("hf-falcon", "falcon", dict(hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                                               new_decoder_architecture=True, bias=True, **_SMALL),
                   "transformer.h", "self_attention", "dense"),
}


def _model(variant: str, *, dtype=None, attn: str | None = None):
    return am.build(MODELS[variant], dtype=dtype, attn=attn)


def _module(model, variant: str, layer: int):
    return am.attention_module(model, MODELS[variant], layer)


def _run(model, variant: str, *calls) -> list[dict]:
    """Block LAYER's attention input and output projection, for each call of the model (kwargs dicts)."""
    return am.capture(model, MODELS[variant], *calls)


_ids = am.token_ids
_decode_calls = am.decode_calls  # the prefix, then the last token on the cache the prefix left
_reference = am.reference  # the float64 reference and the logit magnitudes the policy takes z from


_BUILT: dict[str, tuple] = {}  # each variant built and converted once per session


def _converted(variant: str, tmp_path_factory):
    """(variant, config, tensors, captured full call, captured decode step, state dict, config.json, model)."""
    if variant not in _BUILT:
        _BUILT[variant] = _build(variant, tmp_path_factory)
    return _BUILT[variant]


@pytest.fixture(scope="module", params=[pytest.param(v, marks=needs_transformers) for v in MODELS])
def converted(request, tmp_path_factory):
    return _converted(request.param, tmp_path_factory)


def _build(variant: str, tmp_path_factory):
    model = _model(variant)
    folder = tmp_path_factory.mktemp(variant)
    model.save_pretrained(folder)
    ids = _ids()
    (full,) = _run(model, variant, {"input_ids": ids, "use_cache": False})
    (step,) = _run(model, variant, *_decode_calls(model, ids))
    target = folder / "block.safetensors"
    assert mha(["convert", "--from", MODELS[variant][0], "--to", "canonical", str(folder), str(target),
                "--layer", str(LAYER)]) == 0, variant
    config, tensors = load(target)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return variant, config, tensors, full, step, state, json.loads((folder / "config.json").read_text()), model


def _check(name, actual, expected, config, *, S, z, dtype="float32") -> float:
    result = am.judge(name, actual, expected, config, S=S, z=z, dtype=dtype)
    assert result.ok, result.describe()
    return result.margin


def test_config_read_from_the_checkpoint(converted):
    """What the layout read from config.json, against the model's own attributes and transformers' own
    slope functions (float32: one rounding apart from weights.alibi's float64)."""
    variant, config, tensors, *_, model = converted
    attention, _ = _module(model, variant, LAYER)
    N = model.config.num_attention_heads
    assert (config.num_heads, config.head_dim) == (N, attention.head_dim), (variant, config)
    expect_kv = {"falcon-mq": 1, "falcon-new": 2}.get(variant, N)
    assert config.num_kv_heads == expect_kv, (variant, config.num_kv_heads)
    assert config.alibi is (variant in ("bloom", "mpt", "falcon-rw")), (variant, config.alibi)
    assert (config.rope is not None) is (variant in ("falcon-mq", "falcon-new")), (variant, config.rope)
    if variant == "mpt":
        assert config.qkv_clip == attention.clip_qkv and config.effective_scale == attention.softmax_scale, config
    else:
        assert config.qkv_clip is None and config.effective_scale == pytest.approx(attention.head_dim ** -0.5), config
    if not config.alibi:
        return
    ones = torch.ones(1, 2, dtype=torch.long)
    if variant == "bloom":
        own = transformers.models.bloom.modeling_bloom._get_alibi_slopes(N, "cpu")
    elif variant == "mpt":  # its bias at key position 0 of 2 is -slope * 1
        own = -transformers.models.mpt.modeling_mpt.build_mpt_alibi_tensor(N, 2)[:, 0, 0]
    else:  # Falcon's bias at key position 1 is bfloat16(slope) * 1, then divided by sqrt(H) (FalconModel.forward)
        own = transformers.models.falcon.modeling_falcon.build_alibi_tensor(ones, N, torch.float32)[:, 0, 1]
        own = own / math.sqrt(attention.head_dim)
    # one float32 rounding of each side (transformers raises a float32 base to integer powers)
    np.testing.assert_allclose(tensors["alibi.slopes"], own.numpy(), rtol=2 * np.finfo(np.float32).eps, atol=0,
                               err_msg=f"{variant}: alibi.slopes against transformers' own")


def test_backends_reproduce_the_block(converted):
    """Full causal call on every installed core backend, and one decode step on the cache a first call
    returned (the contract's cache keys sit at positions 0..P-1), against the model's own output."""
    variant, config, tensors, full, *_ = converted
    x, expected = full["x"], full["out"]
    positions = np.arange(T, dtype=np.int64)
    ref, z = _reference(config, tensors, x, positions)
    margins = {"float64": _check(f"{variant} float64 reference", ref["output"], expected, config, S=T, z=z)}
    for name, backend in _installed():
        out = backend.forward(config, tensors, {"query": x, "positions": positions}, {"is_causal": True})
        margins[name] = _check(f"{variant} {name}", out["output"], expected, config, S=T, z=z)
        first = backend.forward(config, tensors, {"query": x[:, :-1], "positions": positions[:-1]},
                                {"is_causal": True, "return_cache": True})
        step = backend.forward(config, tensors, {"query": x[:, -1:], "positions": positions[-1:],
                                                 "past_key": first["present_key"],
                                                 "past_value": first["present_value"]},
                               {"is_causal": True, "causal_alignment": "bottom_right"})
        margins[f"{name} decode"] = _check(f"{variant} {name} decode", step["output"], expected[:, -1:], config,
                                           S=T, z=z[..., -1:, :])
    print(f"{variant}: worst margins " + ", ".join(f"{k} {v:.3g}" for k, v in margins.items()))


def test_transformers_decode_reads_the_cache_at_positions_0_to_P_minus_1(converted):
    """Measured: the model's own decode step (its input and output at block LAYER, on its own cache)
    equals the contract's decode, cache keys at positions 0..P-1 and the query at P, computed by the
    float64 reference from the cache the reference itself builds."""
    variant, config, tensors, full, step, *_ = converted
    result = am.decode_comparison(config, tensors, full, step, f"{variant}: transformers'")
    assert result.ok, result.describe()


def test_round_trip_is_bit_exact(converted):
    """canonical -> the model's layout (with its config.json) -> canonical gives the same bits, and the
    written tensors are the checkpoint's own."""
    variant, config, tensors, _, _, state, hf_config, _ = converted
    layout, *_ = MODELS[variant]
    written = layouts.from_canonical(layout, config, tensors, hf_config=hf_config, layer=LAYER, prefix="transformer.")
    assert written, variant
    for key, value in written.items():
        assert value.dtype == state[key].dtype and np.array_equal(value, state[key]), (variant, key)
    again_config, again = layouts.to_canonical(layout, written, hf_config=hf_config, layer=LAYER)
    assert again_config == config, (again_config, config)
    assert set(again) == set(tensors), (variant, set(again) ^ set(tensors))
    for name in tensors:
        assert np.array_equal(again[name], tensors[name]), (variant, name)


# -- mutants of the slope readers: each must make the reproduction fail ------------------------------------

def _power_of_two_rule(original):
    # 2^(-8k/N), k = 1..N: the paper's formula for a power-of-two head count, applied to BLOOM's 6 heads as they stand
    return lambda num_heads: np.exp2(-8.0 * np.arange(1, num_heads + 1, dtype=np.float64) / num_heads)


MUTANTS = {  # name -> (variant, the reader's function, the bug made from it)
    "bloom_power_of_two_rule": ("bloom", "bloom_slopes", _power_of_two_rule),
    "falcon_without_1_over_sqrt_H": ("falcon-rw", "_falcon_slopes",
                                     lambda original: lambda heads, head_dim: original(heads, 1)),
}


@pytest.mark.parametrize("mutant", [pytest.param(m, marks=needs_transformers) for m in MUTANTS])
def test_mutant_reader_fails_the_policy(mutant, tmp_path_factory, monkeypatch):
    """Each porting bug of a slope rule, put in the reader: the float64 reference on the block it reads
    misses the model's own output under the float32 policy (the reader as it is passes:
    test_backends_reproduce_the_block)."""
    variant, attribute, make = MUTANTS[mutant]
    _, _, _, full, _, state, hf_config, _ = _converted(variant, tmp_path_factory)
    monkeypatch.setattr(alibi_models, attribute, make(getattr(alibi_models, attribute)))
    config, tensors = layouts.to_canonical(MODELS[variant][0], state, hf_config=hf_config, layer=LAYER)
    ref, z = _reference(config, tensors, full["x"], np.arange(T, dtype=np.int64))
    tol = policy_for(config, dtype="float32", quantity="output", B=1, T=T, S=T, reference=full["out"], logits=z,
                     max_position=T)
    result = compare(f"{variant} read by {mutant}", ref["output"], full["out"], tol)
    assert not result.ok, f"{mutant} still passes: {result.describe()}"
    print(result.describe())


@pytest.mark.parametrize("variant", [pytest.param(v, marks=needs_transformers) for v in ("bloom", "falcon-rw")])
def test_writing_checks_the_slopes(variant, tmp_path):
    """from_canonical refuses slopes other than config.json's rule gives, and an ALiBi block without a
    config.json (the layouts store no slopes): one line naming the field."""
    layout, model_type, kwargs, *_ = MODELS[variant]
    hf_config = transformers.AutoConfig.for_model(model_type, **kwargs).to_dict()
    config, tensors = layouts.to_canonical(layout, _fake_state(hf_config, variant), hf_config=hf_config, layer=0)
    bent = dict(tensors, **{"alibi.slopes": tensors["alibi.slopes"] * np.float32(2)})
    with pytest.raises(ValueError, match=r"^hf_config disagrees .*alibi\.slopes=\[[^\n]*$"):
        layouts.from_canonical(layout, config, bent, hf_config=hf_config)
    with pytest.raises(ValueError, match=r"^hf_config: .* stores no alibi\.slopes .*got None$"):
        layouts.from_canonical(layout, config, tensors)


def _fake_state(hf_config, variant):  # BLOOM's and Falcon-RW's keys, (N, 3, H) rows
    D = hf_config["hidden_size"]
    rng = np.random.default_rng(3)
    p = "h.0.self_attention."
    return {p + "query_key_value.weight": rng.standard_normal((3 * D, D)).astype(np.float32),
            p + "query_key_value.bias": rng.standard_normal(3 * D).astype(np.float32),
            p + "dense.weight": rng.standard_normal((D, D)).astype(np.float32),
            p + "dense.bias": rng.standard_normal(D).astype(np.float32)}


@pytest.mark.parametrize("cfg, message", [
    ({"model_type": "mpt", "attn_config": {"attn_type": "multiquery_attention"}}, r"attn_config\.attn_type"),
    ({"model_type": "mpt", "attn_config": {"qk_ln": True}}, r"attn_config\.qk_ln=True"),
    ({"model_type": "falcon", "num_attention_heads": 4, "hidden_size": 32, "new_decoder_architecture": True,
      "num_kv_heads": 3}, r"num_kv_heads must divide num_attention_heads=4: got 3"),
    ({"model_type": "llama", "n_head": 4}, r"model_type must be 'bloom' for hf-bloom: got 'llama'"),
    ({"model_type": "falcon", "num_attention_heads": 12, "hidden_size": 96, "alibi": True,
      "max_position_embeddings": 256}, r"got head_dim=8, num_attention_heads=12, max_position_embeddings=256"),
    ({"model_type": "falcon", "num_attention_heads": 6, "hidden_size": 48, "alibi": True},
     r"got head_dim=8, num_attention_heads=6, max_position_embeddings=2048"),
    ({"model_type": "mpt", "attn_config": {"prefix_lm": True}}, r"attn_config\.prefix_lm=True"),
])
def test_config_refusals_name_the_field(cfg, message):
    layout = {"mpt": "hf-mpt", "falcon": "hf-falcon"}.get(cfg["model_type"], "hf-bloom")
    with pytest.raises(ValueError, match=message) as info:
        layouts.spec(layout).hf(cfg, 0)
    assert "\n" not in str(info.value)


def test_falcon_grouped_rows_are_the_models_split():
    """hf-falcon's row order for each variant: the canonical q, k, v heads equal FalconAttention._split_heads
    of the fused projection (NumPy rows fed through transformers' own split where it is installed; else
    the (K, N/K + 2, H) grouping written out)."""
    N, H, D = 4, 3, 12
    for K in (1, 2, 4):
        cfg = {"model_type": "falcon", "num_attention_heads": N, "hidden_size": D, "alibi": True,
               "new_decoder_architecture": K == 2, "multi_query": K == 1, "num_kv_heads": K,
               "max_position_embeddings": 256}  # H = 3: hf-falcon converts it exactly only up to 256 positions
        rows = np.arange((N + 2 * K) * H * D, dtype=np.float32).reshape((N + 2 * K) * H, D)
        state = {"h.0.self_attention.query_key_value.weight": rows,
                 "h.0.self_attention.dense.weight": np.zeros((D, D), np.float32)}
        config, tensors = layouts.to_canonical("hf-falcon", state, hf_config=cfg)
        assert config.num_kv_heads == K, config
        grid = rows.reshape(K, N // K + 2, H, D)
        np.testing.assert_array_equal(tensors["query.kernel"], grid[:, :-2].reshape(N, H, D).transpose(2, 0, 1))
        np.testing.assert_array_equal(tensors["key.kernel"], grid[:, -2].transpose(2, 0, 1))
        np.testing.assert_array_equal(tensors["value.kernel"], grid[:, -1].transpose(2, 0, 1))


# -- measured: Falcon's two paths, the slope rules, float32 inside float64 --------------------------------

@pytest.mark.parametrize("variant", [pytest.param("falcon-rw", marks=needs_transformers)])
def test_falcon_eager_adds_alibi_twice(variant, converted_falcon_rw):
    """Measured: transformers' Falcon with alibi=True adds the bias once on its sdpa path (the default)
    and twice on its eager path (FalconModel folds alibi / sqrt(H) into the mask, which the eager
    attention adds beside its own (q k^T + alibi) / sqrt(H)). Both against the float64 reference on the
    converted weights: sdpa with the slopes as read, eager with the slopes doubled, and not with them
    as read."""
    config, tensors, sdpa = converted_falcon_rw
    eager = _model(variant, attn="eager")
    (out,) = _run(eager, variant, {"input_ids": _ids(), "use_cache": False})
    once = am.bias_count(config, tensors, sdpa, "falcon sdpa")
    assert once["once"].ok, once["once"].describe()
    twice = am.bias_count(config, tensors, out, "falcon eager")
    assert twice["twice"].ok, twice["twice"].describe()
    assert not twice["once"].ok, twice["once"].describe()
    print(f"falcon eager - float64 reference (bias once): {twice['once'].max_abs_error:.3g}")


@pytest.fixture(scope="module")
def converted_falcon_rw():
    if transformers is None:
        pytest.skip("needs torch and transformers (extra hf)")
    variant = "falcon-rw"
    model = _model(variant)
    (full,) = _run(model, variant, {"input_ids": _ids(), "use_cache": False})
    config, tensors = am.convert(model, MODELS[variant])  # the config.json save_pretrained writes
    return config, tensors, full


SLOPE_HEADS = (6, 12, 40)


def slope_table() -> str:
    """docs/conventions.md's slope table, generated from weights.alibi: each head's -log2(slope)."""
    lines = ["| heads | rule | -log2(slope), head by head |", "|---|---|---|"]
    for N in SLOPE_HEADS:
        for rule, slopes in (("BLOOM", alibi.bloom_slopes(N)), ("MPT, alibi_bias_max 8", alibi.mpt_slopes(N)),
                             ("MPT, alibi_bias_max 16", alibi.mpt_slopes(N, 16))):
            lines.append(f"| {N} | {rule} | {', '.join(f'{-math.log2(s):g}' for s in slopes)} |")
    return "\n".join(lines)


def test_slope_table_is_generated_and_matches_transformers():
    """The table in docs/conventions.md is slope_table()'s output; each BLOOM and MPT (bias max 8) row
    equals transformers' own float32 functions to one float32 rounding where transformers is installed."""
    text = DOCS.read_text(encoding="utf-8")
    assert slope_table() in text, "docs/conventions.md's slope table is stale: paste tests.test_layouts_alibi.slope_table()"
    rows = re.findall(r"^\| (\d+) \| (BLOOM|MPT, alibi_bias_max 8) \| ([^|]+) \|$", text, flags=re.M)
    assert len(rows) == 2 * len(SLOPE_HEADS), rows
    if transformers is None:
        return
    for heads, rule, exponents in rows:
        N = int(heads)
        if rule == "BLOOM":
            own = transformers.models.bloom.modeling_bloom._get_alibi_slopes(N, "cpu").numpy()
        else:
            own = -transformers.models.mpt.modeling_mpt.build_mpt_alibi_tensor(N, 2)[:, 0, 0].numpy()
        table = np.exp2(-np.array([float(e) for e in exponents.split(",")]))
        # the table prints 6 significant digits of the exponent: 2^(1e-6 * 8) - 1 ~ 5.6e-6 relative
        np.testing.assert_allclose(own, table, rtol=6e-6, atol=0, err_msg=f"{rule} {N} heads")


@pytest.mark.parametrize("variant", [pytest.param(v, marks=needs_transformers) for v in ("bloom", "mpt", "falcon-rw")])
def test_float32_inside_a_float64_model(variant):
    """Measured: the model built in float64 against the float64 reference on its converted weights.
    BLOOM (softmax dtype=float32, its alibi tensor from float32 slopes) and MPT (softmax of
    scores.float(), float32 slopes) miss the float64 policy and meet the float32 one; Falcon (softmax
    in the hidden dtype, sdpa in float64; its bfloat16 slopes are powers of two for 6 heads) meets the
    float64 policy."""
    wide = am.float64_model(MODELS[variant], name=variant)  # the slopes as the layout reads them
    result = wide["float64"]
    print(f"{variant} in float64: worst |model - reference| {wide['worst']:.3g}, "
          f"float64 policy atol {result.tolerance.atol:.3g}")
    if variant == "falcon-rw":
        assert result.ok, result.describe()
    else:
        assert not result.ok, f"{variant}: expected float32 rounding inside the float64 model: {result.describe()}"
        assert wide["float32"].ok, wide["float32"].describe()
