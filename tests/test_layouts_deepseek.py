"""hf-deepseek and deepseek on real models: tiny randomly initialised DeepSeek V2 / V3 models (transformers,
eager attention, float32) saved with save_pretrained, one attention block converted with `mha convert --from
hf-deepseek --to canonical FOLDER W.safetensors --layer 1`, and every installed core backend reproducing the
block's own output (a forward hook on the attention module) for a causal sequence; numpy and torch also a
decode step from the latent cache their first call returned; the float64 reference's cache equal to the one
transformers kept (the normed latent, the rotated shared key). The models cover V2's complex-number RoPE, V3
with rope_interleave true and false, YaRN with mscale != mscale_all_dim (so the softmax scale's rule shows),
q_lora_rank null with attention_bias, and Kimi K2's released config.json form (model_type kimi_k2, 4.x
rope_scaling) over a DeepSeek V3 model.

Judged by the float32 policy: the model is float32. Each latent norm's eps is 1e-6 while the model's
rms_norm_eps is 0.25, so an eps read from the wrong field shows. Mutants of the layout's config reader (the
scale from mscale, the eps from rms_norm_eps, rope_interleave ignored) are each shown to fail the policy.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_layouts_modern import _installed

from conformance.cli import files
from conformance.cli.commands import main as mha
from conformance.suite import backends
from conformance.suite.tolerance import compare, policy_for
from weights import layouts, load
from weights.layouts import deepseek

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_transformers = [pytest.mark.torch, pytest.mark.tf, pytest.mark.jax,
                      pytest.mark.skipif(transformers is None, reason="needs torch and transformers: "
                                         "pip install -c constraints/cpu.txt '.[torch,hf]'")]

T, LAYER, QR = 9, 1, 5
SMALL = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=6, qk_nope_head_dim=4,
             qk_rope_head_dim=4, v_head_dim=3, num_hidden_layers=2, first_k_dense_replace=2, intermediate_size=16,
             moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1, vocab_size=64,
             max_position_embeddings=64, rms_norm_eps=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32.0, "beta_slow": 1.0}
KIMI_ROPE = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 4,
             "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0}  # Kimi K2's betas
# name -> (model_type, config kwargs)
MODELS = {
    "v2": ("deepseek_v2", dict(q_lora_rank=QR)),
    "v3": ("deepseek_v3", dict(q_lora_rank=QR, rope_interleave=True)),
    "v3_half": ("deepseek_v3", dict(q_lora_rank=QR, rope_interleave=False)),
    "v3_yarn": ("deepseek_v3", dict(q_lora_rank=QR, rope_interleave=True, rope_parameters=YARN)),
    "v3_no_q_lora": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=True, attention_bias=True)),
    "kimi_k2": ("deepseek_v3", dict(q_lora_rank=QR, rope_interleave=True, rope_parameters=KIMI_ROPE)),
}


def _model(name: str):
    model_type, kwargs = MODELS[name]
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # random weights, norm scales around 1, random biases
        for param_name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in param_name else 0.0, 0.3)
    return model.eval()


def _kimi_k2_config(saved: dict) -> dict:
    """The saved DeepSeek V3 config.json in Kimi K2's released form: model_type kimi_k2, transformers 4.x's
    rope_theta + rope_scaling ("type"), no rope_interleave (transformers' default, true, applies)."""
    cfg = {k: v for k, v in saved.items() if k not in ("rope_parameters", "rope_interleave")}
    rope = dict(saved["rope_parameters"])
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    return {**cfg, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "rope_scaling": rope}


def _capture(model):
    """Block LAYER's attention input and output, and the latent cache transformers kept for it."""
    seen = {}

    def hook(module, args, kwargs, output):
        seen["x"], seen["out"] = kwargs["hidden_states"].numpy().copy(), output[0].numpy().copy()

    handle = model.model.layers[LAYER].self_attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        result = model(input_ids=torch.arange(3, 3 + T)[None], position_ids=torch.arange(T)[None], use_cache=True)
    handle.remove()
    cache = result.past_key_values.layers[LAYER]
    seen["latent"], seen["rotary"] = cache.keys.numpy().copy(), cache.values.numpy().copy()
    return seen


_BUILT: dict[str, tuple] = {}  # each model built and converted once per session


def _converted(name: str, tmp_path_factory):
    """(name, config, tensors, captured, state dict, config.json, folder): block LAYER through the CLI."""
    if name not in _BUILT:
        _BUILT[name] = _build(name, tmp_path_factory)
    return _BUILT[name]


@pytest.fixture(scope="module", params=[pytest.param(m, marks=needs_transformers) for m in MODELS])
def converted(request, tmp_path_factory):
    return _converted(request.param, tmp_path_factory)


def _build(name: str, tmp_path_factory):
    model = _model(name)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    hf_config = json.loads((folder / "config.json").read_text())
    if name == "kimi_k2":
        hf_config = _kimi_k2_config(hf_config)
        (folder / "config.json").write_text(json.dumps(hf_config))
    target = folder / "block.safetensors"
    assert mha(["convert", "--from", "hf-deepseek", "--to", "canonical", str(folder), str(target),
                "--layer", str(LAYER)]) == 0
    config, tensors = load(target)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return name, config, tensors, _capture(model), state, hf_config, folder


def _policy(config, expected, logits):
    return policy_for(config, dtype="float32", quantity="output", B=1, T=expected.shape[1], S=T, reference=expected,
                      logits=logits, max_position=T)


def _reference(config, tensors, x):
    wide = {k: v.astype(np.float64) for k, v in tensors.items()}
    return backends.load("numpy").forward(config, wide, {"query": x.astype(np.float64), "positions": np.arange(T)},
                                          {"is_causal": True, "return_cache": True}, trace=True)


def test_config_read_from_the_checkpoint(converted):
    """What the layout read, against the model's own attributes (written from transformers' modeling files)."""
    name, config, _tensors, _seen, _state, _cfg, _folder = converted
    model_type, kwargs = MODELS[name]
    assert config.latent.kv_rank == 6 and config.latent.rope_dim == 4 and config.latent.eps == 1e-6, config.latent
    assert config.latent.query_rank == kwargs["q_lora_rank"], config.latent
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.value_head_dim) == (4, 4, 8, 3), config
    assert config.rope.interleaved is (model_type == "deepseek_v2" or kwargs["rope_interleave"]), config.rope
    assert config.use_key_bias is config.use_output_bias is bool(kwargs.get("attention_bias")), config
    if name == "v3_yarn":  # (nope + rope)^-1/2 * (0.1 * 0.5 * ln 4 + 1)^2
        assert config.effective_scale == pytest.approx(8 ** -0.5 * (0.05 * np.log(4.0) + 1) ** 2), config.scale
        assert config.rope.scaling.type == "yarn", config.rope
    if name == "kimi_k2":
        assert config.rope.theta == 50000.0 and config.rope.scaling.factor == 8.0, config.rope


