"""`mha bench --quick`: it runs on every installed backend, writes every field,
draws the plots and evaluates every target. No assertion here is about speed:
the machine is shared and timings are noise; only that numbers exist, are
finite and positive, and that targets() judges them by their thresholds."""

from __future__ import annotations

import importlib
import json
import math

import pytest

from conformance.bench import measure, report, runners, shapes
from conformance.bench.targets import add_native_ratios, targets
from conformance.cli.commands import main

# Every result row carries these keys (None where a number does not apply).
ROW_FIELDS = (
    "backend", "shape", "B", "T", "S", "D", "N", "H", "causal", "sweep", "path", "kind", "mode", "pass", "note",
    "status", "flops", "io_bytes", "matmul_flops_per_s", "matmul_flops", "matmul_ratio", "median_s", "min_s", "max_s", "q1_s", "q3_s", "times_s",
    "repeats", "first_call_s", "compile_s", "peak_bytes", "memory_method", "peak_over_io", "max_abs_diff_vs_numpy",
    "reference_max_abs", "pct_matmul", "native_path", "ratio_to_native",
)
TOP_FIELDS = ("schema", "created", "command", "machine", "settings", "backends", "results", "matmul", "sweep_stops",
              "targets", "total_s")
TARGET_FIELDS = ("target", "backend", "shape", "measured", "threshold", "unit", "path", "pass", "status")
# 3 frameworks x 2 shapes x (rate, eager ratio, compiled ratio) + 2 causal shapes x (4 backends + the
# numpy-and-one-framework summary) + numpy at bert-base + 4 backends' long memory.
N_TARGETS = 3 * 2 * 3 + 2 * (4 + 1) + 1 + 4
# numpy is quick on every shape; the frameworks get one plain, one causal long, and the sweep.
QUICK_SHAPES = {"numpy": ["bert-base", "vit-b16", "gpt2", "long", "sweep"], "torch": ["bert-base", "long", "sweep"],
                "tf": ["bert-base", "long", "sweep"], "jax": ["bert-base", "long", "sweep"]}
IMPORTS = {"numpy": ("numpy", "impl_numpy"), "torch": ("torch", "impl_torch.functional"),
           "tf": ("tensorflow", "keras", "impl_tf.functional"), "jax": ("jax", "flax.nnx", "impl_jax.functional")}


# numpy's rows are NumPy's alone (no framework looked for): the numpy env runs them, `tox -e all` (every test not
# marked with one framework) would time the same again; the frameworks' rows run there.
BACKEND_PARAMS = [pytest.param(b, marks=pytest.mark.reference) if b == "numpy" else b for b in shapes.BACKENDS]


def _unavailable(backend: str) -> str | None:
    for module in IMPORTS[backend]:
        try:
            importlib.util.find_spec(module)
        except (ImportError, ValueError) as err:
            return f"{module} not importable ({err})"
        if importlib.util.find_spec(module) is None:
            return f"{module} not installed: install the `{backend}` extra (pip install -e .[{backend}])"
    return None


def _run(tmp_path, capsys, *argv):
    out_json, plot_dir = tmp_path / "bench.json", tmp_path / "plots"
    code = main(["bench", "--quick", *argv, "--json", str(out_json), "--plot", str(plot_dir)])
    printed, err = capsys.readouterr()
    assert code == 0, f"mha bench exited {code}; stderr tail: {err[-2000:]}"
    return json.loads(out_json.read_text()), plot_dir, printed


