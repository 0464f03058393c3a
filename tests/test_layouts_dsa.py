"""hf-deepseek and deepseek on sparse-attention checkpoints: tiny randomly initialised DeepSeek V3.2
(deepseek_v32: the indexer's RoPE half-split) and GLM-5 (glm_moe_dsa: interleaved; layer 0 full, layer 1
shared, reusing layer 0's selection) models (transformers, eager attention, float32, batch 2), saved with
save_pretrained, each block converted with `mha convert --from hf-deepseek --to canonical FOLDER W --layer L`,
and reproduced: the causal prefill of T = 4k tokens (k = index_topk, so the selection drops keys), then a
prefill of T - 2 tokens and a decode token by token from the returned cache (the attention's latent cache and
the indexer's own), on the float64 reference first, then torch / jax / tf in float32. Every call runs the
indexer, then the attention over its selection (tests/dsa_checkpoints.py's sparse_call; the shared layer takes
the full layer's selection). DeepSeek's own names (the `deepseek` layout, ModelArgs config) read the same arrays.

Judged by the float32 policy (the model is float32); the selection of each call against transformers' own
(the tensors its indexer hands torch.topk and the indices the attention module returns) under the selection
policy (conformance.suite.selection: float32's score allowance; transformers' spare slots, masked future keys
where a query sees fewer than k, count as padding). The converter bugs of tests/dsa_checkpoints.py
(CONVERTER_MUTANTS) each fail: the output, or (weights unscaled: a positive factor on every score of a query
keeps the selection) the index scores. About 4 s in all (the `all` env).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from dsa_checkpoints import CONVERTER_MUTANTS, mutate, sparse_call
from test_layouts_modern import _installed

from conformance.cli.commands import main as mha
from conformance.suite.selection import compare_selection, index_length, score_allowance
from conformance.suite.tolerance import compare, policy_for
from impl_numpy.indexer import lightning_indexer
from weights import layouts, load
from weights.layouts.indexer import with_indexer_scoring

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_transformers = [pytest.mark.torch, pytest.mark.tf, pytest.mark.jax,
                      pytest.mark.skipif(transformers is None, reason="needs torch and transformers: "
                                         "pip install -c constraints/cpu.txt '.[torch,hf]'")]

B, K_TOP = 2, 3
T = 4 * K_TOP  # the prefill: each late query keeps 3 of up to 12 keys
PREFIX = T - 2  # the decode: prefill PREFIX tokens (3k + 1), then one token a call
SMALL = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=6, qk_nope_head_dim=4,
             qk_rope_head_dim=4, v_head_dim=3, q_lora_rank=5, num_hidden_layers=2, first_k_dense_replace=2,
             intermediate_size=16, moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1, vocab_size=64,
             max_position_embeddings=64, rms_norm_eps=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             index_n_heads=4, index_head_dim=8, index_topk=K_TOP)
MODELS = {"deepseek_v32": {}, "glm_moe_dsa": {"index_topk_pattern": "FS", "mlp_layer_types": ["dense", "dense"]}}


class _TopkRecorder:
    """Records every tensor handed to torch.Tensor.topk (the indexers' scores), then calls it."""

    def __enter__(self):
        self.original, self.seen = torch.Tensor.topk, []
        recorder = self

        def topk(tensor, *args, **kwargs):
            recorder.seen.append(tensor.detach().numpy().copy())
            return recorder.original(tensor, *args, **kwargs)

        torch.Tensor.topk = topk
        return self

    def __exit__(self, *exc):
        torch.Tensor.topk = self.original


def _model(model_type: str):
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **MODELS[model_type])
    torch.manual_seed(1)  # a seed whose index scores hold no exact tie at the k-th key (see _no_boundary_tie)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # random weights, norm scales around 1
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model.eval()


