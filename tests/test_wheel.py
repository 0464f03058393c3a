"""The wheel works alone: `python -m build` gives an sdist and a wheel (built
from that sdist, so the sdist is complete) holding the vectors and the worked
example; installed into a fresh venv with NumPy and no framework, `mha verify
--impl` and `pytest --mha-impl` work on a user's NumPy function; with torch
added, the torch adapter works.

Minutes, and it needs the package index pip (uv, where there is one) is configured with: marked slow
and `wheel`; `tox -e numpy` runs it (pytest -m wheel). Prints the wheel's
size and the venv's install times (docs/verify-in-ci.md records them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
import venv
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.wheel]

ROOT = Path(__file__).resolve().parents[1]
# The project's own names and no other (a generic one such as `bench` would collide with any other on the path).
TOP_LEVEL = ("weights", "impl_numpy", "impl_torch", "impl_tf", "impl_jax", "impl_mlx", "conformance", "mha_examples")
VECTOR_FILES = sorted(p.name for p in (ROOT / "conformance" / "suite" / "vectors").glob("*.safetensors"))

BUGGY = '''
from attention import attention


def scale_bug(config, tensors, inputs, options):
    """The config's scale ignored: 1/sqrt(head_dim) always."""
    return attention(dict(config, scale=None), tensors, inputs, options)
'''

TORCH_USER = '''
import sys

from torch import nn

from conformance.suite.adapters import torch_module
from conformance.suite.verify import summary, verify


def build(c):
    return nn.MultiheadAttention(c.query_dim, c.num_heads, bias=c.use_query_bias, kdim=c.key_dim, vdim=c.value_dim,
                                 batch_first=True)


results = verify(torch_module(build, "torch-mha"), only=["self_basic", "cross_basic", "gqa"], require_gradients=True)
print(summary(results))
sys.exit(0 if all(r.status in ("pass", "unsupported") for r in results) and
         sum(r.status == "pass" and r.gradients == "checked" for r in results) == 8 else 1)
