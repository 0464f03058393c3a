"""hf-llama on Qwen3.5's multimodal RoPE: its full-attention layers turn by rope.mrope_section, interleaved.

transformers 5.23's Qwen3_5TextRotaryEmbedding reads rope_parameters.get("mrope_section", [11, 11, 10]) and
recomposes the pairs as Qwen3-VL's does (interleaved, mrope_interleaved not read); only the full-attention
layers take the rotation (the linear-attention ones, Gated DeltaNet, get no position embeddings). A tiny randomly
initialised qwen3_5 and qwen3_5_moe (one full-attention layer, eager, float32; a one-block vision tower that is
never run; the MoE's attention is the same code) is each saved and its block converted with `mha convert --from hf-llama --to canonical`. The 3-D positions are the model's
own get_rope_index over text, an image span, text, a video span (a timestamp token between its two frames) and
text. The language model runs on random embeddings at those positions, and every installed core backend reproduces
the block's own output (a forward hook), for the causal prefill and for a decode of the last tokens over the cache
a first call returned. A mutant of the reader that ignores the sections (plain RoPE by the temporal row), lays them
out contiguously, or takes the default sections instead of config.json's fails the reproduction. The sections the
reader writes give each pair the axis Qwen3_5TextRotaryEmbedding gives it, also where config.json's sections do
not fit rotary_dim / 2 (the default 11, 11, 10 on a small head).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_layouts_modern import needs_transformers
from test_layouts_qwen_vl import (
    IMAGE,
    IMAGE_GRID,
    VIDEO,
    VIDEO_GRID,
    _logits,
    _margin,
    assert_block_reproduced,
)

from conformance.cli.commands import main as mha
from weights import layouts, load
from weights.config import Rope
from weights.layouts import llama_gated
from weights.rope import mrope_axes

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None

pytestmark = needs_transformers

# head_dim 32 x partial_rotary_factor 0.5: 8 rotary pairs, 16 features that do not turn. Sections 4, 2, 2
# interleaved: pairs t h w t h w t t; contiguous they would be t t t t h h w w, and the default 11, 11, 10 reaches
# 3, 3, 2 on 8 pairs (t h w t h w t h): each of the three misreadings turns some pair by another axis. theta 10
# (not 1e4): the default sections differ from these at pair 7 alone, the slowest, which at theta 1e4 turns by
# 3e-4 per position and moves the output by less than the allowance (margin 0.684); at theta 10 it turns by 0.13.
SECTION = [4, 2, 2]
TEXT = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=32,
            vocab_size=64, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            num_hidden_layers=1, layer_types=["full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10.0, "partial_rotary_factor": 0.5,
                             "mrope_section": SECTION})
MOE = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
              num_position_embeddings=16)  # spatial_merge_size 2 (the default): 2 x 2 patches per token


def _model(model_type: str):
    text = {**TEXT, **MOE} if model_type == "qwen3_5_moe" else TEXT
    config = transformers.AutoConfig.for_model(model_type, text_config=text, vision_config=VISION,
                                               image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=62,
                                               vision_end_token_id=63)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager",
                                                                 dtype=torch.float32)
    with torch.no_grad():  # random norms too (their inits are zeros: Qwen's 1 + w)
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if ("norm" in name or "bias" in name) else 0.2)
    return model.eval()


def _positions(model) -> np.ndarray:
    """(3, 1, L): the model's own get_rope_index over 2 text tokens, the image's 6 merged patches, 2 text tokens,
    the video's 2 frames of 4 with a timestamp token between them (Qwen3.5's get_rope_index splits a video into
    its frames, as its processor writes them), 2 text tokens."""
    image = (IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2]) // 4
    frame = (VIDEO_GRID[1] * VIDEO_GRID[2]) // 4
    ids = [3, 4] + [IMAGE] * image + [6, 7] + [VIDEO] * frame + [5] + [VIDEO] * frame + [8, 9]
    types = [1 if t == IMAGE else 2 if t == VIDEO else 0 for t in ids]
    with torch.no_grad():
        positions, _ = model.model.get_rope_index(input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]),
                                                  image_grid_thw=torch.tensor([IMAGE_GRID]),
                                                  video_grid_thw=torch.tensor([VIDEO_GRID]))
    return positions.numpy().astype(np.int64)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def block(request, tmp_path_factory):
    """(model_type, config, tensors, x (1, L, D), positions (3, 1, L), the block's own output (1, L, D),
    (config.json, the state dict))."""
    model = _model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    positions = _positions(model)
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
    assert "mrope_section" in json.loads((folder / "config.json").read_text())["text_config"]["rope_parameters"]
    config, tensors = load(target)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    hf_config = json.loads((folder / "config.json").read_text())
    return request.param, config, tensors, seen["x"], positions, seen["out"], (hf_config, state)


def test_config_read_from_the_checkpoint(block):
    _, config, *_ = block
    assert config.rope.mrope_section == tuple(SECTION) and config.rope.mrope_interleaved, config.rope
    assert config.rope.rotary_dim == 16 and config.rope.theta == 10.0 and not config.rope.interleaved, config.rope
    assert config.output_gate is not None and config.output_gate.scope == "element", config.output_gate


def test_backends_reproduce_the_block_at_the_models_positions(block):
    """Prefill and decode at the model's 3-D positions: the float64 reference, then every installed core
    backend, against the model's own attention output."""
    model_type, config, tensors, x, positions, expected, _ = block
    assert not (positions[0] == positions[1]).all() and not (positions[1] == positions[2]).all(), positions
    assert_block_reproduced(model_type, config, tensors, x, positions, expected)


