"""hf-llama on Qwen3-Next, Qwen3.5 and Gemma 4 (weights/layouts/llama_gated.py): the output gate packed
head by head in q_proj, the (1 + w) norms, linear-attention layers refused; Gemma 4's keys and values from
one projection (attention_k_eq_v), its weightless value norm, proportional RoPE on the global layers and
their own head size. Pattern of tests/test_layouts_modern.py: a tiny randomly initialised transformers
model (eager, float32) saved with save_pretrained, one block per interesting layer converted with
`mha convert --from hf-llama --to canonical`, every installed core backend held to the block's own output
(a forward hook on the attention module): full causal, and a decode step on the returned cache.

Mutants of the layout: Qwen's gate read as the second half of q_proj fails the policy; Gemma 4's
attention_k_eq_v ignored makes the global block's conversion fail, naming the missing v_proj.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_layouts_modern import check_block_reproduced, needs_transformers

from conformance.cli.commands import main as mha
from conformance.suite import backends
from conformance.suite.tolerance import compare, policy_for
from weights import layouts, load
from weights.layouts import llama_gated

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None

T = 9  # tokens: longer than Gemma 4's window below
TEXT = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
            vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64)
LINEAR_ATTENTION = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8)
# model_type -> (config kwargs, the checkpoint's path to its blocks, the blocks converted)
MODELS = {
    "qwen3_next": (dict(**TEXT, **LINEAR_ATTENTION, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16), "model.layers", (1,)),
    # the multimodal wrapper: the language model's config sits in text_config, its blocks under
    # model.language_model; attention_bias puts the gate's bias in q_proj.bias, head by head
    "qwen3_5": (dict(text_config=dict(**TEXT, **LINEAR_ATTENTION, attention_bias=True),
                     vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                        out_hidden_size=32, patch_size=4, num_position_embeddings=16),
                     image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63),
                "model.language_model.layers", (1,)),
    # layer 0 slides (window 3, its own v_proj, default RoPE over 16 features); layer 1 is global: 32-wide
    # heads, one kv head, k = v, proportional RoPE (a quarter of its pairs turn)
    "gemma4_text": (dict(**TEXT, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                         sliding_window=3, attention_k_eq_v=True, global_head_dim=32, num_global_key_value_heads=1,
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=64), "model.layers", (0, 1)),
}


def _model(model_type: str):
    kwargs, *_ = MODELS[model_type]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    auto = transformers.AutoModelForImageTextToText if "vision_config" in kwargs else transformers.AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # random norms and biases too (their inits are ones or zeros)
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if ("norm" in name or "bias" in name) else 0.2)
    return model.eval()


def _capture(model, model_type: str) -> dict[int, dict]:
    """Each converted block's attention input, output (after o_proj) and weights, from the model's forward."""
    _, path, layers = MODELS[model_type]
    blocks = model
    for part in path.split("."):
        blocks = getattr(blocks, part)
    seen: dict[int, dict] = {}
    hooks = []
    for index in layers:
        def hook(module, args, kwargs, output, index=index):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            seen[index] = {"x": hidden.detach().numpy().copy(), "out": output[0].detach().numpy().copy(),
                           "weights": output[1].detach().numpy().copy()}
        hooks.append(blocks[index].self_attn.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + T).reshape(1, T), position_ids=torch.arange(T).reshape(1, T),
              output_attentions=True, use_cache=False)
    for hook in hooks:
        hook.remove()
    return seen


_BUILT: dict[str, tuple] = {}  # each model built and converted once per session


def _converted(model_type: str, tmp_path_factory):
    """(model_type, {layer: (config, tensors, captured)}, state dict, config.json, folder)."""
    if model_type not in _BUILT:
        _BUILT[model_type] = _build(model_type, tmp_path_factory)
    return _BUILT[model_type]


@pytest.fixture(scope="module", params=[pytest.param(m, marks=needs_transformers) for m in MODELS])
def converted(request, tmp_path_factory):
    return _converted(request.param, tmp_path_factory)


def _build(model_type: str, tmp_path_factory):
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
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model_type, blocks, state, json.loads((folder / "config.json").read_text()), folder


def _weights(state, model_type: str, layer: int, name: str) -> np.ndarray:
    return state[f"{MODELS[model_type][1]}.{layer}.self_attn.{name}"]


def test_config_read_from_the_checkpoint(converted):
    """What the layout read, against the model's own attributes and tensors."""
    model_type, blocks, state, *_ = converted
    for layer, (config, tensors, _seen) in blocks.items():
        assert config.qk_norm is not None and config.qk_norm.scope == "head", (model_type, config.qk_norm)
        if model_type.startswith("qwen"):
            assert config.output_gate.to_dict() == {"scope": "element", "bias": model_type == "qwen3_5"}, config
            assert config.rope.rotary_dim == 4 and config.rope.scaling is None, config.rope  # 16 * 0.25
            assert config.value_norm is None and config.effective_scale == pytest.approx(16 ** -0.5), config
            q_norm = _weights(state, model_type, layer, "q_norm.weight")  # Qwen3NextRMSNorm: x * (1 + w)
            np.testing.assert_array_equal(tensors["query.norm.scale"], q_norm + np.float32(1), err_msg=model_type)
            continue
        assert config.output_gate is None and config.effective_scale == 1.0, config  # scaling = 1.0
        assert config.value_norm.to_dict() == {"type": "rms", "eps": 1e-6, "scope": "head", "weight": False}
        np.testing.assert_array_equal(tensors["query.norm.scale"], _weights(state, model_type, layer, "q_norm.weight"))
        if layer == 0:  # sliding: its own v_proj, RoPE over the whole head
            assert (config.head_dim, config.num_kv_heads, config.window_left) == (16, 2, 2), config
            assert config.rope.scaling is None and config.rope.theta == 10_000.0, config.rope
            assert not np.array_equal(tensors["value.kernel"], tensors["key.kernel"])
        else:  # global: per_layer_config's head_dim and kv heads, k = v, proportional RoPE
            assert (config.head_dim, config.num_kv_heads, config.window_left) == (32, 1, -1), config
            assert config.rope.to_dict() == {"theta": 1e6, "rotary_dim": 32, "interleaved": False, "scaling": {
                "type": "proportional", "factor": 1.0, "partial_rotary_factor": 0.25}}, config.rope
            assert _weights(state, model_type, layer, "k_proj.weight").shape == (32, 32)
            assert f"{MODELS[model_type][1]}.{layer}.self_attn.v_proj.weight" not in state
            assert np.array_equal(tensors["value.kernel"], tensors["key.kernel"])


