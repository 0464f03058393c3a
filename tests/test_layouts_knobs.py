"""hf-llama on MiMo-V2-Flash and Falcon-H1's attention layers (weights/layouts/llama_knobs.py): issue 42's
value scale and key multiplier, MiMo's value heads narrower than its query/key heads, its partial RoPE, and
the sinks and doubled kv heads of its sliding layers. Pattern of tests/test_layouts_gated.py: a tiny randomly
initialised transformers model (eager, float32) saved with save_pretrained, each attention block converted
with `mha convert --from hf-llama --to canonical`, every installed core backend held to the block's own output
(a forward hook on the attention module: Falcon-H1's attention_in/out multipliers act outside it), full causal
and a decode step on the returned cache.

Mutants of the reader: the value scale or the key multiplier dropped from what it reads fails the policy.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy
from test_layouts_modern import check_block_reproduced, needs_transformers

from conformance.cli.commands import main as mha
from conformance.suite import backends
from conformance.suite.tolerance import compare, policy_for
from weights import layouts, load
from weights.layouts import llama_knobs

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None

T = 9  # tokens: longer than MiMo's window below
TEXT = dict(hidden_size=32, num_attention_heads=4, intermediate_size=32, vocab_size=64, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, max_position_embeddings=64)
# model_type -> (config kwargs, the blocks converted)
MODELS = {
    # layer 0 full attention, layer 1 sliding (window 4, twice the kv heads, sinks); heads of 12 for q and k
    # (int(12 * 0.334) = 4 features turn), of 8 for v; a value scale that is not a power of two
    "mimo_v2_flash": (dict(**TEXT, num_key_value_heads=1, head_dim=12, v_head_dim=8, num_hidden_layers=2,
                           layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "dense"],
                           sliding_window=4, attention_value_scale=0.707, moe_intermediate_size=16,
                           n_routed_experts=2, num_experts_per_tok=1), (0, 1)),
    # one hybrid layer (attention beside a small Mamba-2 mixer), a key multiplier that is not a power of two
    "falcon_h1": (dict(**TEXT, num_key_value_heads=2, num_hidden_layers=1, key_multiplier=0.37,
                       attention_in_multiplier=1.3, attention_out_multiplier=0.8, mamba_d_ssm=32, mamba_n_heads=4,
                       mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=4), (0,)),
}


def _model(model_type: str):
    kwargs, _ = MODELS[model_type]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # random norms, biases and sinks too (their inits are ones, zeros or empty)
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if ("norm" in name or "bias" in name or "sinks" in name) else 0.2)
    return model.eval()


def _capture(model, model_type: str) -> dict[int, dict]:
    """Each converted block's attention input and output (after o_proj), from the model's forward."""
    _, layers = MODELS[model_type]
    seen: dict[int, dict] = {}
    hooks = []
    for index in layers:
        def hook(module, args, kwargs, output, index=index):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            seen[index] = {"x": hidden.detach().numpy().copy(), "out": output[0].detach().numpy().copy()}
        hooks.append(model.model.layers[index].self_attn.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + T).reshape(1, T), use_cache=False)
    for hook in hooks:
        hook.remove()
    return seen


_BUILT: dict[str, tuple] = {}  # each model built and converted once per session


def _converted(model_type: str, tmp_path_factory):
    """(model_type, {layer: (config, tensors, captured)}, state dict, config.json)."""
    if model_type not in _BUILT:
        model = _model(model_type)
        folder = tmp_path_factory.mktemp(model_type)
        model.save_pretrained(folder)
        seen = _capture(model, model_type)
        blocks = {}
        for layer in seen:
            target = folder / f"block{layer}.safetensors"
            rc = mha(["convert", "--from", "hf-llama", "--to", "canonical", str(folder), str(target),
                      "--layer", str(layer)])
            assert rc == 0, f"mha convert of {model_type} block {layer} returned {rc}"
            blocks[layer] = (*load(target), seen[layer])
        state = {}  # the checkpoint's own names (MiMo's sinks are attention_sink_bias there), as the reader sees them
        for file in sorted(folder.glob("*.safetensors")):
            if not file.name.startswith("block"):
                state.update(safetensors.numpy.load_file(file))
        _BUILT[model_type] = (model_type, blocks, state, json.loads((folder / "config.json").read_text()))
    return _BUILT[model_type]


@pytest.fixture(scope="module", params=[pytest.param(m, marks=needs_transformers) for m in MODELS])
def converted(request, tmp_path_factory):
    return _converted(request.param, tmp_path_factory)


def test_config_read_from_the_checkpoint(converted):
    """What the layout read, against the model's own attributes."""
    model_type, blocks, *_ = converted
    for layer, (config, tensors, _seen) in blocks.items():
        assert config.effective_scale == pytest.approx(config.head_dim ** -0.5), config
        if model_type == "falcon_h1":
            assert (config.key_multiplier, config.value_scale, config.use_sinks) == (0.37, 1.0, False), config
            assert config.rope.rotary_dim == 8 and config.value_head_dim == config.head_dim == 8, config
            continue
        sliding = layer == 1
        assert (config.value_scale, config.key_multiplier) == (0.707, 1.0), config
        assert (config.head_dim, config.value_head_dim, config.rope.rotary_dim) == (12, 8, 4), config
        assert config.num_kv_heads == (2 if sliding else 1) and config.use_sinks is sliding, config
        assert config.window_left == (3 if sliding else -1), config
        assert config.rope.theta == (10_000.0 if sliding else 5_000_000.0), config.rope
        assert "output.bias" not in tensors, sorted(tensors)


