"""JAX's chunked path at the causal shapes (float32 forward, under jit) against its parts.

docs/performance.md's JAX causal profile comes from this script (run:
python -m conformance.bench.scripts.jax_causal_parts [gpt2 long]). Each part runs under
jax.jit and is timed by `mha bench`'s own measure_paired against JAX's 2048
x 2048 float32 matmul, reported as a multiple of that matmul's time (median
over ROUNDS pairs) and as % of the matmul rate, with the shape's full FLOP
count (as the bench counts it) or, for the block steps, with the FLOPs they
do:

  ours.chunked  impl_jax's apply(chunk_size=...) as `mha bench` calls it
  projections   the four projections alone (einsum + bias, whole sequences)
  blocks        the key-block steps the chunked core runs, alone: a lax.scan
                over the (query block, key block) pairs that the causal mask
                does not hide, each step logits, exp against the block's
                max, sum and the product with V into a running sum, on q, k, v
                projected beforehand (no masking, no rescaling: less than
                the core does)
  dense         jax.nn.dot_product_attention(is_causal=True) alone on the
                same q, k, v: every T x S logit, XLA's own fusion (only
                where the (B, N, T, S) logits take at most 1 GiB)

projections + blocks, timed apart, is less work than the whole call does
(XLA, compiling the whole call, may still schedule it better than its parts);
the blocks' own rate says how fast XLA:CPU runs one block step. Timings, not
a test.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import weights
from conformance.bench.measure import paired_ratios
from conformance.bench.runners import jax_runner
from conformance.bench.shapes import JAX_CHUNK_SIZE, JAX_CHUNK_SIZE_SMALL_BATCH, SHAPES, framework_chunk
from impl_jax.attention import apply

ROUNDS = 9


def parts_of(name: str):
    shape = SHAPES[name]
    B, T, D, N = shape.B, shape.T, shape.D, shape.N
    H = D // N
    C = framework_chunk(shape, JAX_CHUNK_SIZE, JAX_CHUNK_SIZE_SMALL_BATCH)  # as `mha bench` chooses it
    config = weights.AttentionConfig(num_heads=N, query_dim=D, head_dim=H)
    p = jax.device_put(weights.init(config, seed=0, dtype="float32"))
    x = jax.device_put(np.random.default_rng(0).standard_normal((B, T, D)).astype(np.float32))
    names = ("query", "key", "value")

    @jax.jit
    def ours(pp, inp):
        return apply(config, pp, inp, is_causal=True, chunk_size=C)

    @jax.jit
    def projections(pp, inp):
        qkv = [jnp.einsum("BTD,DNH->BTNH", inp, pp[f"{n}.kernel"]) + pp[f"{n}.bias"] for n in names]
        return qkv, jnp.einsum("BTNH,NHO->BTO", qkv[0], pp["output.kernel"]) + pp["output.bias"]

    (q, k, v), _ = projections(p, x)  # (B, T, N, H)
    q, k, v = (jnp.transpose(a, (0, 2, 1, 3)) for a in (q, k, v))  # (B, N, T, H)
    pairs = np.array([(t0, s0) for t0 in range(0, T, C) for s0 in range(0, t0 + 1, C)], np.int32)

    @jax.jit
    def blocks(q, k, v):
        def step(acc, ts):
            qb = lax.dynamic_slice_in_dim(q, ts[0], C, axis=2)
            kb = lax.dynamic_slice_in_dim(k, ts[1], C, axis=2)
            vb = lax.dynamic_slice_in_dim(v, ts[1], C, axis=2)
            s = jnp.einsum("BNTH,BNSH->BNTS", qb, kb)
            e = jnp.exp(s - s.max(axis=-1, keepdims=True))
            return acc + jnp.einsum("BNTS,BNSH->BNTH", e, vb) / e.sum(axis=-1, keepdims=True), None
        acc, _ = lax.scan(step, jnp.zeros((B, N, C, H), jnp.float32), jnp.asarray(pairs))
        return acc

    @jax.jit
    def dense(q, k, v):
        t = lambda a: jnp.transpose(a, (0, 2, 1, 3))  # noqa: E731 - (B, T, N, H), dot_product_attention's layout
        return jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=True, implementation="xla")

    done = jax.block_until_ready
    parts = {
        "ours.chunked": lambda: done(ours(p, x)),
        "projections": lambda: done(projections(p, x)),
        "blocks": lambda: done(blocks(q, k, v)),
    }
    if B * N * T * T * 4 <= 2**30:  # the dense logits; long's would be 2 GiB per array
        parts["dense"] = lambda: done(dense(q, k, v))
    flops = {part: shape.flops for part in parts}
    flops["projections"] = 8 * B * T * D * D
    flops["blocks"] = len(pairs) * 4 * B * N * C * C * H
    flops["dense"] = 4 * B * N * T * T * H
    return parts, flops, shape.flops, C, len(pairs), (T // C) ** 2


def main(names) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    matmul = jax_runner("cpu", quick=True).matmul(2048)
    for name in names:
        parts, flops, full, C, computed, all_blocks = parts_of(name)
        ratios, rate = paired_ratios(parts, matmul, repeats=ROUNDS)
        print(f"{name}, blocks of {C}: {computed} of {all_blocks} block pairs computed "
              f"(2048 matmul {2 * 2048**3 / rate / 1e9:.0f} GFLOP/s, median of its runs):")
        for part, r in ratios.items():
            print(f"  {part:13} {r:.3f} matmul-times = {100 * flops[part] / (2 * 2048**3) / r:.1f}% of the matmul rate"
                  f" with {'its own' if flops[part] != full else 'the full'} FLOPs")
        bound = ratios["projections"] + ratios["blocks"]
        print(f"  projections + blocks, timed apart: {bound:.3f} matmul-times "
              f"({100 * full / (2 * 2048**3) / bound:.1f}%)")


if __name__ == "__main__":
    main(sys.argv[1:] or ["gpt2", "long"])
