"""Starting the ranks and running jobs in a group: forward, vjp and measure start their processes through
run_jobs (torch.multiprocessing's spawn, a free port on the loopback, env:// init); _spawned is a spawned
rank's entry point; run_in_group runs jobs as one rank of the group the environment describes (torchrun)."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from ..convert import torch_dtype
from .checks import check
from .exchange import _SENT
from .jobs import _assemble, _run_job
from .memory import _peak_begin, _peak_end, bound_heap_retention
from .ring import CHUNK

TIMEOUT = datetime.timedelta(seconds=300)  # a rank that died leaves the others waiting: fail instead of hanging


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs(jobs: list[dict], *, kind: str, devices: int) -> list[dict]:
    """Run several calls in one start of `devices` processes. A job: {"op": "forward" | "vjp", "config",
    "tensors", "inputs", "options"[, "d_output"][, "measure_memory": True]}. Returns, per job, {"result":
    forward's or vjp's dict, "stats": one dict per rank (bytes sent; peak memory where the job asked for it)}."""
    for job in jobs:
        check(job["config"], job["tensors"], job["inputs"], job["options"], kind=kind, devices=devices)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mha-sharded-") as folder:
        path = os.path.join(folder, "results.pickle")
        mp.start_processes(_spawned, args=(int(devices), _free_port(), kind, jobs, path), nprocs=int(devices),
                           join=True, start_method="spawn")
        with open(path, "rb") as f:
            return pickle.load(f)


def forward(config, tensors, inputs, options, *, kind, devices, trace=False):
    check(config, tensors, inputs, options, kind=kind, devices=devices, trace=trace)
    job = {"op": "forward", "config": config, "tensors": tensors, "inputs": inputs, "options": options}
    return run_jobs([job], kind=kind, devices=devices)[0]["result"]


def vjp(config, tensors, inputs, options, d_output, *, kind, devices):
    job = {"op": "vjp", "config": config, "tensors": tensors, "inputs": inputs, "options": options,
           "d_output": np.asarray(d_output)}
    return run_jobs([job], kind=kind, devices=devices)[0]["result"]


def measure(config, tensors, inputs, options, *, devices, kind="sequence") -> dict:
    """One sharded forward, measured: per rank the bytes sent on the ring (keys and values; key ids),
    the ring's minimum per rank ((n-1)/n of the call's key/value bytes in the storage dtype), and each
    process's peak resident memory over the call (VmHWM, reset just before it; ru_maxrss, the lifetime
    peak, where the kernel refuses the reset) and its resident memory just before the call, in bytes:
    peak - before is what the call added. A warm-up call runs first in the same processes, so that the
    libraries' lazily loaded code and pools (torch's kernels and their packing buffers, gloo's) are in
    `before`, not in the call's own growth. Result collection (the gather to rank 0) is not counted;
    every rank holds the whole inputs before the call (in `before`: run_in_group's ranks are handed
    them whole and take their shard)."""
    # The warm-up's blocks are a few sub-blocks long, so that it runs the same kernels at the same sizes
    # (their packing buffers) and sends messages of more than one sub-block.
    rows = min(np.asarray(inputs["query"]).shape[1], 2 * devices * int(options.get("chunk_size") or CHUNK))
    rows = max(rows, 4 * devices)
    small = {"query": np.zeros((1, rows, config.query_dim), np.asarray(inputs["query"]).dtype)}
    if inputs.get("key") is not None:
        small["key"] = np.zeros((1, rows, config.key_dim), np.asarray(inputs["key"]).dtype)
        small["value"] = np.zeros((1, rows, config.value_dim), np.asarray(inputs["key"]).dtype)
    warm = {"op": "forward", "config": config, "tensors": tensors, "inputs": small, "measure_memory": True,
            "options": {k: v for k, v in options.items() if k in ("dtype", "is_causal", "chunk_size")}}
    job = {"op": "forward", "config": config, "tensors": tensors, "inputs": inputs, "options": options,
           "measure_memory": True}
    stats = run_jobs([warm, job], kind=kind, devices=devices)[1]["stats"]
    dtype = torch_dtype(options.get("dtype") or np.asarray(tensors["query.kernel"]).dtype)
    shapes = check(config, tensors, inputs, options, kind=kind, devices=devices)
    itemsize = torch.finfo(dtype).bits // 8
    kv_bytes = shapes.B * config.num_kv_heads * shapes.S_total * (config.head_dim + config.value_head_dim) * itemsize
    minimum = (devices - 1) / devices * kv_bytes
    return {"kind": kind, "devices": devices, "kv_bytes": kv_bytes, "ring_minimum_bytes": minimum,
            "kv_bytes_sent": [s["kv"] for s in stats], "ids_bytes_sent": [s["ids"] for s in stats],
            "ratio_to_minimum": (max(s["kv"] + s["ids"] for s in stats) / minimum) if minimum else None,
            "peak_rss_bytes": [s["peak_rss"] for s in stats], "rss_before_bytes": [s["rss_before"] for s in stats],
            "peak_method": stats[0]["peak_method"], "seconds": [s["seconds"] for s in stats]}


def _spawned(rank, world, port, kind, jobs, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the processes share the host's cores
    bound_heap_retention()
    results = run_in_group(jobs, kind=kind)
    if rank == 0:
        partial = path + ".partial"
        with open(partial, "wb") as f:
            pickle.dump(results, f)
        os.replace(partial, path)


def run_in_group(jobs: list[dict], *, kind: str) -> list[dict] | None:
    """Run the jobs in this process as one rank of the group that the environment describes (env://:
    MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; torchrun sets them). Returns the answers on rank 0 and
    None on the others. Starts the gloo group when none is running (and ends it again)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method="env://", timeout=TIMEOUT)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        answers = []
        for job in jobs:
            for name in _SENT:
                _SENT[name] = 0
            # The probe's gc.collect costs ~65 ms per rank per job (torch's heap): only where it is read.
            before, method = _peak_begin() if job.get("measure_memory") else (None, None)
            job_started = time.perf_counter()
            piece = _run_job(job, kind, rank, world)
            stats = dict(_SENT, peak_rss=_peak_end(method) if method else None, rss_before=before,
                         peak_method=method, seconds=time.perf_counter() - job_started)
            gathered = [None] * world if rank == 0 else None
            dist.gather_object((piece, stats), gathered, dst=0)
            if rank == 0:
                answers.append({"result": _assemble(job, kind, [g[0] for g in gathered]),
                                "stats": [g[1] for g in gathered]})
        return answers if rank == 0 else None
    finally:
        if started:
            dist.destroy_process_group()

