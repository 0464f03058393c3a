"""The ceiling the four projections put on each framework's "% of matmul rate".

docs/performance.md's projection bounds come from this script (run:
python -m conformance.bench.scripts.projection_bound [numpy torch tf jax]). For each
backend and shape it times the four projections alone (x @ W + b for query,
key, value and output, on (B*T, D) rows: no attention core at all) in the
framework's fast mode (NumPy; torch eager under no_grad, F.linear; TF under
tf.function; JAX under jit), with `mha bench`'s own measure_paired against
that framework's 2048 x 2048 float32 matmul, and prints

  the projections' own rate   % of the matmul rate with their own FLOPs
                              (8*B*T*D^2): how well D x D products of this
                              many rows use the machine
  the ceiling                 % of the matmul rate with the shape's full
                              FLOPs (as the bench counts them): what the
                              whole call would score if its attention core
                              took no time at all

Where a call runs these very products (NumPy; torch eager), a ceiling under
a target's line puts that target out of reach on the machine it ran on,
whatever its attention does; a compiled graph (Keras, JAX) can beat the sum
of its parts timed apart, so there the ceiling is a guide. Timings, not a test.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from conformance.bench.measure import paired_ratios
from conformance.bench.runners import RUNNERS
from conformance.bench.shapes import SHAPES

ROUNDS = 9
SHAPE_NAMES = ("bert-base", "vit-b16", "gpt2")


def projections(backend: str, B: int, T: int, D: int):
    """A callable running the four (B*T, D) x (D, D) + bias products in `backend`'s fast mode."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B * T, D)).astype(np.float32)
    ws = [(rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32) for _ in range(4)]
    bs = [rng.standard_normal(D).astype(np.float32) for _ in range(4)]
    if backend == "numpy":
        outs = [np.empty((B * T, D), np.float32) for _ in range(4)]

        def run():
            for w, b, o in zip(ws, bs, outs):
                np.matmul(x, w, out=o)
                o += b
        return run
    if backend == "torch":
        import torch
        import torch.nn.functional as F

        xt, wt, bt = torch.from_numpy(x), [torch.from_numpy(w.T.copy()) for w in ws], [torch.from_numpy(b) for b in bs]

        def run():
            with torch.no_grad():
                return [F.linear(xt, w, b) for w, b in zip(wt, bt)]
        return run
    if backend == "tf":
        from impl_tf._keras import tf

        xt, wt, bt = tf.constant(x), [tf.constant(w) for w in ws], [tf.constant(b) for b in bs]
        graph = tf.function(lambda: [tf.matmul(xt, w) + b for w, b in zip(wt, bt)])
        return graph  # on the CPU an eager call returns once computed (as the bench's own tf paths are timed)
    if backend == "jax":
        import jax

        xj, wj, bj = jax.device_put(x), jax.device_put(ws), jax.device_put(bs)
        jitted = jax.jit(lambda x, ws, bs: [x @ w + b for w, b in zip(ws, bs)])
        return lambda: jax.block_until_ready(jitted(xj, wj, bj))
    raise ValueError(f"backend: expected numpy, torch, tf or jax, got {backend!r}")


def main(backends) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for backend in backends:
        matmul = RUNNERS[backend]("cpu", quick=True).matmul(2048)
        calls = {name: projections(backend, SHAPES[name].B, SHAPES[name].T, SHAPES[name].D) for name in SHAPE_NAMES}
        ratios, matmul_s = paired_ratios(calls, matmul, repeats=ROUNDS)
        print(f"{backend} (2048 matmul {2 * 2048**3 / matmul_s / 1e9:.0f} GFLOP/s, median of its runs):")
        for name, r in ratios.items():
            shape = SHAPES[name]
            own = 8 * shape.B * shape.T * shape.D**2
            print(f"  {name:9} projections {r:.3f} matmul-times: own rate {100 * own / (2 * 2048**3) / r:.1f}%, "
                  f"ceiling {100 * shape.flops / (2 * 2048**3) / r:.1f}% with the full FLOPs")


if __name__ == "__main__":
    main(sys.argv[1:] or ["numpy", "torch", "tf", "jax"])