'''


# uv where there is one (tox's envs: the dev extra's tox-uv brings it): it makes the venv and installs into it
# from its cache, where pip unpacks every wheel again (2026-11-29, 2-core EPYC VM shared with other jobs: the wheel
# + pytest 31 -> 2 s, torch 19 -> 3 s, the whole test 39 -> 17 CPU seconds); what is tested is the wheel, not the
# installer. uv reads UV_CONSTRAINT and UV_FIND_LINKS (tox sets both), not pip's configuration.
UV = shutil.which("uv")


def new_venv(env_dir: Path) -> None:
    if UV:
        proc, _ = run([UV, "venv", "-q", env_dir])
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        venv.create(env_dir, with_pip=True)


def install(python: Path, *args, env) -> tuple[subprocess.CompletedProcess, float]:
    """pip install -q args into the venv of `python` (uv pip where there is uv)."""
    if UV:
        return run([UV, "pip", "install", "-q", "--python", python, *args], env=env)
    return run([python, "-m", "pip", "install", "-q", "--no-compile", *args], env=env)


def run(argv, *, cwd=None, env=None, timeout=900):
    started = time.perf_counter()
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - started


def test_the_wheel_works_alone_in_a_fresh_venv(tmp_path):
    pytest.importorskip("build")
    dist = tmp_path / "dist"
    proc, build_s = run([sys.executable, "-m", "build", *(["--installer", "uv"] if UV else []), "--outdir", dist, ROOT])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == set(TOP_LEVEL), f"the wheel's top-level names: {sorted(top_level)}, expected {TOP_LEVEL}"
    assert "conformance/bench/runners.py" in names and "conformance/bench/scripts/numpy_parts.py" in names
    assert VECTOR_FILES, "no vector in the source tree: is VECTOR_FILES's path right?"
    assert sorted(Path(n).name for n in names if n.startswith("conformance/suite/vectors/")) == VECTOR_FILES
    assert {"mha_examples/__init__.py", "mha_examples/numpy_attention.py", "conformance/suite/pytest_plugin.py",
            "conformance/suite/adapters.py"} <= set(names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "[pytest11]\nmha = conformance.suite.pytest_plugin" in entry_points
    in_sdist = tarfile.open(sdist).getnames()
    assert any(n.endswith("examples/mha_examples/numpy_attention.py") for n in in_sdist)

    env_dir = tmp_path / "venv"
    new_venv(env_dir)
    bin_dir = env_dir / "bin"
    python = bin_dir / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    proc, install_s = install(python, wheel, "pytest", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    frameworks = "import importlib.util as u; print([m for m in ('torch', 'tensorflow', 'jax') if u.find_spec(m)])"
    assert run([python, "-c", frameworks], env=env)[0].stdout.strip() == "[]"

    # a user's repository: the worked example copied out of the installed package, and a buggy variant
    user = tmp_path / "user"
    user.mkdir()
    where = run([python, "-c", "import mha_examples.numpy_attention as m; print(m.__file__)"], cwd=tmp_path, env=env)
    assert str(env_dir) in where[0].stdout, where
    (user / "attention.py").write_text(Path(where[0].stdout.strip()).read_text())
    (user / "buggy.py").write_text(BUGGY)

    proc, verify_s = run([bin_dir / "mha", "verify", "--impl", "attention:attention", "--allow-unsupported",
                          "--require-gradients", "--junit", "out.xml"], cwd=user, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{len(VECTOR_FILES)} vectors: " in proc.stdout and " fail" not in proc.stdout, proc.stdout
    suite = ET.parse(user / "out.xml").getroot().find("testsuite")
    # one testcase per vector, and one skipped testcase per comparison not judged ("<vector> <quantity>")
    cases = list(suite.iter("testcase"))
    per_vector = [c for c in cases if " " not in c.get("name")]
    assert len(per_vector) == len(VECTOR_FILES) and suite.get("failures") == "0", (len(per_vector), suite.attrib)
    assert all(c.find("skipped") is not None for c in cases if c not in per_vector)
    assert int(suite.get("tests")) == len(cases)

    proc, plugin_s = run([python, "-m", "pytest", "--mha-impl", "attention:attention", "-q", "-p", "no:cacheprovider"],
                         cwd=user, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout

    proc, _ = run([python, "-m", "pytest", "--mha-impl", "buggy:scale_bug", "-q", "-p", "no:cacheprovider",
                   "--mha-cases", "custom_scale", "self_basic"], cwd=user, env=env)
    assert proc.returncode == 1
    failed = sorted(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FAILED "))
    assert failed == [f"mha-vectors::custom_scale.{d}" for d in ("bfloat16", "float16", "float32", "float64")], \
        proc.stdout[-3000:]

    # with torch added, the torch adapter works
    constraints = ROOT / "constraints" / "cpu.txt"
    # pip: --no-compile (install()): its bytecode pass over torch's thousands of files (7 of its 18 s here) tests
    # nothing of ours; uv compiles none
    proc, torch_s = install(python, "-c", constraints, "torch", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (user / "torch_user.py").write_text(TORCH_USER)
    proc, _ = run([python, "torch_user.py"], cwd=user, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "12 vectors: 8 pass (8 with quantities not returned), 4 unsupported" in proc.stdout  # weights: default call

    print(f"\nwheel {wheel.name}: {wheel.stat().st_size / 2**20:.2f} MiB, sdist {sdist.stat().st_size / 2**20:.2f} MiB; "
          f"build {build_s:.0f} s; fresh venv ({'uv' if UV else 'pip'}): install wheel + pytest {install_s:.0f} s, mha "
          f"verify {verify_s:.1f} s, pytest --mha-impl {plugin_s:.1f} s, install torch {torch_s:.0f} s")
