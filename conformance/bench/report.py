"""`mha bench`'s printed table and its plots."""

from __future__ import annotations

from pathlib import Path

from conformance.bench.shapes import ALL_BACKENDS as BACKENDS
from conformance.bench.shapes import SHAPES

# The title of the targets on the named shapes (targets.targets): speed against the matmul rate and the
# native paths, and memory at long.
SHAPE_TARGETS = f"targets: speed and memory at {', '.join(SHAPES)}"


def _fmt_ms(s):
    return "-" if s is None else (f"{s * 1e3:.3g}" if s < 1 else f"{s * 1e3:,.0f}")


def _fmt_bytes(b):
    if b is None:
        return "-"
    return f"{b / 2**20:.0f} MiB" if b >= 2**20 else f"{b / 2**10:.0f} KiB"


def print_report(console, data: dict) -> None:
    from rich.table import Table

    rows = data["results"]
    title = "mha bench" + (" --quick (shapes shrunk: not the figures the targets ask for)"
                           if data["settings"]["quick"] else "")
    table = Table(title=title, show_lines=False)
    for col in ("shape", "backend", "path", "pass", "median ms", "spread ms (min-max)", "% matmul", "x native",
                "first call s", "peak mem", "note"):
        table.add_column(col, no_wrap=col not in ("note",), justify="right" if col in (
            "median ms", "% matmul", "x native", "first call s", "peak mem") else "left")
    last = None
    for r in (r for r in rows if not r["sweep"]):
        if last is not None and (r["shape"], r["backend"]) != last:
            table.add_section()
        last = (r["shape"], r["backend"])
        if r["status"] != "ok":
            table.add_row(r["shape"], r["backend"], r["path"] or "-", r["pass"] or "-", "-", "", "", "", "", "",
                          f"[yellow]{r['status']}[/]")
            continue
        pct = f"{r['pct_matmul']:.0f}%"
        ratio = "-" if r["ratio_to_native"] is None else f"{r['ratio_to_native']:.2f}"
        style = "bold" if r["kind"] == "ours" else "dim"
        table.add_row(r["shape"], r["backend"], f"[{style}]{r['path']}[/]", r["pass"], _fmt_ms(r["median_s"]),
                      f"{_fmt_ms(r['min_s'])}-{_fmt_ms(r['max_s'])}", pct, ratio, f"{r['first_call_s']:.2f}",
                      _fmt_bytes(r["peak_bytes"]), r["note"])
    if rows:  # none where only sequence-sharded ran (it has its own table)
        console.print(table)
    for name, b in data["backends"].items():
        if b["status"] != "ok":
            console.print(f"[yellow]{name}: {b['status']}[/]")
    rates = {}
    for m in data["matmul"]:
        rates.setdefault(m["backend"], []).append(m["flops_per_s"] / 1e9)
    if rates:
        console.print(f"large-matmul rate ({data['settings'].get('dtype', 'float32')} 2048^3, GFLOP/s, per shape): "
                      + "; ".join(
            f"{b} {min(v):.0f}-{max(v):.0f}" for b, v in rates.items()))
    sweep = [r for r in rows if r["sweep"] and r["path"] is not None]
    if sweep:
        st = Table(title=f"sweep: forward median ms (B {sweep[0]['B']}, D {sweep[0]['D']}, N {sweep[0]['N']}, not causal)")
        st.add_column("T", justify="right")
        cols = sorted({(r["backend"], r["path"]) for r in sweep}, key=lambda k: (BACKENDS.index(k[0]), k[1]))
        for b, p in cols:
            st.add_column(f"{b} {p}", justify="right")
        for T in sorted({r["T"] for r in sweep}):
            cells = []
            for b, p in cols:
                r = next((r for r in sweep if (r["backend"], r["path"], r["T"]) == (b, p, T)), None)
                cells.append("" if r is None else (_fmt_ms(r["median_s"]) if r["status"] == "ok"
                                                   else r["status"].split(":")[0]))
            st.add_row(str(T), *cells)
        console.print(st)
        for key, why in data.get("sweep_stops", {}).items():
            console.print(f"sweep {key}: {why}")
    _print_window(console, rows)
    _print_decode(console, rows)
    if "sequence_sharded" in data:
        from conformance.bench.sharded import print_family

        print_family(console, data["sequence_sharded"])
    if "latent" in data:
        from conformance.bench.latent import print_family as print_latent

        print_latent(console, data["latent"])
    if "sparse" in data:
        from conformance.bench.sparse import print_family as print_sparse

        print_sparse(console, data["sparse"])
    if "v4" in data:
        from conformance.bench.v4 import print_family as print_v4

        print_v4(console, data["v4"])
    families = ("window", "decode")
    ran = data["settings"].get("shapes")
    shape_targets = [e for e in data["targets"] if e["shape"] not in (*families, "sequence-sharded", "latent")]
    if ran is None or any(name in SHAPES for name in ran):
        _print_targets(console, SHAPE_TARGETS, shape_targets)
    elif shape_targets:
        console.print(f"{SHAPE_TARGETS}: none of these shapes ran ({len(shape_targets)} targets, all in --json)")
    family_targets = [e for e in data["targets"] if e["shape"] in families]
    if family_targets:
        _print_targets(console, "targets: window and decode", family_targets)
    sharding_targets = [e for e in data["targets"] if e["shape"] == "sequence-sharded"]
    if sharding_targets:
        _print_targets(console, "targets: sequence sharding", sharding_targets)
    latent_targets = [e for e in data["targets"] if e["shape"] == "latent"]
    if latent_targets:
        _print_targets(console, "targets: latent attention (MLA) decode", latent_targets)


