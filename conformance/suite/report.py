"""The report of `mha check`: environment, matrix, failing cases, heatmaps.

One list of CaseResult (conformance/suite/compare.py), three renderings:

* `render_terminal`: the matrix printed after the run (rich), then one line
  per case that did not pass.
* `write_report(DIR)`: report.md and report.html (self-contained: inline CSS,
  PNG heatmaps beside them, referenced by file name) with the environment,
  the matrix, the cases that did not pass with their worst comparison and
  first divergent stage, and per-head heatmaps (reference weights, backend
  weights, absolute error) of the worst failing case, or of the closest case
  when everything passed.
* `matrix`: the rows both renderings share, one per (backend, device, dtype).

Every number shown is read from the results of the run being reported
(margins, errors, tolerances), formatted and nothing else: the report never
recomputes a verdict. `environment` (environment.py) records what the numbers depend on: the
versions of every framework, the device names and the precision settings.
Frameworks are imported only when the run used them (or had already imported
them), so writing a report never costs a TensorFlow import the run did not
need, and a missing or broken framework is recorded, never raised.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from pathlib import Path

from conformance.suite.compare import (
    DEFAULT_PATH,
    STATUS_ERROR,
    STATUS_FAIL,
    STATUS_PASS,
    STATUS_UNSUPPORTED,
    CaseResult,
)
from conformance.suite.heatmaps import _atomic_write, _write_heatmaps, heatmap_subject
from conformance.suite.matrix import (
    FAILURE_COLUMNS,
    MATRIX_COLUMNS,
    STATUSES,
    divergence_description,
    failure_cells,
    format_margin,
    matrix,
    matrix_cells,
    not_passing,
    where,
)

# --------------------------------------------------------------------------- writing



def _summary(results: list[CaseResult]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    verdict = "everything passed" if results and counts[STATUS_PASS] == len(results) else (
        "nothing was run" if not results else
        "everything that ran passed (each unsupported one with its reason below)"
        if counts[STATUS_FAIL] == counts[STATUS_ERROR] == 0 and counts[STATUS_PASS] else "NOT everything passed")
    not_judged = sum(len(r.not_judged) for r in results)
    judged = (f" {not_judged} comparisons not judged (their allowance is not well below the quantity's size: no "
              "check, not a pass)." if not_judged else "")
    return (f"{len(results)} results: {counts[STATUS_PASS]} pass, {counts[STATUS_FAIL]} fail, "
            f"{counts[STATUS_ERROR]} error, {counts[STATUS_UNSUPPORTED]} unsupported; {verdict}.{judged}")


def not_judged_lines(results: list[CaseResult]) -> list[str]:
    """One line per case and dtype with comparisons not judged (the allowance is a property of the case, dtype and
    quantity: every backend and path shares it): its quantities, how many results, the worst zero margin's reason."""
    groups: dict[tuple[str, str], dict[str, list]] = {}
    for r in results:
        for c in r.not_judged:
            groups.setdefault((r.case, r.dtype), {}).setdefault(c.name, []).append(c)
    lines = []
    for (case, dtype), quantities in groups.items():
        count = sum(len(v) for v in quantities.values())
        reason = next(iter(quantities.values()))[0].not_judged
        lines.append(f"{case}.{dtype}: {', '.join(quantities)} ({count} results; {reason})")
    return lines


HOW_TO_READ = (
    "Each case runs on a backend, device and dtype and is compared with the float64 NumPy reference evaluated on "
    "the same dtype-rounded inputs. Every compared quantity (output, attention weights, each gradient) has a "
    "tolerance derived from the dtype's unit round-off and the reduction lengths (conformance/suite/tolerance.py); its "
    "margin is the worst element's error divided by its allowance, so a margin <= 1 passes. For a failing case, "
    "the first divergent stage is the first stage of the forward pass (project, split_heads, logits, mask, "
    "softmax, dropout, attend, merge_heads, output) whose values leave the tolerance."
)


