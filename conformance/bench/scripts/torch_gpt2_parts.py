"""Torch at gpt2 (causal, float32, eager, no_grad): our SDPA path against its parts.

docs/performance.md's torch gpt2 profile comes from this script (run:
python -m conformance.bench.scripts.torch_gpt2_parts). Each part is timed by
`mha bench`'s own measure_paired against torch's 2048 x 2048 float32 matmul
and reported as a multiple of that matmul's time (median over ROUNDS pairs):

  ours         impl_torch's multi_head_attention(use_sdpa=True, is_causal=True)
  projections  the four x @ W + b products alone
  sdpa         F.scaled_dot_product_attention(is_causal=True) alone, on
               (B, N, T, H) inputs

and each as % of the matmul rate with gpt2's full FLOP count, as the bench
counts it (8*B*T*D^2 + 4*B*N*T*S*H). Timings, not a test.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import weights
from conformance.bench.measure import paired_ratios
from conformance.bench.runners import torch_runner
from impl_torch.attention import multi_head_attention

B, T, D, N = 4, 1024, 768, 12
H = D // N
ROUNDS = 9


def main() -> None:
    torch.manual_seed(0)
    config = weights.AttentionConfig(num_heads=N, query_dim=D, head_dim=H)
    tensors = {k: torch.from_numpy(v) for k, v in weights.init(config, seed=0, dtype="float32").items()}
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((B, T, D)).astype(np.float32))
    names = ("query", "key", "value", "output")
    kernels = {n: tensors[n + ".kernel"].reshape(D, -1) for n in names}
    q, k, v = (torch.randn(B, N, T, H) for _ in range(3))
    parts = {
        "ours": lambda: multi_head_attention(config, tensors, x, is_causal=True, use_sdpa=True),
        "projections": lambda: [x @ kernels[n] + tensors[n + ".bias"].reshape(-1) for n in names],
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    with torch.no_grad():
        ratios, _ = paired_ratios(parts, torch_runner("cpu", quick=True).matmul(2048), repeats=ROUNDS)
    full_flops = 8 * B * T * D * D + 4 * B * N * T * T * H
    for name, r in ratios.items():
        print(f"{name:12} {r:.3f} matmul-times = {100 * full_flops / (2 * 2048**3) / r:.1f}% of the matmul rate "
              "with gpt2's full FLOPs")
    bound = ratios["projections"] + ratios["sdpa"]
    print(f"projections + sdpa: {bound:.3f} matmul-times, at most {100 * full_flops / (2 * 2048**3) / bound:.1f}%")


if __name__ == "__main__":
    main()
