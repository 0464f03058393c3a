"""The packed and sharded table's torch context_parallel and DTensor-heads
probes, on a 2-process gloo group (packed.py's docstring says what they
measure)."""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import socket
import tempfile
import time
import warnings
from typing import Any

import numpy as np

from conformance.native.conventions.packed_labels import (
    GROUP_TIMEOUT_S,
    NONE,
    SHARD_DOCS,
    SHARD_H,
    SHARD_N,
    SHARD_T,
    WORLD,
    _short,
    reference,
    sharded_label,
)

# -- torch context_parallel and DTensor heads, on a 2-process gloo group ----------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(14)
    q, k, v = (rng.standard_normal((1, SHARD_N, SHARD_T, SHARD_H)).astype(np.float32) for _ in range(3))
    return {"q": q, "k": k, "v": v}  # (B, N, T, H) each


# The default CPU kernel without a mask: DTensor finds its sharding by running the kernel's decomposition
# through fake tensors for every placement of q, k, v (125 runs); the first such call took 69-140 s on the
# 2-core VM (profiled 2026-11-25, torch 2.13). Not part of the default run; measure(slow=True) runs them.
SLOW_PROBES = ("cp math=False causal=False", "heads math=False causal=False")
SKIPPED = "skipped (slow: DTensor searches its sharding through the kernel's decomposition; measure(slow=True))"


