"""`mha bench --shapes latent`: a latent (MLA) layer's decode step, its cache measured, in every backend.

The layer: DeepSeek-V3's attention heads on fewer of them, N 16, kv_rank C 512, rope_dim R 64, 128
features without position (head_dim H = 192), V 128; D 2048 (our choice, DeepSeek-V2-Lite's hidden size:
its attention has these very sizes), one query projection (no query_rank), no biases, RoPE theta 10000,
float32, B 1. One new token after a cache of P = 4096 ... 65536 tokens.

Its cache holds C + R values per token (past_key (B, 1, P, C), the normed latent; past_value (B, 1, P, R),
the rotated shared key), where the per-head cache of the same layer holds N (H + V): keys (B, N, P, H) and
values (B, N, P, V). Per P and backend, each in a worker process of its own (as `mha bench`'s others):

  absorbed       the layer's decode step, as a decoder calls it: the backend's public call with an in-place
                 latent cache (cache_length=P), which runs the absorbed form
  expanded       the same layer decoded over the per-head cache (frameworks/latent.py's expanded_step, from
                 the backend's own stage functions); that cache is impl_numpy.latent.expand of the cached
                 latent and rotary key (the layer's own key and value up-projections, each head's keys
                 joined with the shared rotary key), computed once per P in float32 before timing and
                 handed to the backend (shared by NumPy and torch, copied by TensorFlow and JAX, whose
                 worker then drops the NumPy arrays: one copy held while timing)
  read.latent    one read of what the absorbed step reads: a sum over its latent cache and every weight,
                 in the backend (the machine's read bandwidth, measured in the same run)
  read.expanded  the same for the expanded step (its per-head cache and every weight)

Timed as every `mha bench` path (measure_paired: each timed call right after one run of a large matmul,
ratios of paired times cancel the shared VM's drift). Each step's output is compared with impl_numpy's
float64 call over the latent cache (max_abs_diff). Targets (targets()):

  bytes      the cache bytes per token, latent over per-head, exactly (C + R) / (N (H + V)), from the
             arrays each backend holds, at every P
  speed      expanded over absorbed (paired) >= 4x at every P >= 32768, in NumPy and two frameworks
  bandwidth  absorbed over read.latent (paired) <= 2x at every P
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

from conformance.bench.child import run_worker_process
from conformance.bench.shapes import LATENT_LENGTHS, QUICK_LATENT_LENGTHS  # noqa: F401 - the family's lengths

FAMILY = "latent"
SPEEDUP = 4.0  # absorbed at least 4x faster than expanded ...
SPEEDUP_FROM = 32768  # ... at every P from this one
READ_BOUND = 2.0  # absorbed within 2x of one read of its latent cache and weights
QUICK_SPEEDUP_FROM = 32  # --quick: the speed target judged on the quick lengths (not the targets' figures)


@dataclasses.dataclass(frozen=True)
class Dims:
    B: int
    D: int  # hidden size (the query and key inputs, the output)
    N: int  # heads
    C: int  # kv_rank: the latent's width
    R: int  # rope_dim: the shared rotary key's width, the last R features of each query/key head
    nope: int  # each head's key features without position
    V: int  # value head width

    @property
    def H(self) -> int:
        return self.nope + self.R

    def latent_bytes_per_token(self) -> int:
        """float32 bytes the latent cache holds per token (one layer): C + R values."""
        return (self.C + self.R) * 4

    def expanded_bytes_per_token(self) -> int:
        """float32 bytes the per-head cache of the same layer holds per token: N (H + V) values."""
        return self.N * (self.H + self.V) * 4

    def projection_flops(self) -> int:
        """FLOPs of one token's projections, either form: the query (D -> N H), the latent and rotary key (D ->
        C + R), the latent's key and value up-projections (C -> N (H - R) and N V: the absorbed form's query
        absorption and value expansion, or the expanded form's new key and value), the output (N V -> D)."""
        D, N, C, R, H, V = self.D, self.N, self.C, self.R, self.H, self.V
        return 2 * self.B * (D * N * H + D * (C + R) + C * N * (H - R) + C * N * V + N * V * D)

    def absorbed_flops(self, P: int) -> int:
        """One step's FLOPs, absorbed: every head's logits over P + 1 keys of width C + R, its context over
        values of width C, and the projections."""
        return 2 * self.B * self.N * (P + 1) * (2 * self.C + self.R) + self.projection_flops()

    def expanded_flops(self, P: int) -> int:
        """One step's FLOPs, expanded: every head's logits over P + 1 keys of width H, its context over
        values of width V, and the projections."""
        return 2 * self.B * self.N * (P + 1) * (self.H + self.V) + self.projection_flops()

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "H": self.H}


