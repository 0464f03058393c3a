"""hf-llama and meta-llama on real models: a tiny randomly initialised transformers model (eager
attention, float32) is saved with save_pretrained, one attention block is converted with
`mha convert --from hf-llama --to canonical FOLDER W.safetensors --layer L`, and every installed
core backend reproduces that block's own output (captured by a forward hook on the attention
module) for a causal sequence, and for a decode step on a cache built by a previous call with
return_cache. The expected values are the model's own (an independent formulation); the float64
reference on the converted weights is held to the same output, so a conversion error cannot hide
behind a backend that shares it.

Also measured here: which keys a query of each windowed model sees (its own mask, read off its
attention weights), against the window_left the layout derives from `sliding_window`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conformance import backends
from conformance.cli import main as mha
from conformance.tolerance import compare, policy_for
from weights import layouts, load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch

T = 9  # tokens: longer than every window below, so the window hides keys
SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
             intermediate_size=32, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             max_position_embeddings=64)
# Each model type with the features its family uses turned on and small enough to matter at T tokens.
MODELS = {
    "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}),
    "mistral": dict(sliding_window=3),
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),  # layer 1 slides
    "qwen3": dict(attention_bias=True),
    "gemma2": dict(sliding_window=3, attn_logit_softcapping=3.0, query_pre_attn_scalar=12),
    "gemma3_text": dict(sliding_window=4, query_pre_attn_scalar=12,
                        layer_types=["sliding_attention", "full_attention"]),
    "olmo2": dict(),
    "gpt_oss": dict(sliding_window=3, num_local_experts=2, num_experts_per_tok=1),
    "phi3": dict(partial_rotary_factor=0.5),
}


def _model(model_type: str):
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **MODELS[model_type])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():  # random norms, sinks and biases too (their inits are ones or zeros)
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if ("norm" in name or "sinks" in name or "bias" in name) else 0.2)
    return model.eval()


def _capture(model) -> dict[int, dict]:
    """Each block's attention input, output (after o_proj) and weights, from the model's own forward."""
    seen: dict[int, dict] = {}
    hooks = []
    for index, block in enumerate(model.model.layers):
        def hook(module, args, kwargs, output, index=index):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            seen[index] = {"x": hidden.detach().numpy().copy(), "out": output[0].detach().numpy().copy(),
                           "weights": output[1].detach().numpy().copy()}
        hooks.append(block.self_attn.register_forward_hook(hook, with_kwargs=True))
    ids = torch.arange(3, 3 + T).reshape(1, T)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(T).reshape(1, T), output_attentions=True, use_cache=False)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request, tmp_path_factory):
    """(model_type, {layer: (config, tensors, captured)}, state dict, config.json), converted
    through the CLI from the save_pretrained folder."""
    model_type = request.param
    model = _model(model_type)
    folder = tmp_path_factory.mktemp(model_type)
    model.save_pretrained(folder)
    seen = _capture(model)
    blocks = {}
    for layer in seen:
        target = folder / f"block{layer}.safetensors"
        rc = mha(["convert", "--from", "hf-llama", "--to", "canonical", str(folder), str(target),
                  "--layer", str(layer)])
        assert rc == 0, f"mha convert of {model_type} block {layer} returned {rc}"
        config, tensors = load(target)
        blocks[layer] = (config, tensors, seen[layer])
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model_type, blocks, state, json.loads((folder / "config.json").read_text())


def _check(name, actual, expected, config, *, S, logits, max_position) -> float:
    tol = policy_for(config, dtype="float32", quantity="output", B=1, T=expected.shape[1], S=S,
                     reference=expected, logits=logits, max_position=max_position)
    result = compare(name, actual, expected, tol)
    assert result.ok, result.describe()
    return result.margin


def _installed():
    out = []
    for backend in backends.CORE:
        try:
            out.append((backend, backends.load(backend)))
        except backends.BackendUnavailable:
            continue
    return out


def test_config_read_from_the_checkpoint(converted):
    """What the layout read from config.json, checked against the model's own attributes."""
    model_type, blocks, *_ = converted
    for layer, (config, _tensors, _seen) in blocks.items():
        spec = MODELS[model_type]
        assert config.rope is not None and config.rope.interleaved is False, (model_type, layer, config.rope)
        if model_type == "phi3":
            assert config.rope.rotary_dim == 4, (model_type, config.rope)
        if model_type.startswith("gemma"):
            assert config.effective_scale == pytest.approx(12 ** -0.5), (model_type, config.scale)
        if model_type == "gemma2":
            assert config.logit_softcap == 3.0, (model_type, config.logit_softcap)
        assert config.use_sinks is (model_type == "gpt_oss"), (model_type, config.use_sinks)
        expect_norm = {"qwen3": "head", "gemma3_text": "head", "olmo2": "all"}.get(model_type)
        got_norm = config.qk_norm.scope if config.qk_norm else None
        assert got_norm == expect_norm, (model_type, config.qk_norm)
        if "sliding_window" not in spec:
            assert config.window_left == -1, (model_type, layer, config.window_left)


