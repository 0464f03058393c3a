"""The heatmaps of the `mha check` report (report.py): per-head PNGs of the
reference weights, the backend's weights and their absolute error, for the
worst failing case (or the closest case when everything passed)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np

from conformance.suite.compare import (
    STATUS_FAIL,
    STATUS_PASS,
    CaseResult,
)
from conformance.suite.matrix import _margin_key, format_margin, where
from weights.atomic import write_bytes_atomic

MAX_HEATMAP_HEADS = 16  # one PNG per head; beyond this the report says how many were left out
MAX_TICKS = 10  # labelled positions per axis; a longer axis is labelled every 2, 5, 10, 20, 50, ... positions


# --------------------------------------------------------------------------- heatmaps


def _weights_pair(result: CaseResult) -> tuple[np.ndarray, np.ndarray] | None:
    ref, got = result.arrays.get("reference_weights"), result.arrays.get("backend_weights")
    if ref is None or got is None:
        return None
    try:
        ref, got = np.asarray(ref, dtype=np.float64), np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if ref.shape != got.shape or ref.ndim != 4 or ref.size == 0:
        return None
    return ref, got


def heatmap_subject(results: list[CaseResult]) -> tuple[CaseResult | None, str]:
    """The case the heatmaps show, and why: the worst failing case that kept
    its weights, or (when nothing failed, or no failing case kept them) the
    passing case closest to its tolerance."""
    with_arrays = [r for r in results if r.status in (STATUS_PASS, STATUS_FAIL) and _weights_pair(r) is not None]
    failing = [r for r in with_arrays if r.status == STATUS_FAIL]
    if failing:
        return max(failing, key=lambda r: _margin_key(r.margin)), "worst failing case"
    passing = [r for r in with_arrays if r.status == STATUS_PASS]
    if not passing:
        return None, "no case kept its attention weights (run with keep_arrays / a case that returns weights)"
    if all(r.status == STATUS_PASS for r in results):
        why = "closest case: everything passed, this one has the highest margin"
    elif any(r.status == STATUS_FAIL for r in results):
        why = "closest passing case: no failing case kept its attention weights"
    else:
        why = "closest passing case: nothing failed a comparison, but some cases errored or are unsupported"
    return max(passing, key=lambda r: _margin_key(r.margin)), why


def _abs_error(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|backend - reference|; 0 where both are NaN (a masked_row="nan" row),
    NaN where only one side is not finite (drawn in the 'bad' colour)."""
    both_nan = np.isnan(got) & np.isnan(ref)
    same_inf = np.isinf(got) & np.isinf(ref) & (np.sign(got) == np.sign(ref))
    with np.errstate(invalid="ignore"):
        err = np.abs(got - ref)
    err = np.where(both_nan | same_inf, 0.0, err)
    return np.where(np.isfinite(err), err, np.nan)


def _batch_of_interest(result: CaseResult, B: int) -> int:
    """The batch entry holding the worst weights element (or the divergence), else 0."""
    for c in result.comparisons:
        if c.name == "weights" and c.index is not None and len(c.index) == 4:
            return int(c.index[0]) if 0 <= c.index[0] < B else 0
    d = result.divergence
    if d is not None and d.index and len(d.index) == 4 and 0 <= d.index[0] < B:
        return int(d.index[0])
    return 0


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "x"


def _finite_range(*arrays: np.ndarray) -> tuple[float, float]:
    values = np.concatenate([a[np.isfinite(a)].ravel() for a in arrays])
    if values.size == 0:
        return 0.0, 1.0
    lo, hi = float(values.min()), float(values.max())
    return (lo, hi) if hi > lo else (lo, lo + 1.0)


def integer_ticks(count: int, max_ticks: int = MAX_TICKS) -> list[int]:
    """The positions to label on an axis of `count` cells (imshow draws cell i from i - 0.5 to i + 0.5, and
    matplotlib's own ticks fall on the half-integers between them): 0 and every step-th position after it,
    step the smallest of 1, 2, 5, 10, 20, 50, ... that labels at most max_ticks."""
    magnitude = 1
    while True:
        for step in (magnitude, 2 * magnitude, 5 * magnitude):
            if -(-count // step) <= max_ticks:
                return list(range(0, count, step))
        magnitude *= 10


def _label_positions(ax, queries: int, keys: int) -> None:
    """Ticks on the query and key indices the panel shows, labelled with them."""
    for ticks, set_ticks in ((integer_ticks(keys), ax.set_xticks), (integer_ticks(queries), ax.set_yticks)):
        set_ticks(ticks, [str(i) for i in ticks])


def _head_figures(result: CaseResult, why: str):
    """(head, Figure) for each drawn head of the result's batch of interest (matplotlib imported)."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ref, got = _weights_pair(result)
    B, N, T, S = ref.shape
    b = _batch_of_interest(result, B)
    err = _abs_error(got, ref)
    weights_cmap = colormaps["viridis"].with_extremes(bad="#d0d0d0")
    error_cmap = colormaps["magma"].with_extremes(bad="#00c8ff")
    lo, hi = _finite_range(ref[b], got[b])
    for n in range(min(N, MAX_HEATMAP_HEADS)):
        fig = Figure(figsize=(12.0, 3.6), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, 3)
        head_err = err[b, n]
        finite_err = head_err[np.isfinite(head_err)]
        max_err = float(finite_err.max()) if finite_err.size else 0.0
        panels = (
            (ref[b, n], "reference weights (float64)", weights_cmap, lo, hi),
            (got[b, n], f"{result.backend} weights ({result.dtype})", weights_cmap, lo, hi),
            (head_err, f"absolute error (max {max_err:.3g})", error_cmap, 0.0, max(max_err, np.finfo(np.float64).tiny)),
        )
        for ax, (data, name, cmap, vmin, vmax) in zip(axes, panels):
            image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto",
                              interpolation="nearest")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("key position s")
            ax.set_ylabel("query position t")
            _label_positions(ax, T, S)
            fig.colorbar(image, ax=ax)
        fig.suptitle(f"{result.case} · {where(result)} · head {n} · batch {b} "
                     f"· margin {format_margin(result.margin)} ({why.split(':')[0]})", fontsize=10)
        yield n, fig


def _write_heatmaps(directory: Path, result: CaseResult, why: str) -> tuple[list[tuple[int, Path]], str]:
    """One PNG per head (reference weights | backend weights | absolute error).
    Returns [(head, path)] and a note ("" or why some or all are missing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        return [], f"heatmaps not drawn: matplotlib is not installed ({err}); install the 'report' extra"
    N = _weights_pair(result)[0].shape[1]
    written = []
    for n, fig in _head_figures(result, why):
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=90)
        name = f"heatmap-{_slug(result.case)}-{_slug(result.backend)}-{_slug(result.device)}-{_slug(result.dtype)}-head{n}.png"
        path = directory / name
        _atomic_write(path, buffer.getvalue())
        written.append((n, path))
    note = ""
    if N > MAX_HEATMAP_HEADS:
        note = f"heads {MAX_HEATMAP_HEADS} to {N - 1} not drawn (at most {MAX_HEATMAP_HEADS} heads per report)"
    return written, note



def _atomic_write(path: Path, data: bytes) -> None:
    """Old file or new file, never a mix (weights.atomic)."""
    write_bytes_atomic(path, data, overwrite=True)