FULL = Dims(B=1, D=2048, N=16, C=512, R=64, nope=128, V=128)
QUICK = Dims(B=1, D=32, N=4, C=16, R=4, nope=8, V=8)  # --quick: the same pipeline in seconds


def dims(quick: bool) -> Dims:
    return QUICK if quick else FULL


def expected_ratio(d: Dims) -> Fraction:
    """The latent cache's bytes over the per-head cache's, exactly: (C + R) / (N (H + V))."""
    return Fraction(d.C + d.R, d.N * (d.H + d.V))


def layer(d: Dims):
    """(config, tensors float32): the family's latent layer, seeded."""
    import weights

    config = weights.AttentionConfig(
        num_heads=d.N, query_dim=d.D, head_dim=d.H, value_head_dim=d.V, use_query_bias=False,
        use_key_bias=False, use_value_bias=False, use_output_bias=False, rope={"theta": 10000.0},
        latent={"query_rank": None, "kv_rank": d.C, "rope_dim": d.R})
    return config, weights.init(config, seed=0, dtype="float32")


def inputs(d: Dims, P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The new token x (B, 1, D) and the latent cache: latent (B, 1, P, C), rotary key (B, 1, P, R)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((d.B, 1, d.D), dtype=np.float32)
    return (x, rng.standard_normal((d.B, 1, P, d.C), dtype=np.float32),
            rng.standard_normal((d.B, 1, P, d.R), dtype=np.float32))


def expand_cache(config, tensors, latent, rotary) -> tuple[np.ndarray, np.ndarray]:
    """The per-head cache of the same layer: impl_numpy.latent.expand (the layer's key and value
    up-projections, each head's keys joined with the shared rotary key) of the cached latent and rotary key,
    float32. -> keys (B, N, P, H), values (B, N, P, V), contiguous."""
    from impl_numpy.latent import expand

    keys, values = expand(config, argparse.Namespace(params=tensors), latent, rotary)
    return np.ascontiguousarray(keys), np.ascontiguousarray(values)


def reference(config, tensors, x, latent, rotary) -> np.ndarray:
    """impl_numpy's call over the latent cache in float64 (mha check holds its two forms to the float64
    expanded one): the output every step is compared with."""
    from impl_numpy.attention import multi_head_attention

    return np.asarray(multi_head_attention(config, tensors, x, past_key=latent, past_value=rotary, is_causal=True,
                                           causal_alignment="bottom_right", dtype="float64"))


# --- one backend, in a process of its own -------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _peak_rss() -> int | None:
    from conformance.bench.measure import proc_kb

    try:
        return proc_kb("/proc/self/status", "VmHWM") * 1024
    except OSError:
        return None


def run_worker(spec: dict) -> dict:
    from conformance.bench.frameworks.latent import BUILDERS
    from conformance.bench.measure import MATMUL, measure_paired
    from conformance.bench.runners import RUNNERS, Unsupported

    backend, d = spec["backend"], Dims(**spec["dims"])
    started = time.perf_counter()
    try:
        runner = RUNNERS[backend](spec["device"], spec["quick"], "float32")
    except Exception as err:  # noqa: BLE001 - any failure to import or set up means 'unavailable'
        return {"backend": backend, "status": f"unavailable: {type(err).__name__}: {err}".splitlines()[0]}
    config, tensors = layer(d)
    weight_bytes = sum(t.nbytes for t in tensors.values())
    rows, caches, matmuls = [], [], []
    for P in spec["lengths"]:
        x, latent, rotary = inputs(d, P)
        expanded_bytes = P * d.expanded_bytes_per_token()
        held = None
        why = None
        if 2 * expanded_bytes > spec["mem_limit"]:
            why = (f"skipped: the per-head cache ({expanded_bytes / 2**30:.2f} GiB) and its copy while handed to "
                   f"the backend would pass --mem-limit {spec['mem_limit'] / 2**30:.1f} GiB")
        else:
            try:
                held = expand_cache(config, tensors, latent, rotary)
            except MemoryError:
                why = f"failed: MemoryError building the per-head cache ({expanded_bytes / 2**30:.2f} GiB)"
        try:
            if backend not in BUILDERS:
                raise Unsupported(f"no latent family runner for {backend} yet (its latent paths run in mha check)")
            paths, nbytes = BUILDERS[backend](spec["device"], config, tensors, x, P, latent, rotary, held)
        except Unsupported as err:
            rows.append(_row(backend, P, None, f"skipped: {err}"))
            _log(f"  {backend} latent P={P}: skipped: {err}")
            continue
        except Exception as err:  # noqa: BLE001 - reported in the backend's rows
            rows.append(_row(backend, P, None, f"failed: setting up paths: {type(err).__name__}: {err}"[:300]))
            _log(f"  {backend} latent P={P}: could not set up paths: {err}")
            continue
        held = None  # TensorFlow and JAX copied it; NumPy and torch share it through their paths
        caches.append({"backend": backend, "P": P, "latent_bytes": nbytes["latent"],
                       "expanded_bytes": nbytes["expanded"]})
        expected = reference(config, tensors, x, latent, rotary)
        measured = measure_paired({path.name: path.call for path in paths}, runner.matmul(spec["matmul_n"]),
                                  repeats=spec["repeats"], max_seconds=spec["max_seconds"])
        matmuls.append({"backend": backend, "P": P, **measured.pop(MATMUL)})
        for path in paths:
            row = _row(backend, P, path, "ok")
            row["bytes_read"] = weight_bytes + (nbytes["latent"] if path.name in ("absorbed", "read.latent")
                                                else nbytes["expanded"])
            row["flops"] = {"absorbed": d.absorbed_flops(P), "expanded": d.expanded_flops(P)}.get(path.name)
            try:
                if isinstance(measured[path.name], Exception):
                    raise measured[path.name]
                row.update(measured[path.name])
                if path.compare:
                    y = np.asarray(runner.to_numpy(path.call()), np.float64)
                    row["max_abs_diff"] = float(np.abs(y - expected).max())
                    row["reference_max_abs"] = float(np.abs(expected).max())
            except Exception as err:  # noqa: BLE001
                row["status"] = f"failed: {type(err).__name__}: {err}".splitlines()[0][:300]
            rows.append(row)
            _log(f"  {backend:5} latent P={P:<6} {path.name:14} " + (
                f"{row['median_s'] * 1e3:10.2f} ms" if row["status"] == "ok" else row["status"]))
        if why is not None:
            rows += [_row(backend, P, None, why, name) for name in ("expanded", "read.expanded")]
        del paths, measured
        gc.collect()
    return {"backend": backend, "status": "ok", "info": runner.info, "rows": rows, "caches": caches,
            "matmul": matmuls, "weight_bytes": weight_bytes, "peak_rss_bytes": _peak_rss(),
            "worker_s": time.perf_counter() - started}


def _row(backend, P, path, status, name=None) -> dict:
    return {"backend": backend, "P": P, "path": path.name if path is not None else name,
            "kind": None if path is None else path.kind, "mode": None if path is None else path.mode,
            "note": "" if path is None else path.note, "status": status, "bytes_read": None, "median_s": None,
            "min_s": None, "max_s": None, "q1_s": None, "q3_s": None, "times_s": [], "repeats": 0,
            "first_call_s": None, "matmul_ratio": None, "max_abs_diff": None, "reference_max_abs": None,
            "flops": None}


def run(backends, *, quick: bool, lengths, repeats: int, max_seconds: float, mem_limit: int, matmul_n: int,
        device: str = "cpu") -> dict:
    """Every backend's worker in turn; the family's record (rows, caches, matmuls, per backend status)."""
    d = dims(quick)
    spec = {"dims": dataclasses.asdict(d), "lengths": list(lengths), "quick": quick, "repeats": repeats,
            "max_seconds": max_seconds, "mem_limit": mem_limit, "matmul_n": matmul_n, "device": device}
    record = {"family": FAMILY, "quick": quick, "dims": d.to_dict(), "lengths": list(lengths),
              "speedup_from": QUICK_SPEEDUP_FROM if quick else SPEEDUP_FROM,
              "bytes_per_token": {"latent": d.latent_bytes_per_token(), "expanded": d.expanded_bytes_per_token()},
              "expected_ratio": [expected_ratio(d).numerator, expected_ratio(d).denominator],
              "expanded_cache": "impl_numpy.latent.expand of the cached latent and rotary key, float32, once per P "
                                "before timing; handed to the backend (shared by numpy and torch, copied by tf "
                                "and jax, whose NumPy arrays are then dropped)",
              "backends": {}, "rows": [], "caches": [], "matmul": []}
    for backend in backends:
        _log(f"{backend}: latent family, P {', '.join(map(str, lengths))} ...")
        out = run_worker_process("conformance.bench.latent", backend, spec)
        record["backends"][backend] = {k: out.get(k) for k in ("status", "info", "weight_bytes", "peak_rss_bytes",
                                                               "worker_s")}
        for key in ("rows", "caches", "matmul"):
            record[key] += out.get(key, [])
    return record


# --- what it shows ------------------------------------------------------------------------------------------------


def _timed(record: dict, backend: str) -> dict:
    """(P, path) -> the row, where it ran."""
    return {(r["P"], r["path"]): r for r in record["rows"]
            if r["backend"] == backend and r["status"] == "ok" and r.get("matmul_ratio")}


def ratios(record: dict, backend: str) -> dict:
    """P -> {speedup: expanded over absorbed, over_read: absorbed over read.latent, expanded_over_read,
    read_GBps: read.latent's bytes over its median}, each where both paths ran (paired times)."""
    timed, out = _timed(record, backend), {}
    for P in record["lengths"]:
        a, e = timed.get((P, "absorbed")), timed.get((P, "expanded"))
        rl, re_ = timed.get((P, "read.latent")), timed.get((P, "read.expanded"))
        out[P] = {"speedup": None if a is None or e is None else e["matmul_ratio"] / a["matmul_ratio"],
                  "over_read": None if a is None or rl is None else a["matmul_ratio"] / rl["matmul_ratio"],
                  "expanded_over_read": None if e is None or re_ is None else e["matmul_ratio"] / re_["matmul_ratio"],
                  "read_GBps": None if rl is None else rl["bytes_read"] / rl["median_s"] / 1e9}
    return out


def _entry(target, backend, measured, threshold, passed, *, unit="x", path=None, why=None) -> dict:
    if measured is None:
        return {"target": target, "backend": backend, "shape": FAMILY, "measured": None, "threshold": threshold,
                "unit": unit, "path": path, "pass": None, "status": f"not measured{': ' + why if why else ''}"}
    return {"target": target, "backend": backend, "shape": FAMILY, "measured": measured, "threshold": threshold,
            "unit": unit, "path": path, "pass": bool(passed), "status": "pass" if passed else "miss"}


def _why_not(record: dict, backend: str, paths) -> str:
    b = record["backends"].get(backend)
    if b is None:
        return "not run"
    if b["status"] != "ok":
        return b["status"]
    failed = [r["status"] for r in record["rows"] if r["backend"] == backend and r["path"] in paths
              and r["status"] != "ok"]
    return failed[0] if failed else "no rows"


def targets(record: dict) -> list[dict]:
    """The family's targets: per backend, the cache bytes ratio (exact), the speed-up at P >=
    speedup_from, the step over the read; and the speed-up in NumPy and at least two frameworks."""
    from conformance.bench.shapes import ALL_BACKENDS as BACKENDS

    d = Dims(**{k: v for k, v in record["dims"].items() if k != "H"})
    expected = expected_ratio(d)
    start = record["speedup_from"]
    out, speed = [], {}
    ran = [b for b in BACKENDS if b in record["backends"]]
    for backend in ran:
        caches = [c for c in record["caches"] if c["backend"] == backend and c["expanded_bytes"]]
        found = [Fraction(c["latent_bytes"], c["expanded_bytes"]) for c in caches]
        worst = max(found, key=lambda f: abs(f - expected), default=None)
        out.append(_entry(f"{backend} latent: cache bytes per token = (C+R)/(N(H+V)) = {expected} of the per-head "
                          "cache, exactly (every P)", backend, None if worst is None else float(worst),
                          float(expected), all(f == expected for f in found),
                          path=None if worst is None else f"{worst} (the arrays held, P {caches[0]['P']}-"
                                                          f"{caches[-1]['P']})",
                          why=_why_not(record, backend, ("expanded",)) if not found else None))
    for backend in ran:
        here = {P: r for P, r in ratios(record, backend).items() if P >= start and r["speedup"] is not None}
        worst = min(here, key=lambda P: here[P]["speedup"], default=None)
        measured = None if worst is None else here[worst]["speedup"]
        speed[backend] = _entry(f"{backend} latent: absorbed step >= {SPEEDUP:g}x faster than expanded at every "
                                f"P >= {start}", backend, measured, SPEEDUP, measured is not None and measured >= SPEEDUP,
                                path=None if worst is None else f"expanded / absorbed, worst at P {worst}",
                                why=_why_not(record, backend, ("absorbed", "expanded")) if worst is None else None)
        out.append(speed[backend])
    frameworks = sorted((e for b, e in speed.items() if b != "numpy" and e["measured"] is not None),
                        key=lambda e: e["measured"], reverse=True)[:2]
    numpy_ = speed.get("numpy")
    summary = f"latent: absorbed >= {SPEEDUP:g}x faster at P >= {start} in numpy and at least two frameworks"
    if numpy_ is None or numpy_["measured"] is None or len(frameworks) < 2:
        out.append(_entry(summary, "numpy+2", None, SPEEDUP, None, why="needs numpy and two frameworks"))
    else:
        measured = min(numpy_["measured"], frameworks[-1]["measured"])
        out.append(_entry(summary, "numpy+2", measured, SPEEDUP, measured >= SPEEDUP,
                          path="numpy, " + ", ".join(e["backend"] for e in frameworks)))
    for backend in ran:
        here = {P: r for P, r in ratios(record, backend).items() if r["over_read"] is not None}
        worst = max(here, key=lambda P: here[P]["over_read"], default=None)
        measured = None if worst is None else here[worst]["over_read"]
        out.append(_entry(f"{backend} latent: absorbed step <= {READ_BOUND:g}x one read of its latent cache and "
                          "weights (every P)", backend, measured, READ_BOUND,
                          measured is not None and measured <= READ_BOUND,
                          path=None if worst is None else f"absorbed / read.latent, worst at P {worst}",
                          why=_why_not(record, backend, ("absorbed", "read.latent")) if worst is None else None))
    return out


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.3g}"