def _rank_probes(rank: int, world: int, inputs: dict, slow: bool = False) -> dict:
    """This rank's answers: probe name -> {"error"}, {"skipped"} or {"out", "rows"}."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (world,))
    q, k, v = (torch.tensor(inputs[n]) for n in ("q", "k", "v"))
    ids = torch.tensor(SHARD_DOCS)
    doc_mask = (ids[:, None] == ids[None, :])[None, None]  # (1, 1, T, S)
    answers: dict[str, dict] = {}

    def attempt(name, fn):
        if name in SLOW_PROBES and not slow:
            answers[name] = {"skipped": SKIPPED}
            return
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                answers[name] = fn()
        except Exception as err:  # noqa: BLE001 - a refusal is the measured fact
            answers[name] = {"error": _short(err)}
        answers[name]["seconds"] = round(time.perf_counter() - started, 3)

    def cp(math: bool, causal: bool, mask: str | None):
        """mask: None, "whole" (the (T, S) mask as it is) or "buffer" (sharded by its rows with q, k, v)."""
        from torch.distributed.tensor.experimental import context_parallel

        qq, kk, vv, mm = q.clone(), k.clone(), v.clone(), doc_mask.clone()
        pos = torch.arange(SHARD_T, dtype=torch.float32)[None, None, :, None].contiguous()  # (1, 1, T, 1)
        buffers = [qq, kk, vv, pos] + ([mm] if mask == "buffer" else [])
        kernel = sdpa_kernel(SDPBackend.MATH) if math else _nothing()
        with kernel, context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers)):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, attn_mask=None if mask is None else mm)
            rows = pos[0, 0, :, 0].long().tolist()  # the positions this rank's shard holds
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        return {"out": out.detach().numpy(), "rows": rows}

    def heads(math: bool, causal: bool):
        from torch.distributed.tensor import Shard, distribute_tensor

        dq, dk, dv = (distribute_tensor(x, mesh, [Shard(1)]) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.MATH) if math else _nothing():
            out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=causal)
        return {"out": out.full_tensor().detach().numpy(), "rows": list(range(SHARD_T)),
                "placements": str(tuple(out.placements))}

    for math in (False, True):
        for causal in (False, True):
            attempt(f"cp math={math} causal={causal}", lambda m=math, c=causal: cp(m, c, None))
            attempt(f"heads math={math} causal={causal}", lambda m=math, c=causal: heads(m, c))
    for math in (False, True):
        attempt(f"cp math={math} mask=whole", lambda m=math: cp(m, False, "whole"))
    attempt("cp math=True mask=buffer", lambda: cp(True, False, "buffer"))
    return answers


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _rank_main(rank: int, world: int, port: int, inputs: dict, path: str, slow: bool) -> None:
    import logging

    import torch
    import torch.distributed as dist

    logging.getLogger("torch").setLevel(logging.CRITICAL)  # a refused call logs its traceback; the answer says it

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # the processes share the host's cores
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        answers = _rank_probes(rank, world, inputs, slow)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(answers, gathered, dst=0)
        if rank == 0:
            with open(path + ".partial", "wb") as f:
                pickle.dump(gathered, f)
            os.replace(path + ".partial", path)
        # Every rank past its last collective before any tears the group down: a rank that destroyed the
        # group while the other still had gloo work in flight aborted ("terminate called without an active
        # exception", SIGABRT; seen once in three fresh-clone tox runs).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_group(inputs: dict, slow: bool = False) -> list[dict]:
    """Start WORLD spawned processes on one gloo group; every rank's answers."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mha-conventions-") as tmp:
        path = os.path.join(tmp, "answers.pkl")
        context = mp.start_processes(_rank_main, args=(WORLD, _free_port(), inputs, path, slow), nprocs=WORLD, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + GROUP_TIMEOUT_S
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:  # only the processes started here
                    process.kill()
                raise TimeoutError(f"the {WORLD}-process gloo group did not finish in {GROUP_TIMEOUT_S} s")
        with open(path, "rb") as f:
            return pickle.load(f)


def assemble(per_rank: list[dict], name: str) -> dict:
    """One probe's outcome over the ranks: the first refusal, or the output
    rows in position order (rows: the positions, each once)."""
    answers = [r[name] for r in per_rank]
    for a in answers:
        for why in ("error", "skipped"):
            if why in a:
                return {why: a[why]}
    if "placements" in answers[0]:  # DTensor: full_tensor() is the whole output on every rank
        return {"out": answers[0]["out"], "rows": answers[0]["rows"], "placements": answers[0]["placements"],
                "per_rank_rows": [a["rows"] for a in answers]}
    rows = [p for a in answers for p in a["rows"]]
    out = np.concatenate([a["out"] for a in answers], axis=2)  # (1, N, T, H) in the ranks' order
    order = np.argsort(rows)
    return {"out": out[:, :, order], "rows": sorted(rows), "per_rank_rows": [a["rows"] for a in answers]}


def _shard_reference(inputs, *, causal=False, segments=False, rows_of_rank=None) -> np.ndarray:
    """(1, N, T, H): the whole-sequence reference; with rows_of_rank, each
    rank's queries against only the keys of its own rows."""
    q, k, v = (inputs[n][0] for n in ("q", "k", "v"))  # (N, T, H): heads as the reference's batch
    ids = np.asarray(SHARD_DOCS) if segments else None
    if rows_of_rank is None:
        out, _ = reference(q, k, v, is_causal=causal, segment_ids=ids, key_segment_ids=ids)
        return out[None]
    out = np.zeros(q.shape, np.float64)
    for rows in rows_of_rank:
        rows = np.asarray(rows)
        mask = None
        if causal:  # the global causal rule among the rank's own rows
            mask = np.broadcast_to(rows[:, None] >= rows[None, :], (q.shape[0], len(rows), len(rows)))
        sub_ids = None if ids is None else ids[rows]
        part, _ = reference(q[:, rows], k[:, rows], v[:, rows], mask=mask, segment_ids=sub_ids, key_segment_ids=sub_ids)
        out[:, rows] = part
    return out[None]


def _columns_in_shard_order(inputs, key_order) -> np.ndarray:
    """(1, N, T, H): the segment mask's column c applied to the key at
    position key_order[c] (keys reordered by the sharding, the mask not)."""
    q, k, v = (inputs[n][0] for n in ("q", "k", "v"))
    ids = np.asarray(SHARD_DOCS)
    allowed = np.zeros((len(ids), len(ids)), bool)
    allowed[:, np.asarray(key_order)] = ids[:, None] == ids[None, :]
    out, _ = reference(q, k, v, mask=np.broadcast_to(allowed, (q.shape[0], *allowed.shape)))
    return out[None]


def sharded_cells(per_rank: list[dict], inputs: dict) -> dict:
    """The context_parallel and DTensor-heads rows from the ranks' answers."""
    def label(name, causal=False, segments=False):
        outcome = assemble(per_rank, name)
        if "error" in outcome or "skipped" in outcome:
            return sharded_label(outcome, None)
        whole = _shard_reference(inputs, causal=causal, segments=segments)
        if "placements" in outcome:
            return sharded_label(outcome, whole)
        local = _shard_reference(inputs, causal=causal, segments=segments, rows_of_rank=outcome["per_rank_rows"])
        extra = {}
        if segments:
            order = [p for rows in outcome["per_rank_rows"] for p in rows]
            extra["the mask's columns read in the shards' key order " + str(order)] = _columns_in_shard_order(inputs, order)
        return sharded_label(outcome, whole, local, extra)

    cp: dict[str, Any] = {"evidence": {}}
    heads: dict[str, Any] = {"evidence": {}}
    parts = {"cp": [], "heads": []}
    for math in (False, True):
        kernel = "sdpa_kernel(MATH)" if math else "default CPU kernel"
        for causal in (False, True):
            for kind in ("cp", "heads"):
                name = f"{kind} math={math} causal={causal}"
                text, ev = label(name, causal=causal)
                (cp if kind == "cp" else heads)["evidence"][name] = ev
                parts[kind].append(f"{kernel}, {'is_causal' if causal else 'no mask'}: {text}")
    holds = assemble(per_rank, "cp math=True causal=False")
    if "per_rank_rows" in holds:
        cp["evidence"]["positions_per_rank"] = holds["per_rank_rows"]
        parts["cp"].append("positions per rank " + "; ".join(
            f"{r}: {', '.join(map(str, rows))}" for r, rows in enumerate(holds["per_rank_rows"])))
    heads_placed = assemble(per_rank, "heads math=True causal=False")
    if "placements" in heads_placed:
        parts["heads"].append(f"output placements {heads_placed['placements']}")
    cp["argument"] = (f"context_parallel(mesh of {WORLD} gloo ranks, buffers=[q, k, v, positions], "
                      "buffer_seq_dims=2) around F.scaled_dot_product_attention")
    heads["argument"] = f"q, k, v as DTensors Shard(1) (heads) on a {WORLD}-rank gloo mesh, into F.scaled_dot_product_attention"
    cp["keys_visible"] = "; ".join(parts["cp"])
    heads["keys_visible"] = "; ".join(parts["heads"])
    masked = []
    for name, what in (("cp math=False mask=whole", "the whole (T, S) mask, default CPU kernel"),
                       ("cp math=True mask=whole", "the whole mask, sdpa_kernel(MATH)"),
                       ("cp math=True mask=buffer", "the mask sharded by rows with the buffers, sdpa_kernel(MATH)")):
        text, cp["evidence"][name] = label(name, segments=True)
        masked.append(f"{what}: {text}")
    cp["packing"] = "attn_mask from the segment ids: " + "; ".join(masked)
    cp["empty_row"] = NONE
    heads["packing"] = "- (heads split; documents are the caller's mask)"
    return {"cp": cp, "heads": heads}


@dataclasses.dataclass
class _GroupCache:
    """One group start serves both sharded rows (a start costs seconds)."""
    rows: dict | None = None
    slow: bool = False
    failed: Exception | None = None  # a group that failed once is not started again in the same run

    def get(self) -> dict:
        if self.failed is not None:
            raise self.failed
        if self.rows is None:
            inputs = shard_inputs()
            try:
                self.rows = sharded_cells(run_group(inputs, self.slow), inputs)
            except Exception as err:
                self.failed = err
                raise
        return self.rows


_GROUP = _GroupCache()


def _torch_context_parallel() -> dict:
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    return dict(_GROUP.get()["cp"])


def _torch_dtensor_heads() -> dict:
    return dict(_GROUP.get()["heads"])