def _capture(model):
    """Per layer: the attention input and output, and the selection its module returned; the index scores."""
    seen = {}
    hooks = []
    for layer in range(2):
        def hook(module, args, kwargs, output, layer=layer):
            seen.setdefault(layer, {}).update(x=kwargs["hidden_states"].numpy().copy(), out=output[0].numpy().copy())

        def index_hook(module, args, output, layer=layer):
            seen.setdefault(layer, {})["selection"] = output.numpy().copy()
        attention = model.model.layers[layer].self_attn
        hooks.append(attention.register_forward_hook(hook, with_kwargs=True))
        if attention.indexer is not None:
            hooks.append(attention.indexer.register_forward_hook(index_hook))
    ids = torch.arange(3, 3 + B * T).reshape(B, T) % 61 + 3
    with torch.no_grad(), _TopkRecorder() as rec:
        model(input_ids=ids, position_ids=torch.arange(T)[None].expand(B, -1), use_cache=False)
    for hook in hooks:
        hook.remove()
    scores = [s for s in rec.seen if s.shape == (B, T, T)]
    seen[0]["scores"] = scores[0]
    return seen


_BUILT: dict[str, tuple] = {}


@pytest.fixture(scope="module", params=[pytest.param(m, marks=needs_transformers) for m in MODELS])
def converted(request, tmp_path_factory):
    """(model_type, {layer: (config, tensors)}, captured, state, config.json, folder), through the CLI."""
    model_type = request.param
    if model_type not in _BUILT:
        model = _model(model_type)
        folder = tmp_path_factory.mktemp(model_type)
        model.save_pretrained(folder)
        blocks = {}
        for layer in range(2):
            target = folder / f"block{layer}.safetensors"
            assert mha(["convert", "--from", "hf-deepseek", "--to", "canonical", str(folder), str(target),
                        "--layer", str(layer)]) == 0
            blocks[layer] = load(target)
        state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        _BUILT[model_type] = (model_type, blocks, _capture(model), state,
                              json.loads((folder / "config.json").read_text()), folder)
    return _BUILT[model_type]


def _policy(config, expected, logits_scale, keys):
    return policy_for(config, dtype="float32", quantity="output", B=B, T=expected.shape[1], S=keys,
                      reference=expected, logits=logits_scale, max_position=T)


def _logits(config, tensors, x, selection):
    """The float64 reference's logits for the policy's scale (the selection's attention)."""
    from conformance.suite import backends
    wide = {k: v.astype(np.float64) for k, v in tensors.items() if not k.startswith("indexer.")}
    config = config.replace(indexer=None)  # the attention over the given selection (a layer picks or is given)
    ref = backends.load("numpy").forward(config, wide, {"query": x.astype(np.float64), "positions": np.arange(T),
                                                        "topk_indices": selection}, {"is_causal": True}, trace=True)
    return dict(ref["trace"])["logits"]


def _reproduce(backend, blocks, seen, *, bug=None, dtype=np.float32, full=True):
    """Both layers on `backend` in `dtype`: the prefill of T tokens, then a prefill of PREFIX tokens and a
    decode token by token (full False: without the prefill of all T tokens: the mirrors, as the prefill of
    PREFIX tokens already drops keys and each new shape costs JAX's indexer a compilation of about 4 s on a
    2-core VM). -> {check name: (actual, expected, the layer)} and each call's selection."""
    got, selections = {}, {}
    configs = {layer: mutate(blocks[layer][0], bug if blocks[layer][0].indexer is not None else None)
               for layer in blocks}
    tensors = {layer: {k: v.astype(dtype) for k, v in blocks[layer][1].items()} for layer in blocks}
    positions = np.arange(T, dtype=np.int64)
    caches: dict[int, dict] = {}
    for part, (start, stop) in [("prefill", (0, T))] * full + [("prefix", (0, PREFIX))] + [
            (f"decode {t}", (t, t + 1)) for t in range(PREFIX, T)]:
        selection = None
        for layer in sorted(blocks):
            config, causal = configs[layer]
            x = seen[layer]["x"][:, start:stop].astype(dtype)
            result = sparse_call(backend, config, tensors[layer], x, positions[start:stop],
                                 cache=caches.get(layer) if start else None,
                                 selection=None if config.indexer is not None else selection,
                                 indexer_causal=causal)
            selection = result["topk_indices"]
            caches[layer] = result["cache"]
            got[(part, layer)] = (result["output"], seen[layer]["out"][:, start:stop])
            selections[(part, layer)] = selection
    return got, selections


