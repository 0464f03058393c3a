"""Each tox env holds exactly the pinned versions (constraints/cpu.txt).

tox installs with uv (tox-uv, tox.ini), which reads UV_CONSTRAINT and not PIP_CONSTRAINT: an env whose
installer ignored the file would resolve torch to a CUDA build of several GB and the other frameworks to
whatever is newest, and every test would still run. Here each env compares what it holds with the file.
One parameter per env's marker, so that `tox -e torch` (`-m torch ...`), `tf`, `jax`, `hub`, `mlx` each run it;
the numpy env and `all` run the unmarked one. It imports no framework (importlib.metadata only).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints" / "cpu.txt"


def pins(text: str) -> dict[str, Requirement]:
    """The constraints that apply on this machine (their markers evaluated), by canonical name."""
    found = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate():
                found[canonicalize_name(requirement.name)] = requirement
    return found


def mismatches(pinned: dict[str, Requirement], installed: dict[str, str]) -> list[str]:
    """Installed distributions whose version the pin excludes (a local label such as +cpu must match)."""
    return [f"{name} {version} (pinned {pinned[name].specifier})" for name, version in sorted(installed.items())
            if name in pinned and not pinned[name].specifier.contains(version, prereleases=True)]


def installed_here() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}


@pytest.mark.parametrize("env", [
    "numpy or all",
    pytest.param("torch", marks=pytest.mark.torch),
    pytest.param("tf", marks=pytest.mark.tf),
    pytest.param("jax", marks=pytest.mark.jax),
    pytest.param("hub", marks=pytest.mark.hub),
    pytest.param("mlx", marks=pytest.mark.mlx),
])
def test_the_env_holds_the_pinned_versions(env):
    given = {os.environ.get("UV_CONSTRAINT"), os.environ.get("PIP_CONSTRAINT")} - {None, ""}
    if not any(Path(p).resolve() == CONSTRAINTS.resolve() for p in given):
        pytest.skip("installed without constraints/cpu.txt (tox sets UV_CONSTRAINT and PIP_CONSTRAINT to it)")
    pinned = pins(CONSTRAINTS.read_text())
    installed = installed_here()
    assert not mismatches(pinned, installed), mismatches(pinned, installed)
    assert {"numpy", "pytest"} <= installed.keys() & pinned.keys()


def test_a_cuda_torch_or_an_unpinned_version_is_caught():
    pinned = pins('torch==2.13.0+cpu ; sys_platform != "never"\nnumpy==2.4.6\njax==0.10.2 ; sys_platform == "never"\n')
    assert set(pinned) == {"torch", "numpy"}
    assert mismatches(pinned, {"torch": "2.13.0", "numpy": "2.4.6", "jax": "0.11.0"}) == [
        "torch 2.13.0 (pinned ==2.13.0+cpu)"]
    assert mismatches(pinned, {"torch": "2.13.0+cpu", "numpy": "2.5.0"}) == ["numpy 2.5.0 (pinned ==2.4.6)"]
    assert mismatches(pinned, {"torch": "2.13.0+cpu", "numpy": "2.4.6"}) == []
