"""The forced-kernel conventions table (conformance/native/conventions/kernels.py) and the
GPU run script that carries it (scripts/gpu_run.py), on the CPU.

On a CPU torch offers the math and flash kernels and refuses the memory-efficient
and cuDNN ones; jax offers xla and refuses cudnn. Those facts are what a CPU
measurement must show, and the half-precision tolerance must still separate the
right convention from the wrong ones.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from conformance.native import conventions as conv

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data():
    pytest.importorskip("torch", reason="torch not installed: pip install -c constraints/cpu.txt '.[torch]'")
    pytest.importorskip("jax", reason="jax not installed: pip install -c constraints/cpu.txt '.[jax]'")
    from conformance.native.conventions import kernels as ck

    return ck.measure("cpu")


def _row(data, start: str) -> dict:
    return next(row for row in data["rows"] if row["api"].startswith(start))


@pytest.mark.torch
@pytest.mark.jax
def test_the_cpu_kernels_are_measured_and_the_refused_ones_say_why(data):
    math_row = _row(data, "torch SDPA cpu, sdpa_kernel(MATH)")
    assert (math_row["mask_true_means"], math_row["fully_masked_row"]) == ("attend", "0"), math_row
    assert math_row["causal_T2_S4"] == math_row["causal_T4_S2"] == "top_left", math_row
    flash = _row(data, "torch SDPA cpu, sdpa_kernel(FLASH_ATTENTION)")
    assert flash["dtype"] == "float16" and flash["mask_true_means"] == "attend", flash
    assert flash["accepts"]["dropout_p=0.1"].startswith("no: "), flash["accepts"]
    assert "Triggered internally" not in flash["accepts"]["dropout_p=0.1"]
    for start in ("torch SDPA cpu, sdpa_kernel(EFFICIENT_ATTENTION)", "torch SDPA cpu, sdpa_kernel(CUDNN_ATTENTION)",
                  "jax.nn.dot_product_attention cpu, implementation=cudnn"):
        row = _row(data, start)
        assert all(v.startswith("no: ") for v in row["accepts"].values()), row["accepts"]
    xla = _row(data, "jax.nn.dot_product_attention cpu, implementation=xla")
    assert xla["fully_masked_row"] == conv.POLICY_LABELS["uniform"] and xla["accepts"]["GQA (4 query heads on 2)"] == "yes"
    assert xla["accepts"]["dtype float64"] == "yes", xla["accepts"]  # x64 on for the probe in this process
    text = __import__("conformance.native.conventions.kernels", fromlist=["markdown"]).markdown(data)
    assert "| accepts |" in text and "sdpa_kernel(MATH) float32" in text


@pytest.mark.torch
@pytest.mark.jax
def test_the_half_precision_tolerance_separates_right_from_wrong(data):
    """The float16 rows' correct convention lands within HALF_TOL and every wrong one is
    at least 20x farther: measured on the flash kernel's evidence."""
    from conformance.native.conventions.kernels import HALF_TOL

    flash = _row(data, "torch SDPA cpu, sdpa_kernel(FLASH_ATTENTION)")
    polarity = flash["evidence"]["polarity[attn_mask]"]
    assert polarity["max_err_if_true_attend"] <= HALF_TOL
    assert min(polarity["max_err_if_true_masked"], polarity["max_err_if_true_ignored"]) > 20 * HALF_TOL
    for key in ("causal_T2_S4", "causal_T4_S2"):
        ev = flash["evidence"][key]
        assert ev["max_err_if_top_left"] <= HALF_TOL < ev["max_err_if_bottom_right"] / 20, ev


@pytest.mark.torch
def test_a_kernel_that_drops_the_scale_is_caught(monkeypatch):
    """Mutant: the kernel row without the explicit scale (1/sqrt(64) of the padded width instead of
    1/sqrt(4)) must not read as the reference's conventions."""
    F = pytest.importorskip("torch.nn.functional", reason="torch not installed: pip install -c constraints/cpu.txt '.[torch]'")

    from conformance.native.conventions import kernels as ck

    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: real(*a, **{**kw, "scale": None}))
    row = conv.measure_api(ck.apis("cpu")[3])  # MATH, float32
    assert row["mask_true_means"] == "other" and row["causal_T2_S4"] == "other", row


def _script(name: str):
    """A module of scripts/ (not a package of the wheel), loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_run_steps_are_commands_the_cli_takes(tmp_path):
    """Every `mha` step of scripts/gpu_run.py parses with today's command line, GPU and dry run alike."""
    gpu_run = _script("gpu_run")
    from conformance.cli.commands import build_parser

    for dry_run in (False, True):
        plan = gpu_run.steps(tmp_path, dry_run)
        assert [name for name, *_ in plan][:3] == ["env", "check-torch", "check-jax"]
        for name, command, seconds, _ in plan:
            assert seconds > 0
            if command[1:3] == ["-m", "conformance"]:
                args = build_parser().parse_args(command[3:])
                assert ("gpu" in (getattr(args, "devices", None) or [getattr(args, "device", None)])) != dry_run, name


def test_the_gpu_page_holds_the_tables_its_files_give(capsys):
    """docs/gpu.md's tables are scripts/gpu_report.py's output on the run's own files, unedited."""
    gpu_report = _script("gpu_report")
    runs = sorted((ROOT / "docs" / "gpu").iterdir())
    assert runs, "docs/gpu holds no run"
    page = (ROOT / "docs" / "gpu.md").read_text()
    for run in runs:
        gpu_report.main([str(run)])
        tables = capsys.readouterr().out
        assert "### mha check, core backends" in tables and tables.strip() in page, run