def _judge(name, blocks, seen, got):
    """Each call's output against the model's own, under the float32 policy. -> {check: margin}"""
    margins, failed = {}, []
    for (part, layer), (actual, expected) in got.items():
        config, tensors = blocks[layer]
        keys = expected.shape[1] if part in ("prefill", "prefix") else int(part.split()[1]) + 1
        selection = seen["reference selections"][("prefill", 0 if config.indexer is None else layer)]
        logits = seen.setdefault(("logits", layer), _logits(config, tensors, seen[layer]["x"], selection))
        rows = slice(0, expected.shape[1]) if part != "decode" and not part.startswith("decode") else \
            slice(keys - 1, keys)
        result = compare(f"{name} {part} layer {layer}", actual, expected,
                         _policy(config, expected, logits[..., rows, :], keys))
        margins[f"{part} {layer}"] = result.margin
        if not result.ok:
            failed.append(result.describe())
    return margins, failed


def _reference_selections(blocks, seen):
    if "reference selections" not in seen:
        _, seen["reference selections"] = _reproduce("numpy", blocks, seen, dtype=np.float64)
    return seen["reference selections"]


def _boundary_gap(scores, allowance, k) -> float:
    """The smallest gap between a row's k-th and (k+1)-th float64 reference scores, in allowances of the
    larger: above 2, no float32 port (on any CPU) can swap them, so the model's selection is the reference's
    and the block's outputs compare row by row. inf where no row sees more than k keys."""
    worst = np.inf
    for row in np.ndindex(*scores.shape[:-1]):
        s, a = scores[row], allowance[row]
        order = np.argsort(-s, kind="stable")
        if np.isfinite(s[order[k]]) if len(order) > k else False:
            at = order[k - 1], order[k]
            worst = min(worst, (s[at[0]] - s[at[1]]) / max(a[at[0]], a[at[1]]))
    return worst


def test_config_read_from_the_checkpoint(converted):
    """What hf-deepseek read, against the model's own attributes: the indexer on the full layers (pairing per
    model type), none on GLM-5's shared layer; the main attention's RoPE interleaved on both."""
    model_type, blocks, *_ = converted
    full, second = blocks[0][0], blocks[1][0]
    ix = full.indexer
    assert (ix.heads, ix.head_dim, ix.topk, ix.rope.rotary_dim) == (4, 8, K_TOP, 4), ix
    assert ix.rope.interleaved is (model_type == "glm_moe_dsa"), ix.rope
    assert ix.key_norm.type == "layer" and ix.key_norm.eps == 1e-6 and ix.relu and ix.head_weights, ix
    assert full.rope.interleaved and second.rope.interleaved, (full.rope, second.rope)
    assert (second.indexer is None) is (model_type == "glm_moe_dsa"), second.indexer


