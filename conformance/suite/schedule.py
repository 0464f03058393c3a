"""How `mha check` spreads its work over worker processes on a few cores. None of it changes a result: it
decides which backends share a worker (each worker imports its own frameworks), how a (backend, device,
dtype) column is cut into chunks of cases, and which chunk an idle worker takes next, so that no core waits
at the end of a check while another still has a queue.

The estimates are CPU seconds per case of one dtype (CASE_SECONDS), one figure for a warm check (impl_jax's
and Keras-on-JAX's programs found on disk) and one for a cold one (every program compiled in the run): a cold
check's JAX columns cost six times their warm figure, so a schedule made for one is wrong for the other. A
check guesses which it is from a marker it writes beside the programs when it ends (warm_marker): a wrong
guess costs time, never a result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from importlib import metadata
from pathlib import Path

# The backends that import the same frameworks, by the name of what they import; a backend not named here
# (numpy, mlx, keras-jax, keras-torch) is a family of its own.
IMPORT_FAMILY = {"tf": "tensorflow", "keras-native-mha": "tensorflow", "keras-hub": "tensorflow",
                 "torch": "torch", "torch-native-mha": "torch", "torch-sdpa": "torch", "torch-flex": "torch",
                 "torchtune": "torch",
                 "jax": "jax", "flax-linen-mha": "jax", "flax-nnx-mha": "jax", "jax-dpa": "jax"}

# CPU seconds per case of one dtype, (warm, cold), imports apart: each backend alone in one process on its
# default dtypes over the default grid (94 cases in float32, 68 in the others), one compute thread (2-core
# AMD EPYC VM, 2026-11-29 21:13 UTC, after TensorFlow's reshapes took its fast path and jax's and keras-jax's
# stages and fused path became one program a case). Chunk CPU, warm / cold: tf 16.8 / 17.8 s over 298
# cases, jax 6.6 / 36.3 over 162 (float32 and bfloat16), keras-jax 4.9 / 20.7 over 94 (float32),
# keras-torch 4.9 / 6.1, torch 2.8 / 3.9, mlx 2.3 / 3.1, numpy 1.1 / 1.9 over 298. A family not measured
# counts as TensorFlow's warm figure.
CASE_SECONDS = {"tensorflow": (0.056, 0.060), "jax": (0.041, 0.224), "keras-jax": (0.052, 0.221),
                "keras-torch": (0.0166, 0.0205), "torch": (0.0095, 0.013), "mlx": (0.0078, 0.0104),
                "numpy": (0.0037, 0.0062)}
_UNKNOWN_CASE_SECONDS = 0.056
# What importing a family's frameworks costs a worker, CPU seconds (same machine and day).
IMPORT_SECONDS = {"tensorflow": 3.0, "keras-torch": 2.7, "keras-jax": 1.2, "torch": 1.1, "jax": 0.8, "mlx": 0.2,
                  "numpy": 0.2}
# A column is cut into chunks of about this many estimated seconds at most, so that the last ones can go to
# whichever worker is free: a cold JAX float32 column is about 25 s of CPU, and as one chunk it kept one core
# busy for 11 s after the other had finished (63.5 s cold, 2026-11-29 17:25 UTC).
CHUNK_SECONDS = 6.0
# A worker takes another family's chunk when the chunk and the import cost it at most this share of the
# family's queued seconds (ChunkQueue.next_for).
STEAL_MARGIN = 0.75


# In a warm check the workers with much less to do than the busiest yield it the CPU: nice NICE where their
# estimated seconds are under NICE_BELOW of the busiest's. Fair shares on two cores left a warm check's
# TensorFlow worker (22 s of CPU; the three others 6 to 16 s) running alone for its last 5 s (31.0 s wall,
# 54.6 s of CPU: 27.3 s if no core waited); with the others at nice 3 it runs first and they fill in
# (29.5 and 28.6 s). Not in a cold one: there the busiest are the JAX worker and TensorFlow's (which takes
# JAX's last chunks), beside Keras-on-JAX's worker (25 s of CPU, its programs compiled, in one process),
# which at nice 3 ended 5 s after the others (58.7 s; 2-core EPYC VM, 2026-11-29 17:33 UTC).
NICE = 3
NICE_BELOW = 0.75


def niceness(loads: list[float], warm: bool) -> list[int]:
    """The nice value of each worker, by its estimated seconds (loads, in the workers' order)."""
    most = max(loads, default=0.0)
    return [NICE if warm and load < NICE_BELOW * most else 0 for load in loads]


def family(backend_id: str) -> str:
    return IMPORT_FAMILY.get(backend_id, backend_id)


def case_seconds(backend_id: str, warm: bool) -> float:
    return CASE_SECONDS.get(family(backend_id), (_UNKNOWN_CASE_SECONDS,) * 2)[0 if warm else 1]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Cases of one (backend, device, dtype) column run by one worker in one go; part: its place in the
    column (the results keep the column's order)."""

    backend: str
    device: str
    dtype: str
    cases: tuple[str, ...]
    part: int = 0
    seconds: float = 0.0  # estimated CPU seconds


def split_column(backend_id: str, device: str, dtype: str, cases, warm: bool, most: float | None = CHUNK_SECONDS):
    """The column's cases in contiguous chunks of at most about `most` estimated seconds (None: one chunk)."""
    cases = tuple(cases)
    per_case = case_seconds(backend_id, warm)
    parts = 1 if most is None or not cases else max(1, min(len(cases), math.ceil(len(cases) * per_case / most)))
    bounds = [round(i * len(cases) / parts) for i in range(parts + 1)]
    return [Chunk(backend_id, device, dtype, cases[a:b], i, (b - a) * per_case)
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def worker_groups(loads: dict[str, float], workers: int, chunks: dict[str, int] | None = None
                  ) -> list[tuple[list[str], int]]:
    """The backends in groups, each with its worker processes (`workers` in all): a family's backends in one
    group, the families spread over at most `workers` groups by their estimated seconds (loads: {backend:
    seconds}; a family's import counted once), largest first onto the least loaded group; processes left over
    (fewer families than workers) go one by one to the group with the most seconds per process, whose chunks
    they share (each importing its frameworks), never more processes than the group has chunks (chunks:
    {backend: its chunks}; one per dtype by default)."""
    families: dict[str, list[str]] = {}
    for backend_id in loads:
        families.setdefault(family(backend_id), []).append(backend_id)
    seconds = {f: sum(loads[b] for b in members) + IMPORT_SECONDS.get(f, 1.0) for f, members in families.items()}
    groups: list[list[str]] = [[] for _ in range(max(1, min(workers, len(families))))]
    load = [0.0] * len(groups)
    for name in sorted(families, key=lambda f: -seconds[f]):
        least = load.index(min(load))
        groups[least] += families[name]
        load[least] += seconds[name]
    processes = [1] * len(groups)
    most = [sum((chunks or {}).get(b, 4) for b in group) for group in groups]
    for _ in range(max(0, workers - len(groups))):
        open_groups = [g for g in range(len(groups)) if processes[g] < most[g]]
        if not open_groups:
            break
        busiest = max(open_groups, key=lambda g: load[g] / processes[g])
        processes[busiest] += 1
    return [(group, n) for group, n in zip(groups, processes) if group]


@dataclasses.dataclass
class ChunkWorker:
    """A shared worker process: its one-process pool and the backends whose frameworks it has imported."""

    executor: object
    backends: set


class ChunkQueue:
    """The shared backends' chunks, handed to their workers one at a time. A worker takes its own backends'
    chunks first, the longest first. With none left it takes the smallest chunk of the family with the most
    estimated seconds still queued, when that chunk and the import cost this worker well under what the
    family has queued (STEAL_MARGIN): on two cores, a cold check's JAX chunks outlast TensorFlow's worker,
    which then takes some of them; a warm one's TensorFlow chunks outlast the other worker, which does not
    import TensorFlow for the last two (the import costs what a chunk does)."""

    def __init__(self, chunks=()):
        self.chunks: list[Chunk] = []
        self.add(chunks)

    def add(self, chunks) -> None:
        self.chunks = sorted([*self.chunks, *chunks], key=lambda c: -c.seconds)

    def next_for(self, worker: ChunkWorker) -> Chunk | None:
        own = [c for c in self.chunks if c.backend in worker.backends]
        if own:
            self.chunks.remove(own[0])
            return own[0]
        queued: dict[str, list[Chunk]] = {}
        for chunk in self.chunks:
            queued.setdefault(family(chunk.backend), []).append(chunk)
        if not queued:
            return None
        name = max(queued, key=lambda f: sum(c.seconds for c in queued[f]))
        chunk = queued[name][-1]
        known = {family(b) for b in worker.backends}
        cost = chunk.seconds + (0.0 if name in known else IMPORT_SECONDS.get(name, 1.0))
        # Its own worker, busy now, runs the family's queue after what it runs: taken here, the chunk ends
        # at `cost` from now, the rest of the queue no later than it would have. So it pays when cost is under
        # the queue's seconds, by a margin for estimates that are a day's figures on one machine.
        if cost > STEAL_MARGIN * sum(c.seconds for c in queued[name]):
            return None  # its own workers finish it as soon
        self.chunks.remove(chunk)
        worker.backends.add(chunk.backend)
        return chunk


def _marker_name() -> str:
    """What makes a check's programs the ones found next time: the sources they are traced from and the
    versions that compile them (impl_jax/programs.py keys each program by these and more)."""
    from weights.fingerprint import cpu_flags, source_digest

    h = hashlib.sha256(source_digest(("impl_jax", "impl_tf", "weights")))
    for package in ("jax", "jaxlib", "keras"):
        try:
            h.update(metadata.version(package).encode() + b"\0")
        except metadata.PackageNotFoundError:
            h.update(b"-\0")
    h.update(cpu_flags().encode())
    return f"warm-{h.hexdigest()[:24]}"


def is_warm(compile_cache) -> bool:
    """Whether a check with this program directory ran to its end with these sources and versions before."""
    return compile_cache is not None and (Path(compile_cache) / _marker_name()).exists()


def mark_warm(compile_cache) -> None:
    """Written when a check with a program directory ends: the next one schedules as a warm check. Old
    markers (other sources) are removed."""
    if compile_cache is None:
        return
    directory = Path(compile_cache)
    name = _marker_name()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("warm-*"):
            if old.name != name:
                old.unlink(missing_ok=True)
        (directory / name).touch()
    except OSError:
        pass  # a read-only cache: every check schedules as a cold one