def _finite_positive(row: dict, field: str) -> None:
    value = row[field]
    assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (
        f"{row['backend']} {row['shape']} {row['path']} [{row['pass']}]: {field} = {value!r}, "
        "expected a finite positive number")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_quick_run_writes_every_field(backend, tmp_path, capsys):
    why = _unavailable(backend)
    if why:
        pytest.skip(f"backend {backend}: {why}")
    data, plot_dir, printed = _run(tmp_path, capsys, "--backends", backend, "--shapes", *QUICK_SHAPES[backend])

    missing = [f for f in TOP_FIELDS if f not in data]
    assert not missing, f"JSON lacks top-level fields {missing}"
    status = data["backends"][backend]["status"]
    assert status == "ok", f"backend {backend} reported {status!r}"
    rows = data["results"]
    assert rows, "no result rows"
    for row in rows:
        lacking = [f for f in ROW_FIELDS if f not in row]
        assert not lacking, f"row {row.get('path')} at {row.get('shape')} lacks {lacking}"
        assert row["status"] == "ok", f"{row['shape']} {row['path']} [{row['pass']}]: {row['status']}"
        for field in ("median_s", "min_s", "max_s", "first_call_s", "flops", "matmul_flops_per_s", "matmul_flops",
                      "matmul_ratio", "pct_matmul"):
            _finite_positive(row, field)
        if any(n["kind"] == "native" and (n["shape"], n["pass"]) == (row["shape"], row["pass"]) for n in rows):
            _finite_positive(row, "ratio_to_native")  # NumPy has no native forward+backward to compare with
        assert row["min_s"] <= row["median_s"] <= row["max_s"], (
            f"{row['path']}: min {row['min_s']} median {row['median_s']} max {row['max_s']} out of order")
        assert row["repeats"] == len(row["times_s"]) >= 1, f"{row['path']}: repeats {row['repeats']}, times {row['times_s']}"
        if not row["sweep"]:
            assert row["memory_method"], f"{row['path']} at {row['shape']}: no memory method recorded"
            if row["peak_bytes"] is not None:
                assert row["peak_bytes"] >= 0, f"{row['path']}: peak_bytes {row['peak_bytes']}"
        if row["max_abs_diff_vs_numpy"] is not None:
            # a sanity check of what was timed, not a conformance test: float32 vs the float32 reference
            bound = 1e-3 * max(1.0, row["reference_max_abs"])
            assert row["max_abs_diff_vs_numpy"] <= bound, (
                f"{row['path']} at {row['shape']} differs from impl_numpy by {row['max_abs_diff_vs_numpy']:.3g} "
                f"(bound {bound:.3g}): the benchmark timed a wrong computation")
    kinds = {(r["shape"], r["kind"]) for r in rows if not r["sweep"]}
    for shape in QUICK_SHAPES[backend]:
        if shape != "sweep":
            assert {(shape, "ours"), (shape, "native")} <= kinds, f"{shape}: ours and native not both timed: {kinds}"
    assert any(r["sweep"] for r in rows), "no sweep point measured"
    assert data["matmul"] and all(m["flops_per_s"] > 0 for m in data["matmul"]), data["matmul"]

    pngs = sorted(plot_dir.glob("*.png"))
    expected = {"sweep.png", *(f"ratio-{s}.png" for s in QUICK_SHAPES[backend] if s != "sweep")}
    assert expected <= {p.name for p in pngs}, f"plots written: {[p.name for p in pngs]}, expected {sorted(expected)}"
    for png in pngs:
        head = png.read_bytes()[:8]
        assert png.stat().st_size > 1000 and head == b"\x89PNG\r\n\x1a\n", f"{png.name}: {png.stat().st_size} bytes, head {head!r}"

    assert len(data["targets"]) == N_TARGETS, f"{len(data['targets'])} target entries, expected {N_TARGETS}"
    for entry in data["targets"]:
        assert set(TARGET_FIELDS) <= set(entry), f"target entry lacks fields: {entry}"
    assert report.SHAPE_TARGETS in printed and "mha bench" in printed, f"table or targets not printed: {printed[:500]}"


def test_unavailable_backend_is_reported_not_fatal(tmp_path, capsys):
    data, _, printed = _run(tmp_path, capsys, "--backends", "numpy", "--device", "gpu", "--shapes", "bert-base")
    status = data["backends"]["numpy"]["status"]
    assert status.startswith("unavailable:") and "CPU only" in status, f"status {status!r}"
    assert data["results"] == [], data["results"]
    assert all(e["pass"] is None for e in data["targets"]), [e for e in data["targets"] if e["pass"] is not None]
    assert "numpy: unavailable" in printed, printed[-1000:]


def _row(backend, shape, path, kind, mode, median, pct, *, pass_="forward", peak_over_io=None, matmul_ratio=None):
    """A result row; its paired time (matmul_ratio) is its median unless given."""
    return {"backend": backend, "shape": shape, "path": path, "kind": kind, "mode": mode, "pass": pass_,
            "status": "ok", "median_s": median, "pct_matmul": pct, "peak_over_io": peak_over_io,
            "matmul_ratio": median if matmul_ratio is None else matmul_ratio}


