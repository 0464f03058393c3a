"""The conventions tables rendered: cells, Markdown, the terminal, and the
disagreements with the recorded expectations."""

from __future__ import annotations

from conformance.native.conventions.expectations import EXPECTED_SOURCE, expected
from conformance.native.conventions.harness import NOT_INSTALLED

# -- rendering ---------------------------------------------------------------------------------

COLUMNS = (
    ("API", "api"), ("bool True means", "mask_true_means"), ("fully masked row: output", "fully_masked_row"),
    ("its weights", "fully_masked_weights"), ("causal T=2, S=4", "causal_T2_S4"),
    ("causal T=4, S=2", "causal_T4_S2"), ("default float32 matmul", "float32_matmul"),
)


def _cell(row: dict, key: str) -> str:
    if row.get("status") != "measured" and key != "api":
        if key != "mask_true_means":
            return ""
        return row["status"] if row["status"] == NOT_INSTALLED else f"{row['status']}: {row.get('reason', '')}"
    value = row.get(key, "")
    if key == "float32_matmul":
        return "; ".join(f"{dev}: {m['label']} ({_fmt(m['rel_err'])})" for dev, m in value.items()) or "-"
    if key == "mask_true_means" and value in ("attend", "masked"):
        errs = [ev.get(f"max_err_if_true_{value}") for name, ev in row["evidence"].items() if name.startswith("polarity[")]
        worst = max((e for e in errs if isinstance(e, float)), default=None)
        return f"{value} (err {_fmt(worst)})" if worst is not None else value
    return str(value)


def _fmt(x) -> str:
    return f"{x:.1e}" if isinstance(x, float) else str(x)


FOOTNOTE_OVER = 24  # an "n/a: why" longer than this becomes "n/a [k]" with the why below the table


def table_cells(data: dict) -> tuple[list[list[str]], list[str]]:
    """The table's rows of cell strings, and its footnotes ("[k] why")."""
    rows, footnotes = [], []
    for row in data["rows"]:
        cells = []
        for _, key in COLUMNS:
            text = _cell(row, key)
            if text.startswith("n/a: ") and len(text) > FOOTNOTE_OVER:
                why = text[len("n/a: "):]
                if why not in footnotes:
                    footnotes.append(why)
                text = f"n/a [{footnotes.index(why) + 1}]"
            cells.append(text)
        rows.append(cells)
    return rows, [f"[{i}] {why}" for i, why in enumerate(footnotes, 1)]


def _notes(data: dict) -> list[str]:
    from conformance.native.conventions import alibi_models, modern, packed

    notes = modern.notes(data.get("modern_rows", [])) + packed.notes(data.get("packed_rows", []))
    notes += alibi_models.notes(data.get("alibi_rows", []))
    from conformance.native import mlx_lm_ports

    notes += mlx_lm_ports.notes(data.get("mlx_lm_rows", []))
    if data.get("keras_backends"):
        from conformance.native.conventions import keras_backends as kb

        notes += kb.notes(data["keras_backends"]) + [kb.setup_line(data["keras_backends"])]
    for row in data["rows"]:
        if row.get("status") not in ("measured", NOT_INSTALLED):
            notes.append(f"{row['api']}: {row['status']}: {row.get('reason', '')}")
        elif row.get("status") == NOT_INSTALLED:
            notes.append(f"{row['api']}: {row.get('reason', '')}")
        notes += [f"{row['api']}: {note}" for note in row.get("notes", [])]
    return notes


def disagreements(data: dict) -> list[str]:
    """One line per measured fact that differs from the recorded expectations."""
    import re

    from conformance.native.conventions import keras_backends as kb

    lines = kb.disagreements(data["keras_backends"]) if data.get("keras_backends") else []
    table = expected()
    from conformance.native.conventions.alibi_models import KEYS as ALIBI_KEYS
    from conformance.native.conventions.modern import KEYS as MODERN_KEYS
    from conformance.native.conventions.packed import KEYS as PACKED_KEYS

    tables = ([(row, ()) for row in data["rows"]] + [(row, MODERN_KEYS) for row in data.get("modern_rows", [])]
              + [(row, PACKED_KEYS) for row in data.get("packed_rows", [])]
              + [(row, ALIBI_KEYS) for row in data.get("alibi_rows", [])])
    for row, own in tables:
        if row.get("status") != "measured":
            continue
        for key, want in table.get(row["api"], {}).items():
            # an API may have a row in each table: each checks its own keys (the first table: the rest)
            if not ((key in own) if own else (key not in MODERN_KEYS + PACKED_KEYS + ALIBI_KEYS)):
                continue
            got = row.get(key)
            if isinstance(got, str):  # a modern cell's "(err 1.2e-07)" is evidence, not the convention
                got = re.sub(r" \(err [^)]*\)", "", got)
            if got != want:
                lines.append(f"{row['api']}: {key} expected {want!r}, measured {got!r}")
    return lines


