"""`mha bench`: the command, which runs one worker process per backend
(conformance.bench.worker) and gathers, judges and reports what they measured."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

from conformance.bench.child import run_worker_process
from conformance.bench.measure import MIN_REPEATS, proc_kb
from conformance.bench.report import print_report, write_plots
from conformance.bench.shapes import (
    ALL_BACKENDS,
    BACKENDS,
    CHUNK_SIZE,
    DECODE_LENGTHS,
    FAMILIES,
    LATENT_LENGTHS,
    LONG_T,
    MATMUL_N,
    OPTIONAL_BACKENDS,
    QUICK_DECODE_LENGTHS,
    QUICK_LATENT_LENGTHS,
    QUICK_SHAPES,
    QUICK_SWEEP_LENGTHS,
    QUICK_WINDOW_LENGTHS,
    SHAPES,
    SWEEP_LENGTHS,
    WINDOW_LENGTHS,
    decode_shapes,
    sweep_shapes,
    window_shapes,
)
from conformance.bench.targets import add_native_ratios, targets

SCHEMA = "mha-bench/1"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time every backend against its framework's native paths and matmul rate")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(ALL_BACKENDS),
                   help=f"default: {' '.join(BACKENDS)}; {' '.join(OPTIONAL_BACKENDS)} when named (no target set for it)")
    p.add_argument("--shapes", nargs="+", default=[*SHAPES, "sweep"], choices=[*SHAPES, *FAMILIES],
                   help="shapes and families to time (default: the four shapes and the sweep; window, decode and "
                        "sequence-sharded, latent, sparse and v4 only when named)")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the inputs, weights and caches (and the matmul the rates are measured against): float32, "
                        "or bfloat16 for torch and jax (numpy and tf are benchmarked in float32 only)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 7; --quick 2)")
    p.add_argument("--max-seconds", type=float, default=10.0,
                   help="stop repeating a measurement after this much timing, once 3 calls are done (default 10)")
    p.add_argument("--budget", type=float, default=5.0,
                   help="sweep: stop a path after a point whose median exceeds this many seconds (default 5)")
    p.add_argument("--sweep-max", type=int, default=SWEEP_LENGTHS[-1], help="largest sweep length (default 16384)")
    p.add_argument("--window-max", type=int, default=WINDOW_LENGTHS[-1],
                   help="window family: largest T (default 65536)")
    p.add_argument("--decode-max", type=int, default=DECODE_LENGTHS[-1],
                   help="decode family: largest cache length P (default 65536)")
    p.add_argument("--latent-max", type=int, default=LATENT_LENGTHS[-1],
                   help="latent family: largest cache length P (default 65536)")
    p.add_argument("--sparse-max", type=int, default=None,
                   help="sparse family: largest cache length P (default 32768; 65536 and 131072 opt-in)")
    p.add_argument("--v4-max", type=int, default=None,
                   help="v4 family: largest history P (default 32768; 65536 and 131072 opt-in)")
    p.add_argument("--mem-limit", type=float, default=None,
                   help="GiB a path's (B, N, T, S) arrays may take (default: 40%% of MemAvailable)")
    p.add_argument("--json", metavar="FILE", help="write every raw number as JSON")
    p.add_argument("--plot", metavar="DIR", help="write sweep.png and ratio-<shape>.png here")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats: checks that everything runs")
    p.set_defaults(func=run)


def _mem_available() -> int:
    try:
        return proc_kb("/proc/meminfo", "MemAvailable") * 1024
    except OSError:
        return 8 * 2**30


def _machine() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0],
            "loadavg_start": os.getloadavg(),
            "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS",
                                                    "KERAS_BACKEND")}}


def run_backend(backend: str, spec: dict) -> dict:
    """Run one backend's worker in a child process; its stderr (progress) passes through."""
    return run_worker_process("conformance.bench.worker", backend, spec, with_stdout_tail=True)


def _upto(lengths: tuple, largest: int, flag: str) -> tuple:
    kept = tuple(n for n in lengths if n <= largest)
    if not kept:
        raise ValueError(f"{flag} must be at least {lengths[0]}: got {largest}")
    return kept


