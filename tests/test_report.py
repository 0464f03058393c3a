"""The report of `mha check`: matrix, report.md / report.html, heatmaps, terminal.

Results are real: conformance.suite.compare.run_case on the NumPy backend (passes)
and on small broken adapters (a wrong softmax scale that fails with a
divergence at `logits`, one that refuses a case, one that crashes).
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
import sys
import types
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from conformance.suite import environment, report
from conformance.suite.cases import CASES
from conformance.suite.compare import run_case
from impl_numpy import adapter as numpy_adapter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CRASH_MESSAGE = 'kernel <crashed> | at "row" & col'


# --------------------------------------------------------------------------- broken adapters


def _doubled_scale(config):
    return dataclasses.replace(config, scale=2.0 * config.effective_scale)


def _wrong_scale_forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    # A porting bug: logits scaled by 2/sqrt(H). Runs anywhere ("gpu" too) so the device is a matrix dimension.
    return numpy_adapter.forward(_doubled_scale(config), tensors, inputs, options, precision=precision, trace=trace)


def _wrong_scale_vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    return numpy_adapter.vjp(_doubled_scale(config), tensors, inputs, options, d_output, precision=precision)


def _refuses(*args, **kwargs):
    raise NotImplementedError("causal masks are not supported by this port")


def _crashes(*args, **kwargs):
    raise RuntimeError(CRASH_MESSAGE)


WRONG_SCALE = types.SimpleNamespace(devices=lambda: ["cpu", "gpu"], forward=_wrong_scale_forward, vjp=_wrong_scale_vjp)
PARTIAL = types.SimpleNamespace(devices=lambda: ["cpu"], forward=_refuses, vjp=_refuses)
CRASHING = types.SimpleNamespace(devices=lambda: ["cpu"], forward=_crashes, vjp=_crashes)


@pytest.fixture(scope="module")
def passing():
    # float32 without gradients, float64 with: both pass on the reference itself.
    results = [run_case(CASES[n], "numpy", dtype="float64", keep_arrays=True) for n in ("self_basic", "gqa", "masked_rows_nan")]
    results += [run_case(CASES[n], "numpy", dtype="float32", gradients=False, keep_arrays=True)
                for n in ("self_basic", "cross_basic", "masked_rows_nan")]
    bad = [(r.case, r.dtype, r.status, r.message, r.worst and r.worst.describe()) for r in results if r.status != "pass"]
    assert not bad, f"the NumPy reference must pass against itself: {bad}"
    return results


@pytest.fixture(scope="module")
def mixed(passing):
    failing = [run_case(CASES[n], "wrong_scale", device="cpu", dtype="float32", gradients=False, adapter=WRONG_SCALE,
                        keep_arrays=True) for n in ("self_basic", "gqa")]
    failing.append(run_case(CASES["cross_basic"], "wrong_scale", device="gpu", dtype="float32", gradients=False,
                            adapter=WRONG_SCALE, keep_arrays=True))
    for r in failing:
        assert r.status == "fail", f"{r.case}: the wrong-scale mutant must fail, got {r.status} {r.message}"
        assert r.divergence is not None and r.divergence.stage == "logits", f"{r.case}: divergence {r.divergence}"
    unsupported = run_case(CASES["causal_square"], "partial", dtype="float32", adapter=PARTIAL)
    crashed = run_case(CASES["self_basic"], "crashing", dtype="float32", adapter=CRASHING)
    assert unsupported.status == "unsupported" and crashed.status == "error", (unsupported.status, crashed.status)
    return passing + failing + [unsupported, crashed]


@pytest.fixture(scope="module")
def written(mixed, tmp_path_factory):
    directory = tmp_path_factory.mktemp("report") / "nested" / "dir"  # write_report creates it
    env = environment.environment(sorted({r.backend for r in mixed}), ["cpu", "gpu"], "highest")
    paths = report.write_report(directory, mixed, env, title="mha check <test>")
    return directory, paths, env


# --------------------------------------------------------------------------- an HTML parser that checks nesting

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class StrictHTML(HTMLParser):
    """html.parser plus checks: every non-void tag is closed in order. Collects
    tables (class, rows of cell text), images and all text."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.tables: list[dict] = []
        self.images: list[dict] = []
        self.text: list[str] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs)
        if tag not in VOID:
            self.stack.append(tag)
        if tag == "table":
            self.tables.append({"class": attrs.get("class"), "rows": []})
        elif tag == "tr":
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()
        if tag in ("td", "th"):
            self.tables[-1]["rows"][-1].append("".join(self.cell))
            self.cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self.cell is not None:
            self.cell.append(data)