def test_window_is_the_models_own_mask(converted):
    """The keys each query row of the model's own attention weights gives weight to: min(i, window_left) + 1
    under the converted config (the whole prefix where the block has no window)."""
    model_type, blocks, *_ = converted
    for layer, (config, _tensors, seen) in blocks.items():
        visible = (seen["weights"][0] > 0).sum(-1)  # (N, T)
        left = config.window_left if config.window_left >= 0 else T
        expected = np.minimum(np.arange(T), left) + 1
        assert (visible == expected).all(), (f"{model_type} block {layer}: keys seen per row {visible[0].tolist()}, "
                                             f"window_left={config.window_left} gives {expected.tolist()}")


def test_backends_reproduce_the_block(converted):
    """Full causal call on every installed core backend, and a decode step from the returned cache, against
    the model's own output; the float64 reference first."""
    model_type, blocks, *_ = converted
    for layer, (config, tensors, seen) in blocks.items():
        check_block_reproduced(f"{model_type}[{layer}]", config, tensors, seen["x"], seen["out"])


def test_round_trip_is_bit_exact(converted):
    """canonical -> hf-llama under the model's config.json -> canonical gives the same bits; the written
    tensors are the checkpoint's own (Qwen's 1 + w: to one rounding of the addition), no v_proj where k = v."""
    model_type, blocks, state, hf_config, _ = converted
    prefix = MODELS[model_type][1].rsplit(".", 1)[0] + "."
    for layer, (config, tensors, _seen) in blocks.items():
        written = layouts.from_canonical("hf-llama", config, tensors, hf_config=hf_config, layer=layer, prefix=prefix)
        own = {k: v for k, v in state.items() if k.startswith(f"{prefix}layers.{layer}.self_attn.")}
        assert sorted(written) == sorted(own), (sorted(written), sorted(own))
        for key, value in written.items():
            if model_type.startswith("qwen") and "_norm." in key:
                np.testing.assert_allclose(value, state[key], rtol=0, atol=np.spacing(np.float32(2)), err_msg=key)
            else:
                assert value.dtype == state[key].dtype and np.array_equal(value, state[key]), key
        again_config, again = layouts.to_canonical("hf-llama", written, hf_config=hf_config, layer=layer)
        assert again_config == config, (again_config, config)
        assert sorted(again) == sorted(tensors), (sorted(again), sorted(tensors))
        for name in tensors:
            assert np.array_equal(again[name], tensors[name]), (model_type, layer, name)


