"""The `mha` command line: init, run, trace, and one-line errors."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import select
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import weights
from conformance import console as cli
from conformance import logs
from conformance.cli.commands import main
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
    from weights.call import OPTIONAL_STAGES

    # the example is a plain layer
    assert [s["stage"] for s in report["stages"]] == [s for s in STAGES if s not in OPTIONAL_STAGES]
    softmax = next(s for s in report["stages"] if s["stage"] == "softmax")
    assert softmax["first"][:4] == [1.0, 0.0, 0.0, 0.0], "causal: the first query sees only the first key"
    code, out, err = run_cli("trace", "--weights", EXAMPLE / "weights.safetensors", "--inputs", EXAMPLE / "inputs.safetensors",
                             capsys=capsys)
    assert code == 0 and "merge_heads" in out and "softmax" in out


@pytest.mark.reference  # NumPy only (`mha trace`): the numpy env runs it, not `all`
def test_trace_shows_the_indexers_stages_first(tmp_path, capsys):
    """A layer with an indexer (the grid's DeepSeek V3.2 decode step over a cache): `mha trace` lists the
    indexer's stages (weights.call.indexer_stages) before the attention's, its selection the call's own."""
    from conformance.suite.cases import CASES, make_inputs, make_tensors
    from weights.call import indexer_stages

    case = CASES["indexer_dsa_decode"]
    inputs = make_inputs(case)
    weights.save(tmp_path / "w.safetensors", case.config, make_tensors(case))
    write_arrays(tmp_path / "in.safetensors", {n: x for n, x in inputs.items() if x is not None})
    code, out, err = run_cli("trace", "--weights", tmp_path / "w.safetensors", "--inputs", tmp_path / "in.safetensors",
                             "--causal", "--causal-alignment", "bottom_right", "--json", "--values", 3, capsys=capsys)
    assert code == 0, err
    stages = json.loads(out)["stages"]
    names = [s["stage"] for s in stages]
    first = indexer_stages(case.config)
    assert tuple(names[:len(first)]) == first and "indexer.selection" in first and "logits" in names, names
    _, selection = multi_head_attention(case.config, make_tensors(case), inputs["query"], inputs["key"],
                                        inputs["value"], past_key=inputs["past_key"], past_value=inputs["past_value"],
                                        past_index_keys=inputs["past_index_keys"], is_causal=True,
                                        causal_alignment="bottom_right", return_selection=True)
    chosen = next(s for s in stages if s["stage"] == "indexer.selection")
    assert chosen["shape"] == list(selection.shape) and chosen["first"] == selection.ravel()[:3].tolist(), chosen


@pytest.mark.torch
def test_trace_against_the_reference_names_a_torch_ports_indexer_stage(tmp_path, capsys, monkeypatch):
    """`mha trace --backend torch --against-reference` on DeepSeek V3.2's prefill (float32): the torch mirror
    is within every stage's tolerance (exit 0); with its indexer's RoPE pairing swapped (interleaved for
    V3.2's half-split) the first divergent stage is indexer.query.rope (exit 1), not the attention's output."""
    pytest.importorskip("torch")
    import impl_torch.indexer
    from conformance.suite.cases import CASES, cast_inputs, cast_tensors, make_inputs, make_tensors

    case = CASES["indexer_dsa_prefill"]
    weights.save(tmp_path / "w.safetensors", case.config, cast_tensors(make_tensors(case), "float32"))
    write_arrays(tmp_path / "in.safetensors", cast_inputs(make_inputs(case), "float32"))
    argv = ("trace", "--backend", "torch", "--weights", tmp_path / "w.safetensors", "--inputs",
            tmp_path / "in.safetensors", "--causal", "--against-reference", "--json")
    code, out, err = run_cli(*argv, capsys=capsys)
    assert code == 0 and json.loads(out)["against_reference"].startswith("every stage within"), (code, out[-300:], err)
    rope = impl_torch.indexer.index_rope
    monkeypatch.setattr(impl_torch.indexer, "index_rope", lambda x, angles, rotary_dim, interleaved, *rest:
                        rope(x, angles, rotary_dim, not interleaved, *rest))
    code, out, err = run_cli(*argv, capsys=capsys)
    verdict = json.loads(out)["against_reference"]
    assert code == 1 and verdict.startswith("first divergent stage: indexer.query.rope "), (code, verdict, err)


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


# -- what a user sees around the commands: version, framework logs, pipes and files ----------

def _env() -> dict:
    """The environment of a user's shell: no COLUMNS (a pipe would be 80 wide), no debug switch."""
    drop = ("COLUMNS", "MHA_DEBUG", logs.QUIET_ENV)
    return {k: v for k, v in os.environ.items() if k not in drop}


def _cli(*argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conformance", *map(str, argv)], cwd=ROOT, env=_env(), **kwargs)


def _pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


EXAMPLE_ARGS = ("--weights", EXAMPLE / "weights.safetensors", "--inputs", EXAMPLE / "inputs.safetensors")


def test_version_is_the_distributions(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    out = capsys.readouterr().out
    try:
        expected = importlib.metadata.version("mha-conformance")
    except importlib.metadata.PackageNotFoundError:
        expected = f"{_pyproject_version()} (source checkout, not installed)"
    assert info.value.code == 0 and out == f"mha (mha-conformance) {expected}\n", out


def test_version_from_a_checkout_that_is_not_installed(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    # imported from a checkout, pyproject.toml sits beside the package; installed (tox's wheel), it does not
    if (Path(cli.__file__).resolve().parents[1] / "pyproject.toml").is_file():
        assert cli.package_version() == f"{_pyproject_version()} (source checkout, not installed)"
    else:
        assert cli.package_version() == "unknown (not installed)"


def test_the_stderr_filter_drops_absl_lines_and_keeps_everything_else():
    kept = [b"mha: error: --weights x: no such file\n",
            b"Error: a line of our own that starts like a log line\n",
            b"F0000 00:00:1795606569.1 7 check.cc:1] Check failed: fatal lines always pass\n",
            b"Traceback (most recent call last):\n",
            b"\x1b[?25l\rprogress 3/8"]  # a progress bar: no newline
    dropped = [b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
               b"I0000 00:00:1795606567.396789    5509 port.cc:153] oneDNN custom operations are on.\n",
               b"E0000 00:00:1795606569.456302    5509 mkl_util.h:12] oneDNN supports DT_HALF only on platforms "
               b"with AVX-512. Falling back to the default Eigen-based implementation if present.\n",
               b"W1124 12:34:56.789012   42 cpu_client.cc:7] a warning after absl::InitializeLog\n"]
    stream = [dropped[0], dropped[1], kept[0], kept[1], dropped[2], kept[2], dropped[3], kept[3], kept[4]]
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", logs._FILTER], input=b"".join(stream),
                          capture_output=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == b"", proc
    assert proc.stdout == b"".join(kept), proc.stdout


def test_the_stderr_filter_passes_a_partial_line_at_once():
    """A prompt or progress line that starts like a log line waits 50 ms, not for a newline."""
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", logs._FILTER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        proc.stdin.write(b"Waiting for the device")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "the partial line was held back"
        assert os.read(proc.stdout.fileno(), 100) == b"Waiting for the device"
    finally:
        proc.stdin.close()
        proc.wait(timeout=20)


def test_main_leaves_the_environment_as_it_found_it(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv(logs.QUIET_ENV, raising=False)
    before = dict(os.environ)
    code, _, err = run_cli("trace", *EXAMPLE_ARGS, capsys=capsys)
    assert code == 0, err
    assert dict(os.environ) == before


def test_a_closed_stdout_exits_quietly():
    """The reader is gone before the first write (`mha ... | head` after head has exited)."""
    proc = subprocess.Popen([sys.executable, "-m", "conformance", "trace", "--json", *map(str, EXAMPLE_ARGS)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=_env())
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert err == b"", err
    assert proc.returncode == cli.EXIT_CLOSED_PIPE


def test_piped_into_head_says_nothing_on_stderr():
    command = " ".join(shlex.quote(str(a)) for a in (sys.executable, "-m", "conformance", "trace", "--json",
                                                     "--values", 1000, *EXAMPLE_ARGS)) + " | head -1"
    proc = subprocess.run(command, shell=True, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=120)
    assert proc.stdout == "{\n" and proc.stderr == "", proc


@pytest.mark.reference  # NumPy only (`mha trace`, `mha check --backends numpy`): the numpy env runs it, not `all`
def test_a_wide_table_reaches_a_file_whole(tmp_path):
    """rich would fold the values column at 80 columns; a file gets each stage on one line."""
    path = tmp_path / "trace.txt"
    with path.open("w") as f:
        proc = _cli("trace", "--values", 12, *EXAMPLE_ARGS, stdout=f, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc
    stages = json.loads(_cli("trace", "--json", "--values", 12, *EXAMPLE_ARGS, capture_output=True, text=True,
                             timeout=120).stdout)["stages"]
    lines = path.read_text().splitlines()
    assert max(map(len, lines)) > 80, "every row fits in 80 columns: the test shows nothing"
    for stage in stages:
        first = " ".join(f"{x:.4g}" for x in stage["first"])
        assert any(f" {stage['stage']} " in line and first in line for line in lines), \
            f"{stage['stage']}: its row is cut or folded:\n" + "\n".join(lines)


def test_the_check_matrix_reaches_a_file_one_row_per_line(tmp_path):
    path = tmp_path / "check.txt"
    with path.open("w") as f:
        proc = _cli("check", "--backends", "numpy", "--cases", "self_basic", "cross_dims", "--dtypes", "float32",
                    "float16", "--jobs", 1, "--no-gradients", "--paths", "stages", stdout=f, stderr=subprocess.PIPE,
                    text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc  # rich's disabled progress bar ends in a newline
    lines = path.read_text().splitlines()
    rule = next(i for i, line in enumerate(lines) if set(line.strip()) == {"─"})
    rows = lines[rule + 1:rule + 3]
    assert all(row.split()[:4] in (["numpy", "stages", "cpu", "float32"], ["numpy", "stages", "cpu", "float16"])
               for row in rows), lines
    assert all(re.search(r" \S+ \([a-z ._]+\)\s*$", row) for row in rows), f"worst case cell not whole:\n{lines}"
    assert lines[rule + 3].startswith("4 results"), "\n".join(lines)


@pytest.mark.tf
def test_tensorflow_logs_nothing_through_the_cli(tmp_path):
    pytest.importorskip("tensorflow", reason="TensorFlow not installed")
    out = tmp_path / "o.safetensors"
    proc = _cli("run", "--backend", "tf", "--dtype", "float16", *EXAMPLE_ARGS, "--out", out,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout == f"wrote {out}: output 2x4x2 (tf, cpu)\n", proc.stdout
    # worker processes inherit the filter (the parent imports TensorFlow too, to list its devices)
    proc = _cli("check", "--backends", "tf", "numpy", "--cases", "self_basic", "--dtypes", "float16",
                "--jobs", 2, "--no-gradients", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr


def test_vectors_generate_never_replaces_the_shipped_vectors_unasked(capsys):
    from conformance.suite.vectors import DEFAULT_DIR

    shipped = {p: p.stat().st_mtime_ns for p in DEFAULT_DIR.glob("*.safetensors")}
    assert shipped, "no shipped vectors"
    code, out, err = run_cli("vectors", "generate", "--cases", "self_basic", "--dtypes", "float32", capsys=capsys)
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and f"the shipped vectors in {DEFAULT_DIR}" in err and "--overwrite" in err, err
    assert {p: p.stat().st_mtime_ns for p in DEFAULT_DIR.glob("*.safetensors")} == shipped


def test_vectors_generate_to_a_directory_replaces_only_with_overwrite(tmp_path, capsys):
    argv = ("vectors", "generate", "--cases", "self_basic", "--dtypes", "float32", "--out", tmp_path)
    code, out, err = run_cli(*argv, capsys=capsys)
    assert code == 0 and out == f"wrote 1 vector files ({(tmp_path / 'self_basic.float32.safetensors').stat().st_size / 1024:.0f} KiB) to {tmp_path}\n", (out, err)
    path = tmp_path / "self_basic.float32.safetensors"
    path.write_bytes(b"stale")
    code, out, err = run_cli(*argv, capsys=capsys)
    assert code == 2 and "1 of the 1 vector files exist in --out" in err and path.read_bytes() == b"stale", err
    code, out, err = run_cli(*argv, "--overwrite", capsys=capsys)
    assert code == 0 and path.read_bytes() != b"stale", err


@pytest.mark.reference  # NumPy only (`mha trace`, `mha check --backends numpy`): the numpy env runs it, not `all`
def test_a_plain_check_runs_the_edge_and_long_cases_in_float32_and_given_dtypes_in_each(tmp_path):
    """conformance.suite.cases.CHECK_ONE_DTYPE: without --dtypes an edge case runs in float32 alone and a grid
    case in all four; --dtypes runs every selected case in each."""
    from conformance.suite.cases import CHECK_ONE_DTYPE, DTYPE_NAMES

    assert "edge_longrope_at_original" in CHECK_ONE_DTYPE and "long_alibi_256" in CHECK_ONE_DTYPE
    assert "self_basic" not in CHECK_ONE_DTYPE
    cases = ("self_basic", "edge_longrope_at_original")
    runs = [((), {"self_basic": set(DTYPE_NAMES), "edge_longrope_at_original": {"float32"}}),
            (("--dtypes", "float64", "bfloat16"), dict.fromkeys(cases, {"float64", "bfloat16"}))]
    for given, expected in runs:
        out = tmp_path / "check.json"
        proc = _cli("check", "--backends", "numpy", "--cases", *cases, *given, "--jobs", 1, "--no-gradients",
                    "--paths", "stages", "--json", out, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        ran: dict[str, set[str]] = {}
        for result in json.loads(out.read_text())["results"]:
            ran.setdefault(result["case"], set()).add(result["dtype"])
        assert ran == expected, (given, ran)
