"""The GPU run: every GPU measurement the suite makes, in one command with a time budget.

    python scripts/gpu_run.py --out DIR [--budget SECONDS] [--dry-run]

Runs, each step in its own process with its own time limit (a step that runs
out of time or fails is recorded, and the next one still runs):

  env        nvidia-smi, the Python packages and versions, what torch and jax see;
  check      `mha check --backends numpy torch --devices cpu gpu` and the same for jax,
             side by side: the whole default grid, every dtype, forward and gradients,
             against the float64 reference, plus each backend's GPU against its own CPU;
  kernels    (beside them) python -m conformance.native.conventions.kernels --device gpu: each
             SDPA kernel forced in turn (flash, efficient, cuDNN, math), jax's cudnn / xla;
  tf32       `mha check --precision tf32 --devices gpu --dtypes float32`, then the
             conventions table (its float32-matmul column reads each device);
  natives    (beside it) `mha check --backends native --devices gpu`;
  bench      `mha bench --device gpu` for jax, then torch (bert-base, gpt2, long,
             window, decode), each alone on the machine; then both again in bfloat16.

Everything lands in DIR (JSON, JUnit, logs, report) and in DIR/gpu-run.tar.gz, with
DIR/summary.json saying what each step did and how long it took. --dry-run runs the
same steps on the CPU with small settings (no GPU needed): how the script is tested.

A machine without TensorFlow (the CUDA images of torch and jax usually have none)
reports the Keras mirror "not run" with the reason; so does a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_SHAPES = ("bert-base", "gpt2", "long", "window", "decode")


def steps(out: Path, dry_run: bool) -> list[tuple[str, list[str], int, int]]:
    """(name, command, seconds allowed, phase) in order; the steps of one phase run side by side, a
    phase starts when the one before has ended. `mha` is `python -m conformance`. Each backend's check
    is its own step, so one that runs out of time leaves the others' results whole."""
    mha = [sys.executable, "-m", "conformance"]
    device = "cpu" if dry_run else "gpu"
    devices = ["cpu"] if dry_run else ["cpu", "gpu"]
    small = ["--cases", "self_basic", "causal_bottom_right", "masked_rows_nan", "decode_cache",
             "--dtypes", "float32", "bfloat16"] if dry_run else []
    env = [sys.executable, "-c", "from scripts.gpu_run import environment; environment()"]
    bench = ["bench", "--device", device, "--shapes", *BENCH_SHAPES, "--max-seconds", "1", "--repeats", "5",
             "--window-max", "16384"] + (["--quick"] if dry_run else [])

    def check(name, backends, jobs, *extra):
        return mha + ["check", "--backends", *backends, "--jobs", str(jobs), *extra, "--no-compile-cache",
                      "--json", str(out / f"{name}.json")]

    return [
        ("env", env, 60, 0),
        ("check-torch", check("check-torch", ["numpy", "torch"], 6, "--devices", *devices, *small,
                              "--junit", str(out / "check-torch.xml"), "--report", str(out / "report-torch")),
         330, 1),
        ("check-jax", check("check-jax", ["jax"], 8, "--devices", *devices, *small,
                            "--junit", str(out / "check-jax.xml"), "--report", str(out / "report-jax")), 330, 1),
        ("kernels", [sys.executable, "-m", "conformance.native.conventions.kernels", "--device", device,
                     "--json", str(out / "kernels.json")], 200, 1),
        ("tf32", check("tf32", ["torch", "jax"], 4, "--devices", device, "--dtypes", "float32", "--precision", "tf32",
                       "--conventions", *(small[:5] if dry_run else [])), 200, 2),
        ("natives", check("natives", ["native"], 8, "--devices", device, *small), 200, 2),
        ("bench-jax", mha + bench + ["--backends", "jax", "--json", str(out / "bench-jax.json")], 150, 3),
        ("bench-torch", mha + bench + ["--backends", "torch", "--json", str(out / "bench-torch.json")], 250, 4),
        ("bench-jax-bf16", mha + bench + ["--backends", "jax", "--dtype", "bfloat16",
                                          "--json", str(out / "bench-jax-bf16.json")], 150, 5),
        ("bench-torch-bf16", mha + bench + ["--backends", "torch", "--dtype", "bfloat16",
                                            "--json", str(out / "bench-torch-bf16.json")], 250, 6),
    ]


