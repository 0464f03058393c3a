"""What decides the bits of a computation kept on disk between runs, besides its own arguments: the source
of the packages that run it and the CPU it runs on. impl_jax/programs.py keys compiled programs by them,
conformance/suite/reference_cache.py the float64 references."""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the folder holding the top-level packages


@functools.cache
def source_digest(packages: tuple[str, ...]) -> bytes:
    """A digest of these top-level packages' Python files: their paths and bytes, in order."""
    h = hashlib.sha256()
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.digest()


@functools.cache
def cpu_flags() -> str:
    """The host's CPU flags as the kernel reports them (Linux: the first core's "flags" line on x86,
    "Features" on ARM), which name every extension a CPU has (avx512f, avx512_bf16, amx_tile, ...);
    elsewhere platform.processor()."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.split(":")[0].strip() in ("flags", "Features")), "")
    except OSError:
        return platform.processor()