def _print_targets(console, title: str, entries: list[dict]) -> None:
    from rich.table import Table

    tt = Table(title=title)
    for col in ("target", "measured", "threshold", "path", "result"):
        tt.add_column(col)
    for e in entries:
        m = "-" if e["measured"] is None else (f"{e['measured']:.1f}%" if e["unit"] == "%" else f"{e['measured']:.2f}x")
        res = {"pass": "[green]pass[/]", "miss": "[red]miss[/]"}.get(e["status"], f"[yellow]{e['status']}[/]")
        thr = f"{e['threshold']:g}{'%' if e['unit'] == '%' else 'x'}"
        tt.add_row(e["target"], m, thr, e["path"] or "-", res)
    console.print(tt)


def _family_rows(rows, family):
    return [r for r in rows if r.get("family") == family and r["status"] == "ok" and r.get("matmul_ratio")]


def _print_window(console, rows) -> None:
    """Per T, each backend's fastest chunked path: microseconds per query token, its paired time
    per token against the family's shortest T, and peak memory over inputs+outputs."""
    from rich.table import Table

    window = _family_rows(rows, "window")
    if not window:
        return
    r0 = window[0]
    wt = Table(title=f"window: causal, window_left {r0['window_left']}, B {r0['B']}, D {r0['D']}, N {r0['N']} "
                     "(per backend: us per query token / paired time per token over the shortest T's / peak memory "
                     "over inputs+outputs)")
    wt.add_column("T", justify="right")
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in window)]
    best = {}
    for r in window:
        if r["kind"] == "ours":
            key = (r["backend"], r["T"])
            if key not in best or r["matmul_ratio"] < best[key]["matmul_ratio"]:
                best[key] = r
    for b in backends:
        wt.add_column(b, justify="right")
    Ts = sorted({r["T"] for r in window})
    for T in Ts:
        cells = []
        for b in backends:
            r = best.get((b, T))
            first = next((best[(b, t)] for t in Ts if (b, t) in best), None)
            if r is None:
                cells.append("-")
                continue
            spread = (r["matmul_ratio"] / T) / (first["matmul_ratio"] / first["T"])
            peak = "-" if r["peak_over_io"] is None else f"{r['peak_over_io']:.2f}x"
            cells.append(f"{r['median_s'] / T * 1e6:.1f} us / {spread:.2f}x / {peak}")
        wt.add_row(str(T), *cells)
    console.print(wt)