def test_backends_reproduce_the_block(converted):
    """Full causal call on every installed core backend, and a decode step from the returned latent cache on
    numpy and torch, against the model's own output; the float64 reference first, with its cache against
    transformers' (V3's interleaved path caches the rotated features evens first, then odds)."""
    name, config, tensors, seen, *_ = converted
    x, expected = seen["x"], seen["out"]
    ref = _reference(config, tensors, x)
    logits = dict(ref["trace"])["logits"]
    tol = _policy(config, expected, logits)
    margins = {"float64": compare(f"{name} float64 reference", ref["output"], expected, tol)}
    latent_tol = policy_for(config, dtype="float32", quantity="output", B=1, T=T, S=T, reference=seen["latent"])
    margins["latent cache"] = compare(f"{name} cached latent", ref["present_key"], seen["latent"], latent_tol)
    rotary = ref["present_value"]
    if MODELS[name][0] == "deepseek_v3" and config.rope.interleaved:
        rotary = np.concatenate([rotary[..., 0::2], rotary[..., 1::2]], axis=-1)
    rotary_tol = policy_for(config, dtype="float32", quantity="output", B=1, T=T, S=T, reference=seen["rotary"])
    margins["rotary cache"] = compare(f"{name} cached rotary key", rotary, seen["rotary"], rotary_tol)
    positions = np.arange(T, dtype=np.int64)
    for backend_name, backend in _installed():
        full = backend.forward(config, tensors, {"query": x, "positions": positions}, {"is_causal": True})
        margins[backend_name] = compare(f"{name} {backend_name}", full["output"], expected, tol)
        if backend_name not in ("numpy", "torch"):
            continue
        first = backend.forward(config, tensors, {"query": x[:, :-1], "positions": positions[:-1]},
                                {"is_causal": True, "return_cache": True})
        assert first["present_key"].shape == (1, 1, T - 1, 6) and first["present_value"].shape == (1, 1, T - 1, 4)
        step = backend.forward(config, tensors, {"query": x[:, -1:], "positions": positions[-1:],
                                                 "past_key": first["present_key"], "past_value": first["present_value"]},
                               {"is_causal": True, "causal_alignment": "bottom_right"})
        margins[f"{backend_name} decode"] = compare(f"{name} {backend_name} decode", step["output"], expected[:, -1:],
                                                    _policy(config, expected[:, -1:], logits[..., -1:, :]))
    failed = [result.describe() for result in margins.values() if not result.ok]
    assert not failed, "\n".join(failed)
    print(f"{name}: worst margins " + ", ".join(f"{k} {v.margin:.3g}" for k, v in margins.items()))