def _ignoring_sections(facts):  # llama_gated.py before it read them: plain RoPE
    facts["modern"]["rope"] = {k: v for k, v in facts["modern"]["rope"].items() if not k.startswith("mrope_")}


def _not_interleaved(facts):  # the sections laid out contiguously, as Qwen2-VL's
    facts["modern"]["rope"]["mrope_interleaved"] = False


@pytest.mark.parametrize("bug", ["sections_ignored", "not_interleaved", "default_sections"])
def test_misread_sections_fail_the_reproduction(block, bug, monkeypatch):
    """A mutant of the reader converts the checkpoint, and the float64 reference on what it read fails the
    model's own output: plain RoPE (what llama_gated.py read before; the caller's positions are then the
    temporal row), the sections contiguous, the default sections (11, 11, 10, which reach 3, 3, 2 here) in
    place of config.json's."""
    model_type, config, tensors, x, positions, expected, (hf_config, state) = block
    if bug == "default_sections":
        sections = llama_gated._qwen3_5_sections
        monkeypatch.setattr(llama_gated, "_qwen3_5_sections", lambda cfg, rotary_dim: sections(
            {**cfg, "rope_parameters": {k: v for k, v in cfg["rope_parameters"].items() if k != "mrope_section"}},
            rotary_dim))
    else:
        read, plant = llama_gated.layer_facts, _ignoring_sections if bug == "sections_ignored" else _not_interleaved

        def mutant(cfg, layer):
            facts = read(cfg, layer)
            plant(facts)
            return facts

        monkeypatch.setattr(llama_gated, "layer_facts", mutant)
    misread, _ = layouts.to_canonical("hf-llama", state, hf_config=hf_config, layer=0)
    assert misread.rope != config.rope, misread.rope
    got, logits = _logits(misread, tensors, x, positions[0] if bug == "sections_ignored" else positions)
    ok, margin, _ = _margin(f"{model_type} {bug}", got, expected, config, logits, positions)
    print(f"{model_type} {bug}: margin {margin:.3g}")
    assert not ok and margin > 10, f"{model_type}: {bug} passed the reproduction (margin {margin:.3g})"


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("head_dim,factor,section", [
    (256, 0.25, None),  # Qwen3.5's own: 32 pairs, the default 11, 11, 10
    (32, 0.5, SECTION),  # the model above
    (16, 0.25, None),  # test_layouts_gated.py's: the default on 2 pairs
    (32, 0.5, [0, 5, 1]),  # height past the pairs, temporal 0 (never read)
])
def test_sections_give_each_pair_the_models_axis(model_type, head_dim, factor, section):
    """The reader's sections, through weights.rope.mrope_axes, against Qwen3_5TextRotaryEmbedding itself: at
    one token whose temporal, height and width positions are 0, 1, 2, each pair's cosine tells its axis (theta 2:
    every frequency lies in [1/2, 1], so cos 0, cos f and cos 2f differ by more than 0.1)."""
    from weights.layouts.llama import _llama_config

    params = {"rope_type": "default", "rope_theta": 2.0, "partial_rotary_factor": factor}
    if section is not None:
        params["mrope_section"] = section
    text = dict(TEXT, head_dim=head_dim, rope_parameters=params)
    rope = _llama_config({"model_type": model_type, "text_config": text}, 0)["modern"]["rope"]
    assert rope["mrope_interleaved"] and rope["rotary_dim"] == int(head_dim * factor), rope
    cfg = transformers.AutoConfig.for_model(f"{model_type}_text", **text)
    if model_type == "qwen3_5":
        embedding = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(cfg)
    else:
        embedding = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding(cfg)
    cos, _ = embedding(torch.zeros(1, dtype=torch.float32), torch.arange(3).reshape(3, 1, 1))
    pairs = rope["rotary_dim"] // 2
    cos = cos.numpy()[0, 0, :pairs]  # (pairs,): the second half repeats the first
    freq = embedding.inv_freq.numpy()
    axis = np.argmin(np.abs(cos[:, None] - np.cos(np.arange(3)[None, :] * freq[:, None])), axis=1)
    checked = Rope.from_value(rope)
    checked.mrope_fits(checked.rotary_dim)  # the written sections count the pairs, each within them
    ours = mrope_axes(checked)
    assert ours.tolist() == axis.tolist(), (rope["mrope_section"], ours, axis)