def test_what_the_layout_refuses(converted):
    """One-line errors: a linear-attention layer (named with its type), a k = v block whose values differ from
    its keys, a gated block written where the model has no gate."""
    model_type, blocks, _state, hf_config, folder = converted
    if model_type.startswith("qwen"):
        rc = mha(["convert", "--from", "hf-llama", "--to", "canonical", str(folder), str(folder / "x.safetensors"),
                  "--layer", "0"])
        assert rc == 2, rc
        with pytest.raises(ValueError, match=r"^hf_config: layer 0 of qwen3_\w+ is 'linear_attention'") as err:
            layouts.from_canonical("hf-llama", *blocks[1][:2], hf_config=hf_config, layer=0)
        assert "\n" not in str(err.value)
        llama = {"model_type": "llama", **{k: hf_config.get("text_config", hf_config)[k] for k in (
            "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")}}
        with pytest.raises(ValueError, match=r"output_gate=\{'scope': 'element', .*holds no gate"):
            layouts.from_canonical("hf-llama", *blocks[1][:2], hf_config=llama, layer=0)
        return
    config, tensors, _ = blocks[1]
    changed = {**tensors, "value.kernel": tensors["value.kernel"] * np.float32(2)}
    with pytest.raises(ValueError, match=r"cannot express value\.kernel != key\.kernel \(gemma4 attention_k_eq_v"):
        layouts.from_canonical("hf-llama", config, changed, hf_config=hf_config, layer=1)
    # without the model's config.json, separate projections: v_proj holds the copy
    written = layouts.from_canonical("hf-llama", config, changed, layer=1)
    assert np.array_equal(written["layers.1.self_attn.v_proj.weight"], changed["value.kernel"].reshape(32, -1).T)


# -- mutants of the layout: each must make the reproduction (or the conversion) fail ----------------------

def _gate_read_as_second_half(monkeypatch):
    """hf-llama with its head-major rows read whole: q_proj = [every head's query; every head's gate]."""
    lay = layouts.spec("hf-llama")
    tables = tuple(dataclasses.replace(table, rows=tuple(dataclasses.replace(row, head_major=False)
                                                         for row in table.rows)) for table in lay.tables)
    monkeypatch.setitem(layouts.CATALOGUE.by_id, "hf-llama", dataclasses.replace(lay, tables=tables))


def _k_eq_v_ignored(monkeypatch):
    monkeypatch.setattr(llama_gated, "_shares_kv", lambda cfg, layer_type: False)