def print_family(console, record: dict) -> None:
    """Per P: the bytes per token of both caches; per backend: absorbed ms / expanded ms, the speed-up and
    the absorbed step over its read (paired); then each backend's read bandwidth and peak memory."""
    from rich.table import Table

    from conformance.bench.shapes import ALL_BACKENDS as BACKENDS

    d = record["dims"]
    backends = [b for b in BACKENDS if b in record["backends"]]
    table = Table(title=f"{FAMILY}: one token after P cached, N {d['N']}, C {d['C']}, R {d['R']}, H {d['H']}, "
                        f"V {d['V']}, D {d['D']}, float32 (per backend: absorbed ms / expanded ms / expanded over "
                        "absorbed / absorbed over its read, paired)" + (" --quick" if record["quick"] else ""))
    for col in ("P", "latent B/token", "per-head B/token", "ratio"):
        table.add_column(col, justify="right")
    for b in backends:
        table.add_column(b, justify="right")
    per = {b: ratios(record, b) for b in backends}
    timed = {b: _timed(record, b) for b in backends}
    for P in record["lengths"]:
        cells = []
        for b in backends:
            a, e, r = timed[b].get((P, "absorbed")), timed[b].get((P, "expanded")), per[b][P]
            if a is None and e is None:
                failed = [x["status"] for x in record["rows"] if x["backend"] == b and x["P"] == P]
                cells.append(failed[0].split(":")[0] if failed else "-")
                continue
            speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            over = "-" if r["over_read"] is None else f"{r['over_read']:.2f}x"
            cells.append(f"{_ms(a and a['median_s'])} / {_ms(e and e['median_s'])} / {speed} / {over}")
        bpt = record["bytes_per_token"]
        table.add_row(str(P), f"{bpt['latent']:,}", f"{bpt['expanded']:,}", f"{bpt['latent'] / bpt['expanded']:.4f}",
                      *cells)
    console.print(table)
    for b in backends:
        info = record["backends"][b]
        if info["status"] != "ok":
            console.print(f"[yellow]{FAMILY} {b}: {info['status']}[/]")
            continue
        bw = [r["read_GBps"] for r in per[b].values() if r["read_GBps"]]
        skipped = sorted({x["status"] for x in record["rows"] if x["backend"] == b and x["status"] != "ok"})
        peak = info.get("peak_rss_bytes")
        console.print(f"{FAMILY} {b}: read bandwidth (read.latent) "
                      + (f"{min(bw):.1f}-{max(bw):.1f} GB/s" if bw else "-")
                      + ("" if peak is None else f"; worker peak RSS {peak / 2**30:.2f} GiB")
                      + "".join(f"; {s}" for s in skipped))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.bench.latent")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.worker[0]).read_text())
    Path(args.worker[1]).write_text(json.dumps(run_worker(spec)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
