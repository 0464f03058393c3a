"""GLM-5.3-Flash's indexed attention (transformers' glm5_next, 5.23) reproduced by the contract: a tiny randomly
initialised Glm5NextTextAttention (its own Glm5NextTextConfig, eager, float32, batch 2), its state read by
hf-deepseek (weights.layouts.glm5_next: NoPE MLA, the indexer's k-pool as block_pool "gated" + open_block),
then the causal prefill of T = 6 pools of 2 tokens with 2 pools kept per query (so the selection drops keys),
and a prefill of PREFIX tokens followed by a decode token by token from the returned caches (the latent's and
the indexer's [key | gate] cache), on the float64 reference, each call's output against the model's own under
the float32 policy and each call's selection against the one transformers' indexer returned (the same keys).

The porting bugs a glm5_next port makes each fail the same reproduction: its pools scored by max-pooling token
scores (MiniMax M3's block path), the open tail dropped, the selected pools not expanded back to their tokens
(pool numbers read as key numbers), incomplete pools left selectable.

transformers comes with the `hf` extra; elsewhere the test skips. About 1 s in all (the `all` env)."""

from __future__ import annotations

import numpy as np
import pytest

import impl_numpy.indexer as numpy_indexer
from conformance.suite import backends
from conformance.suite.selection import index_length, score_allowance
from conformance.suite.tolerance import compare, policy_for
from weights import layouts
from weights.layouts.glm5_next import index_cache_from_hf

try:
    import torch
    import transformers
    from transformers.models.glm5_next import modeling_glm5_next as mod
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
except ImportError:
    torch = transformers = None

pytestmark = [pytest.mark.torch, pytest.mark.tf, pytest.mark.jax, pytest.mark.skipif(
    transformers is None, reason="needs torch and transformers >= 5.23 (glm5_next): pip install '.[torch,hf]'")]

B, D, KPOOL, TOPK = 2, 16, 2, 4  # index_topk 4 tokens = 2 pools of 2
T = 12  # 6 pools: a late query keeps 2 of up to 5 complete pools, plus its open one
PREFIX = T - 3  # an odd prefix: the decode crosses pool boundaries both ways
SMALL = dict(hidden_size=D, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=6, q_lora_rank=5,
             qk_nope_head_dim=4, qk_rope_head_dim=0, v_head_dim=3, index_n_heads=8, index_head_dim=8,
             index_topk=TOPK, index_kpool=KPOOL, num_hidden_layers=1, layer_types=["indexed_attention"],
             indexer_types=["full"], mlp_layer_types=["dense"], vocab_size=8, pad_token_id=0, rms_norm_eps=1e-5)

MUTANTS = {
    "max_pooled": "the pools scored by the max of their tokens' scores (MiniMax M3's block path), no pooled key",
    "tail_dropped": "index_kpool_always_select_tail ignored: the query's open pool not kept",
    "pools_not_expanded": "the selected pools not expanded back: pool numbers read as key numbers",
    "open_pools_selectable": "a pool selectable once any of its keys is visible, not when it is complete",
}


def _model():
    cfg = Glm5NextTextConfig(**SMALL)
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    layer = mod.Glm5NextTextAttention(cfg, layer_idx=0).eval()
    with torch.no_grad():  # random weights, norm scales around 1 (the pool's gate and slot positions too)
        for name, param in layer.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.5)
    return cfg, layer


def _run_model(cfg, layer, x):
    """transformers' outputs and selections: the prefill of T, then a prefill of PREFIX and decode steps."""
    seen = []
    hook = layer.indexer.register_forward_hook(lambda m, a, out: seen.append(out.numpy().copy()))
    got = {}
    try:
        with torch.no_grad():
            xt = torch.from_numpy(x)
            for part, spans in (("prefill", [(0, T)]), ("decode", [(0, PREFIX)] + [(t, t + 1) for t in range(PREFIX, T)])):
                cache = transformers.DynamicCache(config=cfg)
                for start, stop in spans:
                    out, _, _ = layer(xt[:, start:stop], torch.ones(B, stop - start, dtype=torch.bool),
                                      past_key_values=cache)
                    got[(part, start)] = (out.numpy().copy(), seen[-1])
                if part == "decode":
                    got["index cache"] = index_cache_from_hf(cache.layers[0].indexer_keys.numpy())
    finally:
        hook.remove()
    return got


@pytest.fixture(scope="module")
def block():
    cfg, layer = _model()
    state = {f"layers.0.self_attn.{n}": p.detach().numpy() for n, p in layer.state_dict().items()}
    config, tensors = layouts.to_canonical("hf-deepseek", state, hf_config={**cfg.to_dict(), "model_type":
                                                                           "glm5_next_text"}, layer=0)
    x = np.random.default_rng(5).standard_normal((B, T, D)).astype(np.float32)
    return config, tensors, x, _run_model(cfg, layer, x)


