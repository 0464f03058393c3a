"""`mha check`: the main job. Every backend x device x dtype x case, forward
and gradients, judged against the float64 reference; a matrix in the
terminal, optionally a report and JSON; exit 0 only if everything conforms.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from pathlib import Path

from conformance.suite import backends, reference_cache, schedule
from conformance.suite.cases import (
    ALL_CASES,
    CASES,
    CHECK_ONE_DTYPE,
    DTYPE_NAMES,
    ONE_DTYPE,
    PROFILE_DTYPES,
    PROFILES,
)
from conformance.suite.compare import (
    DEFAULT_PATH,
    STATUS_ERROR,
    STATUS_FAIL,
    STATUS_PASS,
    CaseResult,
    flush_references,
    release_compiled_programs,
    run_case_paths,
)
from conformance.suite.tolerance import compare, policy_for

CORE_BACKENDS = backends.CORE

# The kinds of path `mha check --paths` selects; a core backend's adapter names its own (PATHS, and FAST_PATH
# for "fast": numpy, tf and jax "fused", torch "sdpa"). The default judges what a user's call runs: the stages
# (the spec, and every call with weights or a trace), the fast path a plain call takes, and an in-place cache
# where a case has a cache. The chunked cores (chunk_size=) are one flag away: JAX compiles a chunked program
# per case and dtype (its nested scans take several times the plain program's compile time), which would
# double the run; the tests run the grid through every chunked core.
PATH_KINDS = ("stages", "fast", "chunked", "in_place")
DEFAULT_PATH_KINDS = ("stages", "fast", "in_place")

# Without --dtypes, keras-jax runs float32 alone: its calls are compiled programs (Keras's layer traced through
# stateless_call, jax.vjp and jax.jit, a case's stages and fused call as one: compare.run_case_paths; eagerly,
# JAX compiled every op for every shape, 5x that): float32 over the default grid 20.7 s of CPU cold (4.9 s
# warm; the four dtypes were 111 s cold when each call was a program of its own, 2-core EPYC VM, 2026-11-29),
# over `mha check`'s budget. --dtypes runs each dtype given.
# jax (impl_jax) runs float32 and bfloat16: JAX's own default dtype (float64 needs x64 mode, which JAX leaves off)
# and the 16-bit one JAX computes in on accelerators. Its programs (a case's stages and fused call one, the
# in-place call another) were about half of a cold check's CPU (73 of 138 s, seven columns, a program per
# result): float64's 142 programs and float16's 74 about 34 s of it (docs/conformance.md, "where a cold check's
# time goes"). The jax tests (tox -e jax) run every dtype, and --dtypes brings them back here.
DEFAULT_BACKEND_DTYPES = {"keras-jax": ("float32",), "jax": ("float32", "bfloat16")}


def paths_of(adapter, kinds) -> list[str]:
    """The adapter's paths of these kinds, in its own order; [DEFAULT_PATH] for a backend with one path."""
    own = getattr(adapter, "PATHS", None)
    if not own:
        return [DEFAULT_PATH]
    if getattr(adapter, "COMPRESSED_CHUNKED", False) and "chunked" not in own:  # torch: DeepSeek V4's block-wise
        own = (*own, "chunked")  # path is its one chunked path (compare.path_options: no row for any other layer)
    wanted = {adapter.FAST_PATH if kind == "fast" else kind for kind in kinds}
    return [path for path in own if path in wanted]


def plan(backend_ids, devices, console):
    """(backend, device) pairs to run; missing frameworks are reported, not fatal."""
    pairs, skipped = [], []
    for backend_id in backend_ids:
        try:
            adapter = backends.load(backend_id)
        except backends.BackendUnavailable as err:
            skipped.append((backend_id, "-", str(err)))
            continue
        present = list(adapter.devices())
        for device in devices or present:
            if device in present:
                pairs.append((backend_id, device, adapter))
            else:
                skipped.append((backend_id, device, f"backend {backend_id}: no {device} device here"))
    return pairs, skipped


