"""The measured tables of docs/gpu.md, from the files of a GPU run (scripts/gpu_run.py).

    python scripts/gpu_report.py docs/gpu/2026-11-27-h200 > /tmp/tables.md

Reads FILE.json or FILE.json.xz for check-torch, check-jax, tf32, natives,
kernels and bench-*; prints markdown. Every number comes from those files.
"""

from __future__ import annotations

import collections
import json
import lzma
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("float64", "float32", "float16", "bfloat16")
TF32_OVER_FLOAT32 = 2.0**-11 / 2.0**-24  # the tolerance policy's unit round-off, TF32 over float32


def load(folder: Path, name: str):
    for path, opener in ((folder / f"{name}.json", open), (folder / f"{name}.json.xz", lzma.open)):
        if path.exists():
            with opener(path, "rt") as f:
                return json.load(f)
    return None


def _cell(rs) -> str:
    if not rs:
        return "-"
    ran = [r for r in rs if r["status"] in ("pass", "fail")]
    counts = collections.Counter(r["status"] for r in rs)
    text = f"{counts['pass']}/{len(rs)}"
    extra = [f"{counts[s]} {s}" for s in ("fail", "error", "unsupported") if counts[s]]
    if extra:
        text += " (" + ", ".join(extra) + ")"
    if ran:
        text += f", worst {max(r['margin'] for r in ran):.3g}"
    return text


def check_table(results) -> list[str]:
    """Rows backend / path / device, a column per dtype: passed/results, worst margin."""
    groups = collections.defaultdict(list)
    for r in results:
        groups[(r["backend"], r["path"], r["device"], r["dtype"])].append(r)
    keys = sorted({k[:3] for k in groups}, key=lambda k: (k[0], k[2], k[1]))
    lines = ["| backend | path | device | " + " | ".join(DTYPES) + " |", "|" + " --- |" * (3 + len(DTYPES))]
    for b, p, d in keys:
        lines.append(f"| {b} | {p} | {d} | " + " | ".join(_cell(groups.get((b, p, d, t), [])) for t in DTYPES) + " |")
    return lines


def tf32_table(highest, tf32) -> list[str]:
    """Per backend and path, float32 on the GPU: the largest output error with TF32 off (the default
    precision) and on, and the worst margin under each judgement."""
    def by_key(results):
        return {(r["case"], r["backend"], r["path"]): r for r in results
                if r["device"] == "gpu" and r["dtype"] == "float32" and r["status"] == "pass"}

    def output_error(r):
        return max((c["max_abs_error"] for c in r.get("comparisons") or [] if c["name"] == "output"), default=None)

    hi, tf = by_key(highest), by_key(tf32)
    rows = collections.defaultdict(list)
    for key in hi.keys() & tf.keys():
        rows[key[1:]].append((hi[key], tf[key]))
    lines = ["| backend | path | cases | worst output error, TF32 off | TF32 on | median ratio on/off | "
             "worst margin, TF32 off (float32's u) | TF32 on (TF32's u) | TF32 on, judged with float32's u |",
             "|" + " --- |" * 9]
    for (b, p), pairs in sorted(rows.items()):
        off = [output_error(h) for h, _ in pairs]
        on = [output_error(t) for _, t in pairs]
        ratios = sorted(o / f for o, f in zip(on, off) if o is not None and f)
        margin_off = max(h["margin"] for h, _ in pairs)
        margin_on = max(t["margin"] for _, t in pairs)
        lines.append(f"| {b} | {p} | {len(pairs)} | {max(x for x in off if x is not None):.2e} | "
                     f"{max(x for x in on if x is not None):.2e} | {ratios[len(ratios) // 2]:.0f}x | {margin_off:.3g} | "
                     f"{margin_on:.3g} | {margin_on * TF32_OVER_FLOAT32:.3g} |")
    return lines


def natives_table(results) -> list[str]:
    groups = collections.defaultdict(list)
    for r in results:
        groups[r["backend"]].append(r)
    lines = ["| backend | results | pass | fail (known difference) | fail / error (new) | unsupported |",
             "|" + " --- |" * 6]
    new = []
    for b, rs in sorted(groups.items()):
        known = [r for r in rs if r["status"] in ("fail", "error") and "known difference" in (r.get("message") or "")]
        fresh = [r for r in rs if r["status"] in ("fail", "error") and r not in known]
        new += fresh
        lines.append(f"| {b} | {len(rs)} | {sum(r['status'] == 'pass' for r in rs)} | {len(known)} | {len(fresh)} | "
                     f"{sum(r['status'] == 'unsupported' for r in rs)} |")
    if new:
        lines += ["", "Failures and errors that are not a recorded known difference:", ""]
        seen = collections.defaultdict(list)
        for r in new:
            seen[(r["backend"], r["case"], r["status"], (r.get("message") or "").split("  ")[0][:160])].append(r["dtype"])
        for (b, case, status, msg), dtypes in seen.items():
            lines.append(f"- {b}, {case} ({', '.join(dtypes)}): {status}: `{msg}`")
    return lines


def bench_table(data) -> list[str]:
    lines = ["| shape | path | pass | median ms | % of matmul rate | x fastest native | peak MiB | max abs diff vs NumPy |",
             "|" + " --- |" * 8]
    for r in data["results"]:
        if r["status"] != "ok":
            if r["path"] is None:
                lines.append(f"| {r['shape']} | - | - | {r['status']} | | | | |")
            continue
        ratio = "-" if r.get("ratio_to_native") is None else f"{r['ratio_to_native']:.2f}"
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
        diff = "-" if r["max_abs_diff_vs_numpy"] is None else f"{r['max_abs_diff_vs_numpy']:.1e}"
        lines.append(f"| {r['shape']} | {r['path']} | {r['pass']} | {r['median_s'] * 1e3:.3f} | {r['pct_matmul']:.1f} | "
                     f"{ratio} | {peak} | {diff} |")
    rates = [m["flops_per_s"] / 1e12 for m in data["matmul"]]
    lines += ["", f"Matmul rate ({data['settings']['dtype']} {data['settings']['matmul_n']}^3, one run before each "
                  f"timed call): {min(rates):.1f}-{max(rates):.1f} TFLOP/s."]
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0])
    sys.path.insert(0, str(ROOT))
    out = []
    core = (load(folder, "check-torch") or {}).get("results", []) + (load(folder, "check-jax") or {}).get("results", [])
    out += ["### mha check, core backends", ""] + check_table(core) + [""]
    tf32 = load(folder, "tf32")
    if tf32:
        out += ["### TF32", ""] + tf32_table(core, tf32["results"]) + [""]
    natives = load(folder, "natives")
    if natives:
        out += ["### Native backends on the GPU", ""] + natives_table(natives["results"]) + [""]
    kernels = load(folder, "kernels")
    if kernels:
        from conformance.native.conventions.kernels import markdown

        out += ["### Forced kernels", ""] + markdown(kernels).splitlines() + [""]
    for name in ("bench-torch", "bench-jax", "bench-jax-decode", "bench-torch-bf16", "bench-jax-bf16"):
        data = load(folder, name)
        if data:
            out += [f"### {name} ({data['settings']['dtype']})", ""] + bench_table(data) + [""]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
