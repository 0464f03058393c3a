"""The float64 references of the grid kept on disk between `mha check` runs (compare.expected_for).

Each of a check's workers computed the reference of every (case, dtype) it ran, again in every run: about
2 s of CPU per worker for the grid in four dtypes, 6 s of a warm check's 60 (2-core EPYC VM, 2026-11-29). A
reference is a deterministic computation of NumPy code on the case's own inputs, so it is kept under a key
of everything that decides its bits, as impl_jax/programs.py keeps compiled programs:

- the source of every module it runs or that decides the case (impl_numpy, weights, conformance);
- the NumPy and ml_dtypes versions;
- the CPU (its flags as the kernel lists them) and the environment variables that choose NumPy's BLAS
  kernels and threads (a reference computed under another kernel differs in its last bits);
- the case itself (its repr: every field and the config) and the dtype.

Any change is a new key, so a stale reference cannot be found; an unreadable or truncated file is a miss,
computed and written again; a read-only or full directory costs the computation, nothing else. Only
`mha check` turns it on (its --no-compile-cache turns it off, with the programs); the tests run without it
(a monkeypatched function is not seen by the source digest). The lazily computed parts of a reference (the
chunked and kernel formulations' 16-bit errors) are written when a chunk ends (flush), whichever worker
computed them.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import platform
from pathlib import Path

import numpy as np

from weights.atomic import write_bytes_atomic
from weights.fingerprint import cpu_flags, source_digest

# Environment variables that choose NumPy's BLAS kernels or their threads (a sum's order)
BLAS_ENVIRONMENT = ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                    "MKL_ENABLE_INSTRUCTIONS", "NPY_DISABLE_CPU_FEATURES", "MKL_CBWR")
SOURCE_PACKAGES = ("impl_numpy", "weights", "conformance")

_directory: Path | None = None
_written: dict[str, tuple] = {}  # key -> the shape (_shape) of what the file holds


def set_directory(directory) -> None:
    """Keep the references under this directory (created if missing); None: compute them in each process."""
    global _directory
    _directory = None if directory is None else Path(directory)
    if _directory is not None:
        _directory.mkdir(parents=True, exist_ok=True)


def directory() -> Path | None:
    return _directory


def key(case, dtype: str) -> str:
    import ml_dtypes

    h = hashlib.sha256(source_digest(SOURCE_PACKAGES))
    for part in (np.__version__, ml_dtypes.__version__, platform.machine(), cpu_flags(),
                 [(name, os.environ.get(name)) for name in BLAS_ENVIRONMENT], repr(case), dtype):
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()


def _shape(reference: dict) -> tuple:
    """What a reference holds: its entries and the lazily computed errors in it."""
    return (tuple(sorted(reference)), tuple(sorted(reference.get("same_precision_chunked", {}))),
            tuple(sorted(map(str, reference.get("same_precision_kernel", {})))))


def load(key_: str) -> dict | None:
    """The reference kept under this key, or None (no directory, absent, unreadable)."""
    if _directory is None:
        return None
    try:
        reference = pickle.loads((_directory / key_).read_bytes())
    except (OSError, EOFError, ValueError, TypeError, AttributeError, ImportError, pickle.UnpicklingError):
        return None
    if not isinstance(reference, dict):
        return None
    _written[key_] = _shape(reference)
    return reference


def flush(references: dict[str, dict]) -> None:
    """Write each reference ({key: reference}) whose file does not hold all of it yet."""
    if _directory is None:
        return
    for key_, reference in references.items():
        shape = _shape(reference)
        if _written.get(key_) == shape:
            continue
        try:
            write_bytes_atomic(_directory / key_, pickle.dumps(reference, protocol=pickle.HIGHEST_PROTOCOL),
                               overwrite=True, durable=False)
            _written[key_] = shape
        except OSError:
            pass  # a read-only or full cache: computed again next time