def cross_device(results: list[CaseResult]) -> list[CaseResult]:
    """CPU versus GPU of the same framework: a comparison of its own."""
    by_key = {(r.backend, r.path, r.device, r.case, r.dtype): r for r in results
              if r.arrays.get("backend_output") is not None}
    extra = []
    for (backend_id, path, device, case_name, dtype), gpu in by_key.items():
        cpu = by_key.get((backend_id, path, "cpu", case_name, dtype))
        if device != "gpu" or cpu is None:
            continue
        case = ALL_CASES[case_name]
        tol = policy_for(case.config, dtype=dtype, quantity="output", B=case.B, T=case.T, S=case.S_total,
                         reference=cpu.arrays["backend_output"], precision=gpu.precision)
        c = compare("output (gpu vs cpu)", gpu.arrays["backend_output"], cpu.arrays["backend_output"], tol)
        extra.append(CaseResult(case_name, backend_id, "gpu-vs-cpu", dtype, gpu.precision,
                                STATUS_PASS if c.ok else STATUS_FAIL, [c], path=path))
    return extra


def default_compile_cache() -> Path:
    """Where `mha check` keeps JAX's compiled programs: $MHA_CACHE_DIR, else
    $XDG_CACHE_HOME/mha, else ~/.cache/mha; then /jax."""
    base = os.environ.get("MHA_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mha"
    return Path(base) / "jax"


def enable_jax_compile_cache(directory) -> None:
    """JAX's own persistent compilation cache, for the JAX backends other than impl_jax (the Flax layers,
    jax-dpa; impl_jax keeps its programs itself, found before tracing: impl_jax/programs.py). JAX keys each
    entry by the lowered program, the jax/jaxlib versions, the XLA flags and the device, so a cached program
    is the one that would have been compiled. The default threshold (cache only compiles over 1 s) would skip
    every one of ours, hence 0."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _warm(backend_ids) -> tuple[dict[str, tuple[bool, list[str] | str]], dict]:
    """In a worker: import these backends' adapters before the first chunk arrives, and say which
    devices each has (or why it is unavailable) and what the report's environment asks of their
    frameworks (environment.framework_probes), so that the main process imports no framework."""
    from conformance.suite import environment

    found = {}
    for backend_id in backend_ids:
        try:
            found[backend_id] = (True, list(backends.load(backend_id).devices()))
        except backends.BackendUnavailable as err:
            found[backend_id] = (False, str(err))
    probes = environment.framework_probes([b for b in backend_ids if found[b][0]])
    gc.freeze()  # the frameworks' modules, imported above, live as long as the worker: never scan them again
    return found, probes


def _plan_from(backend_ids, devices, found) -> tuple[list, list]:
    """plan()'s pairs and skips from the workers' _warm answers (the adapter slot is None)."""
    pairs, skipped = [], []
    for backend_id in backend_ids:
        ok, answer = found[backend_id]
        if not ok:
            skipped.append((backend_id, "-", answer))
            continue
        for device in devices or answer:
            if device in answer:
                pairs.append((backend_id, device, None))
            else:
                skipped.append((backend_id, device, f"backend {backend_id}: no {device} device here"))
    return pairs, skipped


def _run_chunk(backend_id, device, dtype, case_names, precision, gradients, compile_cache=None, xla_full_opt=False,
               path_kinds=DEFAULT_PATH_KINDS):
    """One (backend, device, dtype) over its cases, on each of its paths of path_kinds; runs in a worker
    process."""
    adapter = backends.load(backend_id)
    own_cache = hasattr(adapter, "set_program_cache")  # impl_jax keeps its own programs: see impl_jax/programs.py
    if compile_cache is not None and "jax" in backends.get(backend_id).framework and not own_cache:
        enable_jax_compile_cache(compile_cache)
    if hasattr(adapter, "set_cpu_compile"):  # impl_jax, impl_tf (on jax): see FAST_CPU_COMPILE there
        adapter.set_cpu_compile("default" if xla_full_opt else "fast")
    if own_cache:
        adapter.set_program_cache(None if compile_cache is None else Path(compile_cache) / "programs")
    # the float64 references too (conformance/suite/reference_cache.py), beside the programs
    reference_cache.set_directory(None if compile_cache is None else Path(compile_cache) / "references")
    # a case on each path in turn: the case's reference and the adapter's prepared layer serve every path (and
    # impl_jax compiles the stages and the fused path as one program: compare.run_case_paths)
    paths = paths_of(adapter, path_kinds)
    results = [result for name in case_names
               for result in run_case_paths(ALL_CASES[name], backend_id, paths, device=device, dtype=dtype,
                                            precision=precision, gradients=gradients, adapter=adapter,
                                            keep_arrays=True)]
    flush_references()
    release_compiled_programs()  # a worker runs many chunks: keep its memory mappings bounded
    return results


# Each worker's frameworks on one compute thread where the workers are as many as the cores: the grid's
# calls are tiny, and every framework's own thread pool (OpenBLAS under the NumPy reference, torch's
# intra-op threads, TensorFlow's) otherwise contends with the other worker's, or spins waiting. Measured
# (2026-11-27, 2-core EPYC, the 2000-result grid, jobs 2): warm 28.3 s -> 20.2 s, cold 51-52 s -> 49-52 s.
# Only for the workers (the variables are read when a worker's libraries load), and never over a value the
# caller set.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


# A worker's garbage collector runs its full collections less often. Tracing a JAX program or running an
# eager Keras call allocates objects by the hundred thousand, and with Python's default thresholds
# (700, 10, 10) the oldest generation, all of TensorFlow's, torch's and JAX's objects included, was scanned
# again every few programs. A worker lives for one `mha check`, and what it leaves is freed when it exits.
# Measured (2026-11-27, 2-core EPYC, the 2000-result grid, cold, runs alternated): 47.8 and 45.9 s ->
# 44.6 and 43.3 s wall, user CPU 89.0 and 85.5 -> 83.3 and 80.9 s.
WORKER_GC_THRESHOLDS = (50_000, 20, 100)


def _start_worker(nice: int = 0) -> None:
    gc.set_threshold(*WORKER_GC_THRESHOLDS)
    if nice and hasattr(os, "nice"):  # a lower priority than the busiest worker's (schedule.niceness)
        os.nice(nice)


def _start_keras_worker(keras_backend: str, nice: int = 0) -> None:
    """A worker of a Keras backend's own (backends.own_process): KERAS_BACKEND set before keras is imported."""
    _start_worker(nice)
    os.environ["KERAS_BACKEND"] = keras_backend


@contextlib.contextmanager
def _one_thread_per_worker(jobs: int):
    """ONE_THREAD in the environment the workers start with, when jobs >= the cores; restored after."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    added = {k: v for k, v in ONE_THREAD.items() if k not in os.environ} if jobs >= cores else {}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def run_check(backend_ids=CORE_BACKENDS, devices=None, dtypes=DTYPE_NAMES, case_names=None, *, precision="highest",
              gradients=True, console=None, progress=True, jobs=None, compile_cache=None, xla_full_opt=False,
              path_kinds=DEFAULT_PATH_KINDS, probes: dict | None = None, skip=None, backend_dtypes=None):
    """Every (backend, device, dtype) chunk of cases. jobs > 1 runs chunks in
    that many worker processes (each imports its own frameworks); the
    results are the same objects either way. A backend that runs Keras on
    jax or torch (keras-jax, keras-torch: backends.own_process) runs in one
    worker of its own whatever jobs says, since Keras fixes its backend at
    import and the other workers' Keras runs on TensorFlow. compile_cache: a directory for
    JAX's persistent compilation cache (None: compile everything afresh).
    xla_full_opt: compile impl_jax's CPU programs with XLA's default options
    instead of impl_jax.adapter.FAST_CPU_COMPILE. path_kinds: which of each
    core backend's paths (PATH_KINDS). probes: a dict to fill with the
    workers' environment.framework_probes (left empty when jobs is 1). skip: (case, dtype) pairs not to run.
    backend_dtypes: {backend: dtypes} runs those backends in those of `dtypes` alone (DEFAULT_BACKEND_DTYPES)."""
    import concurrent.futures

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    names = list(case_names or CASES)
    skip = frozenset(skip or ())

    def names_for(dtype):
        return [name for name in names if (name, dtype) not in skip]
    backend_dtypes = backend_dtypes or {}

    def dtypes_of(backend_id):
        return [t for t in dtypes if t in backend_dtypes.get(backend_id, dtypes)]
    warm = schedule.is_warm(compile_cache)

    def column_chunks(pairs, split: bool):
        """The pairs' columns in chunks (schedule.split_column: cut where another worker may take a part)."""
        return [chunk for b, d, _ in pairs for t in dtypes_of(b)
                for chunk in schedule.split_column(b, d, t, names_for(t), warm,
                                                   schedule.CHUNK_SECONDS if split else None)]
    # The workers start and import the frameworks themselves, and tell this process which backends
    # and devices are here (_warm): the main process imports no framework (TensorFlow alone takes 4 s).
    # A worker starts on its chunks as soon as its own frameworks are in, not when the slowest import ends.
    own = [b for b in backend_ids if backends.own_process(b)]  # Keras on jax / torch: a worker each
    shared = [b for b in backend_ids if b not in own]
    jobs = max(1, min(jobs if jobs is not None else (os.cpu_count() or 1), max(1, len(shared)) * len(dtypes)))
    done_chunks: dict = {}  # Chunk -> its results
    all_pairs, skipped = [], []
    with contextlib.ExitStack() as stack, Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, disable=not progress, transient=True) as bar:
        task = bar.add_task("mha check", total=0)
        planned = 0

        def add_to_bar(chunks):
            nonlocal planned
            planned += sum(len(c.cases) for c in chunks)
            bar.update(task, total=planned)

        def submit(executor, chunk):
            return executor.submit(_run_chunk, chunk.backend, chunk.device, chunk.dtype, list(chunk.cases), precision,
                                   gradients, compile_cache, xla_full_opt, path_kinds)

        pools: dict = {}  # a Keras backend of its own -> its worker's pool
        warming: dict = {}  # future of a worker's _warm -> (its backends, its ChunkWorker or None)
        pending: dict = {}  # future of a chunk -> (the chunk, its ChunkWorker or None)
        queue, idle, queued_groups = schedule.ChunkQueue(), [], set()
        if jobs > 1 or own:
            import multiprocessing

            # spawn: TensorFlow and JAX hold threads that a fork would copy half-alive.
            # JAX takes 75% of a GPU's memory when it starts (its default preallocation); the workers share
            # one GPU, so each allocates as it goes instead (read by the workers' JAX when it starts).
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
            stack.enter_context(_one_thread_per_worker(jobs + len(own)))
            spawn = multiprocessing.get_context("spawn")

            def load(backend_id):
                return schedule.case_seconds(backend_id, warm) * sum(len(names_for(t)) for t in dtypes_of(backend_id))
            groups = []
            if jobs > 1:
                counts = {b: len(column_chunks([(b, None, None)], True)) for b in shared}
                groups = schedule.worker_groups({b: load(b) for b in shared}, jobs, counts)
            # every worker's estimated seconds, its imports included, for its priority
            nice = iter(schedule.niceness(
                [load(b) + schedule.IMPORT_SECONDS.get(b, 1.0) for b in own]
                + [(sum(map(load, group)) + sum(schedule.IMPORT_SECONDS.get(f, 1.0)
                                                for f in {schedule.family(b) for b in group})) / processes
                   for group, processes in groups for _ in range(processes)], warm))
            for backend_id in own:
                pools[backend_id] = stack.enter_context(concurrent.futures.ProcessPoolExecutor(
                    1, mp_context=spawn, initializer=_start_keras_worker,
                    initargs=(backends.get(backend_id).keras_backend, next(nice))))
                warming[pools[backend_id].submit(_warm, [backend_id])] = ((backend_id,), None)
            for group, processes in groups:
                for _ in range(processes):  # each worker imports its own group's frameworks alone
                    worker = schedule.ChunkWorker(stack.enter_context(concurrent.futures.ProcessPoolExecutor(
                        1, mp_context=spawn, initializer=_start_worker, initargs=(next(nice),))), set(group))
                    warming[worker.executor.submit(_warm, group)] = (tuple(group), worker)

        def hand_out():
            for worker in list(idle):
                chunk = queue.next_for(worker)
                if chunk is not None:
                    idle.remove(worker)
                    pending[submit(worker.executor, chunk)] = (chunk, worker)

        def service(block: bool):
            """Plan what warmed workers found and start their chunks; collect finished chunks."""
            done, _ = concurrent.futures.wait([*warming, *pending], timeout=None if block else 0,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                if future in warming:
                    group, worker = warming.pop(future)
                    answer, probed = future.result()
                    if probes is not None:
                        probes.update(probed)
                    if group not in queued_groups:  # a group's second process finds what its first did
                        queued_groups.add(group)
                        pairs, missing = _plan_from(list(group), devices, answer)
                        all_pairs.extend(pairs)
                        skipped.extend(missing)
                        chunks = column_chunks(pairs, split=worker is not None)
                        add_to_bar(chunks)
                        if worker is None:  # a Keras backend's own worker runs its chunks in turn
                            for chunk in chunks:
                                pending[submit(pools[chunk.backend], chunk)] = (chunk, None)
                        else:
                            queue.add(chunks)
                    if worker is not None:
                        idle.append(worker)
                else:
                    chunk, worker = pending.pop(future)
                    done_chunks[chunk] = future.result()
                    bar.advance(task, len(chunk.cases))
                    if worker is not None:
                        idle.append(worker)
            hand_out()

        if jobs == 1:  # the shared backends in this process, beside the Keras backends' own workers
            pairs, missing = plan(shared, devices, console)
            all_pairs.extend(pairs)
            skipped.extend(missing)
            chunks = column_chunks(pairs, split=False)
            add_to_bar(chunks)
            for chunk in chunks:
                if warming or pending:
                    service(block=False)
                bar.update(task, description=f"{chunk.backend}/{chunk.device}/{chunk.dtype}")
                done_chunks[chunk] = _run_chunk(chunk.backend, chunk.device, chunk.dtype, list(chunk.cases),
                                                precision, gradients, compile_cache, xla_full_opt, path_kinds)
                bar.advance(task, len(chunk.cases))
        while warming or pending:
            service(block=True)
        if queue.chunks:  # every queued chunk belongs to a worker that takes its own first: never left
            raise RuntimeError(f"mha check: {len(queue.chunks)} chunks were never run")
    order = {b: i for i, b in enumerate(backend_ids)}
    all_pairs.sort(key=lambda p: order[p[0]])
    skipped.sort(key=lambda s: order.get(s[0], len(order)))
    column = {(b, d, t): i for i, (b, d, t) in enumerate((b, d, t) for b, d, _ in all_pairs for t in dtypes)}
    results = [r for chunk in sorted(done_chunks, key=lambda c: (column[(c.backend, c.device, c.dtype)], c.part))
               for r in done_chunks[chunk]]
    results.extend(cross_device(results))
    if compile_cache is not None and set(CASES) <= set(names):  # the default grid's programs are all on disk
        schedule.mark_warm(compile_cache)
    return results, skipped


def expand_backends(names) -> list[str]:
    groups = {"core": list(backends.CORE), "native": list(backends.NATIVE), "all": list(backends.REGISTRY)}
    expanded = []
    for name in names:
        for backend_id in groups.get(name, [name]):
            if backend_id not in expanded:
                expanded.append(backend_id)
    return expanded


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("check", help="the main job: do the backends agree with the reference?")
    p.add_argument("--backends", nargs="+", default=["core"], choices=["core", "native", "all", *backends.REGISTRY],
                   metavar="BACKEND",
                   help="ids, or groups: core (numpy torch tf keras-jax keras-torch jax mlx, the default), native (the frameworks' own layers: "
                        + ", ".join(backends.NATIVE) + "), all; missing frameworks are reported, not fatal")
    p.add_argument("--devices", nargs="+", default=None, choices=list(backends.DEVICES),
                   help="default: every device present for each backend")
    p.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPE_NAMES),
                   help="default: the profile's (default: all four, the edge, top-k and indexer cases, multimodal RoPE, "
                        "differential attention, the shared-KV and multiplier cases and the realistic lengths float32 alone; long: float32 bfloat16); given, every selected case runs in each")
    p.add_argument("--profile", default="default", choices=list(PROFILES),
                   help="which grid: default (the shipped grid, its vectors), or long (T and S in the hundreds to "
                        "thousands: ALiBi, windows, local chunks, LongRoPE, a latent decode step; every path by "
                        "default; tox -e full runs it): " + ", ".join(PROFILES["long"]))
    p.add_argument("--cases", nargs="+", default=None, choices=list(ALL_CASES), metavar="CASE",
                   help="default: the profile's; names: " + ", ".join(ALL_CASES))
    p.add_argument("--precision", default="highest", choices=["highest", "tf32"],
                   help="tf32: let float32 matmuls use TF32 on GPUs, judged with TF32's unit round-off")
    p.add_argument("--no-gradients", action="store_true", help="forward only")
    p.add_argument("--paths", nargs="+", default=None, choices=[*PATH_KINDS, "all"],
                   metavar="PATH",
                   help="which paths of each core backend to judge, each a column of the matrix: stages (the spec), "
                        "fast (numpy/tf/jax fused, torch sdpa), chunked (chunk_size=2; T // 8 on a long call), in_place (cache_length=, cases "
                        "with a cache), all; default: " + " ".join(DEFAULT_PATH_KINDS) + " (--profile long: all, the "
                        "chunked cores being where length matters)")
    p.add_argument("--report", metavar="DIR", help="write report.md, report.html and heatmaps here")
    p.add_argument("--json", metavar="FILE", help="write every result as JSON")
    p.add_argument("--junit", metavar="FILE", help="write JUnit XML: one testcase per case x backend x device x dtype")
    p.add_argument("--conventions", action="store_true", help="also measure the native layers' conventions")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="worker processes (default: one per CPU core; 1 runs everything in this process)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile every JAX program and compute every reference afresh instead of loading them "
                        "from the caches (impl_jax's and keras-jax's programs, JAX's persistent cache, the float64 "
                        "references; default location: $MHA_CACHE_DIR or ~/.cache/mha, under jax/)")
    p.add_argument("--xla-full-opt", action="store_true",
                   help="compile impl_jax's CPU programs with XLA's default optimisation (about 4x slower to compile) "
                        "instead of LLVM -O0 and XLA's classic fusion emitters; the HLO optimisation is the same")
    p.add_argument("--sharded", action="store_true",
                   help="instead of the default grid: the sharded grid (conformance/suite/sharded.py) on each sharded engine, "
                        "heads and sequence, 2 and 4 devices, float32 and bfloat16 unless --dtypes says otherwise")
    p.add_argument("--sharded-engines", nargs="+", default=None, metavar="ENGINE",
                   help="with --sharded: these engines only (default: every one of conformance.suite.sharded.ENGINES)")
    p.add_argument("--sharded-cases", nargs="+", default=None, metavar="CASE",
                   help="with --sharded: these cases of the sharded grid only (names in conformance/suite/sharded.py)")
    p.set_defaults(func=run)


