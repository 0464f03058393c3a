"""The timing scripts the README cites (docs/bench/*.py) still run, on tiny
shapes. No assertion is about speed: only that each prints its figures and
leaves the library as it found it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "docs" / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_bench_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_threads_ab_prints_both_settings_and_restores_the_threshold(monkeypatch, capsys):
    from impl_numpy import chunked

    script = load("threads_ab")
    monkeypatch.setattr(script, "SHAPES", [(2, 8, 16, 2), (1, 4, 8, 1)])
    monkeypatch.setattr(script, "ROUNDS", 1)
    before = chunked.THREADED_MIN_FLOPS
    script.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2, lines
    for line in lines:
        assert re.search(r"ffn: BLAS threads +[\d.]+ ms, ours +[\d.]+ ms \(x[\d.]+\)", line), line
        assert re.search(r"settle: BLAS threads +[\d.]+ ms, ours +[\d.]+ ms \(x[\d.]+\)", line), line
    assert chunked.THREADED_MIN_FLOPS == before, "the script must put the threshold back"


@pytest.mark.torch
def test_torch_gpt2_parts_prints_every_part_and_the_bound(monkeypatch, capsys):
    pytest.importorskip("torch")
    script = load("torch_gpt2_parts")
    for name, value in dict(B=1, T=16, D=8, N=2, H=4, ROUNDS=1).items():
        monkeypatch.setattr(script, name, value)
    script.main()
    out = capsys.readouterr().out
    for part in ("ours", "projections", "sdpa"):
        assert re.search(rf"^{part} +[\d.]+ matmul-times = [\d.]+% of the matmul rate", out, re.M), out
    assert re.search(r"^projections \+ sdpa: [\d.]+ matmul-times, at most [\d.]+%", out, re.M), out
