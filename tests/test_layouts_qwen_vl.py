"""hf-llama on the multimodal Qwen decoders (issue 42): Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

A tiny randomly initialised model of each (eager attention, float32; a one-block vision tower that is never
run) is saved with save_pretrained and its language model's attention block converted with `mha convert --from
hf-llama --to canonical`. The 3-D positions are the model's own: its get_rope_index over a sequence of text, an
image span, text and a video span (Qwen2.5-VL: its temporal positions scaled by second_per_grid_ts; Qwen3-VL:
the video's frames split by a timestamp token, as its processor lays them out). The language model runs on random
embeddings at those positions, and every installed core backend reproduces the block's own output (a forward
hook) for the causal prefill and for a decode of the last DECODE tokens (a video frame and text) over the cache a
first call returned; the float64 reference on the converted weights first. The model's output is the expected
value (an independent formulation: transformers' rotary embedding recomposes the sections itself). The two
porting bugs of multimodal RoPE (the height and width sections exchanged; Qwen3-VL not interleaved) fail the
reproduction.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_layouts_modern import _installed, needs_transformers

from conformance.cli.commands import main as mha
from conformance.suite import backends
from conformance.suite.tolerance import compare, policy_for
from weights import layouts, load

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None

IMAGE, VIDEO = 60, 61  # the token ids of an image and a video patch
TEXT = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, intermediate_size=32,
            vocab_size=64, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# head_dim 8: 4 rotary pairs. Unequal sections (t, h, w), so that an exchange of h and w turns some pair by
# the other axis; Qwen3-VL's 2, 1, 1 interleaved is pairs t h w t, contiguous it would be t t h w.
MODELS = {
    "qwen2_vl": (dict(mrope_section=[1, 1, 2]),
                 dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=1, spatial_merge_size=2,
                      patch_size=2, temporal_patch_size=2)),
    "qwen2_5_vl": (dict(mrope_section=[1, 1, 2]),
                   dict(depth=1, hidden_size=16, out_hidden_size=32, num_heads=2, intermediate_size=16,
                        spatial_merge_size=2, patch_size=2, temporal_patch_size=2, fullatt_block_indexes=[0],
                        window_size=8, tokens_per_second=2)),
    "qwen3_vl": (dict(mrope_section=[2, 1, 1], mrope_interleaved=True),
                 dict(depth=1, hidden_size=16, out_hidden_size=32, num_heads=2, intermediate_size=16,
                      spatial_merge_size=2, patch_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
                      num_position_embeddings=16)),
}
IMAGE_GRID, VIDEO_GRID = (1, 4, 6), (2, 4, 4)  # (t, h, w) patches before the 2 x 2 merge: 1 x 2 x 3, 2 x 2 x 2
DECODE = 6  # the decode step's tokens: the video's last frame and the text after it


def _model(model_type: str):
    rope, vision = MODELS[model_type]
    text = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **rope}}
    if model_type == "qwen3_vl":
        text["head_dim"] = 8
    config = transformers.AutoConfig.for_model(model_type, text_config=text, vision_config=vision,
                                               image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=62)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager",
                                                                 dtype=torch.float32)
    with torch.no_grad():  # random norms and biases too (their inits are ones or zeros)
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if ("norm" in name or "bias" in name) else 0.2)
    return model.eval()


def _sequence(model_type: str) -> tuple[list[int], list[int]]:
    """(token ids, mm_token_type_ids): 2 text tokens, the image's 6 patches, 2 text tokens, the video's 2 x 4
    patches (Qwen3-VL: a timestamp token between its frames), 2 text tokens."""
    image = (IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2]) // 4
    frame = (VIDEO_GRID[1] * VIDEO_GRID[2]) // 4
    video = [VIDEO] * frame + ([5] if model_type == "qwen3_vl" else []) + [VIDEO] * frame
    ids = [3, 4] + [IMAGE] * image + [6, 7] + video + [8, 9]
    types = [1 if t == IMAGE else 2 if t == VIDEO else 0 for t in ids]
    return ids, types


def _positions(model, model_type: str) -> np.ndarray:
    """(3, 1, L): the model's own get_rope_index over _sequence."""
    ids, types = _sequence(model_type)
    kwargs = dict(input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]),
                  image_grid_thw=torch.tensor([IMAGE_GRID]), video_grid_thw=torch.tensor([VIDEO_GRID]))
    if model_type == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([1.0])  # x tokens_per_second 2: the frames 2 positions apart
    with torch.no_grad():
        positions, _ = model.model.get_rope_index(**kwargs)
    return positions.numpy().astype(np.int64)