def _mutated(config, bug):
    ix = config.indexer
    if bug == "max_pooled":
        return config.replace(indexer={**ix.to_dict(), "block_pool": "max", "open_block": False})
    if bug == "tail_dropped":
        return config.replace(indexer={**ix.to_dict(), "open_block": False})
    return config


def _ours(config, tensors, x, monkeypatch=None, bug=None, backend="numpy", dtype=np.float64, full=True):
    """One backend's calls (default: the float64 reference), as _run_model's: {(part, start): (output,
    selection)}, the index cache. full False: without the prefill of all T tokens (the mirrors: the prefill
    of PREFIX tokens already drops keys, and each new shape costs JAX a compilation)."""
    if bug == "pools_not_expanded":
        monkeypatch.setattr(numpy_indexer, "expand_blocks", lambda blocks, bs, allowed, S: blocks)
    if bug == "open_pools_selectable":
        monkeypatch.setattr(numpy_indexer, "complete_blocks", lambda allowed, bs: numpy_indexer.block_scores(
            np.where(allowed, 0.0, -np.inf), bs) > -np.inf)
    config = _mutated(config, bug)
    if bug == "max_pooled":
        tensors = {k: v for k, v in tensors.items() if not k.startswith("indexer.pool.")}
    wide = {k: v.astype(dtype) for k, v in tensors.items()}
    run = backends.load(backend)
    got = {}
    for part, spans in [("prefill", [(0, T)])] * full + [("decode", [(0, PREFIX)] + [(t, t + 1) for t in
                                                                                    range(PREFIX, T)])]:
        cache = {}
        for start, stop in spans:
            inputs = {"query": x[:, start:stop].astype(dtype), "positions": np.arange(start, stop), **cache}
            options = {"is_causal": True, "return_cache": True, "return_selection": True}
            if cache:
                options["causal_alignment"] = "bottom_right"
            r = {name: _array(v) for name, v in run.forward(config, wide, inputs, options).items()
                 if name in ("output", "selection", "present_key", "present_value", "present_index_keys")}
            cache = {"past_key": r["present_key"], "past_value": r["present_value"],
                     "past_index_keys": r["present_index_keys"]}
            got[(part, start)] = (np.asarray(r["output"]), np.asarray(r["selection"]))
        if part == "decode":
            got["index cache"] = cache["past_index_keys"]
    return got


def _array(x):
    return np.asarray(x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else x)


def _judge(config, tensors, x, ours, theirs, name):
    """Each call's output under the float32 policy (the model is float32). -> (margins, failures)."""
    margins, failed = {}, []
    for key, (actual, _) in ours.items():
        if key == "index cache":
            continue
        expected = theirs[key][0]
        part, start = key
        S = start + expected.shape[1]
        policy = policy_for(config, dtype="float32", quantity="output", B=B, T=expected.shape[1], S=S,
                            reference=expected, max_position=T)
        result = compare(f"{name} {part} {start}", actual, expected, policy)
        margins[key] = result.margin
        if not result.ok:
            failed.append(result.describe())
    return margins, failed


def _keys(selection):
    return [sorted(int(k) for k in row if k >= 0) for row in selection.reshape(-1, selection.shape[-1])]


def test_config_read_from_the_checkpoint(block):
    config, tensors, *_ = block
    ix = config.indexer
    assert (ix.block_size, ix.topk, ix.block_pool, ix.open_block, ix.rope) == (KPOOL, TOPK // KPOOL, "gated", True,
                                                                              None), ix
    assert config.scale == SMALL["qk_nope_head_dim"] ** -0.5 and config.latent.rope_dim == 2, config
    assert not tensors["query.kernel"][..., -2:].any() and not tensors["latent.kernel"][:, -2:].any(), \
        "the NoPE heads' padded rotary features must be zero"


def test_reader_finds_the_layer_in_a_full_checkpoint(block):
    """The same layer as layer 3 of a glm5_next checkpoint's names (model.language_model.layers.3.self_attn.*,
    its text_config nested, the default schedule: layers 0-2 linear_attention, 3 indexed): the same block;
    a linear_attention layer refused, a missing key listed (one line each)."""
    config, tensors, *_ = block
    cfg, layer = _model()
    text = {**cfg.to_dict(), "num_hidden_layers": 4, "layer_types": None, "indexer_types": None,
            "mlp_layer_types": None}
    full = {"model_type": "glm5_next", "text_config": text}
    state = {f"model.language_model.layers.3.self_attn.{n}": p.detach().numpy() for n, p in layer.state_dict().items()}
    again, t = layouts.to_canonical("hf-deepseek", state, hf_config=full, layer=3)
    assert again == config and all(np.array_equal(t[n], tensors[n]) for n in tensors), "layer 3 read differently"
    with pytest.raises(ValueError, match="layer 0 of glm5_next is a linear_attention layer") as err:
        layouts.to_canonical("hf-deepseek", {k.replace(".3.", ".0."): v for k, v in state.items()}, hf_config=full,
                             layer=0)
    assert "\n" not in str(err.value)
    gone = {k: v for k, v in state.items() if not k.endswith("index_kpool_compress_ape")}
    with pytest.raises(ValueError, match="missing model.language_model.layers.3.self_attn.indexer.index_kpool_comp"):
        layouts.to_canonical("hf-deepseek", gone, hf_config=full, layer=3)


