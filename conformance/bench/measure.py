"""Timing and peak memory: the paired timing every figure of `mha bench` and
of the timing scripts (conformance.bench.scripts) comes from."""

from __future__ import annotations

import gc
import statistics
import time

MIN_REPEATS = 3


def _peak_rss_begin() -> int | None:
    """Reset the peak RSS counter; return the current RSS in bytes (None if the kernel refuses)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return proc_kb("/proc/self/status", "VmRSS") * 1024


def proc_kb(path: str, field: str) -> int:
    """A "Field: N kB" line's N from a /proc file (/proc/self/status, /proc/meminfo)."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{path} has no {field}")


def rss_memory(call):
    """(peak bytes, method, output) of one call, as growth of the process's peak resident set."""
    gc.collect()
    base = _peak_rss_begin()
    out = call()
    if base is None:
        return None, "unavailable (/proc/self/clear_refs not writable)", out
    return max(0, proc_kb("/proc/self/status", "VmHWM") * 1024 - base), "peak RSS growth (VmHWM after - VmRSS before)", out


def tracemalloc_memory(call):
    """(peak bytes, method, output) of one call, as tracemalloc's peak (NumPy reports its buffers to it)."""
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = call()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return peak, "tracemalloc peak", out


def time_call(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


MATMUL = "matmul"  # measure_paired's name for the large-matmul reference


def measure_paired(calls: dict, reference, *, repeats: int, max_seconds: float) -> dict:
    """Time every call of `calls` (name -> callable), one after another, each
    of its timed runs a moment after one run of the reference (the large
    matmul), so that a change in the machine's speed (the project's machines
    are shared VMs: CPU steal comes and goes) reaches a path and its matmul
    alike. Each call
    first runs once apart (timed: compile_s) plus one warm-up when that took
    under 2 s, then up to `repeats` timed runs, MIN_REPEATS once its timed
    runs passed max_seconds. A call that took under 2 s runs once more,
    untimed, between the matmul and each timed run.

    Why: a call's speed depends on what ran just before it in the process,
    beyond the machine. NumPy's plain forward at bert-base took 57 ms run
    after run, 72 ms right after the matmul, and 82 ms right after the
    hand-written backward (measured 2026-11-23, a 2-core CPU VM). So each timed run follows a
    run of its own path, and the paths are not interleaved with each other.

    Returns name -> summarize()'s dict plus first_call_s and matmul_ratio
    (the median over pairs of the call's time / the matmul's time just
    before it: a drift that begins mid-path moves it by at most one pair,
    where it could move a ratio of two medians by the whole drift), or the
    exception the call raised; under MATMUL, every matmul run's summary
    (at least MIN_REPEATS)."""
    results: dict = {}
    first_ref = time_call(reference)
    time_call(reference)
    reference_times: list[float] = []
    for name, call in calls.items():
        try:
            first = time_call(call)
            if first < 2.0:
                time_call(call)
            times, ratios, spent = [], [], 0.0
            while len(times) < repeats and not (len(times) >= min(MIN_REPEATS, repeats) and spent > max_seconds):
                ref = time_call(reference)
                if first < 2.0:
                    call()  # untimed: the timed run follows a run of its own path, not the matmul
                t = time_call(call)
                reference_times.append(ref)
                times.append(t)
                ratios.append(t / ref)
                spent += t
        except Exception as err:  # noqa: BLE001 - reported in that path's row
            results[name] = err
            continue
        results[name] = summarize(times) | {"first_call_s": first, "matmul_ratio": statistics.median(ratios)}
    while len(reference_times) < MIN_REPEATS:
        reference_times.append(time_call(reference))
    results[MATMUL] = summarize(reference_times) | {"first_call_s": first_ref}
    return results


def paired_ratios(calls: dict, reference, *, repeats: int) -> tuple[dict, float]:
    """measure_paired for the timing scripts (conformance.bench.scripts): each call's
    matmul_ratio (its time in matmul-times) and the reference's median time
    in seconds; a call that failed raises its exception here."""
    measured = measure_paired(calls, reference, repeats=repeats, max_seconds=float("inf"))
    for name in calls:
        if isinstance(measured[name], Exception):
            raise measured[name]
    return {name: measured[name]["matmul_ratio"] for name in calls}, measured[MATMUL]["median_s"]


def summarize(times: list[float]) -> dict:
    s = sorted(times)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    return {"times_s": times, "repeats": len(times), "median_s": statistics.median(s), "min_s": s[0], "max_s": s[-1],
            "q1_s": q[0], "q3_s": q[2]}