def run(args) -> int:
    from rich.console import Console

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    quick = args.quick
    repeats = args.repeats if args.repeats is not None else (2 if quick else 7)
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1: got {repeats}")
    shape_table = QUICK_SHAPES if quick else SHAPES
    shapes = [shape_table[s] for s in args.shapes if s not in FAMILIES]
    if "sweep" in args.shapes:
        lengths = QUICK_SWEEP_LENGTHS if quick else tuple(T for T in SWEEP_LENGTHS if T <= args.sweep_max)
        shapes += sweep_shapes(lengths)
    if "window" in args.shapes:
        shapes += window_shapes(QUICK_WINDOW_LENGTHS if quick else _upto(WINDOW_LENGTHS, args.window_max, "--window-max"),
                                quick)
    if "decode" in args.shapes:
        shapes += decode_shapes(QUICK_DECODE_LENGTHS if quick else _upto(DECODE_LENGTHS, args.decode_max, "--decode-max"),
                                quick)
    mem_limit = int(args.mem_limit * 2**30) if args.mem_limit is not None else int(0.4 * _mem_available())
    latent_lengths = None
    if "latent" in args.shapes:
        latent_lengths = QUICK_LATENT_LENGTHS if quick else _upto(LATENT_LENGTHS, args.latent_max, "--latent-max")
    spec = {"shapes": [dataclasses.asdict(s) for s in shapes], "device": args.device, "dtype": args.dtype,
            "repeats": repeats, "max_seconds": args.max_seconds, "budget": args.budget, "mem_limit": mem_limit,
            "quick": quick, "matmul_n": 256 if quick else MATMUL_N}
    started = time.perf_counter()
    data = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": ["mha", *sys.argv[1:]],
            "machine": _machine(),
            "settings": {k: v for k, v in spec.items() if k != "shapes"} | {
                "shapes": {s.name: s.to_dict() for s in shapes}, "min_repeats": MIN_REPEATS, "long_T": LONG_T,
                "chunk_size": CHUNK_SIZE,
                "flops": "forward 4*B*T*D*N*H + 4*B*S*D*K*H + 4*B*N*pairs*H, pairs = T*(P+S) (full T*S when causal; "
                         "under a window only the pairs it leaves); forward+backward 3x; the cache read: its elements",
                "matmul": "median time of one matmul_n^3 matmul of the bench's dtype in the framework, one run before each timed path call",
                "memory": "numpy: tracemalloc peak; tf: get_memory_info peak growth; torch, jax: peak RSS growth via "
                          "/proc/self/clear_refs + VmHWM (GPU: the framework's peak-allocation counter); "
                          "one extra call after timing",
                "ratio_to_native": "time / fastest native path, same backend, shape, pass and mode"},
            "backends": {}, "results": [], "matmul": [], "sweep_stops": {}}
    for backend in args.backends if shapes else ():  # sequence-sharded or latent alone starts no backend worker
        console.print(f"[bold]{backend}[/]: running ({len(shapes)} shapes) ...")
        out = run_backend(backend, spec)
        data["backends"][backend] = {"status": out["status"], "info": out.get("info", {}),
                                     "worker_s": out.get("worker_s")}
        data["results"] += out.get("results", [])
        data["matmul"] += out.get("matmul", [])
        data["sweep_stops"].update({f"{backend} {k}": v for k, v in out.get("sweep_stops", {}).items()})
        if out["status"] != "ok":
            console.print(f"[yellow]{backend}: {out['status']}[/]")
    add_native_ratios(data["results"])
    data["targets"] = targets(data)
    if "sequence-sharded" in args.shapes:
        from conformance.bench import sharded

        console.print(f"[bold]{sharded.FAMILY}[/]: torch, {sharded.DEVICES} processes and one unsharded ...")
        data["sequence_sharded"] = sharded.run(quick)
        data["targets"] += sharded.targets(data["sequence_sharded"])
    if latent_lengths is not None:
        from conformance.bench import latent

        data["latent"] = latent.run(args.backends, quick=quick, lengths=latent_lengths, repeats=repeats,
                                    max_seconds=args.max_seconds, mem_limit=mem_limit, matmul_n=spec["matmul_n"],
                                    device=args.device)
        data["targets"] += latent.targets(data["latent"])
    if "sparse" in args.shapes:
        from conformance.bench import sparse

        largest = sparse.DEFAULT_MAX if args.sparse_max is None else args.sparse_max
        data["sparse"] = sparse.run(args.backends, quick=quick, repeats=repeats, max_seconds=args.max_seconds,
                                    lengths=sparse.QUICK_SPARSE_LENGTHS if quick else _upto(
                                        sparse.SPARSE_LENGTHS, largest, "--sparse-max"),
                                    matmul_n=spec["matmul_n"])
    if "v4" in args.shapes:
        from conformance.bench import v4

        largest = v4.DEFAULT_MAX if args.v4_max is None else args.v4_max
        data["v4"] = v4.run(args.backends, quick=quick, repeats=repeats, max_seconds=args.max_seconds,
                            lengths=v4.QUICK_V4_LENGTHS if quick else _upto(v4.V4_LENGTHS, largest, "--v4-max"),
                            matmul_n=spec["matmul_n"])
    data["machine"]["loadavg_end"] = os.getloadavg()
    data["total_s"] = time.perf_counter() - started
    if args.json:  # first: a problem in printing must not lose the numbers
        from weights.atomic import write_bytes_atomic

        write_bytes_atomic(args.json, (json.dumps(data, indent=1) + "\n").encode(), overwrite=True)
    print_report(console, data)
    if args.json:
        console.print(f"wrote {args.json}")
    if args.plot:
        for path in write_plots(data, Path(args.plot)):
            console.print(f"wrote {path}")
    return 0
