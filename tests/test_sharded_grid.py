"""`mha check --sharded` as documented: the whole sharded grid on both engines.

Every case of conformance.suite.sharded.SHARDED_CASES for jax and torch, heads and
sequence, 2 and 4 devices, float32 and bfloat16, forward and gradients, in one
`mha check --sharded` run. It takes about ten minutes on a 2-core VM, so it has
its own marker and tox env (`tox -e sharded`, in the default env list) instead
of riding in the framework envs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MISSING = [name for name in ("jax", "flax", "torch") if importlib.util.find_spec(name) is None]

pytestmark = [
    pytest.mark.sharded,
    pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not installed: "
                       "pip install -c constraints/cpu.txt '.[torch,jax]'"),
]


def test_mha_check_sharded_whole_grid(tmp_path):
    from conformance.suite.sharded import DEVICE_COUNTS, DTYPES, KINDS, SHARDED_CASES

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-m", "conformance", "check", "--sharded", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert not payload["skipped"], payload["skipped"]
    records = payload["results"]
    per_engine = len(SHARDED_CASES) * len(KINDS) * len(DEVICE_COUNTS) * len(DTYPES)
    for engine in ("jax", "torch"):
        mine = [r for r in records if r["sharding"]["engine"] == engine]
        assert len(mine) == per_engine, (engine, len(mine), per_engine)
        assert {(r["sharding"]["kind"], r["sharding"]["devices"]) for r in mine} == {
            (k, d) for k in KINDS for d in DEVICE_COUNTS}, engine
    # Every result passes; a refusal counts only with its reason written.
    odd = [(r["case"], r["backend"], r["dtype"], r["status"], r["message"]) for r in records
           if r["status"] != "pass" and not (r["status"] == "unsupported" and r["message"])]
    assert not odd, odd


# Each shard kind and count once per backend, each file under both kinds (the whole grid above runs every
# kind x count x case; this is the command line's own plumbing): 4 `mha run` starts per backend, not 8.
SHARDS = {"packed": ("heads:4", "sequence:2"), "cached": ("heads:2", "sequence:4")}


def _run_files(tmp_path):
    """A weight file with GQA (4 query heads on 2 kv heads: heads:4 replicates them), RoPE, a window and sinks;
    an inputs file with two packed documents per row (positions restarted per document) and one with a cache."""
    import numpy as np

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


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_mha_run_shard_gives_the_unsharded_output(tmp_path, backend):
    """The acceptance run of sharding: `mha run --backend jax|torch --shard heads:2|heads:4|sequence:2|sequence:4`
    writes the float64 reference's output (and, with a cache, its present key/value) within the policy."""
    import numpy as np
    from safetensors.numpy import load_file

    from conformance.suite.tolerance import assert_close
    from impl_numpy.adapter import forward

    config, tensors, files = _run_files(tmp_path)
    t64 = {n: t.astype(np.float64) for n, t in tensors.items()}
    env = dict(os.environ)
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
            got = load_file(out)
            assert_close(f"{backend} {shard} {name} output", got["output"], expected["output"], config=config,
                         dtype="float32", quantity="output", B=B, T=T, S=S)
            if name == "cached":
                for key in ("present_key", "present_value"):
                    assert_close(f"{backend} {shard} {key}", got[key], expected[key], config=config,
                                 dtype="float32", quantity="output", B=B, T=T, S=S)
