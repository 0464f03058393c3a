"""hf-minimax on MiniMax M3: a tiny randomly initialised text model (transformers' MiniMaxM3VLForCausalLM,
eager, float32, batch 2; layer 0 sparse: 2 index heads = kv heads, blocks of 2 keys, 3 blocks kept, 1 local
block; layer 1 dense; per-head Gemma QK-norm, RoPE on half of each head) saved with save_pretrained, each
block converted with `mha convert --from hf-minimax`, and reproduced: the causal prefill of T = 16 tokens (8
blocks, so the selection drops keys), then a prefill of 14 and a decode token by token from the returned
caches, on the float64 reference first, then torch / jax / tf in float32 (the indexer, then the attention
over its per-kv-head selection: tests/dsa_checkpoints.py's sparse_call). The released VL model's folder
(MiniMaxM3SparseForConditionalGeneration holding the same text weights: language_model.model.layers.{L}.
self_attn.index_*) reads the same config and the same tensors, its prefix detected.

Judged by the float32 policy. Converter mutants (tests/dsa_checkpoints.py, and the kv heads' selections handed
to the query heads in the wrong grouping) each fail. A few seconds (the `all` env).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from dsa_checkpoints import mutate, sparse_call
from test_layouts_modern import _installed

from conformance.cli.commands import main as mha
from conformance.suite.tolerance import compare, policy_for
from weights import layouts, load

try:
    import torch
    import transformers  # noqa: F401
    from safetensors.numpy import load_file
    from transformers.models.minimax_m3_vl import configuration_minimax_m3_vl as conf
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mod
except ImportError:
    torch = None
needs_transformers = [pytest.mark.torch, pytest.mark.tf, pytest.mark.jax,
                      pytest.mark.skipif(torch is None, reason="needs torch and transformers: "
                                         "pip install -c constraints/cpu.txt '.[torch,hf]'")]
pytestmark = needs_transformers

B, T, PREFIX, N, K, H = 2, 16, 14, 4, 2, 8
TEXT = dict(hidden_size=16, num_attention_heads=N, num_key_value_heads=K, head_dim=H, index_n_heads=K,
            index_head_dim=8, index_block_size=2, index_topk_blocks=3, index_local_blocks=1, num_hidden_layers=2,
            layer_types=["minimax_m3_sparse", "full_attention"], vocab_size=64, rms_norm_eps=1e-6,
            intermediate_size=16, rotary_dim=2, eos_token_id=2, pad_token_id=0, bos_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})
GROUPING = "kv_grouping_swapped"  # query head n reads index head n mod K, not n // (N / K)


def _model():
    torch.manual_seed(0)
    model = mod.MiniMaxM3VLForCausalLM(conf.MiniMaxM3VLTextConfig(**TEXT)).float().eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)  # Gemma norms: w around 0, scale 1 + w around 1
    return model


def _capture(model):
    seen = {}
    hooks = []
    for layer in range(2):
        def hook(module, args, kwargs, output, layer=layer):
            seen[layer] = {"x": kwargs["hidden_states"].numpy().copy(), "out": output[0].numpy().copy()}
        hooks.append(model.model.layers[layer].self_attn.register_forward_hook(hook, with_kwargs=True))
    ids = torch.arange(B * T).reshape(B, T) % 60 + 3
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(T)[None].expand(B, -1), use_cache=False)
    for h in hooks:
        h.remove()
    return seen


_BUILT: dict = {}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    if not _BUILT:
        model = _model()
        folder = tmp_path_factory.mktemp("minimax_m3")
        model.save_pretrained(folder)
        blocks = {}
        for layer in range(2):
            target = folder / f"block{layer}.safetensors"
            assert mha(["convert", "--from", "hf-minimax", "--to", "canonical", str(folder), str(target),
                        "--layer", str(layer)]) == 0
            blocks[layer] = load(target)
        _BUILT.update(model=model, blocks=blocks, seen=_capture(model), folder=folder)
    return _BUILT


def _call(backend, config, tensors, x, positions, cache, bug):
    config, causal = mutate(config, bug if bug != GROUPING and config.indexer is not None else None)
    if bug != GROUPING or config.indexer is None:
        return sparse_call(backend, config, tensors, x, positions, cache=cache, indexer_causal=causal)
    # the grouping mutant: the same model with one kv head per query head (k and v repeated, as GQA shares
    # them), each query head handed index head n mod K's blocks instead of n // (N / K)'s
    from impl_numpy.indexer import lightning_indexer
    index = lightning_indexer(config, tensors, x, positions=positions,
                              past_index_keys=None if cache is None else cache["past_index_keys"])
    wide = config.replace(num_kv_heads=N, indexer=None)
    t = {k: v for k, v in tensors.items() if not k.startswith("indexer.")}
    t.update({name: np.repeat(tensors[name], N // K, axis=1) for name in ("key.kernel", "value.kernel")})
    selection = np.tile(index["topk_indices"], (1, N // K, 1, 1))
    past = {} if cache is None else {"past_key": np.repeat(cache["past_key"], N // K, axis=1),
                                     "past_value": np.repeat(cache["past_value"], N // K, axis=1)}
    out = sparse_call(backend, wide, t, x, positions, cache=past or None, selection=selection)
    out["cache"] = {"past_key": out["cache"]["past_key"][:, ::N // K], "past_value": out["cache"]["past_value"][:, ::N // K],
                    "past_index_keys": index["present_index_keys"]}
    return out


def _reproduce(backend, blocks, seen, *, bug=None, dtype=np.float32, full=True):
    """full False: without the prefill of all T tokens (the mirrors: the prefill of PREFIX tokens already
    drops keys, and each new shape costs JAX's indexer a compilation of about 4 s on a 2-core VM)."""
    got = {}
    positions = np.arange(T, dtype=np.int64)
    caches: dict = {}
    for part, (start, stop) in [("prefill", (0, T))] * full + [("prefix", (0, PREFIX))] + [
            (f"decode {t}", (t, t + 1)) for t in range(PREFIX, T)]:
        for layer, (config, tensors) in blocks.items():
            t = {k: v.astype(dtype) for k, v in tensors.items()}
            result = _call(backend, config, t, seen[layer]["x"][:, start:stop].astype(dtype), positions[start:stop],
                           caches.get(layer) if start else None, bug)
            caches[layer] = result["cache"]
            got[(part, layer)] = (result["output"], seen[layer]["out"][:, start:stop])
    return got


def _judge(name, blocks, got):
    margins, failed = {}, []
    for (part, layer), (actual, expected) in got.items():
        keys = T if part == "prefill" else PREFIX if part == "prefix" else int(part.split()[1]) + 1
        tol = policy_for(blocks[layer][0], dtype="float32", quantity="output", B=B, T=expected.shape[1], S=keys,
                         reference=expected, max_position=T)
        result = compare(f"{name} {part} layer {layer}", actual, expected, tol)
        margins[f"{part} {layer}"] = result.margin
        if not result.ok:
            failed.append(result.describe())
    return margins, failed


def test_config_read_from_the_checkpoint(converted):
    sparse, dense = converted["blocks"][0][0], converted["blocks"][1][0]
    assert dense.indexer is None and sparse.indexer is not None, (sparse.indexer, dense.indexer)
    ix = sparse.indexer
    assert (ix.heads, ix.block_size, ix.topk, ix.local_blocks, ix.per_kv_head) == (K, 2, 3, 1, True), ix
    # partial_rotary_factor 0.5 of head_dim 8, not the config's rotary_dim 2 (transformers ignores it)
    assert sparse.rope.rotary_dim == 4 and ix.rope.rotary_dim == 4 and not sparse.rope.interleaved, sparse.rope
    assert sparse.qk_norm.type == "rms" and sparse.qk_norm.scope == "head", sparse.qk_norm
    assert (sparse.num_heads, sparse.num_kv_heads) == (N, K)


def test_backends_reproduce_the_blocks(converted):
    """Prefill and token-by-token decode, float64 reference then every installed core backend in float32."""
    blocks, seen = converted["blocks"], converted["seen"]
    margins, failed = _judge("minimax_m3 float64", blocks, _reproduce("numpy", blocks, seen, dtype=np.float64))
    report = {"float64": max(margins.values())}
    for backend_name, _ in _installed():
        m, f = _judge(f"minimax_m3 {backend_name}", blocks, _reproduce(backend_name, blocks, seen, full=False))
        report[backend_name] = max(m.values())
        failed += f
    assert not failed, "\n".join(failed)
    print("minimax_m3: worst margins " + ", ".join(f"{k} {v:.3g}" for k, v in report.items()))


@pytest.mark.parametrize("bug", ["pairing_swapped", "rope_end_swapped", "causal_after_topk", GROUPING])
def test_converter_mutants_fail_the_reproduction(converted, bug):
    blocks, seen = converted["blocks"], converted["seen"]
    margins, failed = _judge(f"minimax_m3 {bug}", blocks, _reproduce("numpy", blocks, seen, bug=bug,
                                                                     dtype=np.float64))
    assert failed, f"{bug} passed the reproduction (worst margin {max(margins.values()):.3g})"
    print(f"minimax_m3 {bug}: worst margin {max(margins.values()):.3g}")


def test_the_vl_folder_reads_the_same_blocks(converted, tmp_path):
    """The released VL model's folder (text weights under language_model.model.layers.{L}.self_attn, the
    indexer's as index_*; a vision tower beside them): the prefix detected, the same config and tensors; and
    written back under that prefix, the same keys and bits."""
    model, blocks = converted["model"], converted["blocks"]
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    vl = mod.MiniMaxM3SparseForConditionalGeneration(conf.MiniMaxM3VLConfig(text_config=TEXT, vision_config=vision))
    vl.model.language_model.load_state_dict(model.model.state_dict())
    vl.save_pretrained(tmp_path)
    state, hf_config = load_file(tmp_path / "model.safetensors"), json.loads((tmp_path / "config.json").read_text())
    assert "language_model.model.layers.0.self_attn.index_q_proj.weight" in state, sorted(state)[:8]
    assert layouts.layers("hf-minimax", state) == [0, 1]  # the vision tower's attention (no q_norm) not counted
    for layer, (config, tensors) in blocks.items():
        read_config, read = layouts.to_canonical("hf-minimax", state, hf_config=hf_config, layer=layer)
        assert read_config == config, (read_config, config)
        assert sorted(read) == sorted(tensors) and all(np.array_equal(read[k], tensors[k]) for k in read), layer
        back = layouts.from_canonical("hf-minimax", config, tensors, hf_config=hf_config, layer=layer,
                                      prefix="language_model.model.")
        scope = f"language_model.model.layers.{layer}.self_attn."
        assert sorted(back) == sorted(k for k in state if k.startswith(scope)), sorted(back)
        for key, value in back.items():  # Gemma's w comes back as (1 + w) - 1: within one float32 ulp of 1
            exact = "norm" not in key.rsplit(".", 2)[-2]
            assert np.array_equal(value, state[key]) if exact else \
                np.allclose(value, state[key], rtol=0, atol=np.finfo(np.float32).eps), key


def test_refusals_name_the_field(converted, tmp_path):
    """A layer past num_hidden_layers, a VL config.json without its text_config, a bias or an interleaved RoPE
    written as M3: each refused with what it got."""
    model, (config, tensors) = converted["model"], converted["blocks"][0]
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    hf_config = json.loads((converted["folder"] / "config.json").read_text())
    with pytest.raises(ValueError, match="layer must be in \\[0, 2\\).*got 3"):
        layouts.to_canonical("hf-minimax", state, hf_config=hf_config, layer=3)
    with pytest.raises(ValueError, match="minimax_m3_vl config.json needs text_config"):
        layouts.to_canonical("hf-minimax", state, hf_config={"model_type": "minimax_m3_vl"}, layer=0)
    assert layouts.cannot_express("hf-minimax", config.replace(use_query_bias=True)) == [
        "use_query_bias=True (MiniMax M3's projections have no bias)"]
    with pytest.raises(ValueError, match="rope.interleaved=True"):
        layouts.from_canonical("hf-minimax", config.replace(rope={**config.rope.to_dict(), "interleaved": True}),
                               tensors)


def test_no_block_near_a_tie(converted):
    """The premise of the row-by-row reproduction: on every query and kv head of the full prefill, the k-th and
    (k+1)-th float64 block scores (max-pooled, the local block at +inf) differ by more than twice the
    float32 allowance, so no float32 port (transformers' included, on any CPU) can pick other blocks."""
    from test_layouts_dsa import _boundary_gap

    from conformance.suite.selection import index_length, score_allowance
    from impl_numpy.indexer import block_scores, lightning_indexer
    config, tensors = converted["blocks"][0]
    ours = lightning_indexer(config, {k: v.astype(np.float64) for k, v in tensors.items()},
                             converted["seen"][0]["x"].astype(np.float64), return_scores=True)
    magnitudes = block_scores(ours["index_score_magnitudes"], config.indexer.block_size)
    allowance = score_allowance("float32", magnitudes, length=index_length(config, T))
    gap = _boundary_gap(ours["block_scores"], allowance, config.indexer.topk)
    assert 2 < gap < np.inf, f"a k-th and (k+1)-th block score within {gap:.3g} allowances"
