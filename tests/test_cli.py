"""The `mha` command line: init, run, trace, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import weights
from conformance.cli import main
from conformance.io import read_inputs, write_arrays
from impl_numpy import multi_head_attention

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "seed004"


def run_cli(*argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_init_run_matches_the_reference(tmp_path, capsys):
    config_path = tmp_path / "c.json"
    config_path.write_text(json.dumps({"num_heads": 2, "query_dim": 6, "head_dim": 3, "num_kv_heads": 1}))
    code, out, err = run_cli("init", "--config", config_path, "--out", tmp_path / "w.safetensors", "--dtype", "float64",
                             "--seed", 3, capsys=capsys)
    assert code == 0, err
    x = np.random.default_rng(0).standard_normal((2, 5, 6))
    mask = (np.random.default_rng(1).random((2, 5, 5)) < 0.7).astype(np.uint8)
    mask[..., 0] = 1
    write_arrays(tmp_path / "in.safetensors", {"query": x, "mask": mask})
    code, out, err = run_cli("run", "--weights", tmp_path / "w.safetensors", "--inputs", tmp_path / "in.safetensors",
                             "--out", tmp_path / "o.safetensors", "--causal", "--causal-alignment", "bottom_right",
                             "--return-weights", capsys=capsys)
    assert code == 0, err
    _, result = weights.read_safetensors(tmp_path / "o.safetensors")
    config, tensors = weights.load(tmp_path / "w.safetensors")
    out_ref, w_ref = multi_head_attention(config, tensors, x, mask=mask.astype(bool), is_causal=True,
                                          causal_alignment="bottom_right", return_weights=True)
    np.testing.assert_array_equal(result["output"], out_ref)
    np.testing.assert_array_equal(result["weights"], w_ref)
    # --dtype recomputes in another dtype
    code, _, err = run_cli("run", "--weights", tmp_path / "w.safetensors", "--inputs", tmp_path / "in.safetensors",
                           "--out", tmp_path / "o16.safetensors", "--dtype", "bfloat16", capsys=capsys)
    assert code == 0, err
    assert weights.read_safetensors(tmp_path / "o16.safetensors")[1]["output"].dtype.name == "bfloat16"


def test_trace_prints_every_stage(capsys):
    code, out, err = run_cli("trace", "--weights", EXAMPLE / "weights.safetensors", "--inputs", EXAMPLE / "inputs.safetensors",
                             "--causal", "--json", capsys=capsys)
    assert code == 0, err
    report = json.loads(out)
    from impl_numpy import STAGES

    assert [s["stage"] for s in report["stages"]] == list(STAGES)
    softmax = next(s for s in report["stages"] if s["stage"] == "softmax")
    assert softmax["first"][:4] == [1.0, 0.0, 0.0, 0.0], "causal: the first query sees only the first key"
    code, out, err = run_cli("trace", "--weights", EXAMPLE / "weights.safetensors", "--inputs", EXAMPLE / "inputs.safetensors",
                             capsys=capsys)
    assert code == 0 and "merge_heads" in out and "softmax" in out


def test_example_inputs_are_what_the_script_writes(tmp_path):
    inputs = read_inputs(EXAMPLE / "inputs.safetensors")
    assert inputs["query"].shape == (2, 4, 3)
    np.testing.assert_array_equal(inputs["query"][0], inputs["query"][1])


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["run", "--weights", "nope.safetensors", "--inputs", "x", "--out", "o"], "nope.safetensors: no such file"),
        (["init", "--config", "missing.json", "--out", "w"], "--config missing.json: cannot read"),
        (["run", "--backend", "caffe"], "argument --backend: invalid choice: 'caffe'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["trace", "--weights", "{example}/weights.safetensors", "--inputs", "{example}/weights.safetensors"],
         "unexpected tensors"),
        (["trace", "--weights", "{example}/inputs.safetensors", "--inputs", "{example}/inputs.safetensors"],
         "format is None, expected 'mha-weights'"),
        (["trace", "--weights", "{example}/weights.safetensors", "--inputs", "{example}/inputs.safetensors", "--device", "gpu"],
         "--device gpu: backend numpy has no such device here"),
        (["run", "--weights", "{example}/weights.safetensors", "--inputs", "{example}/inputs.safetensors",
          "--out", "{example}/weights.safetensors"], "exists; pass overwrite=True (CLI: --overwrite)"),
    ],
)
def test_errors_are_one_line_exit_2(argv, fragment, capsys):
    argv = [a.replace("{example}", str(EXAMPLE)) for a in argv]
    with pytest.raises(SystemExit) if argv[0] == "frobnicate" or "caffe" in argv else _nothing() as info:
        code, out, err = run_cli(*argv, capsys=capsys)
    if info is not None and hasattr(info, "value"):
        code, err = info.value.code, capsys.readouterr().err
    assert code == 2, (code, err)
    assert fragment in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_console_script_runs_without_traceback(tmp_path):
    """The installed entry point, in a subprocess, on a corrupt file."""
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 20)
    proc = subprocess.run([sys.executable, "-m", "conformance", "trace", "--weights", str(bad), "--inputs", str(bad)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert "bad.safetensors: not a safetensors file: header length" in proc.stderr
