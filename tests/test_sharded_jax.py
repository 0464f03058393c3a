"""impl_jax.sharded against the float64 reference, its mutants, `mha run --shard` and `mha check --sharded`.

JAX fixes its device count when it starts, so everything that needs several
devices runs in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4;
what needs none (block order, refusals, argument errors) runs here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The tests that run the engine are marked jax (tox -e jax) and skip without it (tox -e numpy);
# the runner's own tests need no framework.
needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None or importlib.util.find_spec("flax") is None,
                               reason="JAX/Flax not installed: pip install -c constraints/cpu.txt '.[jax]'")
MHA = [sys.executable, "-m", "conformance"]


def _env() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# -- in this process: no devices needed ----------------------------------------------

@pytest.mark.jax
@needs_jax
@pytest.mark.parametrize("length", [1, 5, 8, 11])
@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("zigzag", [False, True])
def test_block_order_holds_every_position_once(length, devices, zigzag):
    from impl_jax.sharded import block_order

    order = block_order(length, devices, zigzag)
    assert order.size % devices == 0, (order, devices)
    real = order[order >= 0]
    assert sorted(real.tolist()) == list(range(length)), order
    if zigzag and length % (2 * devices) == 0:
        blocks = order.reshape(devices, -1)
        chunk = length // (2 * devices)
        # device i: chunk i, then chunk 2N-1-i (an early and a late one)
        for i, block in enumerate(blocks):
            assert block[0] == i * chunk and block[chunk] == (2 * devices - 1 - i) * chunk, (i, block)


@pytest.mark.jax
@needs_jax
def test_heads_refusals_name_the_counts():
    from impl_jax.sharded import kv_split
    from weights import AttentionConfig

    assert kv_split(AttentionConfig(num_heads=8, num_kv_heads=4, query_dim=8, head_dim=2), 4) == "split"
    assert kv_split(AttentionConfig(num_heads=8, num_kv_heads=2, query_dim=8, head_dim=2), 4) == "replicated"
    assert kv_split(AttentionConfig(num_heads=8, num_kv_heads=1, query_dim=8, head_dim=2), 4) == "replicated"
    with pytest.raises(NotImplementedError, match="num_heads=2, devices=4"):
        kv_split(AttentionConfig(num_heads=2, query_dim=8, head_dim=2), 4)
    with pytest.raises(NotImplementedError, match="num_kv_heads=3, devices=2"):
        kv_split(AttentionConfig(num_heads=6, num_kv_heads=3, query_dim=6, head_dim=2), 2)


@pytest.mark.jax
@needs_jax
def test_past_key_positions_is_refused_by_name():
    """The engines place a cache's keys at 0..P-1: past_key_positions is refused before anything runs."""
    from conformance.suite.cases import CASES
    from conformance.suite.compare import expected_for
    from impl_jax import sharded as engine

    case = CASES["decode_cache"]
    exp = expected_for(case, "float32")
    inputs = dict(exp["inputs"], past_key_positions=np.arange(case.P))
    with pytest.raises(NotImplementedError, match="past_key_positions is not taken"):
        engine.forward(case.config, exp["tensors"], inputs, case.options("float32"), kind="heads", devices=1)
    inputs = dict(exp["inputs"], topk_indices=np.zeros((case.B, case.T, 2), np.int64))  # not wired for a selection
    with pytest.raises(NotImplementedError, match="topk_indices is not taken"):
        engine.forward(case.config, exp["tensors"], inputs, case.options("float32"), kind="heads", devices=1)


def test_parse_shard_and_missing_engine():
    from conformance.suite import sharded

    assert sharded.parse_shard("sequence:4") == ("sequence", 4)
    for bad in ("heads", "heads:0", "rows:2", "heads:x"):
        with pytest.raises(ValueError, match=f"--shard must be heads:N or sequence:N.*got '{bad}'"):
            sharded.parse_shard(bad)


def test_an_engine_whose_module_is_missing_is_not_run(monkeypatch):
    from conformance.suite import sharded

    monkeypatch.setitem(sharded.ENGINES, "ghost", "impl_ghost.sharded")
    results, skipped = sharded.run_sharded(("ghost",), case_names=["sh_self"], jobs=1)
    assert results == [] and len(skipped) == 1, (results, skipped)
    assert skipped[0][0] == "ghost (sharded)" and "impl_ghost.sharded cannot be imported" in skipped[0][2], skipped


# -- subprocesses with 4 host devices ---------------------------------------------------