def test_reference_reproduces_prefill_and_decode(block):
    """Outputs within the float32 policy, the same keys on every row of every call, the same index cache."""
    config, tensors, x, theirs = block
    ours = _ours(config, tensors, x)
    margins, failed = _judge(config, tensors, x, ours, theirs, "glm5_next")
    assert not failed, "\n".join(failed)
    for key in ours:
        if key == "index cache":
            continue
        assert _keys(ours[key][1]) == _keys(theirs[key][1]), f"{key}: selections differ"
    late = _keys(ours[("prefill", 0)][1])[T - 2]  # query T - 2 of batch row 0: 2 pools and its open one
    assert len(late) == TOPK + 1 < T - 1 and late[-1] == T - 2, f"the selection drops no key: {late}"
    assert np.allclose(ours["index cache"], theirs["index cache"], rtol=1e-5, atol=1e-5), "the index caches differ"
    print(f"glm5_next float64: worst margin {max(margins.values()):.3g}")


def test_no_near_tie_at_the_kth_pool(block):
    """The premise of comparing selections row by row: every row's k-th and (k+1)-th pool scores more than 2
    float32 allowances apart (a ReLU shuts each index head's score to exactly 0 with probability 1/2: seed 3 with
    4 index heads held a tie of two all-zero pools, which the contract breaks to the lower pool and torch.topk
    need not: an admissible difference, so this test uses 8 heads and a seed without one)."""
    config, tensors, x, _ = block
    wide = {k: v.astype(np.float64) for k, v in tensors.items()}
    r = numpy_indexer.lightning_indexer(config, wide, x.astype(np.float64), return_scores=True)
    s, allowance = r["block_scores"][:, 0], score_allowance("float32", r["index_score_magnitudes"][:, 0],
                                                            length=index_length(config, T))
    k, worst = config.indexer.topk, np.inf
    for row in np.ndindex(*s.shape[:-1]):
        order = np.argsort(-s[row], kind="stable")
        if np.isfinite(s[row][order[k]]):
            a, b = order[k - 1], order[k]
            worst = min(worst, (s[row][a] - s[row][b]) / max(allowance[row][a], allowance[row][b]))
    print(f"glm5_next: k-th and (k+1)-th pool scores at least {worst:.3g} allowances apart")
    assert 2 < worst < np.inf, f"a k-th and (k+1)-th pool score within {worst:.3g} allowances (or none dropped)"


@pytest.mark.parametrize("backend", [name for name in backends.CORE if name != "numpy"])
def test_mirrors_reproduce_prefill_and_decode(block, backend):
    """Each installed mirror in float32 through its own multi_head_attention (the layer runs its indexer):
    the model's outputs within the float32 policy, its selections, its index cache. (Loaded here, not at
    collection: an xdist worker that collects this file imports no framework for it.)"""
    try:
        backends.load(backend)
    except backends.BackendUnavailable as err:
        pytest.skip(f"{backend}: {err}")
    config, tensors, x, theirs = block
    ours = _ours(config, tensors, x, backend=backend, dtype=np.float32, full=False)
    margins, failed = _judge(config, tensors, x, ours, theirs, f"glm5_next {backend}")
    assert not failed, "\n".join(failed)
    for key in ours:
        if key != "index cache":
            assert _keys(ours[key][1]) == _keys(theirs[key][1]), f"{backend} {key}: selections differ"
    assert np.allclose(ours["index cache"], theirs["index cache"], rtol=1e-5, atol=1e-5), "the index caches differ"
    print(f"glm5_next {backend}: worst margin {max(margins.values()):.3g}")


@pytest.mark.parametrize("bug", list(MUTANTS))
def test_porting_bugs_fail_the_reproduction(block, bug, monkeypatch):
    config, tensors, x, theirs = block
    ours = _ours(config, tensors, x, monkeypatch, bug)
    margins, failed = _judge(config, tensors, x, ours, theirs, bug)
    assert failed, f"{bug} ({MUTANTS[bug]}) passed: worst margin {max(margins.values()):.3g}"
    print(f"glm5_next {bug}: worst margin {max(margins.values()):.3g}")
