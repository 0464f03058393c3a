"""impl_jax/programs.py: compiled CPU programs found on disk before tracing.

A program loaded from the cache must be the program jax.jit would have
compiled (the same bits out), and the key must change with everything that
changes the program, or a warm `mha check` would judge a stale program.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

INSTALL = "JAX/Flax not installed: pip install -c constraints/cpu.txt '.[jax]'"
jax = pytest.importorskip("jax", reason=INSTALL)

from assertions import assert_bit_equal, assert_bit_exact  # noqa: E402

import impl_jax.adapter as adapter  # noqa: E402  (switches x64 on)
from conformance.suite.cases import CASES  # noqa: E402
from conformance.suite.compare import expected_for  # noqa: E402
from impl_jax import programs  # noqa: E402

pytestmark = pytest.mark.jax


@pytest.fixture
def program_dir(tmp_path):
    programs.set_directory(tmp_path)
    programs.clear()
    yield tmp_path
    programs.set_directory(None)
    programs.clear()


def _call(case_name="modern_everything", dtype="float32"):
    case = CASES[case_name]
    exp = expected_for(case, dtype)
    options = case.options(dtype)
    d_out = exp["d_output"].astype(exp["tensors"]["query.kernel"].dtype)
    forward = adapter.forward(case.config, exp["tensors"], exp["inputs"], options, trace=True)
    grads = adapter.vjp(case.config, exp["tensors"], exp["inputs"], options, d_out)["grads"]
    return forward, grads


def _assert_same_bits(a, b):
    """Two (forward, grads) answers bit for bit: every output, every traced stage, every gradient."""
    fa, ga = a
    fb, gb = b
    for name in ("output", "weights", "present_key", "present_value"):
        if name in fa:
            assert_bit_equal(name, fa[name], fb[name])
    assert [s for s, _ in fa["trace"]] == [s for s, _ in fb["trace"]]
    for (stage, x), (_, y) in zip(fa["trace"], fb["trace"]):
        assert_bit_equal(stage, x, y)
    assert ga.keys() == gb.keys()
    assert_bit_exact(ga, gb, "grads")


@pytest.mark.parametrize("case_name", ["modern_everything", "decode_cache", "self_basic"])
def test_a_program_loaded_from_disk_gives_the_bits_jit_gives(program_dir, case_name):
    programs.set_directory(None)
    by_jit = _call(case_name)
    programs.set_directory(program_dir)
    compiled_here = _call(case_name)
    stored = list(program_dir.iterdir())
    assert stored, "nothing was written"
    programs.clear()  # a new process: only the files remain
    loaded = _call(case_name)
    _assert_same_bits(by_jit, compiled_here)
    _assert_same_bits(by_jit, loaded)
    assert sorted(program_dir.iterdir()) == sorted(stored), "a loaded program was compiled and written again"


def test_a_truncated_file_is_compiled_again(program_dir):
    first = _call("self_basic")
    paths = list(program_dir.iterdir())
    for path in paths:
        path.write_bytes(path.read_bytes()[:100])
    programs.clear()
    again = _call("self_basic")
    _assert_same_bits(first, again)
    assert all(path.stat().st_size > 100 for path in paths), "a truncated file was not replaced"


def _key(**change):
    device = jax.devices("cpu")[0]
    parts = {"name": "options", "static": (("config",), (("static", (("is_causal", False),)),)),
             "dynamic": ({"q": np.zeros((2, 3), np.float32)},)}
    parts.update(change)
    return programs._key(parts["name"], device, parts["static"], parts["dynamic"])


def test_the_key_changes_with_what_changes_the_program(monkeypatch):
    base = _key()
    assert _key() == base, "an equal call must find its program"
    changed = {
        "compile options": _key(name="other options"),
        "a static argument": _key(static=(("config",), (("static", (("is_causal", True),)),))),
        "a shape": _key(dynamic=({"q": np.zeros((2, 4), np.float32)},)),
        "a dtype": _key(dynamic=({"q": np.zeros((2, 3), np.float64)},)),
        "the tree": _key(dynamic=({"k": np.zeros((2, 3), np.float32)},)),
    }
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    changed["XLA_FLAGS"] = _key()
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(programs, "source_digest", lambda packages: b"edited source")
    changed["the source"] = _key()
    monkeypatch.undo()
    monkeypatch.setitem(programs._cpu_targets, id(jax.devices("cpu")[0]), "another CPU's instruction set")
    changed["the CPU compiled for"] = _key()
    monkeypatch.undo()
    with jax.default_matmul_precision("bfloat16"):
        changed["JAX's configuration"] = _key()
    same = [what for what, key in changed.items() if key == base]
    assert not same, f"the key ignores: {', '.join(same)}"


def test_without_a_directory_nothing_is_kept(tmp_path):
    programs.set_directory(None)
    _call("self_basic")
    assert programs._loaded == {}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA cap below is x86's")
def test_the_cpu_target_follows_the_instruction_set_xla_compiles_for():
    """A cache written where XLA targets one instruction set must not be read where it targets another. Capped at
    SSE4.2 (below any x86-64 CPU that runs these tests, all of which have AVX2), XLA compiles for less than the
    host: the target, and so every key, must differ from the uncapped one."""
    script = ("import jax; from impl_jax import programs; d = jax.devices('cpu')[0]; "
              "print(programs._cpu_target(d).split(chr(0))[1])")
    fingerprints = []
    for cap in ("", " --xla_cpu_max_isa=SSE4_2"):
        env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + cap}
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        fingerprints.append(proc.stdout.strip())
    assert not fingerprints[0].startswith("no topology"), fingerprints
    assert fingerprints[0] != fingerprints[1], fingerprints
