"""The issue's targets (issue 7), judged on a result set: each measured, with
its threshold, pass or miss; and each path's ratio to the native fastest."""

from __future__ import annotations

from bench.shapes import BACKENDS, FRAMEWORKS


def add_native_ratios(results: list[dict]) -> None:
    """ratio_to_native: time / the fastest native path of the same backend, shape,
    pass and mode (eager against eager, compiled against compiled); where the
    backend has no native path in that mode (NumPy), against any mode. Both
    times are taken as measure_paired's matmul_ratio (each path's time over its
    own adjacent matmul runs): the two paths ran a minute or so apart, and a
    change of machine speed between them cancels out of this ratio, where it
    would stay in a ratio of their medians."""
    ok = [r for r in results if r["status"] == "ok" and r["kind"] == "native" and r.get("matmul_ratio")]
    for r in results:
        if r["status"] != "ok" or not r.get("matmul_ratio"):
            continue
        same = [n for n in ok if (n["backend"], n["shape"], n["pass"]) == (r["backend"], r["shape"], r["pass"])]
        pool = [n for n in same if n["mode"] == r["mode"]] or same
        if pool:
            best = min(pool, key=lambda n: n["matmul_ratio"])
            r["native_path"] = f"{best['path']}"
            r["ratio_to_native"] = r["matmul_ratio"] / best["matmul_ratio"]


def _best(results, backend, shape, *, kind="ours", mode=None, pass_="forward", key="median_s"):
    rows = [r for r in results if r["status"] == "ok" and r["backend"] == backend and r["shape"] == shape
            and r["kind"] == kind and r["pass"] == pass_ and (mode is None or r["mode"] == mode)
            and r.get(key) is not None]
    return min(rows, key=lambda r: r[key]) if rows else None


def _entry(target, backend, shape, measured, threshold, op, *, unit, path=None, why=None) -> dict:
    if measured is None:
        return {"target": target, "backend": backend, "shape": shape, "measured": None, "threshold": threshold,
                "unit": unit, "path": path, "pass": None, "status": f"not measured{': ' + why if why else ''}"}
    passed = {">=": measured >= threshold, "<=": measured <= threshold, ">": measured > threshold,
              "<": measured < threshold}[op]
    return {"target": target, "backend": backend, "shape": shape, "measured": measured, "threshold": threshold,
            "unit": unit, "path": path, "pass": bool(passed), "status": "pass" if passed else "miss"}


def targets(results) -> list[dict]:
    """The issue's targets evaluated on a result set (a bench JSON dict, or its
    "results" list). One entry per target and backend/shape; `pass` is None
    where the measurement is missing."""
    rows = results["results"] if isinstance(results, dict) else results
    out = []
    for backend in FRAMEWORKS:
        for shape in ("bert-base", "vit-b16"):
            best = max((r for r in rows if r["status"] == "ok" and r["backend"] == backend and r["shape"] == shape
                        and r["kind"] == "ours" and r["pass"] == "forward"), key=lambda r: r["pct_matmul"], default=None)
            out.append(_entry(f"{backend} forward at {shape} >= 85% of matmul rate", backend, shape,
                              None if best is None else best["pct_matmul"], 85.0, ">=", unit="%",
                              path=None if best is None else best["path"]))
            for mode in ("eager", "compiled"):  # by paired time (add_native_ratios says why)
                ours = _best(rows, backend, shape, mode=mode, key="matmul_ratio")
                native = _best(rows, backend, shape, kind="native", mode=mode, key="matmul_ratio")
                ratio = None if ours is None or native is None else ours["matmul_ratio"] / native["matmul_ratio"]
                out.append(_entry(f"{backend} {mode} forward at {shape} <= 1.10x native fastest {mode}", backend, shape,
                                  ratio, 1.10, "<=", unit="x",
                                  path=None if ratio is None else f"{ours['path']} vs {native['path']}"))
    for shape in ("gpt2", "long"):
        for backend in BACKENDS:
            best = max((r for r in rows if r["status"] == "ok" and r["backend"] == backend and r["shape"] == shape
                        and r["kind"] == "ours" and r["pass"] == "forward"), key=lambda r: r["pct_matmul"], default=None)
            out.append(_entry(f"{backend} causal {shape} forward > 100% of matmul rate (full T*S FLOPs)", backend, shape,
                              None if best is None else best["pct_matmul"], 100.0, ">", unit="%",
                              path=None if best is None else best["path"]))
        numpy_ok = out[-4]["pass"]
        fw = [e for e in out[-3:] if e["measured"] is not None]
        top = max(fw, key=lambda e: e["measured"], default=None)
        both = None if numpy_ok is None or top is None else bool(numpy_ok and top["pass"])
        out.append({"target": f"causal {shape}: > 100% in numpy and at least one framework", "backend": "numpy+any",
                    "shape": shape, "measured": None if top is None else min(out[-4]["measured"] or 0, top["measured"]),
                    "threshold": 100.0, "unit": "%", "path": None if top is None else f"numpy, {top['backend']}",
                    "pass": both, "status": "not measured" if both is None else ("pass" if both else "miss")})
    best = max((r for r in rows if r["status"] == "ok" and r["backend"] == "numpy" and r["shape"] == "bert-base"
                and r["kind"] == "ours" and r["pass"] == "forward"), key=lambda r: r["pct_matmul"], default=None)
    out.append(_entry("numpy float32 forward at bert-base >= 75% of matmul rate", "numpy", "bert-base",
                      None if best is None else best["pct_matmul"], 75.0, ">=", unit="%",
                      path=None if best is None else best["path"]))
    for backend in BACKENDS:
        best = _best(rows, backend, "long", key="peak_over_io")
        out.append(_entry(f"{backend} long forward peak memory < 4x inputs+outputs", backend, "long",
                          None if best is None else best["peak_over_io"], 4.0, "<", unit="x",
                          path=None if best is None else best["path"]))
    return out