def parse_html(path: Path) -> StrictHTML:
    parser = StrictHTML()
    parser.feed(path.read_text(encoding="utf-8"))
    parser.close()
    assert parser.stack == [], f"unclosed tags at the end of {path.name}: {parser.stack}"
    return parser


def table(parser: StrictHTML, css_class: str) -> list[list[str]]:
    found = [t["rows"] for t in parser.tables if t["class"] == css_class]
    assert len(found) == 1, f"expected one table of class {css_class}, found {len(found)}"
    return found[0]


def md_rows(text: str, header_start: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header starts with header_start."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
        rows.append([re.sub(r"\\(.)", r"\1", c.strip()) for c in cells])
    return rows


# --------------------------------------------------------------------------- matrix


def test_matrix_counts_and_worst_margins_match_the_results(mixed):
    rows = report.matrix(mixed)
    keys = [(r["backend"], r["device"], r["dtype"]) for r in rows]
    assert len(keys) == len(set(keys)), f"duplicate matrix rows: {keys}"
    assert set(keys) == {(r.backend, r.device, r.dtype) for r in mixed}
    for row in rows:
        members = [r for r in mixed if (r.backend, r.device, r.dtype) == (row["backend"], row["device"], row["dtype"])]
        for status in ("pass", "fail", "error", "unsupported"):
            expected = sum(r.status == status for r in members)
            assert row[status] == expected, f"{row}: {status} count {row[status]}, results say {expected}"
        assert row["total"] == len(members)
        judged = [r for r in members if r.status in ("pass", "fail")]
        if judged:
            worst = max(judged, key=lambda r: r.margin)
            assert row["worst_margin"] == worst.margin and row["worst_case"] == worst.case, (row, worst.case, worst.margin)
            assert row["worst_comparison"] == worst.worst.name
        else:
            assert row["worst_margin"] is None and row["worst_case"] is None, row
    # Order: backends as first seen; dtypes float64 before float32; cpu before gpu.
    assert keys[:2] == [("numpy", "cpu", "float64"), ("numpy", "cpu", "float32")]
    assert keys.index(("wrong_scale", "cpu", "float32")) < keys.index(("wrong_scale", "gpu", "float32"))


def test_format_margin():
    assert report.format_margin(None) == "-"
    assert report.format_margin(math.inf) == "inf"
    assert report.format_margin(0.0123456) == "0.0123"
    assert report.format_margin(2.5e13) == "2.5e+13"
    assert report.format_margin(0.0) == "0"


# --------------------------------------------------------------------------- report.html / report.md


def test_write_report_returns_the_files_it_wrote(written):
    directory, paths, _ = written
    assert paths["md"] == directory / "report.md" and paths["html"] == directory / "report.html"
    for key, path in paths.items():
        assert path.is_file() and path.stat().st_size > 0, f"{key}: {path} missing or empty"
    leftovers = [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == [], f"temporary files left behind: {leftovers}"
    assert set(paths) == {"md", "html"} | {k for k in paths if k.startswith("heatmap_head")}


def test_html_parses_and_holds_matrix_failures_and_environment(written, mixed):
    directory, paths, env = written
    parsed = parse_html(paths["html"])
    text = "".join(parsed.text)

    matrix_rows = table(parsed, "matrix")
    assert matrix_rows[0] == list(report.MATRIX_COLUMNS)
    assert matrix_rows[1:] == [report.matrix_cells(row) for row in report.matrix(mixed)]
    for row in report.matrix(mixed):  # the worst margins printed are the measured ones
        if row["worst_margin"] is not None:
            assert f"{row['worst_margin']:.3g}" in report.matrix_cells(row)

    failures = table(parsed, "failures")
    assert failures[0] == list(report.FAILURE_COLUMNS)
    body = {(cells[1], cells[2], cells[4]): cells for cells in failures[1:]}
    not_passing = [r for r in mixed if r.status != "pass"]
    assert len(failures) - 1 == len(not_passing)
    for r in not_passing:
        cells = body[(r.case, r.backend, r.device)]
        assert cells[0] == r.status and cells[3] == r.path and cells[5] == r.dtype
        if r.status == "fail":
            assert cells[6] == f"{r.margin:.3g}"
            assert r.worst.describe() in cells[7]
            assert cells[8] == r.divergence.describe() and cells[8].startswith("first divergent stage: logits")
        else:
            assert r.message and cells[9] == r.message
    assert CRASH_MESSAGE in text
    assert "<crashed>" not in paths["html"].read_text(encoding="utf-8"), "the error message must be escaped"
    assert "mha check <test>" in text

    assert env["versions"]["numpy"] in text and env["devices"]["cpu"] in text
    assert "highest" in text and env["precision"]["meaning"] in text


def test_markdown_holds_the_same(written, mixed):
    _, paths, env = written
    md = paths["md"].read_text(encoding="utf-8")
    assert md_rows(md, "| backend | path | device | dtype |") == [report.matrix_cells(row)
                                                                  for row in report.matrix(mixed)]
    failures = md_rows(md, "| status | case |")
    assert len(failures) == sum(r.status != "pass" for r in mixed)
    assert all(len(cells) == len(report.FAILURE_COLUMNS) for cells in failures), "a pipe in a cell broke the table"
    for r in mixed:
        if r.status == "fail":
            assert r.case in md and r.divergence.describe() in md
    assert sorted(c[9] for c in failures if c[0] != "fail") == sorted(r.message for r in mixed if r.status in ("error", "unsupported"))
    table_lines = [line for line in md.splitlines() if line.startswith("| error |")]
    assert len(table_lines) == 1 and "\\<crashed>" in table_lines[0], f"raw HTML in a message must be escaped: {table_lines}"
    assert env["versions"]["numpy"] in md and env["precision"]["meaning"] in md


def test_heatmaps_show_the_worst_failing_case_per_head(written, mixed):
    directory, paths, _ = written
    worst = max((r for r in mixed if r.status == "fail"), key=lambda r: r.margin)
    heads = worst.arrays["reference_weights"].shape[1]
    pngs = sorted((k, p) for k, p in paths.items() if k.startswith("heatmap_head"))
    assert len(pngs) == heads, f"{len(pngs)} heatmaps for {heads} heads of {worst.case}"
    for _, path in pngs:
        data = path.read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_SIGNATURE), f"{path.name}: not a PNG ({len(data)} bytes)"
        assert path.parent == directory and worst.case in path.name and worst.backend in path.name
    parsed = parse_html(paths["html"])
    assert sorted(img["src"] for img in parsed.images) == sorted(p.name for _, p in pngs), "img src must be relative names"
    md = paths["md"].read_text(encoding="utf-8")
    assert all(f"]({p.name})" in md for _, p in pngs)
    assert "Worst failing case: " + worst.case in md


def test_heatmaps_of_the_closest_case_when_everything_passed(passing, tmp_path):
    paths = report.write_report(tmp_path, passing, {"versions": {"numpy": np.__version__}})
    closest = max((r for r in passing if r.arrays.get("backend_weights") is not None), key=lambda r: r.margin)
    pngs = [p for k, p in paths.items() if k.startswith("heatmap_head")]
    assert len(pngs) == closest.arrays["reference_weights"].shape[1]
    assert all(closest.case in p.name and p.read_bytes().startswith(PNG_SIGNATURE) for p in pngs)
    md = paths["md"].read_text(encoding="utf-8")
    assert "everything passed" in md and "None: every case passed." in md
    parse_html(paths["html"])


def test_heatmaps_label_the_query_and_key_indices(passing):
    """Each panel's ticks sit on the cells it draws (integers, never imshow's half-integer edges) and are
    labelled with those query and key indices; a long axis is labelled at most MAX_TICKS times."""
    from conformance.suite import heatmaps

    subject, why = heatmaps.heatmap_subject(passing)
    T, S = subject.arrays["reference_weights"].shape[2:]
    figures = list(heatmaps._head_figures(subject, why))
    assert figures
    for n, fig in figures:
        panels = [ax for ax in fig.axes if ax.images]  # the three heatmaps, not their colorbars
        assert len(panels) == 3
        for ax in panels:
            for axis, count in ((ax.xaxis, S), (ax.yaxis, T)):
                ticks = [float(t) for t in axis.get_ticklocs()]
                labels = [label.get_text() for label in axis.get_ticklabels()]
                assert all(t.is_integer() and 0 <= t < count for t in ticks), f"head {n}: ticks {ticks}, {count} cells"
                assert ticks == heatmaps.integer_ticks(count), f"head {n}: ticks {ticks} on {count} cells"
                assert labels == [str(int(t)) for t in ticks], f"head {n}: labels {labels}"
    assert heatmaps.integer_ticks(1) == [0] and heatmaps.integer_ticks(10) == list(range(10))
    assert heatmaps.integer_ticks(11) == list(range(0, 11, 2)) and heatmaps.integer_ticks(100) == list(range(0, 100, 10))
    assert heatmaps.integer_ticks(4097) == list(range(0, 4097, 500))
    for count in range(1, 300):
        ticks = heatmaps.integer_ticks(count)
        assert ticks[0] == 0 and len(ticks) <= heatmaps.MAX_TICKS and ticks[-1] < count, count


def test_report_without_arrays_or_matplotlib(passing, tmp_path, monkeypatch):
    bare = [run_case(CASES["self_basic"], "numpy", dtype="float64")]  # keep_arrays off
    paths = report.write_report(tmp_path / "bare", bare, {})
    assert set(paths) == {"md", "html"}
    assert "None drawn: no case kept its attention weights" in paths["md"].read_text(encoding="utf-8")
    parse_html(paths["html"])

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the 'report' extra were missing
    paths = report.write_report(tmp_path / "nompl", passing, {})
    assert set(paths) == {"md", "html"}
    assert "matplotlib is not installed" in paths["md"].read_text(encoding="utf-8")


def test_rewriting_a_report_replaces_it(passing, tmp_path):
    first = report.write_report(tmp_path, passing[:1], {})["md"].read_text(encoding="utf-8")
    second = report.write_report(tmp_path, passing, {})["md"].read_text(encoding="utf-8")
    assert first != second and f"{len(passing)} results:" in second


# --------------------------------------------------------------------------- terminal


def test_render_terminal_prints_matrix_and_failing_lines(mixed):
    console = Console(file=io.StringIO(), width=200, color_system=None)
    assert report.render_terminal(mixed, console) is console
    out = console.file.getvalue()
    for backend in {r.backend for r in mixed}:
        assert backend in out, f"backend {backend} missing from the terminal matrix:\n{out}"
    for row in report.matrix(mixed):
        assert report.format_margin(row["worst_margin"]) in out
    for r in mixed:
        if r.status == "fail":
            flat = " ".join(out.split())  # the console wraps a long line at a space
            assert f"FAIL {r.case} on {r.backend}/{r.device}/{r.dtype}" in out
            assert " ".join(r.divergence.describe().split()) in flat
    assert CRASH_MESSAGE in out and "causal masks are not supported" in out


def test_render_terminal_colours_margins(mixed):
    console = Console(file=io.StringIO(), width=200, force_terminal=True, color_system="standard")
    report.render_terminal(mixed, console)
    out = console.file.getvalue()
    for row in report.matrix(mixed):
        if row["worst_margin"] is None:
            continue
        colour = "\x1b[32m" if row["worst_margin"] <= 1 else "\x1b[1;31m"
        assert colour + report.format_margin(row["worst_margin"]) in out, f"{row} not coloured {colour!r}"


# --------------------------------------------------------------------------- environment


def test_environment_records_versions_devices_and_precision():
    had_tf = sys.modules.get("tensorflow") is not None
    env = environment.environment(["numpy"], ["cpu"], "highest")
    assert set(environment.PACKAGES) <= set(env["versions"])
    assert env["versions"]["numpy"] == np.__version__
    assert env["versions"]["python"].startswith(".".join(map(str, sys.version_info[:3])))
    assert all(isinstance(v, str) and v for v in env["versions"].values()), env["versions"]
    assert env["devices"]["requested"] == ["cpu"] and env["devices"]["cpu"]
    assert env["precision"]["mode"] == "highest" and "no GPU in this run" in env["precision"]["meaning"]
    if not had_tf:
        assert sys.modules.get("tensorflow") is None, "a numpy-only run must not import TensorFlow"
    tf32 = environment.environment(["numpy"], ["cpu"], "tf32")["precision"]
    assert tf32["mode"] == "tf32" and "wider tolerance" in tf32["meaning"] and "does not apply" in tf32["meaning"]


def _fake_torch(cudnn_tf32: bool) -> types.ModuleType:
    """torch as the report's probe sees it: one CUDA device and the TF32 switches."""
    torch = types.ModuleType("torch")
    torch.__version__ = "0.0-fake"
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                                       get_device_name=lambda i: "Fake GPU")
    torch.backends = types.SimpleNamespace(cuda=types.SimpleNamespace(matmul=types.SimpleNamespace(allow_tf32=False)),
                                           cudnn=types.SimpleNamespace(allow_tf32=cudnn_tf32))
    torch.get_float32_matmul_precision = lambda: "highest"
    return torch


