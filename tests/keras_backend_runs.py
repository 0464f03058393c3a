"""Run in a process of its own with KERAS_BACKEND set (tests/test_keras_backends.py starts it): impl_tf's
Keras layer on that backend, judged by run_case on a few cases, with and without a planted bug.

    python tests/keras_backend_runs.py BACKEND_ID MUTANT CASE[:DTYPE[:PATH]] ...

prints one JSON line: [[case, dtype, path, status, message], ...]. MUTANT "none" runs the layer as it is;
the others (MUTANTS) are porting bugs a Keras-on-jax or Keras-on-torch port makes, planted in that backend's
path alone, that the columns keras-jax and keras-torch must catch.
"""

from __future__ import annotations

import json
import sys


def _plant(mutant: str) -> None:
    from impl_tf import attention, backend, fused, masks
    from impl_tf import functional as F

    ops = backend.ops
    if mutant == "fused_scale":  # the fast path's scale 10% off, the stages untouched (the other backends' plant)
        original = attention._attention
        attention._attention = lambda q, k, v, scale, **kw: original(q, k, v, scale=scale * 1.1, **kw)
    elif mutant == "keras_matmul":  # the fused core's matmuls as keras.ops.matmul: float64 computed in float32
        fused.matmul = ops.matmul
        fused.matmul_nt = lambda a, b: ops.matmul(a, ops.swapaxes(b, -1, -2))
    elif mutant == "causal_top_left_only":  # the causal mask aligned top-left whatever the call asks
        original_mask = masks.causal_mask
        F.causal_mask = lambda T, S, alignment="top_left": original_mask(T, S, "top_left")
    elif mutant != "none":
        raise SystemExit(f"unknown mutant {mutant!r}")


MUTANTS = ("fused_scale", "keras_matmul", "causal_top_left_only")


def main(argv: list[str]) -> None:
    backend_id, mutant, *specs = argv
    from conformance.suite import backends
    from conformance.suite.cases import ALL_CASES
    from conformance.suite.compare import run_case

    adapter = backends.load(backend_id)
    _plant(mutant)
    rows = []
    for spec in specs:
        name, dtype, path = (spec.split(":") + ["float32", "stages"][spec.count(":"):])[:3]
        result = run_case(ALL_CASES[name], backend_id, dtype=dtype, adapter=adapter, path=path)
        rows.append([name, dtype, path, None if result is None else result.status,
                     None if result is None else result.message])
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