def _env_sections(env: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    """The environment as titled key/value tables: scalars under "Run", each
    nested dict under its own title (versions, devices, precision, ...)."""
    def text(value) -> str:
        if isinstance(value, (list, tuple)):
            return "; ".join(str(v) for v in value) if value else "-"
        if isinstance(value, dict):
            return "; ".join(f"{k}: {text(v)}" for k, v in value.items())
        return str(value)

    run = [(str(k), text(v)) for k, v in env.items() if not isinstance(v, dict)]
    sections = [("Run", run)] if run else []
    sections += [(str(k).capitalize(), [(str(kk), text(vv)) for kk, vv in v.items()])
                 for k, v in env.items() if isinstance(v, dict)]
    return sections


def _md_cell(text: str) -> str:
    """Backslash-escape what would break a table row or start raw HTML."""
    text = str(text).replace("\\", "\\\\").replace("|", "\\|").replace("<", "\\<")
    return text.replace("\r", " ").replace("\n", " ")


def _md_table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(_md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return lines


def _markdown(title, results, env, rows, bad, subject, why, heatmaps, heatmap_note) -> str:
    out = [f"# {title}", "", _summary(results), "", HOW_TO_READ, "", "## Matrix", ""]
    out += _md_table(MATRIX_COLUMNS, (matrix_cells(r) for r in rows)) if rows else ["No results."]
    out += ["", "## Cases that did not pass", ""]
    out += _md_table(FAILURE_COLUMNS, (failure_cells(r) for r in bad)) if bad else ["None: every case passed."]
    errors = [r for r in bad if r.status == STATUS_ERROR and r.arrays.get("traceback")]
    for r in errors:
        out += ["", f"### Traceback: {r.case} on {where(r)}", "", "```",
                str(r.arrays["traceback"]).rstrip().replace("```", "'''"), "```"]
    out += ["", "## Heatmaps", ""]
    if subject is None:
        out += [f"None drawn: {why}."]
    else:
        out += [f"{why[0].upper()}{why[1:]}: {subject.case} on {where(subject)} "
                f"(margin {format_margin(subject.margin)}). Per head: reference weights, backend weights, absolute "
                "error (grey: NaN in the weights; cyan: non-finite on one side only).", ""]
        out += [f"![{_md_cell(subject.case)} head {n}]({path.name})" for n, path in heatmaps]
        if heatmap_note:
            out += ["", heatmap_note[0].upper() + heatmap_note[1:] + "."]
    out += ["", "## Environment", ""]
    for name, items in _env_sections(env):
        out += [f"### {name}", ""] + _md_table(("setting", "value"), items) + [""]
    return "\n".join(out).rstrip() + "\n"


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 110em;
       padding: 0 1em; color: #1d1d1f; line-height: 1.4; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #c8c8cc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f0f0f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.long { font-family: ui-monospace, Menlo, monospace; font-size: 0.85em; max-width: 40em; }
.pass, .ok { color: #137333; font-weight: 600; }
.fail, .error, .bad { color: #b3261e; font-weight: 600; }
.unsupported { color: #8a5a00; font-weight: 600; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #e0e0e0; }
pre { background: #f6f6f8; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
""".strip()


def _html_table(header: Iterable[str], rows: Iterable[Iterable[tuple[str, str]]], *, css_class: str = "") -> list[str]:
    """rows: cells as (text, class) pairs; every text is escaped here."""
    esc = html.escape
    lines = [f'<table class="{esc(css_class)}">' if css_class else "<table>",
             "<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr></thead>", "<tbody>"]
    for row in rows:
        cells = "".join(f'<td class="{esc(cls)}">{esc(text)}</td>' if cls else f"<td>{esc(text)}</td>" for text, cls in row)
        lines.append(f"<tr>{cells}</tr>")
    lines.append("</tbody></table>")
    return lines


def _matrix_html_row(row: dict) -> list[tuple[str, str]]:
    cells = matrix_cells(row)
    margin = row["worst_margin"]
    margin_class = "num" if margin is None else ("num ok" if margin <= 1.0 else "num bad")
    classes = ["", "", "", "", "num pass" if row[STATUS_PASS] else "num", "num fail" if row[STATUS_FAIL] else "num",
               "num error" if row[STATUS_ERROR] else "num", "num unsupported" if row[STATUS_UNSUPPORTED] else "num",
               margin_class, ""]
    return list(zip(cells, classes))


def _failure_html_row(result: CaseResult) -> list[tuple[str, str]]:
    classes = [result.status, "", "", "", "", "", "num", "long", "long", "long"]
    return list(zip(failure_cells(result), classes))


def _html(title, results, env, rows, bad, subject, why, heatmaps, heatmap_note) -> str:
    esc = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">', f"<title>{esc(title)}</title>",
           f"<style>\n{CSS}\n</style>", "</head>", "<body>", f"<h1>{esc(title)}</h1>",
           f'<p class="summary">{esc(_summary(results))}</p>', f"<p>{esc(HOW_TO_READ)}</p>",
           '<h2 id="matrix">Matrix</h2>']
    out += _html_table(MATRIX_COLUMNS, (_matrix_html_row(r) for r in rows), css_class="matrix") if rows else [
        "<p>No results.</p>"]
    out.append('<h2 id="failures">Cases that did not pass</h2>')
    out += _html_table(FAILURE_COLUMNS, (_failure_html_row(r) for r in bad), css_class="failures") if bad else [
        "<p>None: every case passed.</p>"]
    for r in bad:
        if r.status == STATUS_ERROR and r.arrays.get("traceback"):
            out += [f"<details><summary>Traceback: {esc(r.case)} on {esc(where(r))}"
                    f"</summary><pre>{esc(str(r.arrays['traceback']).rstrip())}</pre></details>"]
    out.append('<h2 id="heatmaps">Heatmaps</h2>')
    if subject is None:
        out.append(f"<p>None drawn: {esc(why)}.</p>")
    else:
        out.append(f"<p>{esc(why[0].upper() + why[1:])}: <strong>{esc(subject.case)}</strong> on "
                   f"{esc(where(subject))} (margin "
                   f"{esc(format_margin(subject.margin))}). Per head: reference weights, backend weights, absolute "
                   "error (grey: NaN in the weights; cyan: non-finite on one side only).</p>")
        for n, path in heatmaps:
            alt = f"{subject.case} on {where(subject)}, head {n}"
            out.append(f'<figure><img src="{esc(path.name)}" alt="{esc(alt)}"><figcaption>head {n}</figcaption></figure>')
        if heatmap_note:
            out.append(f"<p>{esc(heatmap_note[0].upper() + heatmap_note[1:])}.</p>")
    out.append('<h2 id="environment">Environment</h2>')
    for name, items in _env_sections(env):
        out.append(f"<h3>{esc(name)}</h3>")
        out += _html_table(("setting", "value"), ([(k, ""), (v, "long")] for k, v in items), css_class="env")
    out += ["</body>", "</html>"]
    return "\n".join(out) + "\n"


def _conventions_md(conventions: dict | None) -> str:
    if conventions is None:
        return ""
    from conformance.native.conventions import to_markdown

    return "\n## Framework conventions, measured in this run\n\n" + to_markdown(conventions)


def _conventions_html(conventions: dict | None) -> str:
    if conventions is None:
        return ""
    from conformance.native.conventions import COLUMNS, table_cells, to_markdown

    rows, _ = table_cells(conventions)
    lines = ["<h2>Framework conventions, measured in this run</h2>"]
    lines += _html_table([title for title, _ in COLUMNS], [[(cell, "") for cell in cells] for cells in rows])
    notes = to_markdown(conventions).split("\n\n", 1)[1] if "\n\n" in to_markdown(conventions) else ""
    lines.append(f"<pre>{html.escape(notes)}</pre>")
    return "\n".join(lines) + "\n"


def write_report(directory, results: list[CaseResult], env: dict, *, title: str = "mha check",
                 conventions: dict | None = None) -> dict[str, Path]:
    """Write report.md, report.html and the heatmap PNGs into `directory`
    (created if needed). Returns {"md": ..., "html": ..., "heatmap_head0": ...}.
    `conventions`: conformance.native.conventions.measure()'s result, if measured."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    results = list(results)
    rows = matrix(results)
    bad = not_passing(results)
    subject, why = heatmap_subject(results)
    heatmaps, heatmap_note = ([], "") if subject is None else _write_heatmaps(directory, subject, why)
    if subject is not None and not heatmaps:
        subject, why = None, heatmap_note
    args = (title, results, env, rows, bad, subject, why, heatmaps, heatmap_note)
    paths: dict[str, Path] = {}
    for key, name, render in (("md", "report.md", _markdown), ("html", "report.html", _html)):
        paths[key] = directory / name
        text = render(*args)
        if key == "md":
            text += _conventions_md(conventions)
        else:
            text = text.replace("</body>", _conventions_html(conventions) + "</body>")
        _atomic_write(paths[key], text.encode("utf-8"))
    paths.update({f"heatmap_head{n}": path for n, path in heatmaps})
    return paths


# --------------------------------------------------------------------------- terminal


def _unsupported_groups(results: list[CaseResult]) -> dict[tuple[str, str, str], list[CaseResult]]:
    """Unsupported results by (backend, path, reason): one terminal line each, not one per case and dtype."""
    groups: dict[tuple[str, str, str], list[CaseResult]] = {}
    for r in results:
        if r.status == STATUS_UNSUPPORTED:
            groups.setdefault((r.backend, r.path, r.message), []).append(r)
    return groups


def _case_list(members: list[CaseResult]) -> str:
    """'softcap, sinks (cpu: float64, float32)': the cases, then the devices and dtypes they ran on."""
    cases = ", ".join(dict.fromkeys(r.case for r in members))
    places = {}
    for r in members:
        places.setdefault(r.device, []).append(r.dtype)
    where_ = "; ".join(f"{device}: {', '.join(dict.fromkeys(dtypes))}" for device, dtypes in places.items())
    return f"{cases} ({where_})"


def render_terminal(results: list[CaseResult], console=None):
    """Print the matrix (rich Table) and one line per case that did not pass.
    Returns the console used."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    results = list(results)
    table = Table(title="mha check: backend x path x device x dtype", title_justify="left", box=box.SIMPLE_HEAD,
                  show_edge=False, collapse_padding=True)
    for column in MATRIX_COLUMNS:
        numeric = column in ("pass", "fail", "error", "unsupported", "worst margin")
        header = {"error": "err.", "unsupported": "unsup.", "worst margin": "worst\nmargin"}.get(column, column)
        table.add_column(header, justify="right" if numeric else "left", no_wrap=column != "worst case",
                         overflow="fold", min_width=12 if column == "worst case" else None)
    for row in matrix(results):
        cells = [Text(c) for c in matrix_cells(row)]
        for i, status in ((4, STATUS_PASS), (5, STATUS_FAIL), (6, STATUS_ERROR), (7, STATUS_UNSUPPORTED)):
            if row[status]:
                cells[i].stylize({STATUS_PASS: "green", STATUS_FAIL: "bold red", STATUS_ERROR: "bold red",
                                  STATUS_UNSUPPORTED: "yellow"}[status])
        if row["worst_margin"] is not None:
            cells[8].stylize("green" if row["worst_margin"] <= 1.0 else "bold red")
        table.add_row(*cells)
    console.print(table)
    console.print(Text(_summary(results)))
    bad = not_passing(results)
    for (backend, path, message), members in _unsupported_groups(bad).items():
        line = Text()
        line.append("UNSUPPORTED ", style="yellow")
        where_ = backend if path == DEFAULT_PATH else f"{backend}/{path}"
        line.append(f"{where_}: {_case_list(members)}: ", style="bold")
        line.append(message or "-")
        console.print(line)
    for r in bad:
        if r.status == STATUS_UNSUPPORTED:
            continue
        line = Text()
        line.append(f"{r.status.upper()} ", style={STATUS_FAIL: "bold red", STATUS_ERROR: "bold red"}.get(r.status, "yellow"))
        line.append(f"{r.case} on {where(r)}: ", style="bold")
        if r.status == STATUS_FAIL:
            worst = r.worst
            line.append(worst.describe() if worst is not None else "-")
            line.append("; " + divergence_description(r))
            if r.message:
                line.append(f"; {r.message}")
        else:
            line.append(r.message or "-")
        console.print(line)
    for text in not_judged_lines(results):
        line = Text()
        line.append("NOT JUDGED ", style="yellow")
        line.append(text)
        console.print(line)
    return console
