"""hf-llama's frontier model types on real models: llama4_text (a chunked RoPE layer with the weightless
norm after RoPE, and a NoPE layer with the query temperature), smollm3 (a NoPE layer, sliding), ministral3
(the Llama 4 temperature with offset 0), granite (attention_multiplier), cohere (per-head LayerNorm,
interleaved RoPE), cohere2 (RoPE only on its sliding layers) and phi3 with LongRoPE (short and long
factors). As tests/test_layouts_modern.py does for the older types: a tiny randomly initialised
transformers model (eager attention, float32) saved with save_pretrained, each block converted with
`mha convert --from hf-llama`, and the block's own output (a forward hook on its attention module)
reproduced by the float64 reference and every installed core backend, full causal and a decode step on
the returned cache (numpy and torch); the models are float32, so the float32 policy judges everything.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_layouts_modern import check_block_reproduced

from conformance.cli.commands import main as mha
from weights import layouts, load

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_transformers = [pytest.mark.torch, pytest.mark.tf, pytest.mark.jax,
                      pytest.mark.skipif(transformers is None,
                                         reason="needs torch and transformers: pip install '.[hf]'")]

T = 9  # longer than the chunk (4), the windows (4), the temperature floors (4) and phi3's original length (4)
SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
             intermediate_size=32, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             max_position_embeddings=64)
MODELS = {
    # layer 0: RoPE, chunks of 4, L2 norm; layer 1: NoPE with the temperature (floor 4: it grows inside T)
    "llama4_text": dict(no_rope_layers=[1, 0], attention_chunk_size=4, floor_scale=4, attn_scale=0.5,
                        use_qk_norm=True, num_local_experts=2, intermediate_size_mlp=32, rms_norm_eps=1e-2),
    "smollm3": dict(no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=4),  # layer 1: NoPE, sliding
    "ministral3": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                                        "original_max_position_embeddings": 4, "llama_4_scaling_beta": 0.5}),
    "granite": dict(attention_multiplier=0.3),
    "cohere": dict(use_qk_norm=True, layer_norm_eps=1e-2),
    "cohere2": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(original_max_position_embeddings=4,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 4.0, 9.0, 16.0]}),
}
SHORT = 4  # phi3 also runs T = 4 tokens: largest position + 1 = 4 <= original_max_position_embeddings, short factors


def _model(model_type: str):
    config = transformers.AutoConfig.for_model(model_type, **{**SMALL, **MODELS[model_type]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # random norms too (their inits are ones)
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if "norm" in name else 0.2)
    return model.eval()


def _capture(model, tokens: int) -> dict[int, dict]:
    """Each block's attention input, output (after o_proj) and weights from the model's own forward."""
    seen: dict[int, dict] = {}
    hooks = []
    for index, block in enumerate(model.model.layers):
        def hook(module, args, kwargs, output, index=index):
            seen[index] = {"x": kwargs["hidden_states"].detach().numpy().copy(),
                           "out": output[0].detach().numpy().copy(), "weights": output[1].detach().numpy().copy()}
        hooks.append(block.self_attn.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + tokens).reshape(1, tokens),
              position_ids=torch.arange(tokens).reshape(1, tokens), output_attentions=True, use_cache=False)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.fixture(scope="module", params=[pytest.param(m, marks=needs_transformers) for m in MODELS])
def converted(request, tmp_path_factory):
    """(model_type, model, {layer: (config, tensors)}, {tokens: captured}, state, config.json)."""
    model_type = request.param
    model = _model(model_type)
    folder = tmp_path_factory.mktemp(model_type)
    model.save_pretrained(folder)
    runs = {T: _capture(model, T)}
    if model_type == "phi3":
        runs[SHORT] = _capture(model, SHORT)
    blocks = {}
    for layer in range(len(model.model.layers)):
        target = folder / f"block{layer}.safetensors"
        rc = mha(["convert", "--from", "hf-llama", "--to", "canonical", str(folder), str(target),
                  "--layer", str(layer)])
        assert rc == 0, f"mha convert of {model_type} block {layer} returned {rc}"
        blocks[layer] = load(target)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model_type, model, blocks, runs, state, json.loads((folder / "config.json").read_text())


def test_config_read_matches_the_model(converted):
    """What the layout read from config.json, against the attributes of the model's own attention modules."""
    model_type, model, blocks, *_ = converted
    for layer, (config, tensors) in blocks.items():
        attn = model.model.layers[layer].self_attn
        uses_rope = bool(getattr(attn, "use_rope", True)) and (model_type != "cohere2" or attn.sliding_window is not None)
        assert (config.rope is not None) == uses_rope, (model_type, layer, config.rope)
        if config.rope is not None:
            assert config.rope.interleaved is (model_type in ("llama4_text", "cohere", "cohere2")), config.rope
        assert config.effective_scale == pytest.approx(attn.scaling, rel=1e-12), (model_type, config.scale)
        if model_type == "llama4_text":
            assert config.local_chunk == (4 if uses_rope else None), (layer, config.local_chunk)
            if uses_rope:
                norm = config.qk_norm.to_dict()
                assert norm == {"type": "rms", "eps": attn.qk_norm.eps, "scope": "head", "weight": False,
                                "after_rope": True}, norm
                assert config.query_temperature is None
            else:
                assert config.qk_norm is None and not hasattr(attn, "qk_norm")
                want = {"beta": attn.attn_scale, "floor": attn.floor_scale, "offset": 1, "position": "cache_index"}
                assert config.query_temperature.to_dict() == want, config.query_temperature
        elif model_type == "ministral3":
            assert config.query_temperature.to_dict() == {"beta": 0.5, "floor": 4.0, "offset": 0}
        elif model_type == "cohere":
            assert config.qk_norm.type == "layer" and config.qk_norm.per_head, config.qk_norm
            assert config.qk_norm.eps == attn.q_norm.variance_epsilon, config.qk_norm
            np.testing.assert_array_equal(tensors["query.norm.scale"], attn.q_norm.weight.detach().numpy())
            np.testing.assert_array_equal(tensors["key.norm.bias"], np.zeros((2, 8), np.float32))
        elif model_type == "phi3":
            scaling = config.rope.scaling
            assert scaling.type == "longrope" and scaling.original_max_position_embeddings == 4, scaling
            assert scaling.long_factor == (1.0, 4.0, 9.0, 16.0) and scaling.factor == 16.0, scaling
            assert scaling.attention_factor == pytest.approx(model.model.rotary_emb.attention_scaling), scaling
        if model_type not in ("llama4_text", "ministral3"):
            assert config.query_temperature is None and config.local_chunk is None, (model_type, config)