_QWEN3_5_0_8B = {  # Qwen3.5-0.8B's text_config (its config.json on the hub, as public code quotes it)
    "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 24,
    "full_attention_interval": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000, "rope_type": "default"}}
_YARN = {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "yarn", "rope_theta": 10000000,
         "partial_rotary_factor": 0.25, "factor": 4.0, "original_max_position_embeddings": 262144}


@pytest.mark.parametrize("hf_config,scaling", [
    ({"model_type": "qwen3_5", "text_config": _QWEN3_5_0_8B}, None),  # the multimodal wrapper, 5.x
    ({**_QWEN3_5_0_8B, "model_type": "qwen3_5_text"}, None),  # the text model alone: the fields at the top level
    # the YaRN override Qwen3.5's model cards give for 1M tokens: the sections kept beside the scaling
    ({"model_type": "qwen3_5_moe", "text_config": {**_QWEN3_5_0_8B, "rope_parameters": _YARN}}, "yarn"),
])
def test_released_config_files_are_read(hf_config, scaling):
    """Layer 3 (full attention): 64 rotary features of 256, 32 pairs in sections 11, 11, 10, interleaved."""
    from weights.layouts.llama import _llama_config

    rope = _llama_config(hf_config, 3)["modern"]["rope"]
    assert (rope["mrope_section"], rope["mrope_interleaved"], rope["rotary_dim"], rope["theta"]) == (
        [11, 11, 10], True, 64, 1e7), rope
    assert (rope["scaling"] or {}).get("type") == scaling and not rope["interleaved"], rope
    Rope.from_value(rope).mrope_fits(64)  # the canonical config takes it (sections and scaling together)
    with pytest.raises(ValueError, match="linear_attention"):
        _llama_config(hf_config, 2)
