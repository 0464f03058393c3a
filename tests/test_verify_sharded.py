"""`mha verify --shard`: a user's own sharded attention, checked on the shipped vectors.

The worked example is examples/mha_examples/jax_ring_attention.py, a ring
attention written by hand with jax.shard_map: it must pass the vectors it can
express, and the same ring with the classic causal-offset bug (each received
key block masked as if it were the device's own) must fail the causal ones.
JAX fixes its device count when it starts, so every run is a subprocess of
`mha verify`, which asks XLA for the host devices itself. Few vectors, one
dtype: each one compiles a sharded program with its gradients (about 4 s on
the 2-core VM).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MHA = [sys.executable, "-m", "conformance"]
RING = "mha_examples.jax_ring_attention"
needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                               reason="JAX not installed: pip install -c constraints/cpu.txt '.[jax]'")
# causal_bottom_right_long_query has query rows that see no key (the masked-row policy across the ring)
CAUSAL = ["causal_square", "causal_top_left", "causal_bottom_right_long_query"]


def _mha(*args, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # mha verify sets the device count itself
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "examples"), env.get("PYTHONPATH", "")])
    env |= env_extra or {}
    return subprocess.run([*MHA, "verify", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _one_line_error(done) -> str:
    """The CLI's refusal: exit 2 and one line on stderr, returned for the caller to check its words."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr, done.stdout[-2000:])
    return lines[0]


@pytest.mark.jax
@needs_jax
def test_hand_written_ring_passes_every_vector_it_runs(tmp_path):
    out, xml = tmp_path / "verify.json", tmp_path / "verify.xml"
    cases = [*CAUSAL, "gqa", "padding_mask"]  # gqa: a plain cross case; padding_mask: an input the ring refuses
    done = _mha("--impl", f"{RING}:attention", "--shard", "sequence:4", "--cases", *cases, "--dtypes", "float32",
                "--require-gradients", "--allow-unsupported", "--json", str(out), "--junit", str(xml))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "(jax sequence:4, 4 cpu devices)" in done.stdout, done.stdout
    payload = json.loads(out.read_text())
    assert payload["sharding"] == {"engine": "jax", "kind": "sequence", "devices": 4}, payload["sharding"]
    records = {r["name"]: r for r in payload["results"]}
    assert set(records) == {f"{c}.float32" for c in cases}, sorted(records)  # every chosen vector ran
    assert all(r["sharding"] == payload["sharding"] for r in records.values()), records
    passed = {name for name, r in records.items() if r["status"] == "pass"}
    assert passed == {f"{c}.float32" for c in [*CAUSAL, "gqa"]}, {n: r["detail"] for n, r in records.items()}
    for name in passed:  # gradients checked through the ring; the weights reported not returned, with the reason
        assert records[name]["gradients"] == "checked" and "weights" in records[name]["unchecked"], records[name]
        assert any(c["name"] == "grad key" for c in records[name]["comparisons"]), records[name]
    unsupported = records["padding_mask.float32"]
    assert unsupported["status"] == "unsupported" and "input mask" in unsupported["detail"], unsupported
    suite = ET.parse(xml).getroot()
    classnames = {case.get("classname") for case in suite.iter("testcase")}
    assert classnames == {"mha.verify.jax.sequence:4"}, classnames
    assert {p.get("name"): p.get("value") for p in suite.iter("property")}["sharding"] == json.dumps(
        payload["sharding"])


@pytest.mark.jax
@needs_jax
def test_ring_without_the_received_blocks_causal_offset_fails_the_causal_vectors(tmp_path):
    out = tmp_path / "verify.json"
    done = _mha("--impl", f"{RING}:attention_with_causal_offset_bug", "--shard", "sequence:4", "--cases", *CAUSAL,
                "self_basic", "--dtypes", "float32", "--json", str(out))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    records = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    failed = {name for name, r in records.items() if r["status"] == "fail"}
    assert failed == {f"{c}.float32" for c in CAUSAL}, {n: (r["status"], r["detail"]) for n, r in records.items()}
    # the bug is in the mask of the blocks that travel: the output is far off, not a rounding away
    assert all(records[f"{c}.float32"]["margin"] > 100 for c in CAUSAL), records
    assert records["self_basic.float32"]["status"] == "pass", records["self_basic.float32"]  # no causality: no bug
    assert "fail causal_square.float32" in done.stdout and "output: FAIL" in done.stdout, done.stdout[-3000:]


@pytest.mark.jax
@needs_jax
def test_hand_written_heads_split_passes_and_refuses_what_it_cannot_split(tmp_path):
    """The example's heads_attention under --shard heads:2: kernels split by head, one psum of the outputs."""
    out = tmp_path / "verify.json"
    done = _mha("--impl", f"{RING}:heads_attention", "--shard", "heads:2", "--cases", "gqa", "no_biases", "mqa",
                "causal_bottom_right_long_query", "--dtypes", "float32", "--require-gradients", "--allow-unsupported",
                "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["sharding"] == {"engine": "jax", "kind": "heads", "devices": 2}, payload["sharding"]
    status = {r["name"]: (r["status"], r["gradients"], r["detail"]) for r in payload["results"]}
    assert {n for n, s in status.items() if s[:2] == ("pass", "checked")} == {
        "gqa.float32", "no_biases.float32", "causal_bottom_right_long_query.float32"}, status
    assert status["mqa.float32"][0] == "unsupported" and "num_kv_heads divisible by 2" in status["mqa.float32"][2], \
        status["mqa.float32"]


@pytest.mark.jax
@needs_jax
def test_a_mesh_of_another_kind_is_refused_by_the_function_not_the_runner():
    """--shard heads:2 hands the ring a mesh whose axis is "heads": its own NotImplementedError, per vector."""
    done = _mha("--impl", f"{RING}:attention", "--shard", "heads:2", "--cases", "self_basic", "--dtypes", "float32")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "unsupported self_basic.float32: this ring shards the sequence only: got a mesh over ('heads',)" in \
        done.stdout, done.stdout


@pytest.mark.jax
@needs_jax
def test_sharded_refusals_are_one_line():
    # a function without a mesh argument: refused before any vector runs
    line = _one_line_error(_mha("--impl", "mha_examples.numpy_attention:attention", "--shard", "sequence:2"))
    assert "takes no mesh argument" in line, line
    # a sharded function without --shard: told to use it, instead of a TypeError per vector
    line = _one_line_error(_mha("--impl", f"{RING}:attention", "--cases", "self_basic"))
    assert "run it with --shard sequence:N" in line, line
    # fewer host devices than asked for (XLA_FLAGS set by the caller wins): the count and the flag named
    line = _one_line_error(_mha("--impl", f"{RING}:attention", "--shard", "sequence:4",
                                env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}))
    assert "4 devices asked for, 2 cpu device(s) present" in line, line


@pytest.mark.reference  # needs no framework: the numpy env runs it, not `tox -e all` again
def test_shard_arguments_without_jax_are_one_line():
    """What needs no framework: a malformed --shard, the torch engine (not built), --shard-engine alone."""
    line = _one_line_error(_mha("--impl", f"{RING}:attention", "--shard", "rows:2"))
    assert "--shard must be heads:N or sequence:N" in line, line
    line = _one_line_error(_mha("--impl", f"{RING}:attention", "--shard", "sequence:2", "--shard-engine", "torch"))
    assert "--shard-engine torch: unsupported: not built yet" in line, line
    line = _one_line_error(_mha("--impl", f"{RING}:attention", "--shard-engine", "torch"))
    assert "only with --shard KIND:N" in line, line
