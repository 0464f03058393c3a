"""The conformance adapter's compiled CPU programs kept on disk, found before tracing.

JAX's persistent compilation cache (conformance.suite.check.enable_jax_compile_cache)
keys a program by its lowered HLO, so a hit still pays for tracing and
lowering: about 0.1 s of CPU per program on a 2-core EPYC, which was most of
a warm `mha check`'s JAX time (26 s of worker CPU for its 322 programs, the
compiler skipped). This cache keys a program by what determines it before
any tracing and keeps the compiled executable itself
(jax.experimental.serialize_executable):

- the source of every module the trace runs (impl_jax and weights);
- the jax, jaxlib and NumPy versions, XLA_FLAGS, and JAX's configuration
  (x64, default precision, PRNG implementation...; the cache locations aside);
- the device's platform and kind, and which compile options (the program's name);
- the CPU the program is compiled for (_cpu_target): XLA compiles for the host's
  instruction set, so a program written on an AVX-512 machine would stop an
  AVX2 one that shares the directory (a network home, a restored CI cache)
  with an illegal instruction;
- the call's static arguments and the tree, shapes and dtypes of its arrays.

Values never change a program (they are its arguments), so equal keys are the
same program; any change is a new key, so a stale program cannot be found. An
unreadable or truncated file is a miss, compiled and written again. The
source is read from the files: a function replaced at run time (a test's
monkeypatch) is not seen, so only `mha check` turns the cache on (its
--no-compile-cache turns it off) and the tests run without it. CPU only:
a GPU executable's placement belongs to the device runtime, and GPU programs
are few; they go through jax.jit and JAX's own cache as before.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import platform
from pathlib import Path

import jax
import numpy as np

from weights.atomic import write_bytes_atomic
from weights.fingerprint import cpu_flags, source_digest

_directory: Path | None = None
_loaded: dict[str, object] = {}  # key -> compiled program, this process
# What a program's trace runs, by default: impl_jax's and weights' sources (impl_tf's Keras programs on jax
# name their own: impl_tf.adapter)
TRACED_PACKAGES = ("impl_jax", "weights")
_cpu_targets: dict[int, str] = {}  # id(device) -> _cpu_target(device)


def set_directory(directory) -> None:
    """Keep programs under this directory (created if missing); None: compile through jax.jit only."""
    global _directory
    _directory = None if directory is None else Path(directory)
    if _directory is not None:
        _directory.mkdir(parents=True, exist_ok=True)


def directory() -> Path | None:
    return _directory


def clear() -> None:
    """Drop this process's loaded programs (each holds memory mappings: see conformance.suite.compare)."""
    _loaded.clear()


def _cpu_target(device) -> str:
    """What XLA compiles this device's programs for: the fingerprint of XLA's topology of the device (the one JAX's
    own compilation cache hashes; it follows the instruction set XLA targets: with XLA_FLAGS
    --xla_cpu_max_isa=SSE4_2 it differs, tests/test_jax_programs.py), and the host's CPU flags as the kernel
    reports them (Linux), which name every extension a CPU has (avx512f, avx512_bf16, amx_tile, ...)."""
    if id(device) not in _cpu_targets:
        parts = [platform.machine()]
        try:
            from jax._src.lib import xla_client

            parts.append(str(xla_client.get_topology_for_devices([device]).fingerprint()))
        except Exception as error:  # a jaxlib without it: keyed by the flags below alone
            parts.append(f"no topology: {type(error).__name__}")
        parts.append(cpu_flags())
        _cpu_targets[id(device)] = "\0".join(parts)
    return _cpu_targets[id(device)]


def _key(name: str, device, static: tuple, dynamic: tuple, packages: tuple[str, ...] = TRACED_PACKAGES) -> str:
    import jaxlib

    config = sorted((k, repr(v)) for k, v in jax.config.values.items()
                    if "compilation_cache" not in k and "persistent_cache" not in k)
    leaves, tree = jax.tree.flatten(dynamic)
    h = hashlib.sha256(source_digest(packages))
    for part in (jax.__version__, jaxlib.__version__, np.__version__, os.environ.get("XLA_FLAGS", ""), config,
                 device.platform, device.device_kind, _cpu_target(device), name, static, tree,
                 [(tuple(x.shape), str(x.dtype)) for x in leaves]):
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()


def run(name: str, program, device, static_args: tuple, static_kwargs: dict, dynamic: tuple, *,
        packages: tuple[str, ...] = TRACED_PACKAGES):
    """program(*static_args, *dynamic, **static_kwargs), its compiled form found by key where the directory
    is set and the device is a CPU; `name` says which compile options `program` carries (their repr) and
    anything else that decides the program outside these modules; `packages`, whose sources its trace runs."""
    if _directory is None or device.platform != "cpu":
        return program(*static_args, *dynamic, **static_kwargs)
    key = _key(name, device, (static_args, tuple(sorted(static_kwargs.items()))), dynamic, packages)
    compiled = _loaded.get(key) or _load(key, device)
    if compiled is None:
        compiled = program.lower(*static_args, *dynamic, **static_kwargs).compile()
        if not compiled._params.const_args:  # a serialized program carries no hoisted constants (JAX's TODO)
            _store(key, compiled)
    _loaded[key] = compiled
    return compiled(*dynamic)


def _load(key: str, device):
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        serialized, in_tree, out_tree = pickle.loads((_directory / key).read_bytes())
        return deserialize_and_load(serialized, in_tree, out_tree, backend=device.client, execution_devices=[device])
    except (OSError, EOFError, ValueError, TypeError, pickle.UnpicklingError, RuntimeError):
        return None  # absent, truncated or from elsewhere: compile it


def _store(key: str, compiled) -> None:
    from jax.experimental.serialize_executable import serialize

    try:
        write_bytes_atomic(_directory / key, pickle.dumps(serialize(compiled)), overwrite=True, durable=False)
    except OSError:
        pass  # a read-only or full cache costs a compile next time, nothing else
