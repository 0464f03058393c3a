"""hf-falcon on Falcon-RW at its real head counts: transformers builds Falcon-RW's ALiBi bias in bfloat16
whatever the model's dtype, bf16(bf16(slope) * bf16(j)) for key position j (modeling_falcon.py,
build_alibi_tensor), so the product rounds to 8 significant bits and positions past 256 come in steps of
2, 4, 8. The layout states that rounding (alibi_bias_dtype "bfloat16"); these tests hold a tiny randomly
initialised FalconModel (head_dim 4, 2 blocks, float32, its default sdpa path) with 32, 64 and 71 heads
to it: the float64 reference first, then every installed core backend.

- T = 300 (positions past 256), 32 heads: the full causal call and a decode step (check_block_reproduced).
- T = 2048, 32, 64 and 71 heads (slow): the last 16 query rows on a cache of the first 2032 keys, their
  projections computed from the converted weights in float64 (a (64, 2048, 2048) float64 score array per
  backend would be 2 GiB).
- The mutant: the same conversion without the rounding (exact ALiBi, what hf-falcon did before) misses.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_layouts_modern import _installed, check_block_reproduced

from conformance.native.conventions import alibi_models as am
from conformance.suite import backends

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_transformers = [pytest.mark.torch, pytest.mark.tf, pytest.mark.jax,
                      pytest.mark.skipif(transformers is None, reason="needs torch and transformers (extra hf)")]
H = 4  # 1/sqrt(H) = 1/2: a power of two, as Falcon-RW 1B's and 7B's 1/sqrt(64)
ROWS = 16


def _falcon_rw(N: int, T: int):
    """(config, tensors, the block's attention input x and output) of block am.LAYER of a tiny Falcon-RW."""
    kwargs = dict(hidden_size=N * H, num_attention_heads=N, alibi=True, multi_query=False, bias=True,
                  parallel_attn=False, num_hidden_layers=2, vocab_size=64, max_position_embeddings=max(T, 2048))
    spec = ("hf-falcon", "falcon", kwargs, "transformer.h", "self_attention", "dense")
    model = am.build(spec)
    ids = (torch.arange(T).reshape(1, T) * 7 + 3) % 64
    (run,) = am.capture(model, spec, {"input_ids": ids, "use_cache": False})
    config, tensors = am.convert(model, spec)
    return config, tensors, run["x"], run["out"]


def _last_rows(config, tensors, x, expected, backend, name: str, rows: int = ROWS) -> tuple[float, float]:
    """The last `rows` queries on a cache of the others' keys and values (their projections, float64),
    judged as the conventions table judges Falcon (am.judge: |logits| + |bias| for z). -> (margin, max abs)."""
    N, T = config.num_heads, x.shape[1]
    P = T - rows
    wide = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    prefix = x[:, :P].astype(np.float64)

    def heads(role: str) -> np.ndarray:  # (1, N, P, H)
        flat = prefix @ wide[f"{role}.kernel"].reshape(prefix.shape[-1], -1) + wide[f"{role}.bias"].reshape(-1)
        return flat.reshape(1, P, N, H).transpose(0, 2, 1, 3)

    k, v = heads("key"), heads("value")
    _, z = am.reference(config, tensors, x[:, P:], np.arange(P, T), past_key=k, past_value=v)
    dtype = np.float64 if backend is None else x.dtype
    inputs = {"query": x[:, P:].astype(dtype), "positions": np.arange(P, T), "past_key": k.astype(dtype),
              "past_value": v.astype(dtype)}
    use = {n: np.asarray(t, dtype) for n, t in tensors.items()}
    runner = backends.load("numpy") if backend is None else backend
    out = runner.forward(config, use, inputs, {"is_causal": True, "causal_alignment": "bottom_right"})["output"]
    result = am.judge(name, out, expected[:, P:], config, S=T, z=z, dtype="float32")
    return result, float(np.abs(out - expected[:, P:]).max())


@pytest.mark.parametrize("N", [pytest.param(32, marks=needs_transformers)])
def test_falcon_rw_past_position_256(N):
    """32 heads (Falcon-RW 1B's), T = 300: every backend, full causal call and decode, reproduces the model."""
    config, tensors, x, expected = _falcon_rw(N, 300)
    assert config.alibi_bias_dtype == "bfloat16", config
    check_block_reproduced(f"falcon-rw N={N} T=300", config, tensors, x, expected)


@pytest.mark.parametrize("N", [pytest.param(32, marks=needs_transformers)])
def test_mutant_exact_alibi_misses_falcon_rw(N):
    """The porting bug this field fixes: Falcon-RW converted with exact ALiBi (hf-falcon before it, rounding
    the slopes only) misses the model at T = 64 already; with the rounding the same rows pass."""
    config, tensors, x, expected = _falcon_rw(N, 64)
    rounded, _ = _last_rows(config, tensors, x, expected, None, "rounded")
    assert rounded.ok, rounded.describe()
    exact, error = _last_rows(config.replace(alibi_bias_dtype=None), tensors, x, expected, None, "exact")
    assert not exact.ok and exact.margin > 1.5, (exact.margin, error)


@pytest.mark.slow
@pytest.mark.parametrize("N", [pytest.param(n, marks=needs_transformers) for n in (32, 64, 71)])
def test_falcon_rw_at_2048_tokens(N):
    """Falcon-RW 1B's 32 and 7B's 64 heads (and 71, Falcon-7B's count) at T = 2048: the last 16 rows on a
    cache of 2032 keys, on the float64 reference and every installed backend."""
    config, tensors, x, expected = _falcon_rw(N, 2048)
    margins = {}
    for name, backend in [("float64", None), *_installed()]:
        result, error = _last_rows(config, tensors, x, expected, backend, f"falcon-rw N={N} T=2048 {name}")
        assert result.ok, result.describe()
        margins[name] = (round(result.margin, 4), f"{error:.2g}")
    print(f"falcon-rw N={N} T=2048: margin, max abs error: {margins}")