def environment() -> None:
    """What the machine has: printed as JSON (the env step's log)."""
    import importlib.metadata as md
    import platform

    info: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
                  "packages": {}}
    for name in ("numpy", "torch", "jax", "jaxlib", "flax", "tensorflow", "keras", "onnxruntime", "onnxruntime-gpu",
                 "safetensors", "rich", "transformers", "jax-cuda13-plugin", "jax-cuda12-plugin", "nvidia-cudnn-cu13",
                 "nvidia-cudnn-cu12"):
        try:
            info["packages"][name] = md.version(name)
        except md.PackageNotFoundError:
            info["packages"][name] = None
    try:
        info["nvidia-smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                             "--format=csv"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        info["nvidia-smi"] = f"not run: {err}"
    try:
        import torch

        info["torch"] = {"cuda": torch.version.cuda, "available": torch.cuda.is_available(),
                         "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
                         "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                         "allow_tf32_matmul_default": torch.backends.cuda.matmul.allow_tf32,
                         "allow_tf32_cudnn_default": torch.backends.cudnn.allow_tf32,
                         "float32_matmul_precision_default": torch.get_float32_matmul_precision()}
    except Exception as err:  # noqa: BLE001 - recorded
        info["torch"] = f"error: {err}"
    try:
        import jax

        info["jax"] = {"devices": [str(d) for d in jax.devices()], "default_backend": jax.default_backend(),
                       "default_matmul_precision": jax.config.jax_default_matmul_precision}
    except Exception as err:  # noqa: BLE001 - recorded
        info["jax"] = f"error: {err}"
    print(json.dumps(info, indent=1))


def run(out: Path, budget: float, dry_run: bool) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
               PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false", TF_CPP_MIN_LOG_LEVEL="2",
               MHA_CACHE_DIR=str(out / "cache"), COLUMNS="160")
    started = time.monotonic()
    summary: dict = {"budget_s": budget, "dry_run": dry_run, "steps": []}
    plan = steps(out, dry_run)
    running: list[tuple[str, subprocess.Popen, float, object]] = []

    def finish(name, proc, t0, log):
        rc = proc.wait()
        log.close()
        summary["steps"].append({"step": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
                                 "timed_out": getattr(proc, "timed_out", False)})
        print(f"[gpu_run] {name}: rc {rc} in {time.monotonic() - t0:.0f} s", flush=True)

    def wait_all():
        """Wait for every running step, each killed at its own deadline; each timed to its own end."""
        while running:
            for entry in list(running):
                name, proc, t0, log = entry
                if proc.poll() is None and time.monotonic() > proc.deadline:
                    proc.kill()
                    proc.timed_out = True
                if proc.poll() is not None:
                    running.remove(entry)
                    finish(name, proc, t0, log)
            time.sleep(0.2)

    phase_now = None
    for name, command, allowed, phase in plan:
        if phase != phase_now:
            wait_all()
            phase_now = phase
        left = budget - (time.monotonic() - started)
        if left < 15:
            summary["steps"].append({"step": name, "rc": None, "skipped": f"budget spent ({left:.0f} s left)"})
            continue
        log = open(out / f"{name}.log", "w")
        t0 = time.monotonic()
        print(f"[gpu_run] {name}: {' '.join(command[1:])}", flush=True)
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        proc.deadline = t0 + min(allowed, left)
        proc.timed_out = False
        running.append((name, proc, t0, log))
    wait_all()
    summary["seconds"] = round(time.monotonic() - started, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    shutil.rmtree(out / "cache", ignore_errors=True)
    with tarfile.open(out / "gpu-run.tar.gz", "w:gz") as tar:
        for path in sorted(out.rglob("*")):
            if path.is_file() and path.name != "gpu-run.tar.gz":
                tar.add(path, arcname=str(path.relative_to(out)))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for every result (created)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all steps together (default 480)")
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, small settings")
    args = p.parse_args(argv)
    summary = run(args.out, args.budget, args.dry_run)
    for step in summary["steps"]:
        print(f"{step['step']:12} rc={step.get('rc')} {step.get('seconds', '-')} s {step.get('skipped', '')}"
              f"{' TIMED OUT' if step.get('timed_out') else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