def _setup_line(data: dict) -> str:
    shapes = data["shapes"]
    return (f"Measured in this run ({data['seconds']} s): B={shapes['B']} T={shapes['T']} S={shapes['S']} "
            f"N={shapes['N']} H={shapes['H']}, identity projections, float32 inputs vs the float64 NumPy reference, "
            f"match tolerance {data['tolerance']:g}; matmul probe {'x'.join(map(str, data['matmul_shape']))} "
            "(M x K x N) against float64, normwise relative error.")


def _second_tables(data: dict):
    """The tables after the first that this run measured: (name, module with SETUP/COLUMNS/cells, rows)."""
    from conformance.native import mlx_lm_ports
    from conformance.native.conventions import alibi_models, modern, packed

    for name, table, key in (("Modern arguments", modern, "modern_rows"),
                             ("Packed and sharded paths", packed, "packed_rows"),
                             ("ALiBi in transformers' models", alibi_models, "alibi_rows"),
                             ("mlx-lm's ports judged", mlx_lm_ports, "mlx_lm_rows")):
        if data.get(key) is not None and (data[key] or key != "mlx_lm_rows"):  # the ports' table: where asked for
            yield name, table, data[key]
    yield from _keras_backend_tables(data)


def _keras_backend_tables(data: dict):
    """The fifth and sixth tables: Keras's own attention on its three backends (keras_backends.py)."""
    from conformance.native.conventions import keras_backends as kb

    if data.get("keras_backends"):
        yield "Keras on its three backends", kb.RowsTable, data["keras_backends"]["rows"]
        yield "The same Keras calls across backends", kb.CrossTable, data["keras_backends"]["cross"]


def to_markdown(data: dict) -> str:
    """The table (Markdown), its footnotes and notes, versions, and one line per
    disagreement with the recorded expectations."""
    rows, footnotes = table_cells(data)
    out = ["| " + " | ".join(title for title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |" for cells in rows]
    out += ["", *[f"{line}  " for line in footnotes]] if footnotes else []
    for name, table, rows_ in _second_tables(data):
        out += ["", f"{name} ({table.SETUP}):", "",
                "| " + " | ".join(title for title, _ in table.COLUMNS) + " |", "|" + "---|" * len(table.COLUMNS)]
        out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |" for cells in table.cells(rows_)]
    notes = _notes(data)
    if notes:
        out += ["", "Notes:", *[f"- {note}" for note in notes]]
    out += ["", _setup_line(data), "", "Versions: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items()) + "."]
    lines = disagreements(data)
    out += ["", f"Disagreements with {EXPECTED_SOURCE}:" if lines else f"No disagreement with {EXPECTED_SOURCE}."]
    out += [f"- {line}" for line in lines]
    return "\n".join(out) + "\n"


def render_terminal(data: dict, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    table = Table(title="Native attention APIs: conventions measured in this run", show_lines=True)
    for title, key in COLUMNS:
        table.add_column(title, overflow="fold", min_width=12 if key == "api" else None)
    rows, footnotes = table_cells(data)
    for row, cells in zip(data["rows"], rows):
        table.add_row(*[Text(cell) for cell in cells], style=None if row.get("status") == "measured" else "dim")
    console.print(table)
    for name, table, rows_ in _second_tables(data):
        extra = Table(title=f"{name}: measured in this run ({table.SETUP})", show_lines=True)
        for title, key in table.COLUMNS:
            extra.add_column(title, overflow="fold", min_width=12 if key == "api" else None)
        for row, cells in zip(rows_, table.cells(rows_)):
            extra.add_row(*[Text(cell) for cell in cells], style=None if row.get("status") == "measured" else "dim")
        console.print(extra)
    for line in [*footnotes, *_notes(data), _setup_line(data),
                 "versions: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items())]:
        console.print(escape(line))
    lines = disagreements(data)
    if lines:
        console.print(f"[bold]disagreements with {escape(EXPECTED_SOURCE)}:[/]")
        for line in lines:
            console.print(escape(f"  {line}"))
    else:
        console.print(f"no disagreement with {escape(EXPECTED_SOURCE)}")


