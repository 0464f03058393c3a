"""The environment section of the `mha check` report (report.py): the versions
of every framework, the device names and the precision settings the numbers
depend on. Frameworks are imported only when the run used them (or had
already imported them); a missing or broken framework is recorded, never raised."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from conformance.suite.tolerance import REFERENCE_FACTOR, SAFETY, UNIT_ROUNDOFF

NOT_INSTALLED = "not installed"

# Top-level modules whose versions every report records, in this order.
PACKAGES = ("numpy", "torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "mlx", "onnx", "onnxruntime",
            "ml_dtypes", "safetensors", "matplotlib", "rich")

# Backend id prefix -> the framework whose devices and precision flags it depends on.
FRAMEWORK_OF = {"torch": "torch", "tf": "tensorflow", "keras": "tensorflow", "jax": "jax", "flax": "jax",
                "onnx": "onnxruntime", "ort": "onnxruntime", "mlx": "mlx"}
# Whole backend ids whose framework their prefix does not say: Keras on jax and on torch.
FRAMEWORK_OF_BACKEND = {"keras-jax": "jax", "keras-torch": "torch"}


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
        if backend_id in FRAMEWORK_OF_BACKEND:
            wanted.append(FRAMEWORK_OF_BACKEND[backend_id])
        elif prefix in FRAMEWORK_OF:
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


def _mlx_probe(devices: dict, flags: dict) -> None:
    mx = importlib.import_module("mlx.core")
    devices["mlx"] = _ask(lambda: [str(mx.default_device())] + (["gpu (Metal)"] if mx.metal.is_available() else []))


PROBES = {"torch": _torch_probe, "jax": _jax_probe, "tensorflow": _tf_probe, "onnxruntime": _onnxruntime_probe,
          "mlx": _mlx_probe}


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
    from conformance.console import package_version

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