def _print_decode(console, rows) -> None:
    """Per cache length P, each backend's fastest step, its cache read, and the ratio of their paired times."""
    from rich.table import Table

    decode = _family_rows(rows, "decode")
    if not decode:
        return
    r0 = decode[0]
    dt = Table(title=f"decode: one token after a cache of P keys, N {r0['N']}, K {r0['K']}, H {r0['H']}, D {r0['D']} "
                     "(per backend: step ms / cache read ms / step over read, paired; floor: weights + cache "
                     "over cache, the bytes a step must read)")
    dt.add_column("P", justify="right")
    dt.add_column("floor", justify="right")
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in decode)]
    for b in backends:
        dt.add_column(b, justify="right")
    for P in sorted({r["P"] for r in decode}):
        cells = []
        for b in backends:
            here = [r for r in decode if r["backend"] == b and r["P"] == P]
            step = min((r for r in here if r["kind"] == "ours"), key=lambda r: r["matmul_ratio"], default=None)
            read = next((r for r in here if r["kind"] == "reference"), None)
            if step is None or read is None:
                cells.append("-")
                continue
            cells.append(f"{_fmt_ms(step['median_s'])} / {_fmt_ms(read['median_s'])} / "
                         f"{step['matmul_ratio'] / read['matmul_ratio']:.2f}x")
        floor = next(r["decode_floor"] for r in decode if r["P"] == P) if "decode_floor" in r0 else None
        dt.add_row(str(P), "-" if floor is None else f"{floor:.2f}x", *cells)
    console.print(dt)


def write_plots(data: dict, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    colors = {"numpy": "tab:blue", "torch": "tab:red", "tf": "tab:orange", "jax": "tab:green", "mlx": "tab:purple"}
    rows = [r for r in data["results"] if r["status"] == "ok"]
    sweep = [r for r in rows if r["sweep"]]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for backend in BACKENDS:
        for kind, style in (("ours", "-"), ("native", "--")):
            pts = {}
            for r in (r for r in sweep if r["backend"] == backend and r["kind"] == kind):
                if r["T"] not in pts or r["median_s"] < pts[r["T"]]["median_s"]:
                    pts[r["T"]] = r
            if pts:
                Ts = sorted(pts)
                label = f"{backend} {'ours' if kind == 'ours' else 'native'} ({', '.join(sorted({pts[T]['path'] for T in Ts}))})"
                ax.errorbar(Ts, [pts[T]["median_s"] for T in Ts],
                            yerr=[[pts[T]["median_s"] - pts[T]["min_s"] for T in Ts],
                                  [pts[T]["max_s"] - pts[T]["median_s"] for T in Ts]],
                            fmt=style + "o", color=colors[backend], label=label, markersize=4, capsize=2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T = S")
    ax.set_ylabel("forward time, median (s)")
    dims = f"B {sweep[0]['B']}, D {sweep[0]['D']}, N {sweep[0]['N']}" if sweep else ""
    ax.set_title(f"mha bench sweep: {dims}, {data['settings'].get('dtype', 'float32')}, not causal" + (" (--quick)" if data["settings"]["quick"] else ""))
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no sweep points measured", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    path = directory / "sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    for shape in dict.fromkeys(r["shape"] for r in rows if not r["sweep"]):
        bars = [r for r in rows if r["shape"] == shape and r["ratio_to_native"] is not None]
        if not bars:
            continue
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.32 * len(bars) + 1.8), sharey=True)
        labels = [f"{r['backend']} {r['path']} [{r['pass'].replace('forward+backward', 'fwd+bwd')}]" for r in bars]
        ys = range(len(bars))
        cs = [colors[r["backend"]] for r in bars]
        alphas = [1.0 if r["kind"] == "ours" else 0.45 for r in bars]
        for y, r, c, a in zip(ys, bars, cs, alphas):
            ax1.barh(y, r["ratio_to_native"], color=c, alpha=a)
            ax2.barh(y, r["pct_matmul"], color=c, alpha=a)
        ax1.set_yticks(list(ys), labels, fontsize=7)
        ax1.invert_yaxis()
        ax1.axvline(1.0, color="k", lw=0.8)
        ax1.axvline(1.10, color="k", lw=0.8, ls=":")
        ax1.set_xscale("log", base=2)
        ax1.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=2, subs=(1.0, 1.5)))  # ... 0.75, 1, 1.5, 2 ...
        ax1.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
        ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # log minor labels collide
        ax1.set_xlabel("time / native fastest (same framework, pass, mode); < 1 is faster")
        ax2.axvline(100, color="k", lw=0.8)
        ax2.axvline(85, color="k", lw=0.8, ls=":")
        ax2.set_xlabel("% of the framework's large-matmul FLOP rate")
        fig.suptitle(f"{shape}: ours (solid) and native (pale)" + (" --quick" if data["settings"]["quick"] else ""))
        fig.tight_layout()
        path = directory / f"ratio-{shape}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
