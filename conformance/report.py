"""The report of `mha check`: environment, matrix, failing cases, heatmaps.

One list of CaseResult (conformance/compare.py), three renderings:

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
recomputes a verdict. `environment` records what the numbers depend on: the
versions of every framework, the device names and the precision settings.
Frameworks are imported only when the run used them (or had already imported
them), so writing a report never costs a TensorFlow import the run did not
need, and a missing or broken framework is recorded, never raised.
"""

from __future__ import annotations

import contextlib
import datetime
import html
import importlib
import importlib.metadata
import importlib.util
import io
import math
import os
import platform
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from conformance.cases import DTYPE_NAMES
from conformance.compare import DEFAULT_PATH, STATUS_ERROR, STATUS_FAIL, STATUS_PASS, STATUS_UNSUPPORTED, CaseResult
from conformance.tolerance import REFERENCE_FACTOR, SAFETY, UNIT_ROUNDOFF
from weights.atomic import write_bytes_atomic

STATUSES = (STATUS_PASS, STATUS_FAIL, STATUS_ERROR, STATUS_UNSUPPORTED)
DEVICE_ORDER = ("cpu", "gpu")
NOT_INSTALLED = "not installed"

# Top-level modules whose versions every report records, in this order.
PACKAGES = ("numpy", "torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "onnx", "onnxruntime",
            "ml_dtypes", "safetensors", "matplotlib", "rich")

# Backend id prefix -> the framework whose devices and precision flags it depends on.
FRAMEWORK_OF = {"torch": "torch", "tf": "tensorflow", "keras": "tensorflow", "jax": "jax", "flax": "jax",
                "onnx": "onnxruntime", "ort": "onnxruntime"}

MAX_HEATMAP_HEADS = 16  # one PNG per head; beyond this the report says how many were left out


# --------------------------------------------------------------------------- environment


def _version_of(module_name: str, distributions: dict[str, list[str]]) -> str:
    """A module's version without importing it (unless it already is)."""
    try:
        module = sys.modules.get(module_name)
        if module is not None and isinstance(getattr(module, "__version__", None), str):
            return module.__version__
        if importlib.util.find_spec(module_name) is None:
            return NOT_INSTALLED
        for dist in distributions.get(module_name, []) + [module_name]:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                return importlib.metadata.version(dist)
        return "installed (version unknown)"
    except Exception as err:  # a broken install is recorded, never raised
        return f"{NOT_INSTALLED} ({type(err).__name__}: {err})"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")) and ":" in line:
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def _frameworks_in_use(backends_used: Iterable[str]) -> list[str]:
    """The frameworks to ask for devices and precision flags: those the run's
    backends need, and any the process has already imported."""
    wanted = []
    for backend_id in backends_used:
        prefix = re.split(r"[_\-.]", str(backend_id), maxsplit=1)[0]
        if prefix in FRAMEWORK_OF:
            wanted.append(FRAMEWORK_OF[prefix])
    wanted += [name for name in ("torch", "tensorflow", "jax") if sys.modules.get(name) is not None]
    return list(dict.fromkeys(wanted))


def _ask(fn, default: Any = None) -> Any:
    try:
        return fn()
    except Exception as err:  # the report records why a framework couldn't answer
        return f"unavailable ({type(err).__name__}: {err})".replace("\n", " ")[:300] if default is None else default


def _torch_probe(devices: dict, flags: dict) -> None:
    torch = importlib.import_module("torch")

    def cuda_names():
        if not torch.cuda.is_available():
            return ["no CUDA device"]
        return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]

    devices["torch"] = _ask(cuda_names)
    flags["torch.backends.cuda.matmul.allow_tf32"] = _ask(lambda: bool(torch.backends.cuda.matmul.allow_tf32))
    flags["torch.backends.cudnn.allow_tf32"] = _ask(lambda: bool(torch.backends.cudnn.allow_tf32))
    flags["torch.get_float32_matmul_precision()"] = _ask(lambda: str(torch.get_float32_matmul_precision()))


