"""NumPy's fast path (float32 forward) against its parts, at bert-base, gpt2 and long.

docs/performance.md's NumPy profile comes from this script (run:
python -m conformance.bench.scripts.numpy_parts [bert-base gpt2 long]). Each part is
timed by `mha bench`'s own measure_paired against NumPy's 2048 x 2048
float32 matmul and reported as a multiple of that matmul's time (median over
ROUNDS pairs) and as % of the matmul rate with its FLOPs: the shape's full
count for the whole call, as the bench counts it (8*B*T*D^2 + 4*B*N*T*S*H,
full T*S when causal), the FLOPs they do for the parts (exp: time per
logit):

  ours         impl_numpy's multi_head_attention, as `mha bench` calls it
  projections  the four x @ W + b products alone (BLAS's threads)
  core         impl_numpy.chunked.chunked_attention_core alone, on q, k, v
               projected beforehand (its own threads where it uses them)
  core.gemm    the core's two products alone (Q.K^T and P.V on the key
               blocks the core computes, hidden causal blocks skipped, in
               its blocks: QUERY_ROWS queries by FUSED_BLOCK keys, one head
               after another), on BLAS's threads
  core.exp     np.exp over as many logits as the core computes (values in
               [-8, 0], as after the max), in blocks of the same size, into
               one block buffer, one thread

projections + core is what the whole call costs at least; the core's GEMMs
and exp show where its time goes. Timings, not a test.
"""

from __future__ import annotations

import sys

import numpy as np

import weights
from conformance.bench.measure import paired_ratios
from conformance.bench.runners import numpy_runner
from conformance.bench.shapes import CHUNK_SIZE, SHAPES
from impl_numpy import chunked
from impl_numpy.attention import FUSED_BLOCK, multi_head_attention

ROUNDS = 9


def parts_of(name: str) -> tuple[dict, dict, int, int]:
    shape = SHAPES[name]
    B, T, D, N, causal = shape.B, shape.T, shape.D, shape.N, shape.causal
    H = D // N
    config = weights.AttentionConfig(num_heads=N, query_dim=D, head_dim=H)
    tensors = weights.init(config, seed=0, dtype="float32")
    x = np.random.default_rng(0).standard_normal((B, T, D)).astype(np.float32)
    chunk = min(CHUNK_SIZE, T) if shape.long else None  # as `mha bench` calls it: ours (plain), ours.chunked (long)
    block = chunk or FUSED_BLOCK
    names = ("query", "key", "value", "output")
    kernels = {n: tensors[n + ".kernel"].reshape(D, D) for n in names}
    biases = {n: tensors[n + ".bias"].reshape(D) for n in names}
    rows = x.reshape(B * T, D)
    projected = {n: np.empty((B * T, D), np.float32) for n in names}

    def projections():
        for n in names:
            np.matmul(rows, kernels[n], out=projected[n])
            projected[n] += biases[n]

    projections()
    q, k, v = (projected[n].reshape(B, T, N, H).transpose(0, 2, 1, 3) for n in ("query", "key", "value"))
    q = q * np.float32(config.effective_scale)

    def core():
        chunked.chunked_attention_core(config, q, k, v, mask=None, bias=None, keep=None, is_causal=causal,
                                       causal_alignment="top_left", chunk_size=block)

    # the (query block, key block) pairs the core computes: key blocks up to the query block's last row when causal
    qrows = min(chunked.QUERY_ROWS, block, T)
    stops = {t0: min(T, t0 + qrows) if causal else T for t0 in range(0, T, qrows)}
    pairs = [(t0, s0, min(stop, s0 + block)) for t0, stop in stops.items() for s0 in range(0, stop, block)]
    # contiguous (B, N, qrows, s) blocks of one buffer, as the core's own
    logits = np.empty(B * N * qrows * block, np.float32)
    exp_source = np.random.default_rng(1).uniform(-8, 0, logits.shape).astype(np.float32)  # as the core's logits
    context = np.empty((B, N, qrows, H), np.float32)

    def blocked(flat, s):
        return flat[: B * N * qrows * s].reshape(B, N, qrows, s)

    def core_gemm():
        for t0, s0, s1 in pairs:
            x_ = blocked(logits, s1 - s0)
            np.matmul(q[:, :, t0:t0 + qrows], k[:, :, s0:s1].swapaxes(-1, -2), out=x_)
            np.matmul(x_, v[:, :, s0:s1], out=context)

    def core_exp():
        for _, s0, s1 in pairs:
            np.exp(blocked(exp_source, s1 - s0), out=blocked(logits, s1 - s0))

    parts = {
        "ours": lambda: multi_head_attention(config, tensors, x, is_causal=causal, chunk_size=chunk),
        "projections": projections,
        "core": core,
        "core.gemm": core_gemm,
        "core.exp": core_exp,
    }
    logits_computed = B * N * qrows * sum(s1 - s0 for _, s0, s1 in pairs)
    computed = 4 * H * logits_computed  # the core's matmul FLOPs: Q.K^T and P.V, 2*H each per logit
    flops = {"ours": shape.flops, "projections": 8 * B * T * D * D, "core": computed, "core.gemm": computed}
    return parts, flops, shape.flops, logits_computed


def main(names) -> None:
    matmul = numpy_runner("cpu", quick=True).matmul(2048)
    for name in names:
        parts, flops, full, logits = parts_of(name)
        ratios, matmul_s = paired_ratios(parts, matmul, repeats=ROUNDS)
        print(f"{name} (2048 matmul {2 * 2048**3 / matmul_s / 1e9:.0f} GFLOP/s, median of its runs; "
              f"the core computes {100 * flops['core'] / (full - flops['projections']):.1f}% of the T*S logits):")
        for part, r in ratios.items():
            if part in flops:
                what = "the full" if part == "ours" else "its own"
                rate = f"{100 * flops[part] / (2 * 2048**3) / r:.1f}% of the matmul rate with {what} FLOPs"
            else:
                rate = f"{r * matmul_s / logits * 1e9:.2f} ns per logit"
            print(f"  {part:12} {r:.3f} matmul-times = {rate}")
        bound = ratios["projections"] + ratios["core"]
        print(f"  projections + core: {bound:.3f} matmul-times, at most {100 * full / (2 * 2048**3) / bound:.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bert-base", "gpt2", "long"])
