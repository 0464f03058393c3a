"""The rows the `mha check` report (report.py) shows: the matrix, one row per
(backend, path, device, dtype), and the cases that did not pass."""

from __future__ import annotations

import math
from collections.abc import Iterable

from conformance.suite.cases import DTYPE_NAMES
from conformance.suite.compare import (
    DEFAULT_PATH,
    STATUS_ERROR,
    STATUS_FAIL,
    STATUS_PASS,
    STATUS_UNSUPPORTED,
    CaseResult,
)

STATUSES = (STATUS_PASS, STATUS_FAIL, STATUS_ERROR, STATUS_UNSUPPORTED)
DEVICE_ORDER = ("cpu", "gpu")

# --------------------------------------------------------------------------- matrix


def _order(values: Iterable[str], known: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    seen = list(dict.fromkeys(values))
    return {v: (known.index(v) if v in known else len(known), seen.index(v)) for v in seen}


def _margin_key(m: float) -> float:
    return math.inf if math.isnan(m) else m


def where(result: CaseResult) -> str:
    """backend/path/device/dtype of a result; backend/device/dtype where the backend has one path."""
    path = "" if result.path == DEFAULT_PATH else f"{result.path}/"
    return f"{result.backend}/{path}{result.device}/{result.dtype}"


def matrix(results: list[CaseResult]) -> list[dict]:
    """One row per (backend, path, device, dtype): status counts, the worst
    margin over passing and failing comparisons and the case it came from.

    Backends and their paths keep the order they first appear in; devices and
    dtypes go in the project's order (cpu, gpu; float64, float32, float16,
    bfloat16).
    """
    backend_rank = _order((r.backend for r in results), ())
    path_rank = _order((r.path for r in results), ())
    device_rank = _order((r.device for r in results), DEVICE_ORDER)
    dtype_rank = _order((r.dtype for r in results), DTYPE_NAMES)
    groups: dict[tuple[str, str, str, str], list[CaseResult]] = {}
    for r in results:
        groups.setdefault((r.backend, r.path, r.device, r.dtype), []).append(r)
    rows = []
    for (backend, path, device, dtype), members in sorted(
            groups.items(), key=lambda kv: (backend_rank[kv[0][0]], path_rank[kv[0][1]], device_rank[kv[0][2]],
                                            dtype_rank[kv[0][3]])):
        judged = [r for r in members if r.status in (STATUS_PASS, STATUS_FAIL) and r.comparisons]
        worst = max(judged, key=lambda r: _margin_key(r.margin), default=None)
        row = {"backend": backend, "path": path, "device": device, "dtype": dtype}
        row.update({status: sum(r.status == status for r in members) for status in STATUSES})
        row["total"] = len(members)
        row["worst_margin"] = None if worst is None else worst.margin
        row["worst_case"] = None if worst is None else worst.case
        row["worst_comparison"] = None if worst is None or worst.worst is None else worst.worst.name
        rows.append(row)
    return rows


def format_margin(margin: float | None) -> str:
    """A margin as the report prints it: 3 significant digits, "inf", or "-"."""
    if margin is None:
        return "-"
    if math.isnan(margin):
        return "nan"
    if math.isinf(margin):
        return "inf" if margin > 0 else "-inf"
    return f"{margin:.3g}"


MATRIX_COLUMNS = ("backend", "path", "device", "dtype", "pass", "fail", "error", "unsupported", "worst margin",
                  "worst case")


def matrix_cells(row: dict) -> list[str]:
    """The matrix row as the report's table cells (MATRIX_COLUMNS)."""
    worst_case = "-" if row["worst_case"] is None else f"{row['worst_case']} ({row['worst_comparison']})"
    return [row["backend"], row["path"], row["device"], row["dtype"], str(row[STATUS_PASS]), str(row[STATUS_FAIL]),
            str(row[STATUS_ERROR]), str(row[STATUS_UNSUPPORTED]), format_margin(row["worst_margin"]), worst_case]


# --------------------------------------------------------------------------- failing cases


def not_passing(results: list[CaseResult]) -> list[CaseResult]:
    """Failures (worst margin first), then errors, then unsupported cases."""
    rank = {STATUS_FAIL: 0, STATUS_ERROR: 1, STATUS_UNSUPPORTED: 2}
    bad = [r for r in results if r.status != STATUS_PASS]
    return sorted(bad, key=lambda r: (rank.get(r.status, 3), -_margin_key(r.margin) if r.status == STATUS_FAIL else 0))


def worst_description(result: CaseResult) -> str:
    worst = result.worst
    if worst is None:
        return "-"
    failed = [c.name for c in result.comparisons if not c.ok]
    prefix = f"{len(failed)} of {len(result.comparisons)} comparisons failed ({', '.join(failed)}); worst " if failed else ""
    return prefix + worst.describe()


def divergence_description(result: CaseResult) -> str:
    if result.divergence is not None:
        return result.divergence.describe()
    if result.status == STATUS_FAIL:
        return "not localised: every traced forward stage is within tolerance (or the backend has no trace)"
    return "-"


FAILURE_COLUMNS = ("status", "case", "backend", "path", "device", "dtype", "margin", "worst comparison",
                   "first divergent stage", "message")


def failure_cells(result: CaseResult) -> list[str]:
    margin = format_margin(result.margin) if result.comparisons else "-"
    return [result.status, result.case, result.backend, result.path, result.device, result.dtype, margin,
            worst_description(result), divergence_description(result), result.message or "-"]


