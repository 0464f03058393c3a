"""One backend's measurements, in a process of its own (`python -m
conformance.bench.worker --worker SPEC OUT`, started by
conformance.bench.command.run_backend): every shape, every
path, timed, measured for memory and compared with the NumPy reference."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from conformance.bench.measure import MATMUL, measure_paired
from conformance.bench.runners import DECODE_OPTIONS, RUNNERS, Unsupported, decode_cache
from conformance.bench.shapes import CHUNK_SIZE, Shape


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_worker(spec: dict) -> dict:
    """One backend: every requested shape, every path. Runs in its own process."""
    import weights

    backend = spec["backend"]
    started = time.perf_counter()
    try:
        runner = RUNNERS[backend](spec["device"], spec["quick"], spec.get("dtype", "float32"))
    except Exception as err:  # noqa: BLE001 - any failure to import or set up means 'unavailable'
        return {"backend": backend, "status": f"unavailable: {type(err).__name__}: {err}".splitlines()[0]}
    results, matmuls, sweep_stops = [], [], {}
    stopped: dict[str, str] = {}
    for sd in spec["shapes"]:
        shape = Shape(**sd)
        config = weights.AttentionConfig(num_heads=shape.N, query_dim=shape.D, head_dim=shape.H,
                                         num_kv_heads=shape.kv_heads, window_left=shape.window_left)
        tensors = weights.init(config, seed=0, dtype="float32")
        x = np.random.default_rng(0).standard_normal((shape.B, shape.T, shape.D)).astype(np.float32)
        reference, rows_compared = None, slice(None)
        try:
            paths = runner.paths(shape, config, tensors, x)
        except Unsupported as why:
            results.append(_row(backend, shape, None, f"skipped: {why}", None))
            _log(f"  {backend} {shape.name}: skipped: {why}")
            continue
        except Exception as err:  # noqa: BLE001
            results.append(_row(backend, shape, None, f"failed: setting up paths: {type(err).__name__}: {err}", None))
            _log(f"  {backend} {shape.name}: could not set up paths: {err}")
            continue
        rows, timed = [], {}
        for path in paths:
            key = f"{path.name}/{path.pass_}"
            row = _row(backend, shape, path, "ok", None)
            estimate = path.ts_arrays * shape.ts_bytes
            if shape.sweep and key in stopped:
                row["status"] = f"skipped: {stopped[key]}"
            elif estimate > spec["mem_limit"]:
                row["status"] = (f"skipped: would hold ~{estimate / 2**30:.1f} GiB of (B, N, T, S) arrays "
                                 f"(no chunked path), over --mem-limit {spec['mem_limit'] / 2**30:.1f} GiB")
            else:
                timed[key] = path.call
            rows.append((key, path, row))
        measured = measure_paired(timed, runner.matmul(spec["matmul_n"]), repeats=spec["repeats"],
                                  max_seconds=spec["max_seconds"])
        mm = measured.pop(MATMUL)
        rate = 2 * spec["matmul_n"] ** 3 / mm["median_s"]
        matmuls.append({"backend": backend, "shape": shape.name, "n": spec["matmul_n"], **mm, "flops_per_s": rate})
        for key, path, row in rows:
            row["matmul_flops_per_s"], row["matmul_flops"] = rate, 2 * spec["matmul_n"] ** 3
            if key in measured:
                try:
                    if isinstance(measured[key], Exception):
                        raise measured[key]
                    row.update(measured[key])
                    row["compile_s"] = max(0.0, row["first_call_s"] - row["median_s"])
                    if not shape.sweep:
                        peak, method, y = runner.memory(path.call)
                        row.update(peak_bytes=peak, memory_method=method)
                        if peak is not None:
                            row["peak_over_io"] = peak / shape.io_bytes
                        if path.compare:
                            if reference is None:
                                reference, rows_compared = _numpy_reference(config, tensors, x, shape)
                            y = y[0] if isinstance(y, (tuple, list)) else y  # a decode step returns its cache too
                            diff = np.abs(runner.to_numpy(y).astype(np.float64)[:, rows_compared] - reference)
                            row["max_abs_diff_vs_numpy"] = float(diff.max())
                            row["reference_max_abs"] = float(np.abs(reference).max())
                except Exception as err:  # noqa: BLE001
                    row["status"] = f"failed: {type(err).__name__}: {err}".splitlines()[0][:300]
                    if os.environ.get("MHA_DEBUG"):
                        traceback.print_exception(err)
            if shape.sweep and row["status"] == "ok" and row["median_s"] > spec["budget"]:
                stopped[key] = f"stopped after T={shape.T}: {row['median_s']:.1f} s > budget {spec['budget']:g} s"
                sweep_stops[key] = stopped[key]
            _finish(row)
            results.append(row)
            _log(f"  {backend:5} {shape.name:12} {path.name:24} {path.pass_:16} " + (
                f"{row['median_s'] * 1e3:10.2f} ms  {row['pct_matmul']:6.1f}% of matmul"
                if row["status"] == "ok" else row["status"]))
        del paths, timed, rows
        gc.collect()
    return {"backend": backend, "status": "ok", "info": runner.info, "results": results, "matmul": matmuls,
            "sweep_stops": sweep_stops, "worker_s": time.perf_counter() - started}


def _numpy_reference(config, tensors, x, shape):
    """-> (impl_numpy's output, float64; the query rows of the call's output it stands for)."""
    from impl_numpy.attention import multi_head_attention

    if shape.family == "decode":
        pk, pv = decode_cache(shape)
        out = multi_head_attention(config, tensors, x, past_key=pk, past_value=pv, **DECODE_OPTIONS)[0]
        return np.asarray(out, np.float64), slice(None)
    if shape.family == "window" and shape.T > 2 * (shape.window_left + 1):
        # Causal, windowed and without RoPE, output row i depends on inputs i - window_left ... i alone,
        # not on its position: so the last rows of a call on the last 2w inputs are the full call's last
        # w rows, at a fraction of its time (the first rows are checked at the family's shortest T).
        w = shape.window_left + 1
        out = multi_head_attention(config, tensors, x[:, -2 * w:], is_causal=True, chunk_size=min(CHUNK_SIZE, w))
        return np.asarray(out[:, w:], np.float64), slice(shape.T - w, None)
    chunk = min(CHUNK_SIZE, shape.T) if shape.long else None
    out = multi_head_attention(config, tensors, x, is_causal=shape.causal, chunk_size=chunk)
    return np.asarray(out, np.float64), slice(None)


def _row(backend, shape, path, status, rate) -> dict:
    return {
        "backend": backend, "shape": shape.name, "B": shape.B, "T": shape.T, "S": shape.S, "D": shape.D, "N": shape.N,
        "H": shape.H, "causal": shape.causal, "sweep": shape.sweep, "family": shape.family, "K": shape.kv_heads,
        "P": shape.P, "window_left": shape.window_left,
        **({"decode_floor": shape.decode_floor} if shape.family == "decode" else {}),
        "path": None if path is None else path.name, "kind": None if path is None else path.kind,
        "mode": None if path is None else path.mode, "pass": None if path is None else path.pass_,
        "note": "" if path is None else path.note, "status": status,
        "flops": path.flops if path is not None and path.flops is not None else
        shape.flops * (3 if path is not None and path.pass_ == "forward+backward" else 1),
        "io_bytes": shape.io_bytes, "matmul_flops_per_s": rate, "matmul_flops": None, "matmul_ratio": None,
        "median_s": None, "min_s": None, "max_s": None, "q1_s": None, "q3_s": None, "times_s": [], "repeats": 0,
        "first_call_s": None, "compile_s": None, "peak_bytes": None, "memory_method": None, "peak_over_io": None,
        "max_abs_diff_vs_numpy": None, "reference_max_abs": None,
        "pct_matmul": None, "native_path": None, "ratio_to_native": None,
    }


def _finish(row: dict) -> None:
    if row["status"] == "ok":
        # measure_paired's ratio: the path's time over the matmul run just before it, median over pairs
        row["pct_matmul"] = 100.0 * row["flops"] / row["matmul_flops"] / row["matmul_ratio"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.bench.worker")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.worker[0]).read_text())
    result = run_worker(spec)
    Path(args.worker[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