def test_targets_judge_by_their_thresholds():
    rows = [
        _row("torch", "bert-base", "ours.sdpa.eager", "ours", "eager", 1.05, 90.0),
        _row("torch", "bert-base", "native.sdpa.eager", "native", "eager", 1.0, 95.0),
        _row("torch", "bert-base", "ours.compiled", "ours", "compiled", 1.2, 80.0),
        _row("torch", "bert-base", "native.sdpa.compiled", "native", "compiled", 1.0, 96.0),
        _row("numpy", "bert-base", "ours", "ours", "eager", 1.0, 74.9),
        _row("numpy", "gpt2", "ours.chunked", "ours", "eager", 1.0, 130.0),
        _row("jax", "gpt2", "ours.jit", "ours", "compiled", 1.0, 101.0),
        _row("numpy", "long", "ours.chunked", "ours", "eager", 1.0, 120.0, peak_over_io=3.5),
        _row("tf", "long", "ours.xla", "ours", "compiled", 1.0, 20.0, peak_over_io=60.0),
    ]
    entries = targets(rows)
    assert len(entries) == N_TARGETS, len(entries)
    by = {e["target"]: e for e in entries}

    def check(name, passed, measured):
        e = by[name]
        assert e["pass"] is passed and (measured is None or abs(e["measured"] - measured) < 1e-9), (name, e)

    check("torch forward at bert-base >= 85% of matmul rate", True, 90.0)
    check("torch eager forward at bert-base <= 1.10x native fastest eager", True, 1.05)
    check("torch compiled forward at bert-base <= 1.10x native fastest compiled", False, 1.2)
    check("tf forward at bert-base >= 85% of matmul rate", None, None)
    check("numpy float32 forward at bert-base >= 75% of matmul rate", False, 74.9)
    check("causal gpt2: > 100% in numpy and at least one framework", True, None)
    check("causal long: > 100% in numpy and at least one framework", False, None)
    check("numpy long forward peak memory < 4x inputs+outputs", True, 3.5)
    check("tf long forward peak memory < 4x inputs+outputs", False, 60.0)
    check("jax long forward peak memory < 4x inputs+outputs", None, None)
    assert all(e["status"] in ("pass", "miss") or e["status"].startswith("not measured") for e in entries)


def test_ratio_to_native_compares_paired_times_not_medians():
    """The native path ran while the machine was twice as slow (its matmul too):
    its median is 2.0 s against ours 1.2 s, but against their own matmul runs
    ours takes 1.2 and native 1.0 of a matmul, so ours is 1.2x native (a miss),
    not 0.6x (a pass)."""
    rows = [_row("torch", "bert-base", "ours.sdpa.eager", "ours", "eager", 1.2, 90.0, matmul_ratio=1.2),
            _row("torch", "bert-base", "native.sdpa.eager", "native", "eager", 2.0, 95.0, matmul_ratio=1.0),
            _row("torch", "bert-base", "native.mha.eager", "native", "eager", 2.2, 95.0, matmul_ratio=1.05)]
    add_native_ratios(rows)
    assert rows[0]["native_path"] == "native.sdpa.eager" and rows[0]["ratio_to_native"] == pytest.approx(1.2), rows[0]
    entry = next(e for e in targets(rows) if e["target"] == "torch eager forward at bert-base <= 1.10x native "
                 "fastest eager")
    assert entry["measured"] == pytest.approx(1.2) and entry["pass"] is False, entry


class _DriftingClock:
    """A stand-in for conformance.bench.measure.time_call: each call's duration is its work times the machine's
    slowness, which triples after `switch` calls (CPU steal arriving mid-shape)."""

    def __init__(self, switch: int):
        self.switch, self.calls, self.order = switch, 0, []

    def __call__(self, call) -> float:
        name, work = call()
        self.order.append(name)
        self.calls += 1
        return work * (3.0 if self.calls > self.switch else 1.0)


def _fake(name: str, work: float):
    return lambda: (name, work)


