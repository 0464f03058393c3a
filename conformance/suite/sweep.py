"""Random cases (cases.random_case) through one backend's paths: the sweep the tolerance policy is proven on.

    python -m conformance.suite.sweep --backend jax --seeds 920000 930000 --dtypes float32 float64 --json jax.json

Every seed's case runs on each of the backend's paths of --paths (conformance.suite.check's kinds) in each
dtype; a result that is not a pass is a finding, listed in full. The policy's constants were set on seeds
the tests use; a sweep of seeds no test uses is the check that they hold (docs/conformance.md lists the
runs). tests/test_conformance_sweep.py runs small sweeps of its own seeds. --compressed sweeps DeepSeek V4's
layers instead (cases.random_compressed_case, its own stream: random_case's seeds keep their cases); --long-cache
takes random_case's draws over a cache of 64-4200 keys (cases.random_long_cache_case), so the decode fast paths
run.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

from conformance.suite import backends
from conformance.suite.cases import (
    DTYPE_NAMES,
    random_case,
    random_compressed_case,
    random_differential_case,
    random_long_cache_case,
)
from conformance.suite.check import DEFAULT_PATH_KINDS, PATH_KINDS, paths_of
from conformance.suite.compare import STATUS_PASS, STATUS_UNSUPPORTED, clear_cache, run_case_paths


def sweep(backend_id: str, seeds, dtypes=DTYPE_NAMES, path_kinds=DEFAULT_PATH_KINDS, *, progress=None,
          make_case=random_case) -> dict:
    """{"runs", "failures": [descriptions], "worst": {"path dtype": (margin, case, quantity)}, "unsupported"}.
    progress(done, runs, failures, summary) after each seed; summary() is the summary of the seeds done."""
    adapter = backends.load(backend_id)
    paths = paths_of(adapter, path_kinds)
    worst: dict[str, tuple[float, str, str]] = {}
    failures, runs, unsupported = [], 0, collections.Counter()

    def summary(done: int) -> dict:
        return {"backend": backend_id, "seeds": [seeds[0], seeds[done - 1] + 1] if done else [],
                "dtypes": list(dtypes), "paths": paths, "runs": runs, "failures": list(failures),
                "worst": {k: {"margin": m, "case": c, "quantity": q} for k, (m, c, q) in sorted(worst.items())},
                "unsupported": dict(unsupported)}

    for i, seed in enumerate(seeds):
        case = make_case(seed)
        for dtype in dtypes:
            # a case's paths as `mha check` runs them: where the adapter compiles them as one program (JAX,
            # Keras on JAX), one joint run judged path by path; each path alone where it cannot join
            for r in run_case_paths(case, backend_id, paths, dtype=dtype, adapter=adapter):
                runs += 1
                key = f"{r.path} {dtype}"
                if r.status == STATUS_PASS:
                    if r.worst is not None and r.margin > worst.get(key, (-1.0,))[0]:
                        worst[key] = (r.margin, case.name, r.worst.name)
                elif r.status == STATUS_UNSUPPORTED:
                    unsupported[f"{key}: {r.message}"] += 1
                else:
                    failures.append(f"{case.name} {key}: {r.status} {r.message} "
                                    f"{r.worst.describe() if r.worst else ''} "
                                    f"{r.divergence.describe() if r.divergence else ''}".strip())
        if i % 10 == 9:
            clear_cache()  # every case has new shapes: bound the references and JAX programs kept
        if progress is not None:
            progress(i + 1, runs, len(failures), lambda done=i + 1: summary(done))
    clear_cache()
    return summary(len(seeds))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.suite.sweep", description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, choices=list(backends.CORE))
    p.add_argument("--seeds", nargs=2, type=int, required=True, metavar=("FIRST", "STOP"),
                   help="random_case seeds FIRST .. STOP-1")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPE_NAMES), choices=list(DTYPE_NAMES))
    p.add_argument("--paths", nargs="+", default=list(DEFAULT_PATH_KINDS), choices=[*PATH_KINDS, "all"])
    p.add_argument("--json", metavar="FILE", help="write the summary here")
    kind = p.add_mutually_exclusive_group()  # the case family: random_case's unless one is named
    kind.add_argument("--differential", action="store_true",
                      help="cases.random_differential_case instead of random_case (differential attention's sweep)")
    kind.add_argument("--compressed", action="store_true",
                      help="cases.random_compressed_case instead of random_case (DeepSeek V4's layers, issue 41)")
    kind.add_argument("--long-cache", action="store_true",
                      help="cases.random_long_cache_case instead of random_case (a cache of 64-4200 keys: the "
                           "decode fast paths)")
    args = p.parse_args(argv)
    kinds = PATH_KINDS if "all" in args.paths else tuple(args.paths)
    started = time.perf_counter()

    def write(summary: dict) -> str:
        summary["seconds"] = round(time.perf_counter() - started, 1)
        text = json.dumps(summary, indent=1)
        if args.json:
            from weights.atomic import write_bytes_atomic

            write_bytes_atomic(args.json, text.encode(), overwrite=True)
        return text

    def progress(done, runs, failed, summary):
        if done % 10 == 0:  # the summary so far: an interrupted sweep keeps what it measured
            write(summary())
        if done % 100 == 0:
            print(f"{args.backend}: {done} seeds, {runs} runs, {failed} failures, "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    summary = sweep(args.backend, range(*args.seeds), args.dtypes, kinds, progress=progress,
                    make_case=random_compressed_case if args.compressed
                    else random_differential_case if args.differential
                    else random_long_cache_case if args.long_cache else random_case)
    print(write(summary))
    return 0 if not summary["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
