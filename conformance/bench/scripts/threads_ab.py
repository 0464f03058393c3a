"""NumPy's fast path on our threads against BLAS's threads, in two settings.

docs/performance.md's figures for impl_numpy.chunked.THREADED_MIN_FLOPS come
from this script (run: python -m conformance.bench.scripts.threads_ab). For each shape
(float32 self-attention, no mask) it times the plain call with the threshold
forced off (BLAS's threads for the projections; the serial core) and forced
on (every stage on our threads, BLAS held to one), interleaved, each timed
call either

  ffn     right after a feed-forward-sized matmul (B*T x D by D x 4D), what a
          transformer block runs between two attentions: OpenBLAS's idle
          worker is still spinning when the call starts;
  settle  after 0.2 s of nothing but the same call: no foreign spin left.

and prints the medians and threaded/serial. Timings, not a test.
"""

from __future__ import annotations

import time

import numpy as np

import weights
from impl_numpy import chunked
from impl_numpy.attention import multi_head_attention

SHAPES = [(8, 128, 768, 12), (1, 512, 768, 12), (2, 256, 768, 12), (4, 128, 768, 12), (1, 1024, 512, 8),
          (16, 128, 768, 12), (32, 64, 768, 12), (2, 128, 512, 8)]  # (B, T=S, D, N)
ROUNDS = 9
SERIAL, THREADED = float("inf"), 0  # THREADED_MIN_FLOPS values that force each way


def median_ms(times):
    return float(np.median(times)) * 1e3


def main() -> None:
    saved = chunked.THREADED_MIN_FLOPS
    try:
        for B, T, D, N in SHAPES:
            config = weights.AttentionConfig(num_heads=N, query_dim=D, head_dim=D // N)
            tensors = weights.init(config, seed=0, dtype="float32")
            x = np.random.default_rng(0).standard_normal((B, T, D)).astype(np.float32)
            ffn_kernel = np.random.default_rng(1).standard_normal((D, 4 * D)).astype(np.float32)
            ffn_out = np.empty((B * T, 4 * D), np.float32)
            times: dict[tuple, list] = {}
            for _ in range(ROUNDS):
                for threshold in (SERIAL, THREADED):
                    chunked.THREADED_MIN_FLOPS = threshold
                    for setting in ("ffn", "settle"):
                        multi_head_attention(config, tensors, x)
                        if setting == "settle":
                            start = time.perf_counter()
                            while time.perf_counter() - start < 0.2:
                                multi_head_attention(config, tensors, x)
                        else:
                            np.matmul(x.reshape(-1, D), ffn_kernel, out=ffn_out)
                        t0 = time.perf_counter()
                        multi_head_attention(config, tensors, x)
                        times.setdefault((threshold, setting), []).append(time.perf_counter() - t0)
            gflop = chunked.matmul_flops(config, B, T, T) / 1e9
            cells = []
            for setting in ("ffn", "settle"):
                serial, threaded = median_ms(times[SERIAL, setting]), median_ms(times[THREADED, setting])
                cells.append(f"{setting}: BLAS threads {serial:7.2f} ms, ours {threaded:7.2f} ms (x{threaded / serial:.2f})")
            print(f"B {B:2} T=S {T:4} D {D} N {N:2} {gflop:5.2f} GFLOP  " + "  ".join(cells), flush=True)
    finally:
        chunked.THREADED_MIN_FLOPS = saved


if __name__ == "__main__":
    main()