def test_window_is_the_models_own_mask(converted):
    """Measured: the number of keys each query row of the model's own attention weights gives
    weight to equals min(i, window_left) + 1 under the converted config (the whole prefix when
    the block has no window)."""
    model_type, blocks, *_ = converted
    for layer, (config, _tensors, seen) in blocks.items():
        weights = seen["weights"][0]  # (N, T, T)
        visible = (weights > 0).sum(-1)  # (N, T)
        left = config.window_left if config.window_left >= 0 else T
        expected = np.minimum(np.arange(T), left) + 1
        assert (visible == expected).all(), (
            f"{model_type} block {layer}: keys seen per row {visible[0].tolist()}, "
            f"window_left={config.window_left} gives {expected.tolist()}")
    windowed = [layer for layer, block in blocks.items() if block[0].window_left >= 0]
    assert bool(windowed) == ("sliding_window" in MODELS[model_type]), (model_type, windowed)


def test_backends_reproduce_the_block(converted):
    """Full causal call and one decode step on a cache, every installed core backend, against the
    model's own output; the float64 reference first."""
    model_type, blocks, *_ = converted
    numpy_backend = backends.load("numpy")
    positions = np.arange(T, dtype=np.int64)
    for layer, (config, tensors, seen) in blocks.items():
        x, expected = seen["x"], seen["out"]
        wide = {k: v.astype(np.float64) for k, v in tensors.items()}
        ref = numpy_backend.forward(config, wide, {"query": x.astype(np.float64), "positions": positions},
                                    {"is_causal": True}, trace=True)
        logits = dict(ref["trace"])["logits"]
        margins = {"float64": _check(f"{model_type}[{layer}] float64 reference", ref["output"], expected, config,
                                     S=T, logits=logits, max_position=T)}
        for name, backend in _installed():
            full = backend.forward(config, tensors, {"query": x, "positions": positions}, {"is_causal": True})
            margins[name] = _check(f"{model_type}[{layer}] {name}", full["output"], expected, config, S=T,
                                   logits=logits, max_position=T)
            first = backend.forward(config, tensors, {"query": x[:, :-1], "positions": positions[:-1]},
                                    {"is_causal": True, "return_cache": True})
            step = backend.forward(
                config, tensors, {"query": x[:, -1:], "positions": positions[-1:], "past_key": first["present_key"],
                                  "past_value": first["present_value"]},
                {"is_causal": True, "causal_alignment": "bottom_right"})
            margins[f"{name} decode"] = _check(f"{model_type}[{layer}] {name} decode", step["output"],
                                               expected[:, -1:], config, S=T, logits=logits[..., -1:, :],
                                               max_position=T)
        print(f"{model_type} block {layer}: worst margins " + ", ".join(f"{k} {v:.3g}" for k, v in margins.items()))


def test_round_trip_is_bit_exact(converted):
    """canonical -> hf-llama (with the model's config.json) -> canonical gives the same bits; the
    hf-llama tensors equal the checkpoint's own (Gemma's 1 + w: to one rounding of the addition)."""
    model_type, blocks, state, hf_config = converted
    for layer, (config, tensors, _seen) in blocks.items():
        written = layouts.from_canonical("hf-llama", config, tensors, hf_config=hf_config, layer=layer,
                                         prefix="model.")
        for key, value in written.items():
            if model_type == "gemma3_text" and "_norm." in key:
                np.testing.assert_allclose(value, state[key], rtol=0, atol=np.spacing(np.float32(2)),
                                           err_msg=key)
            else:
                assert value.dtype == state[key].dtype and np.array_equal(value, state[key]), key
        again_config, again = layouts.to_canonical("hf-llama", written, hf_config=hf_config, layer=layer)
        assert again_config == config, (again_config, config)
        for name in tensors:
            assert np.array_equal(again[name], tensors[name]), (model_type, layer, name)