def test_selection_is_transformers_own(converted):
    """The float64 reference's index scores against the ones transformers handed torch.topk (float32
    allowance), and its selection of every prefill query against the one the indexer module returned, on
    every layer that runs an indexer.

    Also the premise of the row-by-row reproduction below: the same keys on every row. A ReLU shuts each
    index head's score to exactly 0 with probability 1/2, so a query's k-th and (k+1)-th scores are now and
    then both exactly 0 (every head shut); the contract breaks that tie to the lower key index and
    torch.topk may not, an admissible difference (the selection policy) after which the two outputs of that
    row differ legitimately. The model's seed holds no such tie (seeds 0, 2 and 3 each hold one), and no near
    one: every row's k-th and (k+1)-th scores at least 2 allowances apart (at seed 1: 113 for V3.2, 10.4 for
    GLM-5), so the premise holds for a float32 port on any CPU."""
    model_type, blocks, seen, *_ = converted
    full = [layer for layer in blocks if blocks[layer][0].indexer is not None]
    assert full == ([0, 1] if model_type == "deepseek_v32" else [0]), full
    assert ("selection" in seen[1]) is (model_type == "deepseek_v32"), "GLM-5's shared layer 1 ran an indexer"
    for layer in full:
        config, tensors = blocks[layer]
        ours = lightning_indexer(config, {k: v.astype(np.float64) for k, v in tensors.items()},
                                 seen[layer]["x"].astype(np.float64), return_scores=True)
        allowance = score_allowance("float32", ours["index_score_magnitudes"], length=index_length(config, T))
        if layer == 0:  # the first indexer's scores: the first tensors of shape (B, T, T) handed to topk
            s, theirs = ours["index_scores"][:, 0], seen[0]["scores"]
            finite = np.isfinite(s)
            gap = np.abs(s[finite] - theirs[finite])
            assert np.all(gap <= allowance[:, 0][finite]), f"{model_type}: index scores off by {gap.max():.3g}"
        c = compare_selection(f"{model_type} layer {layer} selection", seen[layer]["selection"][:, None],
                              ours["topk_indices"][:, None], ours["index_scores"], allowance)
        assert c.ok, c.describe()
        assert c.swaps == 0, f"{model_type} layer {layer}: {c.swaps} admissible swaps (a tie): pick another seed"
        gap = _boundary_gap(ours["index_scores"][:, 0], allowance[:, 0], K_TOP)
        assert gap > 2, f"{model_type} layer {layer}: a k-th and (k+1)-th score within {gap:.3g} allowances"
        assert (ours["topk_indices"][:, -1] >= 0).all() and T > 2 * K_TOP, "the selection drops no key"


def test_backends_reproduce_the_blocks(converted):
    """Prefill and token-by-token decode of both blocks, float64 reference then every installed core
    backend in float32, against the model's own outputs; each backend's selections the reference's (the
    selection policy: only near-ties may swap)."""
    model_type, blocks, seen, *_ = converted
    reference = _reference_selections(blocks, seen)
    got, _ = _reproduce("numpy", blocks, seen, dtype=np.float64)
    margins, failed = _judge(f"{model_type} float64", blocks, seen, got)
    report = {"float64": max(margins.values())}
    for backend_name, _backend in _installed():
        got, selections = _reproduce(backend_name, blocks, seen, full=False)  # the reference ran the full one
        for key, sel in selections.items():
            assert np.array_equal(np.sort(np.where(sel < 0, 10 ** 6, sel), -1),
                                  np.sort(np.where(reference[key] < 0, 10 ** 6, reference[key]), -1)), \
                f"{model_type} {backend_name} {key}: selection {sel.tolist()} against {reference[key].tolist()}"
        m, f = _judge(f"{model_type} {backend_name}", blocks, seen, got)
        report[backend_name] = max(m.values())
        failed += f
    assert not failed, "\n".join(failed)
    print(f"{model_type}: worst margins " + ", ".join(f"{k} {v:.3g}" for k, v in report.items()))


@pytest.mark.parametrize("bug", list(CONVERTER_MUTANTS))
def test_converter_mutants_fail_the_reproduction(converted, bug):
    """Each converter bug, on the float64 reference: the prefill or decode output leaves the float32 policy,
    or (weights unscaled, which keeps every selection) the index scores leave their allowance."""
    model_type, blocks, seen, *_ = converted
    _reference_selections(blocks, seen)
    if bug == "weights_unscaled":
        config, _ = mutate(blocks[0][0], bug)
        wide = {k: v.astype(np.float64) for k, v in blocks[0][1].items()}
        ours = lightning_indexer(config, wide, seen[0]["x"].astype(np.float64), return_scores=True)
        allowance = score_allowance("float32", ours["index_score_magnitudes"], length=index_length(config, T))
        finite = np.isfinite(ours["index_scores"][:, 0])
        ratio = np.abs(ours["index_scores"][:, 0] - seen[0]["scores"])[finite] / allowance[:, 0][finite]
        assert ratio.max() > 1, f"{bug} passed: index scores within {ratio.max():.3g} of the allowance"
        print(f"{model_type} {bug}: index scores off by {ratio.max():.3g} allowances")
        return
    got, _ = _reproduce("numpy", blocks, seen, bug=bug, dtype=np.float64)
    margins, failed = _judge(f"{model_type} {bug}", blocks, seen, got)
    assert failed, f"{bug} passed the reproduction (worst margin {max(margins.values()):.3g})"
    print(f"{model_type} {bug}: worst margin {max(margins.values()):.3g}")


