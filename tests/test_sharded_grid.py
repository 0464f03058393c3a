"""`mha check --sharded` as documented: the whole sharded grid on both engines.

Every case of conformance.suite.sharded.SHARDED_CASES for jax and torch, heads and
sequence, 2 and 4 devices, float32 and bfloat16, forward and gradients, in one
`mha check --sharded` run. It takes about ten minutes on a 2-core VM, so it has
its own marker and tox env (`tox -e sharded`, in the default env list) instead
of riding in the framework envs. `mha run --shard`'s acceptance run (tests/sharded_runs.py) is each engine's
own env's: tests/test_sharded_jax.py, tests/test_sharded_torch.py.
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