def test_mask_is_the_models_own(converted):
    """The keys each query row of the model's own attention weights gives weight to, against the keys the
    converted config lets it see (causal, window_left, local_chunk)."""
    model_type, _model_, blocks, runs, *_ = converted
    for layer, (config, _tensors) in blocks.items():
        visible = (runs[T][layer]["weights"][0] > 0).sum(-1)  # (N, T)
        i = np.arange(T)
        first = np.zeros(T, int) if config.window_left < 0 else np.maximum(i - config.window_left, 0)
        if config.local_chunk is not None:
            first = np.maximum(first, i // config.local_chunk * config.local_chunk)
        expected = i - first + 1
        assert (visible == expected).all(), (model_type, layer, visible[0].tolist(), expected.tolist())
    limited = [layer for layer, (config, _) in blocks.items() if config.window_left >= 0 or config.local_chunk]
    assert limited == {"llama4_text": [0], "smollm3": [1], "cohere2": [0]}.get(model_type, []), (model_type, limited)


def test_backends_reproduce_the_block(converted):
    """Full causal call on every installed core backend and a decode step (numpy, torch) on the cache the
    prefix returned, against the model's own output; the float64 reference first. phi3 at T = 9 (long
    factors: the prefix of 8 tokens is past the original 4 too) and T = 4 (short)."""
    model_type, _model_, blocks, runs, *_ = converted
    for tokens, seen_by_layer in runs.items():
        for layer, (config, tensors) in blocks.items():
            seen = seen_by_layer[layer]
            check_block_reproduced(f"{model_type}[{layer}] T={tokens}", config, tensors, seen["x"], seen["out"],
                            decode=("numpy", "torch"))


def test_round_trip_is_bit_exact(converted):
    """canonical -> hf-llama (with the model's config.json) -> canonical gives the same bits, and the written
    tensors are the checkpoint's own (Cohere's (N, H) norm weights in that shape, no bias written)."""
    model_type, _model_, blocks, _runs, state, hf_config = converted
    for layer, (config, tensors) in blocks.items():
        written = layouts.from_canonical("hf-llama", config, tensors, hf_config=hf_config, layer=layer,
                                         prefix="model.")
        for key, value in written.items():
            assert value.dtype == state[key].dtype and value.shape == state[key].shape, key
            assert np.array_equal(value, state[key]), key
        again_config, again = layouts.to_canonical("hf-llama", written, hf_config=hf_config, layer=layer)
        assert again_config == config, (again_config, config)
        assert sorted(again) == sorted(tensors), (sorted(again), sorted(tensors))
        for name in tensors:
            assert np.array_equal(again[name], tensors[name]), (model_type, layer, name)


# -- config.json alone: the multimodal wrapper, the forms transformers 4.x wrote, refusals --------------------

def _state(N=4, K=2, H=8, D=32, layers=2, prefix="model.", norm=None):
    rng = np.random.default_rng(0)
    state = {}
    for layer in range(layers):
        p = f"{prefix}layers.{layer}.self_attn."
        for name, rows in (("q", N * H), ("k", K * H), ("v", K * H)):
            state[p + f"{name}_proj.weight"] = rng.standard_normal((rows, D)).astype(np.float32)
        state[p + "o_proj.weight"] = rng.standard_normal((D, N * H)).astype(np.float32)
        if norm == "cohere":
            state[p + "q_norm.weight"] = rng.standard_normal((N, H)).astype(np.float32)
            state[p + "k_norm.weight"] = rng.standard_normal((K, H)).astype(np.float32)
    return state


LLAMA4_TEXT = {"model_type": "llama4_text", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 8, "num_hidden_layers": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
               "no_rope_layers": [1, 0], "attention_chunk_size": 4}


def test_llama4_multimodal_and_4x_configs():
    """The multimodal config's text_config reads as llama4_text; without layer_types (4.x) the chunked layers
    are the RoPE layers, and the defaults are Llama4TextConfig's (eps 1e-5, attn_scale 0.1, floor 8192)."""
    state = _state()
    wrapped = {"model_type": "llama4", "text_config": {k: v for k, v in LLAMA4_TEXT.items() if k != "model_type"}}
    for layer in (0, 1):
        plain, _ = layouts.to_canonical("hf-llama", state, hf_config=LLAMA4_TEXT, layer=layer)
        inner, _ = layouts.to_canonical("hf-llama", state, hf_config=wrapped, layer=layer)
        assert inner == plain, (inner, plain)
    rope_layer, _ = layouts.to_canonical("hf-llama", state, hf_config=LLAMA4_TEXT, layer=0)
    assert rope_layer.local_chunk == 4 and rope_layer.qk_norm.eps == 1e-5, rope_layer
    nope_layer, _ = layouts.to_canonical("hf-llama", state, hf_config=LLAMA4_TEXT, layer=1)
    assert nope_layer.rope is None and nope_layer.local_chunk is None, nope_layer
    assert nope_layer.query_temperature.to_dict() == {"beta": 0.1, "floor": 8192.0, "offset": 1,
                                                      "position": "cache_index"}
    # no no_rope_layers: every 4th layer is NoPE
    four = {**LLAMA4_TEXT, "num_hidden_layers": 4, "no_rope_layers": None}
    kinds = [layouts.to_canonical("hf-llama", _state(layers=4), hf_config=four, layer=i)[0].rope is None
             for i in range(4)]
    assert kinds == [False, False, False, True], kinds


def test_refusals_name_the_field():
    state = _state()
    chunked = {**LLAMA4_TEXT, "attention_chunk_size": None, "layer_types": ["chunked_attention", "full_attention"]}
    with pytest.raises(ValueError, match="attention_chunk_size must be a positive integer: got None"):
        layouts.to_canonical("hf-llama", state, hf_config=chunked, layer=0)
    ministral = {"model_type": "ministral3", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    with pytest.raises(ValueError, match="llama_4_scaling_beta"):
        layouts.to_canonical("hf-llama", state, hf_config=ministral, layer=0)
    phi3 = {"model_type": "phi3", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}}
    with pytest.raises(ValueError, match="needs original_max_position_embeddings: got none"):
        layouts.to_canonical("hf-llama", state, hf_config=phi3, layer=0)


def test_cohere_norm_bias_must_be_zero():
    """Cohere's LayerNorm has no bias: a canonical norm bias other than zero is refused, not dropped."""
    cfg = {"model_type": "cohere", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
           "use_qk_norm": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    config, tensors = layouts.to_canonical("hf-llama", _state(norm="cohere"), hf_config=cfg, layer=0)
    assert tensors["query.norm.scale"].shape == (4, 8) and config.rope.interleaved, config
    tensors = {**tensors, "key.norm.bias": tensors["key.norm.bias"] + np.float32(0.5)}
    with pytest.raises(ValueError, match="key.norm.bias"):
        layouts.from_canonical("hf-llama", config, tensors, hf_config=cfg, layer=0)