def test_round_trip_is_bit_exact(converted):
    """canonical -> hf-deepseek (with its config.json) gives the checkpoint's own tensors, indexer included."""
    model_type, blocks, _seen, state, hf_config, _folder = converted
    for layer, (config, tensors) in blocks.items():
        written = layouts.from_canonical("hf-deepseek", config, tensors, hf_config=hf_config, layer=layer,
                                         prefix="model.")
        scope = f"model.layers.{layer}.self_attn."
        assert sorted(written) == sorted(k for k in state if k.startswith(scope)), sorted(written)
        for key, value in written.items():
            assert np.array_equal(value, state[key]), key


def test_deepseek_own_names_read_the_same_block(converted, tmp_path):
    """The V3.2 block under DeepSeek's own names (layers.L.attn.*, indexer.*) and its ModelArgs config reads the
    same tensors hf-deepseek read and the same config but for the indexer's scoring precision: fp8_e4m3, as
    DeepSeek's own code scores (tests/test_layouts_deepseek_fp8.py); with it cleared (--indexer-scoring plain)
    the reproduction above holds for it. By the API and by `mha convert --from deepseek`."""
    model_type, blocks, _seen, state, hf_config, _folder = converted
    if model_type != "deepseek_v32":
        pytest.skip("DeepSeek's own names hold V3.2 only")
    config, tensors = blocks[0]
    own = layouts.from_canonical("deepseek", config, tensors, layer=0)
    assert "layers.0.attn.indexer.weights_proj.weight" in own, sorted(own)
    args = {"dim": 16, "n_heads": 4, "q_lora_rank": 5, "kv_lora_rank": 6, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
            "v_head_dim": 3, "rope_theta": hf_config["rope_parameters"]["rope_theta"], "max_seq_len": 64,
            "original_seq_len": 64, "index_n_heads": 4, "index_head_dim": 8, "index_topk": K_TOP}
    read_config, read = layouts.to_canonical("deepseek", own, hf_config=args, layer=0)
    assert read_config == with_indexer_scoring(config, "fp8_e4m3"), (read_config, config)
    assert with_indexer_scoring(read_config, "plain") == config
    assert sorted(read) == sorted(tensors) and all(np.array_equal(read[k], tensors[k]) for k in read)
    # through the CLI, the ModelArgs JSON beside the weights as config.json
    from safetensors.numpy import save_file
    save_file(own, tmp_path / "model0.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(args))
    assert mha(["convert", "--from", "deepseek", "--to", "canonical", str(tmp_path / "model0.safetensors"),
                str(tmp_path / "block.safetensors"), "--layer", "0", "--indexer-scoring", "plain"]) == 0
    cli_config, cli = load(tmp_path / "block.safetensors")
    assert cli_config == config and all(np.array_equal(cli[k], tensors[k]) for k in tensors)


def test_refusals_name_the_layer_and_the_field(converted):
    """A shared GLM-5 layer holding indexer keys, a layer past num_hidden_layers, an M3-shaped indexer written
    as a DSA one, and a model type the reader does not know: each refused with what it got."""
    model_type, blocks, _seen, state, hf_config, _folder = converted
    from weights.format import WeightsFormatError
    with pytest.raises(ValueError, match="layer must be in \\[0, 2\\).*got 5"):
        layouts.to_canonical("hf-deepseek", state, hf_config=hf_config, layer=5)
    config, tensors = blocks[0]
    m3 = config.replace(indexer=dataclasses.replace(config.indexer, per_kv_head=True, relu=False, head_weights=False))
    problems = layouts.cannot_express("hf-deepseek", m3)
    assert any("indexer.per_kv_head=True" in p for p in problems) and any("indexer.relu=False" in p for p in problems)
    with pytest.raises(ValueError, match="model_type must be one of .*deepseek_v32, glm_moe_dsa"):
        layouts.to_canonical("hf-deepseek", state, hf_config={**hf_config, "model_type": "minimax_m3_vl"}, layer=0)
    if model_type == "glm_moe_dsa":
        stray = {**state, **{k.replace("layers.0.", "layers.1."): v for k, v in state.items()
                             if k.startswith("model.layers.0.self_attn.indexer.")}}
        with pytest.raises(WeightsFormatError, match="unexpected model.layers.1.self_attn.indexer.*indexer: shared"):
            layouts.to_canonical("hf-deepseek", stray, hf_config=hf_config, layer=1)


def test_deepseek_reads_the_release_pairing_when_asked(converted):
    """ModelArgs without index_* fields is V3 (no indexer); "indexer_rope_interleave": true reads the V3.2
    release's interleaved indexer RoPE (DeepSeek's code before its fix), the default the fixed half-split."""
    from weights.layouts.deepseek import _deepseek_config
    args = {"dim": 16, "n_heads": 4, "q_lora_rank": 5, "kv_lora_rank": 6, "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 4, "v_head_dim": 3}
    assert _deepseek_config(args, 0)["fields"]["indexer"] is None
    fixed = _deepseek_config({**args, "index_topk": 3}, 0)["fields"]["indexer"]
    release = _deepseek_config({**args, "index_topk": 3, "indexer_rope_interleave": True}, 0)["fields"]["indexer"]
    assert (fixed["heads"], fixed["head_dim"], fixed["topk"]) == (64, 128, 3), fixed  # ModelArgs' defaults
    assert fixed["rope"]["interleaved"] is False and release["rope"]["interleaved"] is True


def test_writing_in_the_other_pairing_keeps_the_index_scores(converted):
    """GLM-5's indexer (interleaved) written as DeepSeek's own names (read back half-split), and V3.2's
    (half-split) written under a GLM-5 config.json (read back interleaved): the rotary features permuted, the
    float64 index scores the same (a permutation of each dot product's terms: summation-order rounding only,
    a few float64 ulps of the scores' magnitudes), the attention's tensors untouched."""
    model_type, blocks, seen, _state, hf_config, _folder = converted
    config, tensors = blocks[0]
    wide = {k: v.astype(np.float64) for k, v in tensors.items()}
    x = seen[0]["x"].astype(np.float64)
    if model_type == "glm_moe_dsa":
        args = {"dim": 16, "n_heads": 4, "q_lora_rank": 5, "kv_lora_rank": 6, "qk_nope_head_dim": 4,
                "qk_rope_head_dim": 4, "v_head_dim": 3, "rope_theta": hf_config["rope_parameters"]["rope_theta"],
                "max_seq_len": 64, "original_seq_len": 64, "index_n_heads": 4, "index_head_dim": 8, "index_topk": K_TOP}
        written = layouts.from_canonical("deepseek", config, wide, layer=0)
        other, read = layouts.to_canonical("deepseek", written, hf_config=args, layer=0)
    else:
        glm = {**hf_config, "model_type": "glm_moe_dsa", "indexer_types": ["full", "full"]}
        written = layouts.from_canonical("hf-deepseek", config, wide, hf_config=glm, layer=0)
        other, read = layouts.to_canonical("hf-deepseek", written, hf_config=glm, layer=0)
    assert other.indexer.rope.interleaved is not config.indexer.rope.interleaved, other.indexer.rope
    assert not np.array_equal(read["indexer.key.kernel"], wide["indexer.key.kernel"]), "nothing was permuted"
    for name in ("query.kernel", "key.kernel", "value.kernel", "output.kernel"):
        assert np.array_equal(read[name], wide[name]), name
    before = lightning_indexer(config, wide, x, return_scores=True)
    after = lightning_indexer(other, read, x, return_scores=True)
    finite = np.isfinite(before["index_scores"])
    rounding = 64 * np.finfo(np.float64).eps * before["index_score_magnitudes"][finite]
    assert np.all(np.abs(after["index_scores"][finite] - before["index_scores"][finite]) <= rounding)
    assert np.array_equal(after["topk_indices"], before["topk_indices"])