def test_paired_ratios_survive_a_change_of_machine_speed(monkeypatch):
    """Each timed run of a path follows one of the matmul, so a slowdown that begins in the
    middle of a's runs (one pair straddles it) leaves the paired ratios at the work ratios,
    1/4 and 1.5/4. Had the matmul been timed only before the paths (the old method), with the
    slowdown arriving after it, a would read 3/4 and b 1.125."""
    clock = _DriftingClock(switch=9)
    monkeypatch.setattr(measure, "time_call", clock)
    out = measure.measure_paired({"a": _fake("a", 1.0), "b": _fake("b", 1.5)}, _fake("mm", 4.0),
                               repeats=9, max_seconds=1e9)
    assert out["a"]["matmul_ratio"] == pytest.approx(0.25), out
    assert out["b"]["matmul_ratio"] == pytest.approx(0.375), out
    assert out["a"]["repeats"] == out["b"]["repeats"] == 9 and out[measure.MATMUL]["repeats"] == 18, out
    # a's untimed runs after each matmul do not reach the clock; b's first run, slowed to 4.5 s, has no warm-up
    assert clock.order == ["mm", "mm", "a", "a", *["mm", "a"] * 9, "b", *["mm", "b"] * 9], clock.order


def test_paired_keeps_repeats_budgets_and_failures_per_path(monkeypatch):
    """A path over its time budget stops after MIN_REPEATS, a failing path is reported with its
    exception, the rest carry on; the matmul is timed once per timed path run, and at least
    MIN_REPEATS times."""
    monkeypatch.setattr(measure, "time_call", _DriftingClock(switch=10**9))
    calls = {"quick": _fake("quick", 0.01), "slow": _fake("slow", 5.0)}

    def broken():
        raise RuntimeError("out of memory")

    out = measure.measure_paired(calls | {"broken": broken}, _fake("mm", 0.1), repeats=7, max_seconds=10.0)
    assert isinstance(out["broken"], RuntimeError), out["broken"]
    assert out["slow"]["repeats"] == measure.MIN_REPEATS, out["slow"]  # 3 x 5 s > 10 s
    assert out["quick"]["repeats"] == 7 and out[measure.MATMUL]["repeats"] == 7 + measure.MIN_REPEATS, out
    assert out["slow"]["first_call_s"] == 5.0 and out[measure.MATMUL]["first_call_s"] == 0.1
    empty = measure.measure_paired({}, _fake("mm", 0.1), repeats=7, max_seconds=10.0)
    assert empty[measure.MATMUL]["repeats"] == measure.MIN_REPEATS


def test_flop_count_is_the_documented_formula():
    s = shapes.SHAPES["bert-base"]
    assert s.flops == 8 * 8 * 128 * 768**2 + 4 * 8 * 12 * 128 * 128 * 64, s.flops
    g = shapes.SHAPES["gpt2"]  # causal: still the full T*S
    assert g.flops == 8 * 4 * 1024 * 768**2 + 4 * 4 * 12 * 1024 * 1024 * 64, g.flops


def test_numpy_memory_counts_the_buffers_kept_between_calls():
    """The fast path keeps its scratch buffers for the next call
    (chunked.workspace); the bench's memory figure must still count them, as
    the call's own, not report only what a warm call allocates afresh."""
    import numpy as np

    import weights
    from impl_numpy import chunked
    from impl_numpy.attention import multi_head_attention

    config = weights.AttentionConfig(num_heads=4, query_dim=32, head_dim=8)
    tensors = weights.init(config, seed=0, dtype="float32")
    x = np.random.default_rng(0).standard_normal((2, 64, 32)).astype(np.float32)

    def call():
        return multi_head_attention(config, tensors, x)

    chunked.release_workspace()  # whatever earlier tests left: `kept` below is this call's own buffers
    call()  # warm: its buffers are kept now
    kept = chunked.kept_workspace_bytes()
    assert kept > 0
    peak, method, _ = runners.numpy_runner("cpu", quick=True).memory(call)
    assert peak >= kept + x.nbytes, f"{method} {peak} B: the kept buffers ({kept} B) and the output are not counted"


