"""The contract's indexer against transformers' own Indexer classes: tiny randomly initialised DeepSeek V3.2
(deepseek_v32, half-split RoPE), GLM-5 (glm_moe_dsa, interleaved RoPE) and MiniMax M3 (minimax_m3_vl's text
attention: blocks per kv head, local blocks) indexers, their weights converted by
weights.layouts.indexer, reproduced by the NumPy spec in float64: prefill (T several times k, so the
selection drops keys), then one decode step from each side's index cache.

Judged by the float32 score allowance (conformance.suite.selection), not float64's: inside a float64 model
transformers computes the RoPE angles (`position_ids.float() * inv_freq`), the index scores (`q.float()`)
and MiniMax M3's RMS norms (`x.float()`) in float32. The selection is judged by the selection policy: the
same keys, except near-ties within that allowance; transformers' spare slots (a query that sees fewer than k
keys gets masked future keys) count as padding.

transformers comes with the `hf` extra (the `all` env); elsewhere the test skips with that reason. About a
second in all."""

from __future__ import annotations

import types

import numpy as np
import pytest

from conformance.suite.selection import compare_selection, index_length, score_allowance
from impl_numpy.indexer import block_scores, lightning_indexer
from weights import AttentionConfig
from weights.layouts.indexer import index_keys_from_hf, indexer_field, indexer_layers, indexer_tensors

D, QR, I, J, R, TOPK, T = 16, 6, 3, 8, 4, 3, 10


class _Recorder:
    """Records the tensors transformers hands to torch.Tensor.topk (its index scores), then calls it."""

    def __init__(self, torch):
        self.torch, self.seen = torch, []

    def __enter__(self):
        self.original = self.torch.Tensor.topk
        recorder = self

        def topk(tensor, *args, **kwargs):
            recorder.seen.append(tensor.detach().clone())
            return recorder.original(tensor, *args, **kwargs)

        self.torch.Tensor.topk = topk
        return self

    def __exit__(self, *exc):
        self.torch.Tensor.topk = self.original