def _jax_probe(devices: dict, flags: dict) -> None:
    jax = importlib.import_module("jax")
    devices["jax"] = _ask(lambda: [f"{d.platform}:{d.id} {getattr(d, 'device_kind', '')}".strip() for d in jax.devices()])
    flags["jax.config.jax_default_matmul_precision"] = _ask(lambda: str(jax.config.jax_default_matmul_precision))


def _tf_probe(devices: dict, flags: dict) -> None:
    tf = importlib.import_module("tensorflow")

    def names():
        found = []
        for d in tf.config.list_physical_devices():
            details = _ask(lambda d=d: tf.config.experimental.get_device_details(d), default={}) or {}
            found.append(f"{d.device_type} {d.name}" + (f" ({details['device_name']})" if "device_name" in details else ""))
        return found

    devices["tensorflow"] = _ask(names)
    flags["tf.config.experimental.tensor_float_32_execution_enabled()"] = _ask(
        lambda: bool(tf.config.experimental.tensor_float_32_execution_enabled()))


def _onnxruntime_probe(devices: dict, flags: dict) -> None:
    ort = importlib.import_module("onnxruntime")
    devices["onnxruntime"] = _ask(lambda: [f"{ort.get_device()}; providers {', '.join(ort.get_available_providers())}"])


PROBES = {"torch": _torch_probe, "jax": _jax_probe, "tensorflow": _tf_probe, "onnxruntime": _onnxruntime_probe}


def _precision_meaning(precision: str, gpu_in_run: bool) -> str:
    """What the precision mode meant on the devices this run used. Every
    backend sets its framework's float32 matmul precision for each call
    (impl_torch/device.py, impl_tf/layer.py, impl_jax, conformance/native)
    and restores it after; TF32 exists only on GPUs."""
    tolerance = (f"tolerance rtol = {SAFETY:g} * u * sqrt(L) with u the dtype's unit round-off; float16/bfloat16 at "
                 f"least {REFERENCE_FACTOR:g}x the same-precision reference's error")
    wider = (f"float32 is judged with u = {UNIT_ROUNDOFF['tf32']:.3g} (10 mantissa bits) instead of "
             f"{UNIT_ROUNDOFF['float32']:.3g}: a wider tolerance")
    if not gpu_in_run:
        if precision == "tf32":
            return f"tf32 asked for, but TF32 does not apply: no GPU in this run; {wider}"
        return f"float32 matmuls at the frameworks' highest precision on the CPU (TF32 does not apply: no GPU in this run); {tolerance}"
    if precision == "tf32":
        return f"TF32 / reduced-precision matmuls allowed on the GPU during every backend call; {wider}"
    return ("TF32 and reduced-precision matmuls off on the GPU during every backend call (each backend sets this for "
            f"the call and restores the framework's setting after); {tolerance}")


def framework_probes(backends_used: list[str]) -> dict:
    """The device names and precision flags of the frameworks the backends use (and of any already imported),
    importing them: {"devices": {...}, "flags": {...}}. `mha check` asks its workers, which have imported the
    frameworks already, so that its own process never imports one (TensorFlow alone takes seconds)."""
    device_names: dict[str, Any] = {}
    framework_flags: dict[str, Any] = {}
    for framework in _frameworks_in_use(backends_used):
        # installed or not, without reading every distribution's file list (packages_distributions: 0.3 s a call)
        if sys.modules.get(framework) is None and _version_of(framework, {}).startswith(NOT_INSTALLED):
            device_names[framework] = NOT_INSTALLED
            continue
        try:
            PROBES[framework](device_names, framework_flags)
        except Exception as err:  # import failure of an installed framework
            device_names[framework] = f"unavailable ({type(err).__name__}: {err})".replace("\n", " ")[:300]
    return {"devices": device_names, "flags": framework_flags}