@pytest.fixture(scope="module", params=[pytest.param(m, marks=needs_transformers) for m in MODELS])
def block(request, tmp_path_factory):
    """(model_type, config, tensors, x (1, L, D), positions (3, 1, L), the block's own output (1, L, D),
    (config.json, the state dict))."""
    model_type = request.param
    model = _model(model_type)
    folder = tmp_path_factory.mktemp(model_type)
    model.save_pretrained(folder)
    positions = _positions(model, model_type)
    x = torch.from_numpy(np.random.default_rng(7).standard_normal((1, positions.shape[-1], 32)).astype(np.float32))
    seen = {}

    def hook(module, args, kwargs, output):
        seen["x"] = kwargs.get("hidden_states", args[0] if args else None).detach().numpy().copy()
        seen["out"] = output[0].detach().numpy().copy()

    handle = model.model.language_model.layers[0].self_attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model.model.language_model(inputs_embeds=x, position_ids=torch.from_numpy(positions), use_cache=False)
    handle.remove()
    target = folder / "block0.safetensors"
    assert mha(["convert", "--from", "hf-llama", "--to", "canonical", str(folder), str(target), "--layer", "0"]) == 0
    config, tensors = load(target)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    hf_config = json.loads((folder / "config.json").read_text())
    return model_type, config, tensors, seen["x"], positions, seen["out"], (hf_config, state)


def _reproduce(config, tensors, x, positions, backend, *, decode: bool):
    """The backend's output: the causal prefill, or its last DECODE rows from a decode step over the cache of
    the call before them."""
    if not decode:
        return backend.forward(config, tensors, _at(x, positions), {"is_causal": True})["output"]
    first = backend.forward(config, tensors, _at(x[:, :-DECODE], positions[..., :-DECODE]),
                            {"is_causal": True, "return_cache": True})
    return backend.forward(config, tensors, {**_at(x[:, -DECODE:], positions[..., -DECODE:]),
                                             "past_key": first["present_key"], "past_value": first["present_value"]},
                           {"is_causal": True, "causal_alignment": "bottom_right"})["output"]


def _at(x, positions) -> dict:
    """A self-attention call's inputs: the keys at the queries' positions (key_positions defaults to P + arange)."""
    return {"query": x, "positions": positions, "key_positions": positions}


def _margin(name, actual, expected, config, logits, positions) -> tuple[bool, float, str]:
    tol = policy_for(config, dtype="float32", quantity="output", B=1, T=expected.shape[1], S=positions.shape[-1],
                     reference=expected, logits=logits, max_position=int(positions.max()) + 1)
    result = compare(name, actual, expected, tol)
    return result.ok, result.margin, result.describe()


def _logits(config, tensors, x, positions):
    wide = {k: v.astype(np.float64) for k, v in tensors.items()}
    ref = backends.load("numpy").forward(config, wide, _at(x.astype(np.float64), positions), {"is_causal": True},
                                         trace=True)
    return ref["output"], dict(ref["trace"])["logits"]


def test_config_read_from_the_checkpoint(block):
    """The sections and their layout, the norms and biases, as the model's config and modules hold them."""
    model_type, config, tensors, *_ = block
    rope, _ = MODELS[model_type]
    assert config.rope.mrope_section == tuple(rope["mrope_section"]), config.rope
    assert config.rope.mrope_interleaved is (model_type == "qwen3_vl") and not config.rope.interleaved, config.rope
    assert config.rope.theta == 10000.0 and config.rope.rotary_dim == 8, config.rope
    assert (config.qk_norm is not None) is (model_type == "qwen3_vl"), config.qk_norm
    assert ("query.bias" in tensors) is (model_type != "qwen3_vl") and "output.bias" not in tensors, sorted(tensors)


def test_round_trip_is_bit_exact(block):
    """canonical -> hf-llama with the model's config.json -> the checkpoint's own tensors, bit for bit, and back."""
    model_type, config, tensors, *_, (hf_config, state) = block
    written = layouts.from_canonical("hf-llama", config, tensors, hf_config=hf_config, layer=0,
                                     prefix="model.language_model.")
    for key, value in written.items():
        assert value.dtype == state[key].dtype and np.array_equal(value, state[key]), (model_type, key)
    again_config, again = layouts.to_canonical("hf-llama", written, hf_config=hf_config, layer=0)
    assert again_config == config and all(np.array_equal(again[n], tensors[n]) for n in tensors), model_type