def _judge(name, config, ours, theirs_scores, theirs_selection, scores_key="index_scores"):
    """Scores within the float32 allowance elementwise; selections agree under the selection policy."""
    m = ours["index_score_magnitudes"]
    if scores_key == "block_scores":
        m = block_scores(m, config.indexer.block_size)
    allowance = score_allowance("float32", m, length=index_length(config, T))
    s = ours[scores_key]
    theirs_scores = np.broadcast_to(theirs_scores, s.shape)
    finite = np.isfinite(s)
    assert np.array_equal(finite, np.isfinite(theirs_scores)), f"{name}: the masked scores differ"
    gap = np.abs(s[finite] - theirs_scores[finite])
    worst = np.argmax(gap / np.maximum(allowance[finite], 1e-300))
    assert np.all(gap <= allowance[finite]), (f"{name}: score {theirs_scores[finite][worst]!r} against "
                                              f"{s[finite][worst]!r}, allowance {allowance[finite][worst]:.3g}")
    expected = ours["topk_blocks"] if scores_key == "block_scores" else ours["topk_indices"][:, None]
    c = compare_selection(name, theirs_selection, expected, s, allowance)
    assert c.ok, c.describe()
    return c


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_indexer_reproduces_transformers(model_type):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", reason="transformers not installed: pip install '.[hf]'")
    if model_type == "deepseek_v32":
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as mod
        hf_config = transformers.DeepseekV32Config
        attention, rotary = mod.DeepseekV32Attention, mod.DeepseekV32RotaryEmbedding
    else:
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as mod
        hf_config = transformers.GlmMoeDsaConfig
        attention, rotary = mod.GlmMoeDsaAttention, mod.GlmMoeDsaRotaryEmbedding
    hf = dict(hidden_size=D, q_lora_rank=QR, qk_rope_head_dim=R, qk_nope_head_dim=4, index_n_heads=I,
              index_head_dim=J, index_topk=TOPK, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              kv_lora_rank=6, v_head_dim=4, vocab_size=8, attention_bias=False,
              rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    cfg = hf_config(**hf)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = attention(cfg, layer_idx=0).double().eval()
    with torch.no_grad():  # norms off their initial 1 and 0, so a scale or bias read wrongly shows
        for p in (layer.q_a_layernorm.weight, layer.indexer.k_norm.weight):
            p.uniform_(0.5, 1.5)
        layer.indexer.k_norm.bias.uniform_(-0.5, 0.5)
    config = AttentionConfig(num_heads=2, query_dim=D, head_dim=8, use_query_bias=False, use_key_bias=False,
                             use_value_bias=False, use_output_bias=False, rope={"theta": 500.0, "rotary_dim": R},
                             latent={"query_rank": QR, "kv_rank": 6, "rope_dim": R},
                             indexer=indexer_field(model_type, hf, {"theta": 500.0, "rotary_dim": R}))
    state = {n: p.detach().numpy() for n, p in layer.indexer.named_parameters()}
    tensors = {**indexer_tensors(model_type, state, heads=I), "query.down.kernel": layer.q_a_proj.weight.detach().numpy().T,
               "query.down.norm.scale": layer.q_a_layernorm.weight.detach().numpy()}
    x = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)[None].expand(2, -1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(2, -1, -1)

    def run(h, positions, mask, cache=None):
        with torch.no_grad(), _Recorder(torch) as rec:
            q_resid = layer.q_a_layernorm(layer.q_a_proj(h))
            out = layer.indexer(h, q_resid, rotary(cfg).double()(h, positions), mask, positions,
                                past_key_values=cache)
        return out.numpy(), rec.seen[-1].numpy()

    cache = transformers.DynamicCache(config=cfg)
    prefill_sel, prefill_scores = run(x[:, :T - 1], pos[:, :T - 1], causal[:, :T - 1, :T - 1], cache)
    ours = lightning_indexer(config, tensors, x[:, :T - 1].numpy(), return_scores=True)
    c = _judge(f"{model_type} prefill", config, ours, prefill_scores[:, None], prefill_sel[:, None])
    assert (ours["topk_indices"][:, :TOPK - 1] == -1).any(), "no query saw fewer than k keys: spare slots untested"
    # transformers fills the first query's spare slots with masked future keys (the contract: -1)
    assert (prefill_sel[:, 0, 1:] > 0).all(), prefill_sel[:, 0]
    assert (ours["topk_indices"][:, -1] >= 0).all() and T - 1 > 2 * TOPK, "the selection drops no key"
    decode_sel, decode_scores = run(x[:, T - 1:], pos[:, T - 1:], torch.ones(2, 1, T, dtype=torch.bool), cache)
    step = lightning_indexer(config, tensors, x[:, T - 1:].numpy(), past_index_keys=ours["present_index_keys"],
                             return_scores=True)
    _judge(f"{model_type} decode", config, step, decode_scores[:, None], decode_sel[:, None])
    hf_keys = index_keys_from_hf(model_type, cache.layers[0].indexer_keys.numpy(), R)
    assert np.allclose(hf_keys, step["present_index_keys"], rtol=1e-5, atol=1e-6), "the index caches differ"
    assert c.rows == 2 * (T - 1)


def test_m3_indexer_reproduces_transformers():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers", reason="transformers not installed: pip install '.[hf]'")
    from transformers.models.minimax_m3_vl import configuration_minimax_m3_vl as conf
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mod

    K, H, BS, KB, TT = 2, 8, 2, 3, 13
    hf = dict(hidden_size=D, num_attention_heads=4, num_key_value_heads=K, head_dim=H, index_n_heads=K,
              index_head_dim=J, index_block_size=BS, index_topk_blocks=KB, index_local_blocks=1, rotary_dim=2,
              num_hidden_layers=1, layer_types=["minimax_m3_sparse"], vocab_size=8, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})
    cfg = conf.MiniMaxM3VLTextConfig(**hf)
    torch.manual_seed(0)
    ix = mod.MiniMaxM3VLIndexer(cfg, layer_idx=0).double().eval()
    with torch.no_grad():
        ix.q_norm.weight.uniform_(-0.5, 0.5)
        ix.k_norm.weight.uniform_(-0.5, 0.5)
    field = indexer_field("minimax_m3_vl", hf, {"theta": 1000.0, "rotary_dim": 4})
    assert field["rope"]["rotary_dim"] == 4, "M3's RoPE turns head_dim * partial_rotary_factor features, not rotary_dim"
    config = AttentionConfig(num_heads=4, num_kv_heads=K, query_dim=D, head_dim=H, rope={"theta": 1000.0,
                             "rotary_dim": 4}, indexer=field)
    tensors = indexer_tensors("minimax_m3_vl", {n: p.detach().numpy() for n, p in ix.named_parameters()}, heads=K)
    rotary = mod.MiniMaxM3VLRotaryEmbedding(cfg).double()
    x = torch.randn(2, TT, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(TT)[None].expand(2, -1)
    cache = types.SimpleNamespace(layers=[mod.MiniMaxM3VLSparseCacheLayer()])

    def run(h, positions):
        with torch.no_grad(), _Recorder(torch) as rec:
            out = ix(h, rotary(h, positions), cache, positions)
        return out.numpy(), rec.seen[-1].numpy()

    sel, scores = run(x[:, :TT - 1], pos[:, :TT - 1])
    ours = lightning_indexer(config, tensors, x[:, :TT - 1].numpy(), return_scores=True)
    _judge("minimax_m3 prefill", config, ours, scores, sel, "block_scores")
    assert (ours["topk_blocks"][..., -1] >= 0).any() and (TT - 1) // BS > KB, "the selection drops no block"
    sel, scores = run(x[:, TT - 1:], pos[:, TT - 1:])
    step = lightning_indexer(config, tensors, x[:, TT - 1:].numpy(), past_index_keys=ours["present_index_keys"],
                             return_scores=True)
    _judge("minimax_m3 decode", config, step, scores, sel, "block_scores")
    hf_keys = index_keys_from_hf("minimax_m3_vl", cache.layers[0].idx_keys.numpy(), 4)
    assert np.allclose(hf_keys, step["present_index_keys"], rtol=1e-5, atol=1e-6), "the index caches differ"


def test_which_layers_have_an_indexer_as_transformers_reads_them():
    """indexer_layers against the configs' own resolution: GLM-5's indexer_types from a pattern or the
    freq/offset schedule (full and shared layers), MiniMax M3's layer_types from sparse_attention_freq."""
    transformers = pytest.importorskip("transformers", reason="transformers not installed: pip install '.[hf]'")
    from transformers.models.minimax_m3_vl import configuration_minimax_m3_vl as conf

    for extra in ({}, {"index_topk_freq": 3, "index_skip_topk_offset": 2}, {"index_topk_pattern": "FSSFS"}):
        hf = {"num_hidden_layers": 5, **extra}
        cfg = transformers.GlmMoeDsaConfig(num_hidden_layers=5, **extra)
        assert indexer_layers("glm_moe_dsa", hf) == list(cfg.indexer_types), (extra, cfg.indexer_types)
    assert "shared" in indexer_layers("glm_moe_dsa", {"num_hidden_layers": 5, "index_topk_pattern": "FSSFS"})
    freq = [0, 1, 1, 0]
    cfg = conf.MiniMaxM3VLTextConfig(num_hidden_layers=4, sparse_attention_config={"sparse_attention_freq": freq})
    want = ["full" if t == "minimax_m3_sparse" else None for t in cfg.layer_types]
    assert indexer_layers("minimax_m3_vl", {"num_hidden_layers": 4, "sparse_attention_config":
                                            {"sparse_attention_freq": freq}}) == want == [None, "full", "full", None]
    with pytest.raises(ValueError, match="indexer_types must give full or shared"):
        indexer_layers("glm_moe_dsa", {"num_hidden_layers": 2, "indexer_types": ["shared", "full"]})
