"""hf-llama on DiffLlama (differential attention, config.differential): a tiny randomly initialised transformers
model (eager, float32) saved with save_pretrained, blocks 1 and 2 converted with `mha convert --from hf-llama`
(lambda_init is the layer's, 0.8 - 0.6 exp(-0.3 layer): not layer 0's 0.2), every installed core backend held
to the block's own output (a forward hook on the attention module), a full causal call and a decode step on
the returned cache (tests/test_layouts_modern.py's check_block_reproduced). GQA: 8 query heads over 4 kv heads,
so the value pairs (g, g + K/2) are not the only pairing a port could take.

Mutants (tests/mutants.py's port, the paper's form): lambda_init of layer 0 for every layer, and the norm's
(1 - lambda_init) scale dropped, each fails the reproduction of the model's own output."""

from __future__ import annotations

import json

import numpy as np
import pytest
from mutants import port
from test_layouts_modern import _check, check_block_reproduced, needs_transformers

from conformance.cli.commands import main as mha
from weights import layouts, load
from weights.layouts.llama import diffllama_lambda_init

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None

pytestmark = needs_transformers

T = 7
LAYERS = (1, 2)
KWARGS = dict(hidden_size=32, num_attention_heads=8, num_key_value_heads=4, head_dim=4, num_hidden_layers=3,
              intermediate_size=32, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              max_position_embeddings=64, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """({layer: (config, tensors, captured)}, state dict, config.json) of the tiny model."""
    config = transformers.AutoConfig.for_model("diffllama", **KWARGS)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # lambda vectors of 0.5 (their init is N(0, 0.1)): lambda moves well off lambda_init
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if "lambda" in name or "norm" in name else 0.2)
    model.eval()
    folder = tmp_path_factory.mktemp("diffllama")
    model.save_pretrained(folder)
    seen, hooks = {}, []
    for index in LAYERS:
        def hook(module, args, kwargs, output, index=index):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            seen[index] = {"x": hidden.detach().numpy().copy(), "out": output[0].detach().numpy().copy(),
                           "lambda_init": module.lambda_init}
        hooks.append(model.model.layers[index].self_attn.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + T).reshape(1, T), position_ids=torch.arange(T).reshape(1, T),
              use_cache=False)
    for hook in hooks:
        hook.remove()
    blocks = {}
    for layer in LAYERS:
        target = folder / f"block{layer}.safetensors"
        rc = mha(["convert", "--from", "hf-llama", "--to", "canonical", str(folder), str(target), "--layer",
                  str(layer)])
        assert rc == 0, f"mha convert of diffllama block {layer} returned {rc}"
        blocks[layer] = (*load(target), seen[layer])
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return blocks, state, json.loads((folder / "config.json").read_text())


def test_config_read_from_the_checkpoint(converted):
    """lambda_init is the layer's (the model's own attribute), eps rms_norm_eps, the lambda vectors the model's."""
    blocks, state, _ = converted
    for layer, (config, tensors, seen) in blocks.items():
        assert config.differential.lambda_init == pytest.approx(seen["lambda_init"], abs=0), (layer, config)
        assert config.differential.lambda_init == diffllama_lambda_init(layer) != diffllama_lambda_init(0)
        assert config.differential.eps == 1e-5 and (config.num_heads, config.num_kv_heads) == (8, 4), config
        for n in ("q1", "k1", "q2", "k2"):
            own = state[f"model.layers.{layer}.self_attn.lambda_{n}"]
            assert np.array_equal(tensors[f"differential.lambda_{n}"], own), (layer, n)


def test_backends_reproduce_the_block(converted):
    """Full causal call on every installed core backend, and a decode step from the returned cache, against
    the model's own output; the float64 reference first."""
    blocks, *_ = converted
    for layer, (config, tensors, seen) in blocks.items():
        check_block_reproduced(f"diffllama[{layer}]", config, tensors, seen["x"], seen["out"])


@pytest.mark.parametrize("bug", ["differential_lambda_init_layer0", "differential_scale_dropped"])
def test_mutants_fail_the_reproduction(converted, bug):
    """The same port passes without the bug (so the failure is the bug's), fails with it, on every block."""
    blocks, *_ = converted
    for layer, (config, tensors, seen) in blocks.items():
        x = seen["x"]
        inputs = {"query": x, "key": x, "value": x, "positions": np.arange(T)}
        options = {"dtype": "float32", "is_causal": True, "causal_alignment": "top_left", "return_weights": False,
                   "training": False}
        logits = np.zeros((1, config.num_heads, T, T))  # no logit term: the output's own allowance alone
        check = dict(S=T, logits=logits, max_position=T)
        _check(f"diffllama[{layer}] port", port(config.to_dict(), tensors, inputs, options)["output"], seen["out"],
               config, **check)
        with pytest.raises(AssertionError) as caught:
            _check(f"diffllama[{layer}] {bug}", port(config.to_dict(), tensors, inputs, options, bug=bug)["output"],
                   seen["out"], config, **check)
        print(f"{bug} on diffllama[{layer}]: {str(caught.value).splitlines()[0]}")


def test_round_trip_is_bit_exact(converted):
    """canonical -> hf-llama under the model's config.json -> canonical gives the same bits, the written tensors
    the checkpoint's own (the lambda vectors included); a layout without lambda tensors refuses the block."""
    blocks, state, hf_config = converted
    for layer, (config, tensors, _seen) in blocks.items():
        written = layouts.from_canonical("hf-llama", config, tensors, hf_config=hf_config, layer=layer,
                                         prefix="model.")
        own = {k: v for k, v in state.items() if k.startswith(f"model.layers.{layer}.self_attn.")}
        assert sorted(written) == sorted(own), (sorted(written), sorted(own))
        for key, value in written.items():
            assert value.dtype == state[key].dtype and np.array_equal(value, state[key]), key
        again_config, again = layouts.to_canonical("hf-llama", written, hf_config=hf_config, layer=layer)
        assert again_config == config and sorted(again) == sorted(tensors), (again_config, config)
        assert all(np.array_equal(again[name], tensors[name]) for name in tensors), layer
        problems = layouts.cannot_express("torch-linears", config)
        assert any(p.startswith("differential=") for p in problems), problems
