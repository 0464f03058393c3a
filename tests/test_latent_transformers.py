"""The contract's latent attention (MLA) against transformers' own DeepseekV3Attention: a tiny randomly
initialised layer of the library, its tensors mapped to the contract's names, reproduced by the NumPy
reference in both forms (the expanded stages and the absorbed fused path) in float64, and its returned
latent cache (transformers caches the normed latent and the rotated shared key) equal to the contract's
present_key / present_value.

Judged by the suite's float32 policy, not float64's: inside a float64 model transformers computes the RoPE
angles (`position_ids.float() * inv_freq`), the RMS norms (`hidden_states.to(torch.float32)`) and the eager
softmax (`dtype=torch.float32`) in float32, so its float64 layer is float32-accurate (measured: 1.1e-5
relative against the float64 reference here).

transformers comes with the `hf` extra (the `all` env); elsewhere the test skips with that reason."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.suite.tolerance import assert_close
from impl_numpy import multi_head_attention
from weights import AttentionConfig

N, D, NOPE, R, V, C, QR = 4, 16, 4, 4, 3, 6, 5  # R 4: two rotating pairs, so the pairing shows


def _layer(query_rank):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", reason="transformers not installed: pip install '.[hf]'")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    config = transformers.DeepseekV3Config(
        hidden_size=D, num_attention_heads=N, num_key_value_heads=N, q_lora_rank=query_rank, kv_lora_rank=C,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=R, v_head_dim=V, head_dim=R, rope_interleave=False,
        attention_bias=True, num_hidden_layers=1, vocab_size=8, rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    layer = ds.DeepseekV3Attention(config, layer_idx=0).double().eval()
    for module in layer.modules():  # the norms' weights off their initial 1, so a scale read wrongly shows
        if isinstance(module, ds.DeepseekV3RMSNorm):
            torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    rotary = ds.DeepseekV3RotaryEmbedding(config).double()
    return torch, ds, config, layer, rotary


def _contract(layer, query_rank):
    """transformers' Linear weights (out, in) as the contract's kernels (in, ...)."""
    w = {name: p.detach().double().numpy() for name, p in layer.named_parameters()}
    tensors = {}
    if query_rank is not None:
        tensors.update({"query.down.kernel": w["q_a_proj.weight"].T, "query.down.bias": w["q_a_proj.bias"],
                        "query.down.norm.scale": w["q_a_layernorm.weight"],
                        "query.kernel": w["q_b_proj.weight"].T.reshape(query_rank, N, NOPE + R)})
    else:
        tensors["query.kernel"] = w["q_proj.weight"].T.reshape(D, N, NOPE + R)
    kv_b = w["kv_b_proj.weight"].reshape(N, NOPE + V, C)  # per head: key features, then values
    tensors.update({"latent.kernel": w["kv_a_proj_with_mqa.weight"].T, "latent.bias": w["kv_a_proj_with_mqa.bias"],
                    "latent.norm.scale": w["kv_a_layernorm.weight"],
                    "key.kernel": kv_b[:, :NOPE].transpose(2, 0, 1), "value.kernel": kv_b[:, NOPE:].transpose(2, 0, 1),
                    "output.kernel": w["o_proj.weight"].T.reshape(N, V, D), "output.bias": w["o_proj.bias"]})
    config = AttentionConfig(num_heads=N, query_dim=D, head_dim=NOPE + R, value_head_dim=V,
                             use_query_bias=query_rank is not None, use_value_bias=False, rope={},
                             latent={"query_rank": query_rank, "kv_rank": C, "rope_dim": R})
    return config, {name: np.ascontiguousarray(t) for name, t in tensors.items()}


@pytest.mark.parametrize("query_rank", [QR, None], ids=["query_rank", "no_query_rank"])
def test_contract_reproduces_deepseek_v3_attention(query_rank):
    torch, ds, hf_config, layer, rotary = _layer(query_rank)
    config, tensors = _contract(layer, query_rank)
    rng = np.random.default_rng(4)
    B, T = 2, 7
    x = rng.standard_normal((B, T, D))
    hidden = torch.from_numpy(x)
    positions = torch.arange(T)[None].expand(B, T)
    causal = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    cache = __import__("transformers").DynamicCache(config=hf_config)
    with torch.no_grad():
        want, _ = layer(hidden, position_embeddings=rotary(hidden, positions), attention_mask=causal,
                        past_key_values=cache)
    want = want.numpy()
    cached_latent, cached_rotary = cache.layers[0].keys.numpy(), cache.layers[0].values.numpy()
    policy = dict(config=config, dtype="float32", quantity="output", B=B, T=T, S=T)
    for path in ("stages", "absorbed"):
        trace = [] if path == "stages" else None
        got, present_key, present_value = multi_head_attention(config, tensors, x, is_causal=True,
                                                               return_cache=True, trace=trace)
        logits = None if trace is None else {e.stage: e.value for e in trace}["logits"]
        assert_close(f"{path} output", got, want, logits=logits, **policy)
        # transformers' cache: the key slot holds the normed latent, the value slot the rotated shared key
        assert_close(f"{path} latent cache", present_key, cached_latent, **policy)
        assert_close(f"{path} rotary key cache", present_value, cached_rotary, **policy)
