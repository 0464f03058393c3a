"""A bench family's worker in a process of its own: `python -m MODULE --worker SPEC OUT`, the spec written to a
temporary file and the answer read back from one; the worker's stderr (its progress) passes through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run_worker_process(module: str, backend: str, spec: dict, *, with_stdout_tail: bool = False) -> dict:
    """The worker's answer for this backend, or {"backend", "status": "unavailable: worker died (...)"} when it
    dies or writes nothing (with_stdout_tail: the last line it printed appended to that status)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("KERAS_BACKEND", "tensorflow")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    family = module.rsplit(".", 1)[-1]  # conformance.bench.worker (the shapes) or a family's module
    with tempfile.TemporaryDirectory(prefix="mha-bench-" if family == "worker" else f"mha-bench-{family}-") as tmp:
        spec_file, out_file = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_file.write_text(json.dumps({**spec, "backend": backend}))
        proc = subprocess.run([sys.executable, "-m", module, "--worker", str(spec_file), str(out_file)], env=env,
                              stdout=subprocess.PIPE, stderr=None, text=True)
        if proc.returncode != 0 or not out_file.exists():
            why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            tail = ((proc.stdout or "").strip().splitlines()[-1:] or [""])[0] if with_stdout_tail else ""
            return {"backend": backend, "status": f"unavailable: worker died ({why}) {tail}".strip()}
        return json.loads(out_file.read_text())