def test_round_trip_is_bit_exact(converted):
    """canonical -> hf-deepseek (with its config.json) gives the checkpoint's own tensors, and back the same bits."""
    name, config, tensors, _seen, state, hf_config, _folder = converted
    written = layouts.from_canonical("hf-deepseek", config, tensors, hf_config=hf_config, layer=LAYER, prefix="model.")
    scope = f"model.layers.{LAYER}.self_attn."
    assert sorted(written) == sorted(k for k in state if k.startswith(scope)), sorted(written)
    for key, value in written.items():
        assert value.dtype == state[key].dtype and np.array_equal(value, state[key]), key
    again_config, again = layouts.to_canonical("hf-deepseek", written, hf_config=hf_config, layer=LAYER)
    assert again_config == config, (again_config, config)
    for tensor in tensors:
        assert np.array_equal(again[tensor], tensors[tensor]), (name, tensor)


# -- mutants of the config reader: each must make the reproduction fail ------------------------


def _wrong_scale(original):
    def read(params, head_dim):  # the MLA scale from mscale instead of mscale_all_dim
        return original({**params, "mscale_all_dim": params.get("mscale")}, head_dim)
    return read


MUTANTS = {
    "scale_from_mscale": ("v3_yarn", "_mla_scale", _wrong_scale),
    "eps_from_rms_norm_eps": ("v3", "_latent_eps", lambda original: lambda cfg: float(cfg["rms_norm_eps"])),
    "rope_interleave_ignored": ("v3", "_interleaved",
                                lambda original: lambda model_type, cfg: model_type == "deepseek_v2"),
}


@pytest.mark.parametrize("mutant", [pytest.param(m, marks=needs_transformers) for m in MUTANTS])
def test_mutant_reader_fails_the_policy(mutant, tmp_path_factory, monkeypatch):
    target, attribute, make = MUTANTS[mutant]
    name, _config, _tensors, seen, state, hf_config, _folder = _converted(target, tmp_path_factory)
    monkeypatch.setattr(deepseek, attribute, make(getattr(deepseek, attribute)))
    config, tensors = layouts.to_canonical("hf-deepseek", state, hf_config=hf_config, layer=LAYER)
    ref = _reference(config, tensors, seen["x"])
    result = compare(f"{name} read by {mutant}", ref["output"], seen["out"],
                     _policy(config, seen["out"], dict(ref["trace"])["logits"]))
    assert not result.ok, f"{mutant} still passes: {result.describe()}"
    print(result.describe())


# -- deepseek (DeepSeek's own names) <-> hf-deepseek ------------------------------------------------


@pytest.mark.torch
@pytest.mark.tf
@pytest.mark.jax
@pytest.mark.skipif(transformers is None, reason="needs torch and transformers: "
                    "pip install -c constraints/cpu.txt '.[torch,hf]'")