def test_backends_reproduce_the_block(converted):
    """Full causal call on every installed core backend, and a decode step from the returned cache, against
    the model's own output; the float64 reference first."""
    model_type, blocks, *_ = converted
    for layer, (config, tensors, seen) in blocks.items():
        check_block_reproduced(f"{model_type}[{layer}]", config, tensors, seen["x"], seen["out"])


def _knob_dropped(field):
    def apply(monkeypatch):
        read = llama_knobs.layer_facts

        def without(cfg, layer):
            facts = read(cfg, layer)
            return {**facts, "modern": {k: v for k, v in facts["modern"].items() if k != field}}
        monkeypatch.setattr(llama_knobs, "layer_facts", without)
    return apply


# name -> (model, block, how the mutant is applied)
MUTANTS = {
    "value_scale_dropped": ("mimo_v2_flash", 1, _knob_dropped("value_scale")),
    "key_multiplier_dropped": ("falcon_h1", 0, _knob_dropped("key_multiplier")),
}


@pytest.mark.parametrize("mutant", [pytest.param(m, marks=needs_transformers) for m in MUTANTS])
def test_mutant_reader_fails_the_policy(mutant, tmp_path_factory, monkeypatch):
    """A reader that drops the knob: the float64 reference on the block it reads misses the model's own output
    under the float32 policy (the reader as it is passes: test_backends_reproduce_the_block)."""
    model_type, layer, apply = MUTANTS[mutant]
    _, blocks, state, hf_config = _converted(model_type, tmp_path_factory)
    seen = blocks[layer][2]
    apply(monkeypatch)
    config, tensors = layouts.to_canonical("hf-llama", state, hf_config=hf_config, layer=layer)
    wide = {k: v.astype(np.float64) for k, v in tensors.items()}
    ref = backends.load("numpy").forward(config, wide, {"query": seen["x"].astype(np.float64),
                                                        "positions": np.arange(T, dtype=np.int64)},
                                         {"is_causal": True}, trace=True)
    tol = policy_for(config, dtype="float32", quantity="output", B=1, T=T, S=T, reference=seen["out"],
                     logits=dict(ref["trace"])["logits"], max_position=T)
    result = compare(f"{model_type}[{layer}] read by {mutant}", ref["output"], seen["out"], tol)
    assert not result.ok, f"{mutant} still passes: {result.describe()}"
    print(result.describe())