# (case, kind, devices, dtype): GQA with K < N devices, MQA, causal bottom-right, decode with a
# cache split by position, segment ids with causal, fully masked rows, sinks, bfloat16.
PICKS = [
    ("sh_gqa_k2", "heads", 4, "float32"), ("sh_mqa", "heads", 2, "bfloat16"),
    ("sh_causal_bottom_right", "sequence", 4, "float32"), ("sh_decode_cache", "sequence", 4, "float32"),
    ("sh_segments_causal", "sequence", 2, "bfloat16"), ("sh_masked_rows_uniform", "sequence", 4, "float32"),
    ("sh_sinks_masked_rows", "heads", 4, "float32"), ("sh_window_causal", "sequence", 2, "float32"),
]


# slow (`tox -e full`): each of these runs, judged by the same run_case, is in the whole sharded grid that `tox`
# runs in its `all` env (tests/test_sharded_grid.py: every case x kind x devices x dtype, forward and gradients);
# the jax env keeps the engine's forward and gradients at 4 devices in the mutants' clean run below.
@pytest.mark.slow
@pytest.mark.jax
@needs_jax
def test_sharded_cases_pass_forward_and_gradients():
    code = (
        "import json\n"
        "from conformance.suite import sharded\n"
        "from impl_jax import sharded as engine\n"
        f"picks = {PICKS!r}\n"
        "out = []\n"
        "for case, kind, devices, dtype in picks:\n"
        "    r = sharded.run_case(sharded.SHARDED_CASES[case], 'jax', engine, kind, devices, dtype)\n"
        "    out.append([case, kind, devices, dtype, r.status, r.margin, sorted(c.name for c in r.comparisons),"
        " r.message])\n"
        "print(json.dumps(out))\n"
    )
    rows = json.loads(_python(code).strip().splitlines()[-1])
    for case, kind, devices, dtype, status, margin, compared, message in rows:
        assert status == "pass", (case, kind, devices, dtype, status, margin, message)
        assert "output" in compared and "grad query" in compared and "grad output.kernel" in compared, compared
    decode = next(r for r in rows if r[0] == "sh_decode_cache")
    assert "present_key" in decode[6] and "grad past_key" in decode[6], decode


@pytest.mark.jax
@needs_jax
def test_mutants_fail_and_the_engine_without_them_passes():
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "sharded_mutants.py")], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads(done.stdout.strip().splitlines()[-1])
    assert table["clean"]["failed"] == [], table["clean"]
    assert len(table) - 1 >= 5, table
    for name, row in table.items():
        if name != "clean":
            assert row["failed"], f"mutant {name} passed its cases: {row}"


def _write_run_files(tmp_path):
    import weights
    from conformance.io import write_arrays
    from weights import AttentionConfig

    config = AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=8, head_dim=4, rope={}, window_left=3,
                             use_sinks=True)
    tensors = weights.init(config, seed=3, dtype="float32")
    weights.save(tmp_path / "w.safetensors", config, tensors)
    rng = np.random.default_rng(5)
    ids = np.array([[0] * 4 + [1] * 7, [0] * 8 + [1] * 3])
    positions = np.array([list(range(4)) + list(range(7)), list(range(8)) + list(range(3))])
    inputs = {"query": rng.standard_normal((2, 11, 8)).astype(np.float32), "segment_ids": ids,
              "positions": positions, "key_positions": positions}
    write_arrays(tmp_path / "in.safetensors", inputs)
    return config, tensors, inputs


@pytest.mark.jax
@needs_jax
def test_mha_run_shard_gives_the_unsharded_output(tmp_path):
    """heads:4 and sequence:2 on packed documents, heads:2 and sequence:4 on a cache (present key and value
    written): tests/sharded_runs.py, as test_sharded_torch.py runs it for torch."""
    from sharded_runs import assert_run_shard_gives_the_unsharded_output

    assert_run_shard_gives_the_unsharded_output(tmp_path, "jax")


