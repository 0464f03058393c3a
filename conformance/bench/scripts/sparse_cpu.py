"""The sparse family's DSA decode steps (conformance/bench/sparse.py) in process CPU time, each against its bound
in CPU time: what docs/performance.md quotes while the shared VM is loaded.

Wall-clock figures on a machine that other jobs load measure the scheduler as much as the step. Process CPU
time (time.process_time: every thread of the process, both cores counted) moves far less with the load. So
here each step, the read of the latent cache and the weights, and the backend's 2048^3 float32 matmul are
timed in CPU seconds, in one process, back to back (min of ROUNDS), and

    x bound (CPU) = step CPU / max(bytes x read CPU per byte, flops x matmul CPU per FLOP)

with the bytes and flops of sparse.bounds. Both sides count every core the backend kept busy (a BLAS thread
spinning while it waits counts too, on the step's side and the matmul's alike), so the ratio says how far
a step is from its own bound in the work the machine did; it is no wall-clock figure, and the idle rerun
of `mha bench --shapes sparse` is still what the target is judged on.

    python -m conformance.bench.scripts.sparse_cpu numpy 65536 [ROUNDS]
"""

from __future__ import annotations

import sys
import time

from conformance.bench import sparse

ROUNDS = 3
MATMUL_N = 2048


def cpu_seconds(call, rounds: int) -> float:
    """The least process CPU time of `rounds` calls, after one call to warm up (compiles, caches)."""
    call()
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        call()
        best = min(best, time.process_time() - start)
    return best


def measure(backend: str, P: int, *, quick: bool = False, rounds: int = ROUNDS, matmul_n: int = MATMUL_N) -> dict:
    """{step: {"cpu_ms", "bound_ms", "x_bound", "bound"}} for dense, sparse and indexer, and the read's and the
    matmul's CPU ms, at one P on one backend, in this process."""
    from conformance.bench.runners import RUNNERS

    d, ix = sparse.dims(quick)
    config, tensors = sparse.layer(d, ix)
    data = sparse.inputs(d, ix, P)
    runner = RUNNERS[backend]("cpu", quick, "float32")
    calls = sparse.BUILDERS[backend](config, tensors, data, P)
    att, _ = sparse._split(tensors)
    read_bytes = data["latent"].nbytes + data["rotary"].nbytes + sum(t.nbytes for t in att.values())
    matmul = runner.matmul(matmul_n)
    read_s, mm_s = cpu_seconds(calls["read"], rounds), cpu_seconds(matmul, rounds)
    per_byte, per_flop = read_s / read_bytes, mm_s / (2 * matmul_n**3)
    record = {"read_cpu_ms": read_s * 1e3, "matmul_cpu_ms": mm_s * 1e3}
    for step, b in sparse.bounds(d, ix, P).items():
        step_s = cpu_seconds(calls[step], rounds)
        by_read, by_flops = b["bytes"] * per_byte, b["flops"] * per_flop
        bound = max(by_read, by_flops)
        record[step] = {"cpu_ms": step_s * 1e3, "bound_ms": bound * 1e3, "x_bound": step_s / bound,
                        "bound": "read" if by_read >= by_flops else "flops"}
    return record


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    backend, P = argv[0], int(argv[1])
    rounds = int(argv[2]) if len(argv) > 2 else ROUNDS
    r = measure(backend, P, rounds=rounds)
    print(f"{backend} P={P}: read {r['read_cpu_ms']:.1f} ms CPU, matmul {MATMUL_N}^3 {r['matmul_cpu_ms']:.1f} ms CPU")
    for step in ("dense", "sparse", "indexer"):
        s = r[step]
        print(f"  {step:8} {s['cpu_ms']:8.1f} ms CPU, bound {s['bound_ms']:6.1f} ms ({s['bound']}): "
              f"{s['x_bound']:5.1f}x")


if __name__ == "__main__":
    main()
