"""`mha run` with a modern weight file (rope, QK-norm, softcap, window, sinks)
and an inputs file with positions and a cache: every installed backend writes
the same output and present_key / present_value as the NumPy reference."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conformance.io import read_inputs, write_arrays
from conformance.suite import backends
from weights import read_safetensors

CONFIG = {"num_heads": 4, "num_kv_heads": 2, "query_dim": 8, "head_dim": 4, "window_left": 3, "logit_softcap": 20.0,
          "use_sinks": True, "qk_norm": {"type": "rms"},
          "rope": {"interleaved": True, "scaling": {"type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 16}}}


def mha(*args):
    return subprocess.run([sys.executable, "-m", "conformance", *args], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("modern")
    (root / "config.json").write_text(json.dumps(CONFIG))
    done = mha("init", "--config", str(root / "config.json"), "--out", str(root / "w.safetensors"), "--seed", "1")
    assert done.returncode == 0, done.stderr
    rng = np.random.default_rng(0)
    B, T, P = 2, 3, 4
    write_arrays(root / "in.safetensors", {
        "query": rng.standard_normal((B, T, 8)).astype(np.float32),
        "positions": np.arange(P + 20, P + 20 + T, dtype=np.int64),
        "key_positions": np.arange(P + 20, P + 20 + T, dtype=np.int32),
        "past_key": rng.standard_normal((B, 2, P, 4)).astype(np.float32),
        "past_value": rng.standard_normal((B, 2, P, 4)).astype(np.float32)})
    return root


def run(files, backend):
    out = files / f"out.{backend}.safetensors"
    done = mha("run", "--weights", str(files / "w.safetensors"), "--inputs", str(files / "in.safetensors"),
               "--backend", backend, "--causal", "--causal-alignment", "bottom_right", "--return-cache",
               "--out", str(out), "--overwrite")
    assert done.returncode == 0, done.stderr
    assert "present_key/present_value" in done.stdout
    return read_safetensors(out)[1]


def test_the_inputs_file_takes_the_modern_inputs_and_refuses_float_positions(files, tmp_path):
    inputs = read_inputs(files / "in.safetensors")
    assert inputs["key_positions"].dtype == np.int64 and inputs["past_key"].shape == (2, 2, 4, 4)
    write_arrays(tmp_path / "bad.safetensors", {"query": np.zeros((1, 2, 8), np.float32),
                                                "positions": np.zeros(2, np.float32)})
    done = mha("run", "--weights", str(files / "w.safetensors"), "--inputs", str(tmp_path / "bad.safetensors"),
               "--out", str(tmp_path / "o.safetensors"))
    assert done.returncode == 2 and "positions must be an integer tensor" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("backend", [pytest.param("torch", marks=pytest.mark.torch),
                                     pytest.param("tf", marks=pytest.mark.tf),
                                     pytest.param("jax", marks=pytest.mark.jax)])
def test_every_backend_writes_the_references_output_and_cache(files, backend):
    ok, reason = backends.availability(backend)
    if not ok:
        pytest.skip(reason)
    expected, got = run(files, "numpy"), run(files, backend)
    assert set(got) == {"output", "present_key", "present_value"} == set(expected)
    assert got["present_key"].shape == (2, 2, 7, 4)
    for name in got:  # float32 through a handful of stages: a few ulps of values near 1
        np.testing.assert_allclose(got[name], expected[name], rtol=2e-5, atol=2e-5, err_msg=f"{backend} {name}")