@pytest.mark.jax
@needs_jax
def test_mha_run_shard_refusals_are_one_line(tmp_path):
    _write_run_files(tmp_path)
    common = ["--weights", str(tmp_path / "w.safetensors"), "--inputs", str(tmp_path / "in.safetensors"),
              "--out", str(tmp_path / "o.safetensors")]
    for args, words in ((["--backend", "tf", "--shard", "heads:2"], "backend tf has no sharded engine"),
                        (["--backend", "jax", "--shard", "heads:two"], "--shard must be heads:N or sequence:N"),
                        (["--backend", "jax", "--shard", "heads:3"], "unsupported: heads sharding needs num_heads")):
        done = subprocess.run([*MHA, "run", *args, *common], cwd=ROOT, env=_env(), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 2, (args, done.returncode, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (args, done.stderr)


@pytest.mark.jax
@needs_jax
def test_mha_check_sharded_json_records_the_sharding(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run([*MHA, "check", "--sharded", "--sharded-engines", "jax", "--sharded-cases",
                           "sh_mask_bias_causal", "--dtypes", "float32", "--no-gradients", "--jobs", "1", "--json",
                           str(out)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = json.loads(out.read_text())["results"]
    assert sorted((r["sharding"]["kind"], r["sharding"]["devices"]) for r in records) == [
        ("heads", 2), ("heads", 4), ("sequence", 2), ("sequence", 4)], records
    assert all(r["sharding"]["engine"] == "jax" and r["status"] == "pass" for r in records), records
    assert "jax sequence:4 float32: 1/1 pass" in done.stdout, done.stdout


class _NumpyEngine:
    """A stand-in engine with run_jobs/refusal (as impl_torch.sharded has) that runs the float64 reference's
    code in the case dtype, unsharded: what the batching path must report as passing."""

    calls = 0

    @staticmethod
    def refusal(config, inputs, options, *, kind, devices, trace=False):
        return "no heads here" if kind == "heads" else None

    @classmethod
    def run_jobs(cls, jobs, *, kind, devices):
        from impl_numpy import adapter

        cls.calls += 1
        return [{"result": adapter.forward(j["config"], j["tensors"], j["inputs"], j["options"]) if j["op"] == "forward"
                 else adapter.vjp(j["config"], j["tensors"], j["inputs"], j["options"], j["d_output"])}
                for j in jobs]


def test_an_engine_with_run_jobs_runs_a_chunk_in_one_start(monkeypatch):
    import importlib

    from conformance.suite import sharded

    monkeypatch.setitem(sharded.ENGINES, "fake", "fake_sharded_engine")
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name: _NumpyEngine if name == "fake_sharded_engine"
                        else real(name))
    names = ["sh_causal_bottom_right", "sh_masked_rows_nan"]
    _NumpyEngine.calls = 0
    results, skipped = sharded.run_sharded(("fake",), device_counts=(2,), dtypes=("float32",), case_names=names,
                                           jobs=1)
    assert skipped == [] and _NumpyEngine.calls == 1, (skipped, _NumpyEngine.calls)
    by = {(r.case, r.sharding["kind"]): r for r in results}
    for name in names:
        assert by[(name, "sequence")].status == "pass", by[(name, "sequence")]
        assert "grad query" in {c.name for c in by[(name, "sequence")].comparisons}
        assert by[(name, "heads")].status == "unsupported" and by[(name, "heads")].message == "no heads here"
    assert by[("sh_masked_rows_nan", "sequence")].to_json()["sharding"] == {"engine": "fake", "kind": "sequence",
                                                                            "devices": 2}


@pytest.mark.jax
@needs_jax
def test_two_processes_of_two_devices_make_one_mesh(tmp_path):
    """The multi-host start, on one host: two processes joined by jax.distributed (gloo between their CPU
    devices), each with 2 host devices, run `mha run --shard sequence:4` over the 4; both write the reference's
    output."""
    import socket

    from safetensors.numpy import load_file

    from conformance.suite.tolerance import assert_close
    from impl_numpy.adapter import forward

    config, tensors, inputs = _write_run_files(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(2):
        env = _env() | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "MHA_JAX_NUM_PROCESSES": "2",
                        "MHA_JAX_PROCESS_ID": str(i)}
        procs.append(subprocess.Popen([*MHA, "run", "--backend", "jax", "--shard", "sequence:4", "--weights",
                                       str(tmp_path / "w.safetensors"), "--inputs", str(tmp_path / "in.safetensors"),
                                       "--causal", "--out", str(tmp_path / f"out{i}.safetensors")], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    t64 = {n: t.astype(np.float64) for n, t in tensors.items()}
    i64 = {n: (a.astype(np.float64) if a.dtype.kind == "f" else a) for n, a in inputs.items()}
    expected = forward(config, t64, i64, {"is_causal": True})["output"]
    for i in range(2):
        assert_close(f"output of process {i}", load_file(tmp_path / f"out{i}.safetensors")["output"], expected,
                     config=config, dtype="float32", quantity="output", B=2, T=11, S=11)