# name -> (model, block, how the mutant is applied, what the conversion then says: None where it converts)
MUTANTS = {
    "gate_read_as_second_half_qwen3_next": ("qwen3_next", 1, _gate_read_as_second_half, None),
    "gate_read_as_second_half_qwen3_5": ("qwen3_5", 1, _gate_read_as_second_half, None),
    # Ignored, the reader expects the global layer's own v_proj, which the checkpoint does not hold: the engine
    # never makes up a kernel, so the honest outcome is a refusal naming the key
    "k_eq_v_ignored": ("gemma4_text", 1, _k_eq_v_ignored, r"missing model\.layers\.1\.self_attn\.v_proj\.weight"),
}


@pytest.mark.parametrize("mutant", [pytest.param(m, marks=needs_transformers) for m in MUTANTS])
def test_mutant_reader_fails_the_policy(mutant, tmp_path_factory, monkeypatch):
    """Each porting bug of these rows, put in the layout: the float64 reference on the block it reads misses
    the model's own output under the float32 policy, or the block no longer converts (the layout as it is
    passes: test_backends_reproduce_the_block)."""
    model_type, layer, apply, refusal = MUTANTS[mutant]
    _, blocks, state, hf_config, _ = _converted(model_type, tmp_path_factory)
    seen = blocks[layer][2]
    apply(monkeypatch)
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal) as err:
            layouts.to_canonical("hf-llama", state, hf_config=hf_config, layer=layer)
        print(f"{mutant}: {err.value}")
        return
    config, tensors = layouts.to_canonical("hf-llama", state, hf_config=hf_config, layer=layer)
    wide = {k: v.astype(np.float64) for k, v in tensors.items()}
    # positions left out: arange(T) on every axis (Qwen3.5's multimodal RoPE reads three rows), as the model ran
    ref = backends.load("numpy").forward(config, wide, {"query": seen["x"].astype(np.float64)},
                                         {"is_causal": True}, trace=True)
    tol = policy_for(config, dtype="float32", quantity="output", B=1, T=T, S=T, reference=seen["out"],
                     logits=dict(ref["trace"])["logits"], max_position=T)
    result = compare(f"{model_type}[{layer}] read by {mutant}", ref["output"], seen["out"], tol)
    assert not result.ok, f"{mutant} still passes: {result.describe()}"
    print(result.describe())


@pytest.mark.skipif(transformers is None, reason="needs torch and transformers (extra hf)")
def test_config_json_variants():  # config files only: no model is built
    """The multimodal Gemma 4 wrapper reads its text_config; a config without per_layer_config (the form
    Gemma4TextConfig builds it from) gives the same global layer; layers sharing an earlier layer's keys
    and values, and bidirectional attention, are refused."""
    kwargs = MODELS["gemma4_text"][0]
    text = transformers.Gemma4TextConfig(**kwargs).to_dict()
    reference = [layouts.spec("hf-llama").hf(text, layer) for layer in (0, 1)]
    wrapper = transformers.Gemma4Config(text_config=kwargs).to_dict()
    assert [layouts.spec("hf-llama").hf(wrapper, layer) for layer in (0, 1)] == reference
    old_form = {k: v for k, v in text.items() if k != "per_layer_config"}
    old_form.update(global_head_dim=32, num_global_key_value_heads=1)
    assert [layouts.spec("hf-llama").hf(old_form, layer) for layer in (0, 1)] == reference
    shared = transformers.Gemma4TextConfig(**{**kwargs, "num_hidden_layers": 4, "num_kv_shared_layers": 2,
                                              "layer_types": ["sliding_attention", "full_attention"] * 2}).to_dict()
    assert layouts.spec("hf-llama").hf(shared, 1)["table"] != 0  # layer 1 has its own k_proj
    with pytest.raises(ValueError, match=r"^hf_config: layer 2 of gemma4_text reuses an earlier layer's keys"):
        layouts.spec("hf-llama").hf(shared, 2)
    with pytest.raises(ValueError, match=r"use_bidirectional_attention='all' is not causal"):
        layouts.spec("hf-llama").hf({**text, "use_bidirectional_attention": "all"}, 0)
