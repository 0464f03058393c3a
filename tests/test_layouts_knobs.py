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


# -- Gemma 3n: a reuse layer (kv_shared) reads the cache its storing layer made -------------------------------

# layers 0 (sliding, window 4) and 1 (full) store; 2 (sliding) and 3 (full) reuse them: kv_sharing_modes
GEMMA3N = dict(**TEXT, num_key_value_heads=2, head_dim=8, num_hidden_layers=4, num_kv_shared_layers=2,
               layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4, laurel_rank=4,
               hidden_size_per_layer_input=8, vocab_size_per_layer_input=64, activation_sparsity_pattern=[0.0] * 4)
GEMMA3N_PAIRS = ((0, 2), (1, 3))  # (storing layer, reuse layer)


def _marks(test):
    for mark in needs_transformers:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def gemma3n(tmp_path_factory):
    """({layer: (config, tensors)}, {layer: captured input, output (and a reuse layer's stored keys and values)},
    config.json, the checkpoint's state)."""
    if transformers is None:
        pytest.skip("needs torch and transformers (extra hf)")
    config = transformers.AutoConfig.for_model("gemma3n_text", **GEMMA3N)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if "norm" in name else 0.2)
    model.eval()
    seen: dict[int, dict] = {}
    hooks = []
    for index in range(4):
        def hook(module, args, kwargs, output, index=index):
            seen[index] = {"x": kwargs["hidden_states"].detach().numpy().copy(),
                           "out": output[0].detach().numpy().copy()}
            if module.is_kv_shared_layer:  # what it attends to: the storing layer's keys and values (B, K, T, H)
                k, v = kwargs["shared_kv_states"][module.layer_type]
                seen[index].update(k=k.detach().numpy().copy(), v=v.detach().numpy().copy())
        hooks.append(model.model.layers[index].self_attn.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + T).reshape(1, T), use_cache=False)
    for hook in hooks:
        hook.remove()
    folder = tmp_path_factory.mktemp("gemma3n")
    model.save_pretrained(folder)
    blocks = {}
    for layer in range(4):
        target = folder / f"block{layer}.safetensors"
        rc = mha(["convert", "--from", "hf-llama", "--to", "canonical", str(folder), str(target), "--layer", str(layer)])
        assert rc == 0, f"mha convert of gemma3n_text block {layer} returned {rc}"
        blocks[layer] = load(target)
    state = {}  # the checkpoint's own tensors
    for file in sorted(folder.glob("*.safetensors")):
        if not file.name.startswith("block"):
            state.update(safetensors.numpy.load_file(file))
    return blocks, seen, json.loads((folder / "config.json").read_text()), state


@_marks
def test_gemma3n_config_read(gemma3n):
    """A reuse layer is kv_shared, with no key or value tensors; the storing layers have their own, the weightless
    value norm, scale 1; shared_cache_layer names each reuse layer's storing layer."""
    blocks, _seen, hf_config, _ = gemma3n
    for store, reuse in GEMMA3N_PAIRS:
        (stored, stored_tensors), (shared, shared_tensors) = blocks[store], blocks[reuse]
        assert not stored.kv_shared and stored.value_norm is not None and "key.kernel" in stored_tensors, stored
        assert shared.kv_shared and shared.value_norm is None, shared
        assert sorted(shared_tensors) == ["output.kernel", "query.kernel", "query.norm.scale"], sorted(shared_tensors)
        assert stored.effective_scale == shared.effective_scale == 1.0
        assert stored.window_left == shared.window_left == (3 if store == 0 else -1), (stored, shared)
        assert llama_knobs.shared_cache_layer(hf_config, reuse) == store
        assert llama_knobs.shared_cache_layer(hf_config, store) is None


@_marks
def test_gemma3n_storing_layers_reproduce(gemma3n):
    """The storing layers (their own k_proj, v_proj, k_norm, weightless v_norm): every core backend, prefill and
    decode, against the model's own output."""
    blocks, seen, *_ = gemma3n
    for store, _reuse in GEMMA3N_PAIRS:
        check_block_reproduced(f"gemma3n[{store}]", *blocks[store], seen[store]["x"], seen[store]["out"])