def test_precision_lists_tf32_switches_only_where_a_gpu_ran(monkeypatch):
    """torch's cudnn.allow_tf32 defaults to True; on a CPU-only run it governs
    nothing, and the report must not read as if TF32 had been on or off."""
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cudnn_tf32=True))
    cpu = environment.environment(["torch"], ["cpu"], "highest")["precision"]
    assert cpu["TF32"] == "does not apply: no GPU in this run", cpu
    assert not any("tf32" in key.lower() or "float32_matmul" in key for key in cpu if key != "TF32"), cpu
    assert "off" not in cpu["meaning"].split(";")[0] and "no GPU in this run" in cpu["meaning"], cpu["meaning"]
    gpu = environment.environment(["torch"], ["cpu", "gpu"], "highest")["precision"]
    assert "TF32" not in gpu and "off on the GPU during every backend call" in gpu["meaning"], gpu
    assert gpu["torch.backends.cudnn.allow_tf32"] is True and gpu["torch.backends.cuda.matmul.allow_tf32"] is False, gpu
    assert "read outside the calls" in gpu["framework settings"], gpu
    allowed = environment.environment(["torch"], ["gpu"], "tf32")["precision"]
    assert "allowed on the GPU" in allowed["meaning"] and "wider tolerance" in allowed["meaning"], allowed


def test_environment_never_crashes_on_missing_or_broken_frameworks(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # import fails: "not installed"
    monkeypatch.setitem(sys.modules, "jax", None)

    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError(f"broken install: no {name}")

    monkeypatch.setitem(sys.modules, "torch", Broken("torch"))
    env = environment.environment(["torch", "tf", "jax"], ["cpu", "gpu"], "highest")
    assert env["versions"]["tensorflow"] == "not installed" and env["versions"]["jax"] == "not installed"
    assert env["devices"]["tensorflow"] == "not installed" and env["devices"]["jax"] == "not installed"
    assert str(env["devices"]["torch"]).startswith("unavailable"), env["devices"]
    assert str(env["precision"]["torch.backends.cuda.matmul.allow_tf32"]).startswith("unavailable"), env["precision"]
