"""`mha run --shard` as a user runs it, for tests/test_sharded_jax.py (the jax env) and tests/test_sharded_torch.py
(the torch env): each shard kind and count once per backend, each file under both kinds (4 `mha run` starts per
backend; the whole grid, tests/test_sharded_grid.py, runs every kind x count x case through the engines). The
commands get no XLA_FLAGS of the test's: `mha run --shard` forces JAX's host devices itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARDS = {"packed": ("heads:4", "sequence:2"), "cached": ("heads:2", "sequence:4")}


def run_files(tmp_path):
    """A weight file with GQA (4 query heads on 2 kv heads: heads:4 replicates them), RoPE, a window and sinks;
    an inputs file with two packed documents per row (positions restarted per document) and one with a cache."""
    import weights
    from conformance.io import write_arrays
    from weights import AttentionConfig

    config = AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=8, head_dim=4, rope={}, window_left=3,
                             use_sinks=True)
    tensors = weights.init(config, seed=11, dtype="float32")
    weights.save(tmp_path / "w.safetensors", config, tensors)
    rng = np.random.default_rng(12)
    positions = np.array([list(range(4)) + list(range(7)), list(range(8)) + list(range(3))])
    packed = {"query": rng.standard_normal((2, 11, 8)).astype(np.float32),
              "segment_ids": np.array([[0] * 4 + [1] * 7, [0] * 8 + [1] * 3]),
              "positions": positions, "key_positions": positions}
    cached = {"query": rng.standard_normal((2, 3, 8)).astype(np.float32),
              "past_key": rng.standard_normal((2, 2, 9, 4)).astype(np.float32),
              "past_value": rng.standard_normal((2, 2, 9, 4)).astype(np.float32)}
    write_arrays(tmp_path / "packed.safetensors", packed)
    write_arrays(tmp_path / "cached.safetensors", cached)
    return config, tensors, {"packed": (packed, ["--causal"]),
                             "cached": (cached, ["--causal", "--causal-alignment", "bottom_right", "--return-cache"])}


def assert_run_shard_gives_the_unsharded_output(tmp_path, backend):
    """The acceptance run of sharding: `mha run --backend jax|torch --shard heads:2|heads:4|sequence:2|sequence:4`
    writes the float64 reference's output (and, with a cache, its present key/value) within the policy, in
    float32, and says which sharding it ran."""
    from safetensors.numpy import load_file

    from conformance.suite.tolerance import assert_close
    from impl_numpy.adapter import forward

    config, tensors, files = run_files(tmp_path)
    t64 = {n: t.astype(np.float64) for n, t in tensors.items()}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if os.environ.get("XLA_FLAGS"):  # tox's compile options, without a device count of the test's
        env["XLA_FLAGS"] = " ".join(f for f in os.environ["XLA_FLAGS"].split()
                                    if not f.startswith("--xla_force_host_platform_device_count"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for name, (inputs, flags) in files.items():
        i64 = {n: (a.astype(np.float64) if a.dtype.kind == "f" else a) for n, a in inputs.items()}
        options = {"is_causal": True}
        if name == "cached":
            options.update(causal_alignment="bottom_right", return_cache=True)
        expected = forward(config, t64, i64, options)
        B, T = inputs["query"].shape[:2]
        S = T + (inputs["past_key"].shape[2] if "past_key" in inputs else 0)
        for shard in SHARDS[name]:
            out = tmp_path / f"{name}-{shard.replace(':', '_')}.safetensors"
            done = subprocess.run([sys.executable, "-m", "conformance", "run", "--backend", backend, "--shard", shard,
                                   "--weights", str(tmp_path / "w.safetensors"),
                                   "--inputs", str(tmp_path / f"{name}.safetensors"), *flags, "--out", str(out)],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, (name, shard, done.stderr[-2000:])
            assert f"({backend}, {shard})" in done.stdout, done.stdout
            got = load_file(out)
            assert got["output"].dtype == np.float32, got["output"].dtype
            assert_close(f"{backend} {shard} {name} output", got["output"], expected["output"], config=config,
                         dtype="float32", quantity="output", B=B, T=T, S=S)
            if name == "cached":
                for key in ("present_key", "present_value"):
                    assert_close(f"{backend} {shard} {key}", got[key], expected[key], config=config,
                                 dtype="float32", quantity="output", B=B, T=T, S=S)