def test_report_and_plots_survive_failed_and_skipped_rows(tmp_path):
    """A path that failed in setup (path None) or was skipped must not break the table or plots."""
    import io

    from rich.console import Console

    ok = {**_row("numpy", "sweep-128", "ours", "ours", "eager", 0.01, 50.0), "sweep": True, "T": 128, "B": 1,
          "D": 512, "N": 8, "min_s": 0.009, "max_s": 0.011, "ratio_to_native": 1.0, "first_call_s": 0.02,
          "peak_bytes": None, "note": ""}
    broken = {**ok, "path": None, "kind": None, "mode": None, "pass": None, "T": 256, "shape": "sweep-256",
              "status": "failed: setting up paths: ValueError: too big", "median_s": None, "pct_matmul": None}
    skipped = {**ok, "T": 512, "shape": "sweep-512", "status": "skipped: over --mem-limit", "median_s": None,
               "pct_matmul": None}
    data = {"settings": {"quick": True}, "results": [ok, broken, skipped], "backends": {"numpy": {"status": "ok"}},
            "matmul": [], "sweep_stops": {}, "targets": targets([ok, broken, skipped])}
    out = io.StringIO()
    report.print_report(Console(file=out, width=200), data)
    assert "sweep" in out.getvalue() and "targets" in out.getvalue(), out.getvalue()[:500]
    written = report.write_plots(data, tmp_path)
    assert (tmp_path / "sweep.png").stat().st_size > 1000, written


# --- the window and decode families ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_quick_window_and_decode_run_every_length(backend, tmp_path, capsys):
    """`mha bench --quick --shapes window decode`: every length of both families measured (torch's
    window rows skipped with the reason: it has no chunked path), the output checked against impl_numpy,
    and every window and decode target of the backend judged (pass or miss, never timed here)."""
    why = _unavailable(backend)
    if why:
        pytest.skip(f"backend {backend}: {why}")
    data, _, printed = _run(tmp_path, capsys, "--backends", backend, "--shapes", "window", "decode")
    assert data["backends"][backend]["status"] == "ok", data["backends"][backend]
    rows = data["results"]
    windows = [r for r in rows if r["family"] == "window"]
    decodes = [r for r in rows if r["family"] == "decode"]
    assert sorted({r["T"] for r in windows}) == list(shapes.QUICK_WINDOW_LENGTHS), windows
    assert sorted({r["P"] for r in decodes}) == list(shapes.QUICK_DECODE_LENGTHS), decodes
    assert all(r["window_left"] == shapes.QUICK_WINDOW_LEFT and r["causal"] for r in windows), windows
    assert all(r["T"] == 1 and (r["N"], r["K"]) == (4, 2) for r in decodes), decodes
    if backend == "torch":
        assert all(r["status"].startswith("skipped: impl_torch has no chunked path") for r in windows), windows
    else:
        assert all(r["status"] == "ok" and r["kind"] == "ours" and "chunk_size=16" in r["note"] for r in windows), windows
    for r in [r for r in windows + decodes if r["status"] == "ok"]:
        for field in ("median_s", "matmul_ratio", "first_call_s", "flops"):
            _finite_positive(r, field)
        assert r["memory_method"], r
        if r["kind"] == "ours":  # what was timed computed the windowed / cached attention
            bound = 1e-3 * max(1.0, r["reference_max_abs"])
            assert r["max_abs_diff_vs_numpy"] <= bound, (
                f"{r['path']} at {r['shape']} differs from impl_numpy by {r['max_abs_diff_vs_numpy']:.3g}")
    for P in shapes.QUICK_DECODE_LENGTHS:
        here = {r["kind"] for r in decodes if r["P"] == P and r["status"] == "ok"}
        assert here == {"ours", "reference"}, f"decode P {P}: kinds {here}"
    mine = [e for e in data["targets"] if e["backend"] == backend and e["shape"] in ("window", "decode")]
    expected = 4 if backend != "torch" else 2  # window flat + memory, decode linear + read; torch has no window rows
    judged = [e for e in mine if e["status"] in ("pass", "miss")]
    assert len(judged) == expected and len(mine) == 4, mine
    assert "targets: window and decode" in printed, printed[-2000:]
    assert f"{report.SHAPE_TARGETS}: none of these shapes ran" in printed, (
        "the named shapes' targets table printed, none of its shapes ran")


