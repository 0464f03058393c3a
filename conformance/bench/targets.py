"""`mha bench`'s targets (speed and memory on the named shapes; the window and
decode families' own), judged on a result set: each measured, with its
threshold, pass or miss; and each path's ratio to the native fastest."""

from __future__ import annotations

import statistics

from conformance.bench.shapes import BACKENDS, FRAMEWORKS


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
    """The targets evaluated on a result set (a bench JSON dict, or its
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
    families = {r.get("family") for r in rows}
    if "window" in families:
        out += window_targets(rows)
    if "decode" in families:
        out += decode_targets(rows)
    return out


WINDOW_FLAT = 1.3  # window: time per query token at most 1.3x from the shortest to the longest T
WINDOW_MEMORY = 4.0  # ... and peak memory under 4x inputs+outputs
DECODE_LINEAR = 10.0  # decode: every point within 10% of the least-squares line a + b*P (our reading of "linearly")
DECODE_READ = 2.0  # ... and each step within 2x of one read of its cache


def _family(rows, family, backend, kind="ours"):
    return [r for r in rows if r.get("family") == family and r["backend"] == backend and r["kind"] == kind
            and r["pass"] == "forward"]


def _why_not(rows, family, backend) -> str:
    """The status of a backend's rows in a family that did not run (skipped, failed), for 'not measured'."""
    failed = [r["status"] for r in rows if r.get("family") == family and r["backend"] == backend and r["status"] != "ok"]
    return failed[0] if failed else "no rows"


def _fastest_by(rows, length: str) -> dict:
    """length (T or P) -> the row of least paired time (matmul_ratio) there."""
    best: dict = {}
    for r in rows:
        if r["status"] == "ok" and r.get("matmul_ratio"):
            if r[length] not in best or r["matmul_ratio"] < best[r[length]]["matmul_ratio"]:
                best[r[length]] = r
    return dict(sorted(best.items()))


def window_targets(rows) -> list[dict]:
    """Per backend, on its chunked path (the fastest at each T): the spread of the time per query
    token over the family's lengths, as the largest over the smallest of matmul_ratio / T (paired
    times, so a change of machine speed between lengths cancels), <= 1.3x; the same in NumPy and at
    least two frameworks; and the largest peak memory over inputs+outputs, < 4x."""
    out, flat = [], {}
    for backend in BACKENDS:
        best = _fastest_by(_family(rows, "window", backend), "T")
        per_token = {T: r["matmul_ratio"] / T for T, r in best.items()}
        spread = max(per_token.values()) / min(per_token.values()) if len(per_token) >= 2 else None
        paths = ", ".join(sorted({r["path"] for r in best.values()}))
        lengths = f"T {min(best)}-{max(best)}" if best else ""
        entry = _entry(f"{backend} window: time per query token flat across T (max/min <= {WINDOW_FLAT:g}x)", backend,
                       "window", spread, WINDOW_FLAT, "<=", unit="x", path=f"{paths} ({lengths})" if best else None,
                       why=_why_not(rows, "window", backend) if len(per_token) < 2 else None)
        flat[backend] = entry
        out.append(entry)
    for backend in BACKENDS:
        peaks = [r for r in _fastest_by(_family(rows, "window", backend), "T").values() if r.get("peak_over_io") is not None]
        worst = max(peaks, key=lambda r: r["peak_over_io"], default=None)
        out.append(_entry(f"{backend} window forward peak memory < {WINDOW_MEMORY:g}x inputs+outputs (largest over T)",
                          backend, "window", None if worst is None else worst["peak_over_io"], WINDOW_MEMORY, "<",
                          unit="x", path=None if worst is None else f"{worst['path']} at T {worst['T']}",
                          why=None if worst else _why_not(rows, "window", backend)))
    frameworks = sorted((e for b, e in flat.items() if b != "numpy" and e["measured"] is not None),
                        key=lambda e: e["measured"])[:2]
    numpy_ = flat["numpy"]
    if numpy_["measured"] is None or len(frameworks) < 2:
        out.append({"target": "window: flat in numpy and at least two frameworks", "backend": "numpy+2",
                    "shape": "window", "measured": None, "threshold": WINDOW_FLAT, "unit": "x", "path": None,
                    "pass": None, "status": "not measured: needs numpy and two frameworks"})
    else:
        worst = max(numpy_["measured"], frameworks[-1]["measured"])
        out.append(_entry("window: flat in numpy and at least two frameworks", "numpy+2", "window", worst, WINDOW_FLAT,
                          "<=", unit="x", path="numpy, " + ", ".join(e["backend"] for e in frameworks)))
    return out


def linear_fit(xs, ys) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _floor(row) -> str:
    """The step's own byte floor at that P (conformance.bench.shapes.Shape.decode_floor), where the row carries it."""
    return f" (floor {row['decode_floor']:.2f}x: weights + cache over cache)" if "decode_floor" in row else ""


def decode_targets(rows) -> list[dict]:
    """Per backend, its fastest step at each cache length P (paired times): linear in P (every
    point within DECODE_LINEAR of the least-squares line a + b*P, and b > 0), and within 2x of
    one read of the cache at every P (the step's paired time over the read's, both in the same
    worker and shape, the read a sum over past_key and past_value in the backend's framework)."""
    out = []
    for backend in BACKENDS:
        steps = _fastest_by(_family(rows, "decode", backend), "P")
        reads = _fastest_by(_family(rows, "decode", backend, kind="reference"), "P")
        paths = ", ".join(sorted({r["path"] for r in steps.values()}))
        deviation = why = None
        if len(steps) >= 3:
            a, b = linear_fit(list(steps), [r["matmul_ratio"] for r in steps.values()])
            deviation = 100.0 * max(abs(r["matmul_ratio"] - (a + b * P)) / r["matmul_ratio"] for P, r in steps.items())
        else:
            why = _why_not(rows, "decode", backend) if not steps else "needs three cache lengths"
        entry = _entry(f"{backend} decode: step time linear in P (every point within {DECODE_LINEAR:g}% of the "
                       "fitted line)", backend, "decode", deviation, DECODE_LINEAR, "<=", unit="%",
                       path=f"{paths} (P {min(steps)}-{max(steps)})" if steps else None, why=why)
        if deviation is not None and b <= 0:
            entry.update({"pass": False, "status": "miss"})  # flat or falling: no growth with P to call linear
        out.append(entry)
        both = [P for P in steps if P in reads and reads[P].get("matmul_ratio")]
        ratio = {P: steps[P]["matmul_ratio"] / reads[P]["matmul_ratio"] for P in both}
        worst = max(ratio, key=ratio.get, default=None)
        out.append(_entry(f"{backend} decode: step <= {DECODE_READ:g}x one read of its cache (at every P)", backend,
                          "decode", None if worst is None else ratio[worst], DECODE_READ, "<=", unit="x",
                          path=None if worst is None else (f"{steps[worst]['path']} vs cache.read, worst at P {worst}"
                                                           + _floor(steps[worst])),
                          why=None if worst is not None else _why_not(rows, "decode", backend)))
    return out