def test_deepseek_and_hf_deepseek_through_the_cli(tmp_path_factory, tmp_path):
    """hf-deepseek -> deepseek renames the block's tensors (both interleaved: the same arrays); deepseek, read
    with DeepSeek's ModelArgs config.json, gives the same canonical block; deepseek -> hf-deepseek gives the
    checkpoint's own tensors back, bit for bit."""
    # v3: interleaved, no biases, default RoPE: what DeepSeek's ModelArgs can say
    _name, config, tensors, _seen, state, _hf_config, folder = _converted("v3", tmp_path_factory)
    ds = tmp_path / "deepseek"
    ds.mkdir()
    (ds / "config.json").write_text(json.dumps({  # DeepSeek's ModelArgs keys; max_seq_len <= original: no YaRN
        "dim": 16, "n_heads": 4, "q_lora_rank": QR, "kv_lora_rank": 6, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
        "v_head_dim": 3, "rope_theta": 10000.0, "max_seq_len": 64, "original_seq_len": 4096}))
    assert mha(["convert", "--from", "hf-deepseek", "--to", "deepseek", str(folder), str(ds / "model0-mp1.safetensors"),
                "--layer", str(LAYER)]) == 0
    written = files.read_state(ds / "model0-mp1.safetensors")
    renames = {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa",
               "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
    assert sorted(written) == sorted(f"layers.{LAYER}.attn.{k}.weight" for k in renames), sorted(written)
    for ours, theirs in renames.items():
        assert np.array_equal(written[f"layers.{LAYER}.attn.{ours}.weight"],
                              state[f"model.layers.{LAYER}.self_attn.{theirs}.weight"]), ours
    assert mha(["convert", "--from", "deepseek", "--to", "canonical", str(ds / "model0-mp1.safetensors"),
                str(tmp_path / "c.safetensors")]) == 0
    read_config, read = load(tmp_path / "c.safetensors")
    assert read_config == config, (read_config, config)
    assert all(np.array_equal(read[t], tensors[t]) for t in tensors), "deepseek's block differs from hf-deepseek's"
    assert mha(["convert", "--from", "deepseek", "--to", "hf-deepseek", str(ds / "model0-mp1.safetensors"),
                str(tmp_path / "back.safetensors"), "--layer", str(LAYER), "--to-prefix", "model.", "--to-config",
                str(folder / "config.json")]) == 0
    back = files.read_state(tmp_path / "back.safetensors")
    for key, value in back.items():
        assert value.dtype == state[key].dtype and np.array_equal(value, state[key]), key


def test_half_split_canonical_written_as_deepseek_computes_the_same():
    """A half-split latent block written as deepseek (always interleaved) has its rotary rows permuted, and reads
    back interleaved computing the same output (NumPy only)."""
    from weights import AttentionConfig, init

    config = AttentionConfig(num_heads=2, query_dim=8, head_dim=6, value_head_dim=3, use_query_bias=False,
                             use_key_bias=False, use_value_bias=False, use_output_bias=False,
                             rope={"interleaved": False}, latent={"query_rank": 5, "kv_rank": 4, "rope_dim": 4})
    tensors = init(config, seed=3, dtype="float64")
    args = {"dim": 8, "n_heads": 2, "q_lora_rank": 5, "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 4,
            "v_head_dim": 3, "max_seq_len": 16, "original_seq_len": 4096}
    state = layouts.from_canonical("deepseek", config, tensors, hf_config=args, layer=0)
    back_config, back = layouts.to_canonical("deepseek", state, hf_config=args)
    assert back_config.rope.interleaved is True and back_config.replace(rope=config.rope) == config, back_config
    assert not np.array_equal(back["latent.kernel"], tensors["latent.kernel"])  # the rotary columns moved
    x = np.random.default_rng(0).standard_normal((1, 5, 8))
    numpy_backend = backends.load("numpy")
    want = numpy_backend.forward(config, tensors, {"query": x}, {"is_causal": True})["output"]
    got = numpy_backend.forward(back_config, back, {"query": x}, {"is_causal": True})["output"]
    tol = policy_for(config, dtype="float64", quantity="output", B=1, T=5, S=5, reference=want)
    result = compare("deepseek's interleaved rows vs the half-split block", got, want, tol)
    assert result.ok, result.describe()


def test_refusals_name_the_field():
    from weights import AttentionConfig, init

    plain = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    with pytest.raises(ValueError, match=r"^hf-deepseek cannot express latent=None"):
        layouts.from_canonical("hf-deepseek", plain, init(plain, seed=0))
    biased = AttentionConfig(num_heads=2, query_dim=8, head_dim=6, use_value_bias=False, rope={},
                             latent={"query_rank": 5, "kv_rank": 4, "rope_dim": 4})
    with pytest.raises(ValueError, match=r"use_query_bias=True \(DeepSeek's MLA has no biases\)"):
        layouts.from_canonical("deepseek", biased, init(biased, seed=0))
    with pytest.raises(ValueError, match=r"model_type must be one of .*: got 'llama'"):
        layouts.to_canonical("hf-deepseek", {}, hf_config={"model_type": "llama"})


def test_detect_layers_and_mapping():
    """The table engine's locate (detect_layout, layers) and mapping work on both layouts' states (NumPy only)."""
    from weights import AttentionConfig, init

    for query_rank in (5, None):
        config = AttentionConfig(num_heads=2, query_dim=8, head_dim=6, value_head_dim=3, use_query_bias=False,
                                 use_key_bias=False, use_value_bias=False, use_output_bias=False, rope={},
                                 latent={"query_rank": query_rank, "kv_rank": 4, "rope_dim": 4})
        for layout in ("hf-deepseek", "deepseek"):
            state = layouts.from_canonical(layout, config, init(config, seed=1), layer=3, prefix="model.")
            assert layouts.detect_layout(state) == layout, (layout, query_rank, sorted(state))
            assert layouts.layers(layout, state) == [3], layout
            held = layouts.mapping(layout, config, layer=3, prefix="model.")
            assert sorted(held) == sorted(state), (layout, held)
            kv_up = "kv_b_proj" if layout == "hf-deepseek" else "wkv_b"
            scope = "self_attn" if layout == "hf-deepseek" else "attn"
            assert held[f"model.layers.3.{scope}.{kv_up}.weight"] == ("key.kernel", "value.kernel"), held