def environment(backends_used: list[str], devices: list[str], precision: str, probes: dict | None = None) -> dict:
    """What the run's numbers depend on: versions, devices, precision settings.

    Versions are read without importing (a framework already imported reports
    its own `__version__`); device names and TF32 flags are asked of the
    frameworks the run's backends use (and of any already imported), and
    listed only when the run used a GPU, the one device they govern. Nothing
    here raises: a missing framework is "not installed", a broken one records
    its error. probes: framework_probes' answer, asked elsewhere (by mha
    check's workers); None asks here.
    """
    distributions = _ask(importlib.metadata.packages_distributions, default={})
    versions = {"python": f"{platform.python_version()} ({platform.python_implementation()})"}
    versions.update({name: _version_of(name, distributions) for name in PACKAGES})
    from conformance.cli import package_version

    versions["mha-conformance"] = _ask(package_version, default="unknown")

    device_names: dict[str, Any] = {
        "requested": list(devices),
        "cpu": f"{_cpu_model()} ({os.cpu_count() or '?'} logical cores)",
    }
    gpu_in_run = "gpu" in devices
    flags: dict[str, Any] = {"mode": precision, "meaning": _precision_meaning(precision, gpu_in_run)}
    probes = framework_probes(backends_used) if probes is None else probes
    device_names.update(probes["devices"])
    framework_flags: dict[str, Any] = dict(probes["flags"])
    if not gpu_in_run:
        # The frameworks' TF32 switches (torch's cudnn.allow_tf32 defaults to True,
        # TensorFlow's tensor_float_32_execution_enabled() too) govern GPU kernels
        # only: listing their values here would read as if they had been in force.
        flags["TF32"] = "does not apply: no GPU in this run"
    elif framework_flags:
        flags["framework settings"] = ("the values below, read outside the calls; every call sets its own precision "
                                       "(see meaning) and restores them after")
        flags.update(framework_flags)
    return {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "backends": list(backends_used),
        "versions": versions,
        "devices": device_names,
        "precision": flags,
    }


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


def _write_heatmaps(directory: Path, result: CaseResult, why: str) -> tuple[list[tuple[int, Path]], str]:
    """One PNG per head (reference weights | backend weights | absolute error).
    Returns [(head, path)] and a note ("" or why some or all are missing)."""
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        return [], f"heatmaps not drawn: matplotlib is not installed ({err}); install the 'report' extra"
    ref, got = _weights_pair(result)
    B, N, T, S = ref.shape
    b = _batch_of_interest(result, B)
    err = _abs_error(got, ref)
    weights_cmap = colormaps["viridis"].with_extremes(bad="#d0d0d0")
    error_cmap = colormaps["magma"].with_extremes(bad="#00c8ff")
    lo, hi = _finite_range(ref[b], got[b])
    written = []
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
            fig.colorbar(image, ax=ax)
        fig.suptitle(f"{result.case} · {where(result)} · head {n} · batch {b} "
                     f"· margin {format_margin(result.margin)} ({why.split(':')[0]})", fontsize=10)
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


# --------------------------------------------------------------------------- writing


def _atomic_write(path: Path, data: bytes) -> None:
    """Old file or new file, never a mix (weights.atomic)."""
    write_bytes_atomic(path, data, overwrite=True)


def _summary(results: list[CaseResult]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    verdict = "everything passed" if results and counts[STATUS_PASS] == len(results) else (
        "nothing was run" if not results else
        "everything that ran passed (each unsupported one with its reason below)"
        if counts[STATUS_FAIL] == counts[STATUS_ERROR] == 0 and counts[STATUS_PASS] else "NOT everything passed")
    return (f"{len(results)} results: {counts[STATUS_PASS]} pass, {counts[STATUS_FAIL]} fail, "
            f"{counts[STATUS_ERROR]} error, {counts[STATUS_UNSUPPORTED]} unsupported; {verdict}.")


HOW_TO_READ = (
    "Each case runs on a backend, device and dtype and is compared with the float64 NumPy reference evaluated on "
    "the same dtype-rounded inputs. Every compared quantity (output, attention weights, each gradient) has a "
    "tolerance derived from the dtype's unit round-off and the reduction lengths (conformance/tolerance.py); its "
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
    from conformance.conventions import to_markdown

    return "\n## Framework conventions, measured in this run\n\n" + to_markdown(conventions)


def _conventions_html(conventions: dict | None) -> str:
    if conventions is None:
        return ""
    from conformance.conventions import COLUMNS, table_cells, to_markdown

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
    `conventions`: conformance.conventions.measure()'s result, if measured."""
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
    return console
