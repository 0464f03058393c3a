"""Keras/TF (impl_tf), float32 forward, against its parts at bert-base, vit-b16, gpt2 and long.

docs/performance.md's TF profile comes from this script (run:
python -m conformance.bench.scripts.tf_parts [bert-base vit-b16 gpt2 long]). Each part
is timed by `mha bench`'s own measure_paired against TF's 2048 x 2048
float32 matmul and reported as a multiple of that matmul's time (median over
ROUNDS pairs):

  ours.graph   impl_tf's multi_head_attention under tf.function
  ours.xla     the same under tf.function(jit_compile=True)
  projections  the four x @ W + b products alone, on (B*T, D) rows, graph
  core         logits, softmax and attend alone on (B, N, T, H) q, k, v
               (tf.matmul, graph): what the attention itself costs
  logits       Q.K^T alone (graph)

and at the causal shapes (gpt2, long), with the chunk size `mha bench` uses:

  ours.chunked the chunked path (chunk_size=) under tf.function
  projections  as above
  blocks       the (query block, key block) steps the causal mask leaves,
               alone (logits, exp against the block's max, sum, times V;
               no masking or rescaling), in one graph, on q, k, v
               projected beforehand

projections + core (or + blocks), timed apart, is about what the whole call
costs (XLA, compiling the whole call, may do better than its parts).
Timings, not a test.
"""

from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import weights  # noqa: E402 - after the TF log level
from conformance.bench.measure import paired_ratios  # noqa: E402
from conformance.bench.runners import tf_runner  # noqa: E402
from conformance.bench.shapes import SHAPES, TF_CHUNK_SIZE, TF_CHUNK_SIZE_SMALL_BATCH, framework_chunk  # noqa: E402
from impl_tf._keras import tf  # noqa: E402
from impl_tf.attention import multi_head_attention  # noqa: E402

ROUNDS = 9


def parts_of(name: str) -> tuple[dict, str]:
    shape = SHAPES[name]
    B, T, D, N = shape.B, shape.T, shape.D, shape.N
    H = D // N
    config = weights.AttentionConfig(num_heads=N, query_dim=D, head_dim=H)
    tensors = {k: tf.constant(v) for k, v in weights.init(config, seed=0, dtype="float32").items()}
    x = tf.constant(np.random.default_rng(0).standard_normal((B, T, D)).astype(np.float32))
    names = ("query", "key", "value", "output")
    kernels = {n: tf.reshape(tensors[n + ".kernel"], (D, D)) for n in names}
    biases = {n: tf.reshape(tensors[n + ".bias"], (D,)) for n in names}
    rows = tf.reshape(x, (B * T, D))
    q, k, v = (tf.constant(np.random.default_rng(i).standard_normal((B, N, T, H)).astype(np.float32))
               for i in range(3))

    projections = tf.function(lambda: [tf.matmul(rows, kernels[n]) + biases[n] for n in names])
    if shape.causal:
        C = framework_chunk(shape, TF_CHUNK_SIZE, TF_CHUNK_SIZE_SMALL_BATCH)  # as `mha bench` chooses it
        pairs = [(t0, s0) for t0 in range(0, T, C) for s0 in range(0, t0 + 1, C)]  # the blocks the mask leaves

        def blocks():
            out = []
            for t0, s0 in pairs:
                s = tf.matmul(q[:, :, t0:t0 + C], k[:, :, s0:s0 + C], transpose_b=True)
                e = tf.exp(s - tf.reduce_max(s, axis=-1, keepdims=True))
                out.append(tf.matmul(e, v[:, :, s0:s0 + C]) / tf.reduce_sum(e, axis=-1, keepdims=True))
            return tf.add_n(out)

        chunked = tf.function(lambda: multi_head_attention(config, tensors, x, is_causal=True, chunk_size=C))
        return {"ours.chunked": chunked, "projections": projections, "blocks": tf.function(blocks)}, \
            f"blocks of {C}: {len(pairs)} of {(T // C) ** 2} block pairs computed"

    def core():
        w = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) * (1 / H**0.5), axis=-1)
        return tf.matmul(w, v)

    return {
        "ours.graph": tf.function(lambda: multi_head_attention(config, tensors, x)),
        "ours.xla": tf.function(lambda: multi_head_attention(config, tensors, x), jit_compile=True),
        "projections": projections,
        "core": tf.function(core),
        "logits": tf.function(lambda: tf.matmul(q, k, transpose_b=True)),
    }, "no mask"


def main(names) -> None:
    matmul = tf_runner("cpu", quick=True).matmul(2048)
    for name in names:
        parts, what = parts_of(name)
        core = "blocks" if "blocks" in parts else "core"
        ratios, matmul_s = paired_ratios(parts, matmul, repeats=ROUNDS)
        full = SHAPES[name].flops
        print(f"{name}, {what} (2048 matmul {2 * 2048**3 / matmul_s / 1e9:.0f} GFLOP/s, "
              f"median of its runs; {full / (2 * 2048**3):.3f} matmul-times is 100% with the full FLOPs):")
        for part in parts:
            print(f"  {part:12} {ratios[part]:.3f} matmul-times")
        bound = ratios["projections"] + ratios[core]
        print(f"  projections + {core}, timed apart: {bound:.3f} matmul-times ({100 * full / (2 * 2048**3) / bound:.1f}%)")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bert-base", "vit-b16", "gpt2", "long"])