def test_default_shapes_are_unchanged():
    """The families run only when named: the default `mha bench` times what it timed before."""
    import argparse

    from conformance.bench import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench"])
    assert args.shapes == ["bert-base", "vit-b16", "gpt2", "long", "sweep"], args.shapes


def test_family_length_limits_refuse_one_line(capsys):
    code = main(["bench", "--shapes", "window", "--window-max", "100"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "mha: error: --window-max must be at least 8192: got 100", err


def test_pairs_count_the_keys_the_window_leaves():
    """Shape.pairs (the FLOP count's attention pairs) against the visible entries of a dense
    causal-and-window mask, built independently."""
    import numpy as np

    for T, left in ((1, 0), (7, 0), (7, 3), (16, 15), (40, 15), (33, 100)):
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        visible = int(((j <= i) & (j >= i - left)).sum())
        s = shapes.Shape("w", B=1, T=T, S=T, D=8, N=2, causal=True, window_left=left, family="window")
        assert s.pairs == visible, (T, left, s.pairs, visible)
    real = shapes.window_shapes([8192])[0]
    assert real.pairs == 4096 * 4097 // 2 + 4096 * 4096, real.pairs
    d = shapes.decode_shapes([8192])[0]  # GQA: k and v projections over K heads, attention over P + 1 keys
    assert d.flops == 4 * 4096 * 4096 + 4 * 4096 * 8 * 128 + 4 * 32 * 8193 * 128, d.flops
    # the decode floor's weight bytes: what weights.init builds for the worker's config of that shape
    import weights

    config = weights.AttentionConfig(num_heads=d.N, query_dim=d.D, head_dim=d.H, num_kv_heads=d.kv_heads)
    assert d.weight_bytes == sum(a.nbytes for a in weights.init(config, seed=0, dtype="float32").values())
    assert d.decode_floor == pytest.approx((d.weight_bytes + 2 * 8 * 8192 * 128 * 4) / (2 * 8 * 8192 * 128 * 4))


def test_window_reference_from_the_last_inputs_equals_the_full_call():
    """The bench checks a long windowed call against impl_numpy on its last inputs alone (the rows a
    window of w keys leaves depend on the last w inputs, and nothing on their position): those rows
    must equal the full call's, computed by the stages (the spec, float64)."""
    import numpy as np

    import weights
    from conformance.bench import worker
    from impl_numpy.attention import multi_head_attention

    shape = shapes.window_shapes([128], quick=True)[0]
    config = weights.AttentionConfig(num_heads=shape.N, query_dim=shape.D, head_dim=shape.H,
                                     window_left=shape.window_left)
    tensors = weights.init(config, seed=0, dtype="float64")
    x = np.random.default_rng(0).standard_normal((1, shape.T, shape.D))
    reference, rows = worker._numpy_reference(config, tensors, x, shape)
    full = multi_head_attention(config, tensors, x, is_causal=True, trace=[])
    assert reference.shape == (1, shape.window_left + 1, shape.D) and rows == slice(shape.T - shape.window_left - 1, None)
    np.testing.assert_allclose(reference, full[:, rows], rtol=0, atol=1e-12)


def _fam(backend, family, length, path, kind, matmul_ratio, *, peak_over_io=None, status="ok"):
    key = "T" if family == "window" else "P"
    return {"backend": backend, "shape": f"{family}-{length}", "family": family, key: length, "path": path,
            "kind": kind, "mode": "eager", "pass": "forward", "status": status, "median_s": matmul_ratio,
            "matmul_ratio": matmul_ratio, "pct_matmul": 1.0, "peak_over_io": peak_over_io}


def test_window_targets_judge_paired_time_per_token():
    """Flat means the paired time per query token (matmul_ratio / T) varies at most 1.3x over the
    lengths; the summary asks numpy and two frameworks; memory takes the worst length."""
    Ts = (8192, 16384, 32768, 65536)
    rows = []
    for T, grow in zip(Ts, (1.0, 1.1, 1.2, 1.25)):  # numpy: 1.25x, flat
        rows.append(_fam("numpy", "window", T, "ours.chunked", "ours", grow * T / 8192, peak_over_io=3.0))
    for T, grow in zip(Ts, (1.0, 1.0, 1.2, 1.4)):  # tf: 1.4x, not flat
        rows.append(_fam("tf", "window", T, "ours.chunked.graph", "ours", grow * T / 8192, peak_over_io=2.0 + T / 2**15))
    for T in Ts:  # jax: flat; a slower second path at the same T does not count
        rows.append(_fam("jax", "window", T, "ours.chunked", "ours", T / 8192, peak_over_io=1.0))
        rows.append(_fam("jax", "window", T, "ours.slow", "ours", 5 * T / 8192))
    rows.append(_fam("torch", "window", 8192, None, None, None, status="skipped: no chunked path"))
    by = {(e["backend"], e["target"].split(":")[0]): e for e in targets(rows) if e["shape"] == "window"}
    flat = {b: by[(b, f"{b} window")] for b in ("numpy", "tf", "jax", "torch")}
    assert flat["numpy"]["pass"] is True and flat["numpy"]["measured"] == pytest.approx(1.25), flat["numpy"]
    assert flat["tf"]["pass"] is False and flat["tf"]["measured"] == pytest.approx(1.4), flat["tf"]
    assert flat["jax"]["pass"] is True and flat["jax"]["measured"] == pytest.approx(1.0), flat["jax"]
    assert flat["torch"]["pass"] is None and "no chunked path" in flat["torch"]["status"], flat["torch"]
    summary = by[("numpy+2", "window")]
    assert summary["pass"] is False and summary["measured"] == pytest.approx(1.4), summary  # tf is the second framework
    memory = [e for e in targets(rows) if "peak memory" in e["target"] and e["shape"] == "window"]
    tf_memory = next(e for e in memory if e["backend"] == "tf")
    assert tf_memory["measured"] == pytest.approx(4.0) and tf_memory["pass"] is False, tf_memory  # 2 + 65536/32768
    assert next(e for e in memory if e["backend"] == "numpy")["pass"] is True
    # torch joins with a flat path: numpy and two frameworks (jax, torch) are flat
    rows = [r for r in rows if r["backend"] != "torch"] + [
        _fam("torch", "window", T, "ours.x", "ours", T / 8192 * 1.1) for T in Ts]
    summary = next(e for e in targets(rows) if e["backend"] == "numpy+2")
    assert summary["pass"] is True and summary["measured"] == pytest.approx(1.25), summary


def test_decode_targets_judge_linearity_and_the_cache_read():
    Ps = (8192, 16384, 32768, 65536)
    rows = []
    for P in Ps:
        rows.append(_fam("numpy", "decode", P, "ours", "ours", 0.5 + P / 65536))  # linear, 1.5x the read at the top
        rows.append(_fam("numpy", "decode", P, "cache.read", "reference", P / 65536))
        rows.append(_fam("jax", "decode", P, "ours.jit", "ours", 0.1 + (P / 32768) ** 2))  # quadratic
        rows.append(_fam("jax", "decode", P, "cache.read", "reference", P / 65536))
        rows.append(_fam("tf", "decode", P, "ours.graph", "ours", 1.0 - P / 2**20))  # falling
        rows.append(_fam("tf", "decode", P, "cache.read", "reference", 1.0))
    entries = {e["target"]: e for e in targets(rows) if e["shape"] == "decode"}

    def get(backend, what):
        return next(e for t, e in entries.items() if t.startswith(f"{backend} decode: {what}"))

    assert get("numpy", "step time linear")["pass"] is True and get("numpy", "step time linear")["measured"] < 1e-6
    read = get("numpy", "step <=")
    # (0.5 + P/65536) / (P/65536): 5x at P 8192 (the fixed cost dominates), the worst; 1.5x at P 65536
    assert read["measured"] == pytest.approx(5.0) and read["pass"] is False and "P 8192" in read["path"], read
    assert get("jax", "step time linear")["pass"] is False and get("jax", "step time linear")["measured"] > 10, entries
    assert get("tf", "step time linear")["pass"] is False, "a step time that falls with P is not linear growth"
    assert get("tf", "step <=")["pass"] is True
    assert get("torch", "step time linear")["pass"] is None  # no rows: not measured
