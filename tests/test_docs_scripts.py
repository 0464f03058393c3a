"""The timing scripts docs/performance.md cites (conformance/bench/scripts/*.py) still
run, on tiny shapes. No assertion is about speed: only that each prints its
figures and leaves the library as it found it."""

from __future__ import annotations

import importlib
import re

import pytest


def load(name: str):
    return importlib.import_module(f"conformance.bench.scripts.{name}")


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


def tiny_shapes():
    """bert-base, vit-b16, gpt2 and long under their own names, small enough for a test."""
    from conformance.bench.shapes import Shape

    return {
        "bert-base": Shape("bert-base", B=2, T=16, S=16, D=16, N=2, causal=False),
        "vit-b16": Shape("vit-b16", B=2, T=13, S=13, D=16, N=2, causal=False),
        "gpt2": Shape("gpt2", B=1, T=64, S=64, D=16, N=2, causal=True),
        "long": Shape("long", B=1, T=64, S=64, D=16, N=2, causal=True),
    }


def run_tiny(name: str, args, monkeypatch, capsys, **settings) -> str:
    """Run conformance/bench/scripts/<name>.py's main(args) on tiny_shapes(), one round, with these module
    settings; its output."""
    script = load(name)
    for setting, value in dict(SHAPES=tiny_shapes(), ROUNDS=1, **settings).items():
        monkeypatch.setattr(script, setting, value)
    script.main(args)
    return capsys.readouterr().out


@pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, not `tox -e all` again
def test_numpy_parts_prints_every_part_and_counts_the_logits_the_core_computes(monkeypatch, capsys):
    from impl_numpy import chunked

    monkeypatch.setattr(chunked, "QUERY_ROWS", 8)  # with key blocks of 16 (FUSED_BLOCK): several of each
    out = run_tiny("numpy_parts", ["bert-base", "gpt2"], monkeypatch, capsys, FUSED_BLOCK=16)
    # Causal, top-left, 8 query blocks of 8 rows: block i sees its first 8i keys, so the core computes
    # (1 + ... + 8) / (8 * 8) = 9/16 of the T*S logits; without the mask all of them.
    assert re.search(r"^bert-base .*the core computes 100\.0% of the T\*S logits", out, re.M), out
    assert re.search(r"^gpt2 .*the core computes 56\.2% of the T\*S logits", out, re.M), out
    for part in ("ours", "projections", "core", "core.gemm"):
        assert len(re.findall(rf"^  {re.escape(part)} +[\d.]+ matmul-times = [\d.]+% of the matmul rate", out,
                              re.M)) == 2, out
    assert len(re.findall(r"^  core\.exp +[\d.]+ matmul-times = [\d.]+ ns per logit", out, re.M)) == 2, out
    assert len(re.findall(r"^  projections \+ core: [\d.]+ matmul-times, at most [\d.]+%", out, re.M)) == 2, out


@pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, not `tox -e all` again
def test_projection_bound_numpy_prints_each_shape(monkeypatch, capsys):
    out = run_tiny("projection_bound", ["numpy"], monkeypatch, capsys)
    for name in ("bert-base", "vit-b16", "gpt2"):
        assert re.search(rf"^  {name} +projections [\d.]+ matmul-times: own rate [\d.]+%, ceiling [\d.]+%", out,
                         re.M), out


@pytest.mark.parametrize("backend", [pytest.param("torch", marks=pytest.mark.torch),
                                     pytest.param("tf", marks=pytest.mark.tf),
                                     pytest.param("jax", marks=pytest.mark.jax)])
def test_projection_bound_frameworks_print_each_shape(backend, monkeypatch, capsys):
    pytest.importorskip({"torch": "torch", "tf": "tensorflow", "jax": "jax"}[backend])
    out = run_tiny("projection_bound", [backend], monkeypatch, capsys)
    assert len(re.findall(r"projections [\d.]+ matmul-times: own rate [\d.]+%", out)) == 3, out


@pytest.mark.jax
def test_jax_causal_parts_counts_the_visible_block_pairs(monkeypatch, capsys):
    pytest.importorskip("jax")
    # B*N = 2: the small-batch chunk, 4 blocks of 16 on each axis
    out = run_tiny("jax_causal_parts", ["gpt2"], monkeypatch, capsys, JAX_CHUNK_SIZE_SMALL_BATCH=16)
    # 4 query blocks x 4 key blocks; the causal mask leaves block i its first i + 1 key blocks: 1+2+3+4
    assert re.search(r"^gpt2, blocks of 16: 10 of 16 block pairs computed", out, re.M), out
    for part in ("ours.chunked", "projections", "blocks", "dense"):
        assert re.search(rf"^  {re.escape(part)} +[\d.]+ matmul-times = [\d.]+% of the matmul rate", out, re.M), out
    assert re.search(r"^  projections \+ blocks, timed apart: [\d.]+ matmul-times \([\d.]+%\)", out, re.M), out


@pytest.mark.tf
def test_tf_parts_prints_every_part(monkeypatch, capsys):
    pytest.importorskip("tensorflow")
    # B*N = 2: the small-batch chunk, 4 blocks of 16 on each axis
    out = run_tiny("tf_parts", ["bert-base", "gpt2"], monkeypatch, capsys, TF_CHUNK_SIZE_SMALL_BATCH=16)
    for part in ("ours.graph", "ours.xla", "projections", "core", "logits", "ours.chunked", "blocks"):
        assert re.search(rf"^  {re.escape(part)} +[\d.]+ matmul-times$", out, re.M), out
    assert re.search(r"^bert-base, no mask ", out, re.M), out
    assert re.search(r"^gpt2, blocks of 16: 10 of 16 block pairs computed", out, re.M), out
    assert re.search(r"^  projections \+ core, timed apart: [\d.]+ matmul-times \([\d.]+%\)", out, re.M), out
    assert re.search(r"^  projections \+ blocks, timed apart: [\d.]+ matmul-times \([\d.]+%\)", out, re.M), out


@pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, not `tox -e all` again
def test_sparse_cpu_prints_each_step_against_its_bound_in_cpu_time(capsys):
    """conformance/bench/scripts/sparse_cpu.py on the quick sparse family (numpy, P 32, one round)."""
    script = load("sparse_cpu")
    r = script.measure("numpy", 32, quick=True, rounds=1, matmul_n=64)
    for step in ("dense", "sparse", "indexer"):
        assert r[step]["cpu_ms"] >= 0 and r[step]["bound_ms"] > 0 and r[step]["bound"] in ("read", "flops"), r
        assert r[step]["x_bound"] == pytest.approx(r[step]["cpu_ms"] / r[step]["bound_ms"]), r