def test_backends_reproduce_the_block_at_the_models_positions(block):
    """Prefill and decode at the model's 3-D positions: the float64 reference, then every installed core
    backend, against the model's own attention output."""
    model_type, config, tensors, x, positions, expected, _ = block
    assert not (positions[0] == positions[1]).all(), "the sequence must hold a vision span (h != t somewhere)"
    assert_block_reproduced(model_type, config, tensors, x, positions, expected)


def assert_block_reproduced(model_type, config, tensors, x, positions, expected):
    """The float64 reference, then every installed core backend (prefill, and a decode of the last DECODE
    tokens over the prefix's cache), each within its margin of the model's own attention output."""
    ref, logits = _logits(config, tensors, x, positions)
    margins, failures = {}, []
    ok, margins["float64"], text = _margin(f"{model_type} float64", ref, expected, config, logits, positions)
    failures += [] if ok else [text]
    for name, backend in _installed():
        for decode in (False, True):
            label = f"{name} decode" if decode else name
            got = _reproduce(config, tensors, x, positions, backend, decode=decode)
            want = expected[:, -DECODE:] if decode else expected
            ok, margins[label], text = _margin(f"{model_type} {label}", got, want, config,
                                               logits[..., -DECODE:, :] if decode else logits, positions)
            failures += [] if ok else [text]
    print(f"{model_type}: margins " + ", ".join(f"{k} {v:.3g}" for k, v in margins.items()))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("bug", ["sections_h_w_exchanged", "not_interleaved"])
def test_the_porting_bugs_fail_the_reproduction(block, bug):
    """The float64 reference with the bug planted in the converted config fails the model's own output: h and w
    exchanged (every model: sections (t, w, h), which are unequal, at positions whose rows differ), Qwen3-VL's
    sections laid out contiguously."""
    model_type, config, tensors, x, positions, expected, _ = block
    if bug == "not_interleaved" and model_type != "qwen3_vl":
        pytest.skip("only Qwen3-VL interleaves its sections")
    if bug == "sections_h_w_exchanged":
        wrong, planted = positions[[0, 2, 1]], config  # each pair's height position read from the width row
    else:
        wrong, planted = positions, dataclasses.replace(config, rope=dataclasses.replace(config.rope,
                                                                                         mrope_interleaved=False))
    got, logits = _logits(planted, tensors, x, wrong)
    ok, margin, _ = _margin(f"{model_type} {bug}", got, expected, config, logits, positions)
    print(f"{model_type} {bug}: margin {margin:.3g}")
    assert not ok and margin > 10, f"{model_type}: {bug} passed the reproduction (margin {margin:.3g})"


@pytest.mark.parametrize("hf_config,section,interleaved,theta", [
    # Qwen2-VL-7B-Instruct's config.json as transformers 4.x wrote it: the text fields at the top level, rope_scaling
    # of type "mrope" (transformers reads it as "default")
    ({"model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
      "num_hidden_layers": 28, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False,
      "sliding_window": 32768, "max_window_layers": 28, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
     (16, 24, 24), False, 1000000.0),
    # Qwen3-VL's: the language model in text_config, rope_scaling with rope_type default and mrope_interleaved
    ({"model_type": "qwen3_vl", "text_config": {
        "model_type": "qwen3_vl_text", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "num_hidden_layers": 36, "rms_norm_eps": 1e-6, "rope_theta": 5000000,
        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}}},
     (24, 20, 20), True, 5000000.0),
    # a 5.x Qwen2.5-VL file without mrope_section: the modeling file's default (16, 24, 24) and default_theta
    ({"model_type": "qwen2_5_vl", "text_config": {"model_type": "qwen2_5_vl_text", "hidden_size": 2048,
                                                   "num_attention_heads": 16, "num_key_value_heads": 2,
                                                   "num_hidden_layers": 36}},
     (16, 24, 24), False, 1000000.0),
])
def test_released_config_files_are_read(hf_config, section, interleaved, theta):
    """The sections, their layout and theta from the config.json forms the released checkpoints carry."""
    from weights.layouts.llama import _llama_config

    rope = _llama_config(hf_config, 0)["modern"]["rope"]
    assert (tuple(rope["mrope_section"]), rope["mrope_interleaved"], rope["theta"]) == (section, interleaved, theta), rope
    assert rope["scaling"] is None and not rope["interleaved"], rope