@_marks
def test_gemma3n_reuse_layer_reads_the_storing_layers_cache(gemma3n):
    """On every core backend: the storing layer's returned cache is what the model stored (within the policy), and
    the reuse layer given that cache reproduces the model's own output, prefill (the whole cache) and decode (the
    prefix's cache, the storing layer's decode step appended, the reuse layer's last query)."""
    from test_layouts_modern import _check, _installed

    blocks, seen, *_ = gemma3n
    positions = np.arange(T, dtype=np.int64)
    for store, reuse in GEMMA3N_PAIRS:
        (stored, stored_tensors), (shared, shared_tensors) = blocks[store], blocks[reuse]
        x0, x, expected = seen[store]["x"], seen[reuse]["x"], seen[reuse]["out"]
        cache = {"past_key": seen[reuse]["k"].astype(np.float64), "past_value": seen[reuse]["v"].astype(np.float64)}
        wide = {k: v.astype(np.float64) for k, v in shared_tensors.items()}
        ref = backends.load("numpy").forward(shared, wide, {"query": x.astype(np.float64), "positions": positions,
                                                            **cache}, {"is_causal": True}, trace=True)
        check = dict(S=T, logits=dict(ref["trace"])["logits"], max_position=T)
        margins = {"float64": _check(f"gemma3n[{reuse}] float64", ref["output"], expected, shared, **check)}
        for name, backend in _installed():
            made = backend.forward(stored, stored_tensors, {"query": x0, "positions": positions},
                                   {"is_causal": True, "return_cache": True})
            for part in ("key", "value"):  # the storing layer's cache is the model's (its last stage's tolerance)
                np.testing.assert_allclose(made[f"present_{part}"], seen[reuse][part[0]], rtol=1e-5, atol=1e-5,
                                           err_msg=f"gemma3n[{store}] {name} present_{part}")
            full = backend.forward(shared, shared_tensors, {"query": x, "past_key": made["present_key"],
                                                            "past_value": made["present_value"]}, {"is_causal": True})
            margins[name] = _check(f"gemma3n[{reuse}] {name}", full["output"], expected, shared, **check)
            first = backend.forward(stored, stored_tensors, {"query": x0[:, :-1], "positions": positions[:-1]},
                                    {"is_causal": True, "return_cache": True})
            step = backend.forward(stored, stored_tensors, {"query": x0[:, -1:], "positions": positions[-1:],
                                                            "past_key": first["present_key"],
                                                            "past_value": first["present_value"]},
                                   {"is_causal": True, "causal_alignment": "bottom_right", "return_cache": True})
            last = backend.forward(shared, shared_tensors, {"query": x[:, -1:], "past_key": step["present_key"],
                                                            "past_value": step["present_value"]},
                                   {"is_causal": True, "causal_alignment": "bottom_right"})
            margins[f"{name} decode"] = _check(f"gemma3n[{reuse}] {name} decode", last["output"], expected[:, -1:],
                                               shared, S=T, logits=check["logits"][..., -1:, :], max_position=T)
        print(f"gemma3n[{reuse}]: worst margins " + ", ".join(f"{k} {v:.3g}" for k, v in margins.items()))


@_marks
def test_gemma3n_mutant_appending_fails(gemma3n):
    """A reuse layer that appends the keys it reads to the cache it was given (tests/mutants.py's
    kv_shared_appends_own_keys, here on the model): its prefill attends to every token twice and places its
    queries after them; the model's output is missed."""
    from mutants import MutantAdapter

    blocks, seen, *_ = gemma3n
    store, reuse = GEMMA3N_PAIRS[0]
    shared, tensors = blocks[reuse]
    inputs = {"query": seen[reuse]["x"], "past_key": seen[reuse]["k"], "past_value": seen[reuse]["v"]}
    options = {"is_causal": True, "causal_alignment": "bottom_right", "return_weights": False, "dtype": "float32",
               "training": False}
    right = MutantAdapter(None)(shared.to_dict(), tensors, inputs, options)["output"]
    wrong = MutantAdapter("kv_shared_appends_own_keys")(shared.to_dict(), tensors, inputs, options)["output"]
    tol = policy_for(shared, dtype="float32", quantity="output", B=1, T=T, S=T, reference=seen[reuse]["out"])
    assert compare("the hand port", right, seen[reuse]["out"], tol).ok
    result = compare("the appending port", wrong, seen[reuse]["out"], tol)
    assert not result.ok, result.describe()
    print(result.describe())


@_marks
def test_round_trip_is_bit_exact(converted, gemma3n):
    """canonical -> hf-llama under the model's config.json -> canonical gives the same bits, and the written
    tensors are the checkpoint's own keys and values (MiMo's sinks as attention_sink_bias, no k_proj or v_proj on
    a Gemma 3n reuse layer)."""
    model_type, blocks, state, hf_config = converted
    cases = [(hf_config, state, layer, config, tensors) for layer, (config, tensors, _) in blocks.items()]
    if model_type == "mimo_v2_flash":  # Gemma 3n once, beside the first model
        g_blocks, _seen, g_config, g_state = gemma3n
        cases += [(g_config, g_state, layer, *g_blocks[layer]) for layer in g_blocks]
    for config_json, own_state, layer, config, tensors in cases:
        written = layouts.from_canonical("hf-llama", config, tensors, hf_config=config_json, layer=layer,
                                         prefix="model.")
        own = {k: v for k, v in own_state.items() if k.startswith(f"model.layers.{layer}.self_attn.")}
        assert sorted(written) == sorted(own), (sorted(written), sorted(own))
        assert all(np.array_equal(written[k], own[k]) for k in written), layer
        again_config, again = layouts.to_canonical("hf-llama", written, hf_config=config_json, layer=layer)
        assert again_config == config and sorted(again) == sorted(tensors), (again_config, config)
        assert all(np.array_equal(again[n], tensors[n]) for n in tensors), layer