def _run_sharded(args, console):
    """--sharded: the sharded grid; JAX's host devices forced before JAX starts."""
    from conformance.suite import sharded

    engines = args.sharded_engines or list(sharded.ENGINES)
    for name in engines:
        if name not in sharded.ENGINES:
            raise ValueError(f"--sharded-engines: must be among {', '.join(sharded.ENGINES)}: got {name!r}")
    for name in args.sharded_cases or ():
        if name not in sharded.SHARDED_CASES:
            raise ValueError(f"--sharded-cases: unknown case {name!r} (cases: {', '.join(sharded.SHARDED_CASES)})")
    sharded.force_host_devices(max(sharded.DEVICE_COUNTS))
    # --dtypes defaults to the default grid's four; the sharded grid's default is its own two
    dtypes = sharded.DTYPES if args.dtypes is None else tuple(args.dtypes)
    return sharded.run_sharded(engines, dtypes=dtypes, case_names=args.sharded_cases, gradients=not args.no_gradients,
                               jobs=args.jobs)


def run(args) -> int:
    from rich.console import Console

    from conformance.suite import environment, report
    from weights.atomic import write_bytes_atomic

    console = Console(highlight=False)
    started = time.perf_counter()
    if args.json and Path(args.json).is_dir():
        raise ValueError(f"--json {args.json}: is a directory")
    if args.junit:
        from conformance.suite.verify import check_destination

        check_destination("--junit", args.junit)
    probes: dict = {}
    if args.sharded:
        results, skipped = _run_sharded(args, console)
    else:
        kinds = args.paths or (["all"] if args.profile == "long" else list(DEFAULT_PATH_KINDS))
        # without --dtypes, the edge group and the realistic lengths run in float32 alone (cases.CHECK_ONE_DTYPE)
        skip = None if args.dtypes or args.profile != "default" else \
            {(name, dtype) for name in CHECK_ONE_DTYPE for dtype in DTYPE_NAMES if dtype != ONE_DTYPE}
        results, skipped = run_check(expand_backends(args.backends), args.devices,
                                     args.dtypes or PROFILE_DTYPES[args.profile],
                                     args.cases or list(PROFILES[args.profile]), skip=skip,
                                     precision=args.precision, gradients=not args.no_gradients,
                                     progress=console.is_terminal, jobs=args.jobs,
                                     compile_cache=None if args.no_compile_cache else default_compile_cache(),
                                     xla_full_opt=args.xla_full_opt,
                                     path_kinds=PATH_KINDS if "all" in kinds else tuple(kinds),
                                     probes=probes, backend_dtypes=None if args.dtypes else DEFAULT_BACKEND_DTYPES)
    if not results:
        reasons = "; ".join(reason for _, _, reason in skipped) or "nothing selected"
        raise ValueError(f"nothing to run: {reasons}")
    elapsed = time.perf_counter() - started
    if args.precision == "tf32":
        console.print("[yellow]precision tf32: float32 matmuls may use TF32 on GPUs; float32 is judged with u = 2**-11[/]")
    report.render_terminal(results, console=console)
    for backend_id, device, reason in skipped:
        console.print(f"[yellow]not run[/] {backend_id} {device}: {reason}")
    conventions = None
    if args.conventions:
        from conformance.native import conventions as conv

        conventions = conv.measure(console=console)
        conv.render_terminal(conventions, console=console)
    bad = [r for r in results if r.status in (STATUS_FAIL, STATUS_ERROR)]
    worst = max((r.margin for r in results if r.status in (STATUS_PASS, STATUS_FAIL)), default=0.0)
    if args.sharded:
        from conformance.suite.sharded import summary_lines

        for line in summary_lines(results):
            console.print(line)
    env = environment.environment(sorted({r.backend for r in results}), sorted({r.device for r in results}), args.precision,
                             probes=probes or None)
    if {"jax", "keras-jax"} & {r.backend for r in results}:
        env["precision"]["jax cpu compile"] = ("XLA defaults (--xla-full-opt)" if args.xla_full_opt else
                                               "LLVM -O0, classic fusion emitters (impl_jax.adapter.FAST_CPU_COMPILE, "
                                               "impl_tf.adapter's on keras-jax)")
    if args.report:
        paths = report.write_report(args.report, results, env, conventions=conventions)
        console.print(f"report: {', '.join(str(p) for p in paths.values())}")
    if args.json:
        payload = {"environment": env, "skipped": [list(s) for s in skipped], "seconds": elapsed,
                   "results": [r.to_json() for r in results]}
        if conventions is not None:
            payload["conventions"] = conventions
        write_bytes_atomic(args.json, json.dumps(payload, indent=1).encode(), overwrite=True)
    if args.junit:
        from conformance.suite.junit import write_check

        write_check(args.junit, results, seconds=elapsed, skipped=skipped)
    # the last line: the check's own time, and the wall time since the process started (its start-up, the
    # workers' framework imports and the report included; only the interpreter's exit follows)
    console.print(f"worst margin {worst:.3g}; {elapsed:.1f} s checking, {process_seconds():.1f} s wall since mha "
                  "started")
    return 0 if not bad else 1


def process_seconds() -> float:
    """Wall seconds since this process started (Linux: /proc; elsewhere since conformance.suite.check was imported)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat, open("/proc/uptime", encoding="ascii") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks
            return float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()
