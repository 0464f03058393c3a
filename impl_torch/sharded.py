"""Sharded attention on torch.distributed (gloo): heads split across processes
(tensor parallelism) or the sequence split across processes (ring attention).

The same NumPy-in, NumPy-out interface as impl_torch/adapter.py, plus `kind`
("heads" | "sequence") and `devices` (the number of processes):

    forward(config, tensors, inputs, options, *, kind, devices, trace=False)
    vjp(config, tensors, inputs, options, d_output, *, kind, devices)

Each call starts `devices` processes (torch.multiprocessing, start method
"spawn"), joins them into one gloo process group and returns rank 0's
assembled answer. run_jobs runs several calls in one start (a start costs a
few seconds: every process imports torch). What a call cannot do raises
NotImplementedError with the reason, before any process starts. The spawn
start method re-imports the caller's main module in every process, so a
script that calls these must guard its entry point with
`if __name__ == "__main__":` (multiprocessing's own rule; console scripts
already do).

Heads (`kind="heads"`)
    Rank r holds query heads r*N/n .. (r+1)*N/n (num_heads must divide by
    the n processes) and the kv heads they read: split with them when
    K >= n and K % n == 0, else replicated (each rank computes the one or two
    kv heads its query heads share; MQA: every rank the one). q, k, v are
    column-parallel (each rank projects with its heads' kernel columns), the
    output projection row-parallel: each rank's partial output (its heads'
    rows of the output kernel) is summed by one all_reduce in the compute
    dtype, and the output bias is added once, after it. DTensor's
    parallelize_module is not used: its ColwiseParallel / RowwiseParallel
    styles shard nn.Linear and nn.Embedding, and this layer's kernels are
    (D, heads, width) tensors used through the stages of functional.py (with
    QK-norm and RoPE between projection and logits), so the split is written
    out, with an all_reduce that is an autograd Function (_AllReduceSum).
    The weights (return_weights: each rank's heads, gathered) and the cache
    (return_cache: each kv head from a rank that holds it) come back whole.
    QK-norm with scope "all" normalises over every head at once: its
    statistics are summed over the ranks by an all_reduce (each replicated kv
    head counted once, by the first rank holding it).

Sequence (`kind="sequence"`)
    Queries, new keys/values and the cache are each split by position into
    n blocks; rank r holds query block r and key block r (its cache part,
    then its new keys, after projection, QK-norm and RoPE at their own
    positions). Block order: contiguous blocks without causal; with causal
    (either alignment) the load-balanced "zigzag" order: each length is cut
    into 2n chunks and rank r holds chunks r and 2n-1-r, so every rank gets
    as many early (mostly hidden) as late (mostly visible) keys and queries.
    Key/value blocks go round the ring with point-to-point ops
    (dist.batch_isend_irecv: send to rank+1, receive from rank-1), n-1
    steps; the key segment ids travel with them. Every block carries its
    global key indices (known to every rank from the split rule), so causal
    (both alignments), windows, mask and bias columns and segment ids are
    taken per block from the indices, and a block that causal or a window
    hides from every local query is not computed (it still travels on). Each
    rank merges its blocks with the online-softmax rule of
    impl_numpy/chunked.py (running max m, sum l, numerator acc; sinks start
    m at the sink and l at 1); a row that ends with l == 0 follows the
    masked-row policy ("uniform": the mean of every value row, kept as a
    running sum of the blocks' values). Gradients: autograd through the
    ring, whose shift is a custom autograd Function (its backward sends the
    gradient the other way round); every received block is anchored to the
    output so that each rank's backward runs the same shifts in the same
    order. Each block is computed in sub-blocks of options["chunk_size"]
    key columns (default CHUNK = 512) by min(chunk_size, 128) query rows,
    impl_numpy/chunked.py's sizes, so that a rank's temporaries stay
    (B, N, 128, 512) however long its blocks are.
    Without gradients a block travels in pieces of chunk_size keys: the
    rank sends its piece i, receives the next block's piece i into a free
    buffer and folds its own piece i meanwhile, so the transfer runs while
    it computes and a rank holds one block and a piece or two, never two
    blocks; under autograd whole blocks shift and each shift is waited for
    before its block is used (a custom Function's forward returns the
    received tensor). Dropout:
    the keep-mask's rows of this rank, its columns per block (a seeded one,
    without dropout_mask, is torch's stream drawn whole on every rank, as the
    unsharded call draws it). The weights (B, N, T, S_total) are never
    whole on one rank: return_weights is refused.

Neither kind returns a trace (trace=True is refused): no rank runs every
stage on the whole call.

Gradients: every rank's leaves are the whole canonical tensors and inputs;
its shard reads them by index, so its gradients are whole-shaped with zeros
outside its shard, and rank 0 sums them. Heads: d_output is given to rank
0's output only (every rank holds the whole all-reduced output; the
all_reduce's backward hands it to all). Sequence: each rank's output rows
take their rows of d_output.

Several hosts (torchrun)
    Nothing here assumes one host: the process group starts from the
    environment (init_method "env://": MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE), as torchrun sets it. Under torchrun, call run_in_group in
    every process instead of forward / vjp:

        # job.py
        import impl_torch.sharded as sharded
        results = sharded.run_in_group([{"op": "forward", "config": config,
                                         "tensors": tensors, "inputs": inputs,
                                         "options": {"is_causal": True}}], kind="sequence")
        # rank 0 gets the assembled answers, the other ranks None

        torchrun --nnodes=2 --nproc-per-node=4 --node-rank=$NODE \\
                 --master-addr=$HOST0 --master-port=29500 job.py

    Every process reads the whole inputs and takes its own shard of them;
    the attention's traffic is the all_reduce (heads) or the ring (sequence).
    Gloo picks the network interface from the host name; set
    GLOO_SOCKET_IFNAME where that is the wrong one.

Measurement: measure() runs one sharded forward (after a warm-up call in
the same processes) and returns the bytes each rank sent on the ring (keys
and values; key ids) against the ring's minimum, (n-1)/n of the call's
key/value bytes, and each process's peak resident memory over the call with
its resident memory just before it (the kernel's VmHWM, reset before the
call). The forward sends exactly the minimum when the split is even: every
block makes n-1 hops and nothing else travels but the key ids of packed
rows.

Memory, without gradients (what a rank holds at most): its rows of the
inputs until they are projected (self-attention: one copy for q, k and v),
its queries, its block of keys and values in pieces (written k first, then
v, each projection dropped once written), one or two free pieces, the
running sum and numerator of its rows (one array each, updated in place)
and one scratch buffer that holds every sub-block's (B, N, 128, chunk)
scores in turn (scaled, masked and exponentiated in place). Pieces and queries are freed before the output projection. The
ranks this module starts fix glibc's mmap threshold (bound_heap_retention
says why; a torchrun start sets MALLOC_MMAP_THRESHOLD_=1048576 for the
same). Under autograd every received block is kept for the backward (as
any ring attention's backward needs them).
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import pickle
import resource
import socket
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

import weights
from weights.call import OPTIONAL_INPUTS
from weights.contract import broadcast_shape, check_call, check_chunk_size, check_input_values
from weights.rope import rope_tables

from . import functional as F
from .convert import compute_dtype, to_numpy, to_torch, torch_dtype

KINDS = ("heads", "sequence")
DIFFERENTIABLE_INPUTS = ("query", "key", "value", "past_key", "past_value")
# A ring block is computed in sub-blocks of CHUNK key columns (options["chunk_size"] overrides) by
# min(CHUNK, QUERY_ROWS) query rows: impl_numpy/chunked.py's sizes, so that a rank's temporaries are the
# chunked call's, (B, N, 128, 512).
CHUNK = 512
QUERY_ROWS = 128
TIMEOUT = datetime.timedelta(seconds=300)  # a rank that died leaves the others waiting: fail instead of hanging

# Bytes this process has sent on the ring (sequence sharding): keys and values, key ids, gradients.
_SENT = {"kv": 0, "ids": 0, "grad": 0}
_TAGS = {"kv": 1, "ids": 2, "grad": 3}  # a message of each kind can be in flight at once: each has its tag


# -- validation, before any process starts ----------------------------------------------------------

def check(config, tensors, inputs, options, *, kind, devices, trace=False) -> weights.contract.CallShapes:
    """ValueError for bad input (in the contract's words), NotImplementedError for what the sharded call
    does not do; returns the call's shapes."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}: got {kind!r}")
    if isinstance(devices, bool) or not isinstance(devices, (int, np.integer)) or devices < 1:
        raise ValueError(f"devices must be a positive integer: got {devices!r}")
    weights.validate_tensors(config, tensors)
    check_input_values(**{name: inputs.get(name) for name in DIFFERENTIABLE_INPUTS})
    meta = {}
    for name in OPTIONAL_INPUTS:
        if inputs.get(name) is not None:
            array = np.asarray(inputs[name])
            meta[f"{name}_shape"], meta[f"{name}_dtype"] = array.shape, array.dtype.name
    query = np.asarray(inputs["query"])
    key = query if inputs.get("key") is None else np.asarray(inputs["key"])
    value = key if inputs.get("value") is None else np.asarray(inputs["value"])
    training = bool(options.get("training", False))
    return_weights = bool(options.get("return_weights", False))
    shapes = check_call(config, query_shape=query.shape, key_shape=key.shape, value_shape=value.shape, **meta,
                        is_causal=bool(options.get("is_causal", False)),
                        causal_alignment=options.get("causal_alignment", "top_left"), training=training,
                        seed=options.get("seed"), return_weights=return_weights,
                        return_cache=bool(options.get("return_cache", False)), materializes_scores=False,
                        keys_given=inputs.get("key") is not None or inputs.get("value") is not None)
    if inputs.get("bias") is not None:
        weights.contract.check_bias_values(inputs["bias"])
    check_chunk_size(options.get("chunk_size"), return_weights=return_weights, traced=trace)
    reason = refusal(config, inputs, options, kind=kind, devices=int(devices), trace=trace)
    if reason:
        raise NotImplementedError(reason)
    return shapes


def refusal(config, inputs, options, *, kind, devices, trace=False) -> str | None:
    """Why this sharded call is not built, or None."""
    if trace:
        return "a sharded call returns no trace: no process runs every stage on the whole call"
    if kind == "heads":
        if config.num_heads % devices:
            return (f"heads sharding splits the query heads evenly: num_heads={config.num_heads} "
                    f"does not divide by devices={devices}")
        return None
    if options.get("return_weights"):
        return ("sequence sharding never holds a query's whole row of weights (its key blocks are on other "
                "processes): return_weights is not available")
    return None


# -- processes ----------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs(jobs: list[dict], *, kind: str, devices: int) -> list[dict]:
    """Run several calls in one start of `devices` processes. A job: {"op": "forward" | "vjp", "config",
    "tensors", "inputs", "options"[, "d_output"]}. Returns, per job, {"result": forward's or vjp's dict,
    "stats": one dict per rank (bytes sent, peak memory)}."""
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
    warm = {"op": "forward", "config": config, "tensors": tensors, "inputs": small,
            "options": {k: v for k, v in options.items() if k in ("dtype", "is_causal", "chunk_size")}}
    job = {"op": "forward", "config": config, "tensors": tensors, "inputs": inputs, "options": options}
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


MMAP_THRESHOLD = 1 << 20  # glibc: allocations from 1 MiB on get their own mapping, returned when freed
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


def bound_heap_retention() -> None:
    """In a rank this module started: a fixed glibc mmap threshold. glibc's default threshold is dynamic:
    freeing a mapped block raises it to that block's size, after which blocks up to that size come from
    the heap, which keeps freed memory resident wherever a live block sits above it. The ring frees and
    allocates arrays of many sizes (the rank's inputs, projections, sub-block temporaries): under the
    dynamic threshold a rank's peak over the call was 1.8-2.3x what it is with a fixed one (T 16384,
    4 ranks, docs/sharding.md); the unsharded call's did not move. Same as
    MALLOC_MMAP_THRESHOLD_=1048576 in the environment, which a torchrun start can set. No-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass


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
            before, method = _peak_begin()
            started = time.perf_counter()
            piece = _run_job(job, kind, rank, world)
            stats = dict(_SENT, peak_rss=_peak_end(method), rss_before=before, peak_method=method,
                         seconds=time.perf_counter() - started)
            gathered = [None] * world if rank == 0 else None
            dist.gather_object((piece, stats), gathered, dst=0)
            if rank == 0:
                answers.append({"result": _assemble(job, kind, [g[0] for g in gathered]),
                                "stats": [g[1] for g in gathered]})
        return answers if rank == 0 else None
    finally:
        if started:
            dist.destroy_process_group()


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def _peak_begin() -> tuple[int, str]:
    """Before a job: free what can be freed, reset the kernel's peak-RSS counter (VmHWM, by writing 5 to
    /proc/self/clear_refs) and return (resident bytes now, the method _peak_end reads). Where the kernel
    refuses the reset, the process's lifetime peak (ru_maxrss) stands in: it can only overstate the job's."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc: hand freed heap pages back, so `before` is what is in use
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmRSS"), "VmHWM"
    except OSError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), "ru_maxrss"


def _peak_end(method: str) -> int:
    if method == "VmHWM":
        return _status_bytes("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- one job on one rank ----------------------------------------------------------------------------

def _run_job(job, kind, rank, world) -> dict:
    config, options, inputs = job["config"], job["options"], job["inputs"]
    grad = job["op"] == "vjp"
    dtype = torch_dtype(options.get("dtype") or np.asarray(job["tensors"]["query.kernel"]).dtype)
    leaves = {name: to_torch(t).requires_grad_(grad) for name, t in job["tensors"].items()}
    xs = {name: to_torch(inputs[name]).requires_grad_(grad)
          for name in DIFFERENTIABLE_INPUTS if inputs.get(name) is not None}
    others = {name: to_torch(inputs[name]) for name in OPTIONAL_INPUTS
              if name not in xs and inputs.get(name) is not None}
    run = _heads if kind == "heads" else _sequence
    with torch.set_grad_enabled(grad):
        piece, out = run(config, leaves, xs, others, options, dtype, rank, world)
    if grad:
        d_out = to_torch(np.asarray(job["d_output"])).to(out.dtype)
        if kind == "heads":
            d_local = d_out if rank == 0 else torch.zeros_like(d_out)  # the all_reduce's backward sums it to all
        else:
            d_local = d_out.index_select(1, piece["rows"])
        named = {**xs, **leaves}
        grads = torch.autograd.grad(out, list(named.values()), grad_outputs=d_local, allow_unused=True)
        piece["grads"] = {name: to_numpy(torch.zeros_like(leaf) if g is None else g)
                          for (name, leaf), g in zip(named.items(), grads)}
    return {name: (to_numpy(v) if isinstance(v, torch.Tensor) else v) for name, v in piece.items()}


def _assemble(job, kind, pieces) -> dict:
    """Rank 0: the whole answer from every rank's piece."""
    config, options, inputs = job["config"], job["options"], job["inputs"]
    dtype = pieces[0]["output"].dtype
    answer = {}
    if kind == "heads":
        answer["output"] = pieces[0]["output"]
        if options.get("return_weights"):
            answer["weights"] = np.concatenate([p["weights"] for p in pieces], axis=1)  # (B, N, T, S_total)
        if options.get("return_cache"):
            for name in ("present_key", "present_value"):
                first = pieces[0][name]
                whole = np.zeros((first.shape[0], config.num_kv_heads, *first.shape[2:]), dtype=dtype)
                for p in pieces:
                    whole[:, p["kv_heads"]] = p[name]  # replicated heads: the same values from each holder
                answer[name] = whole
    else:
        B, O = pieces[0]["output"].shape[0], pieces[0]["output"].shape[2]
        T = np.asarray(inputs["query"]).shape[1]
        out = np.zeros((B, T, O), dtype=dtype)
        for p in pieces:
            out[:, p["rows"]] = p["output"]
        answer["output"] = out
        if options.get("return_cache"):
            S_total = sum(len(p["key_index"]) for p in pieces)
            for name in ("present_key", "present_value"):
                first = pieces[0][name]
                whole = np.zeros((first.shape[0], first.shape[1], S_total, first.shape[3]), dtype=dtype)
                for p in pieces:
                    whole[:, :, p["key_index"]] = p[name]
                answer[name] = whole
    if job["op"] == "forward":
        return answer
    order = [n for n in DIFFERENTIABLE_INPUTS if inputs.get(n) is not None] + list(config.tensor_shapes())
    grads = {}
    for name in order:
        total = sum(np.asarray(p["grads"][name], np.float64) for p in pieces)  # each rank: its shard's part
        grads[name] = total.astype(pieces[0]["grads"][name].dtype)
    return {"output": answer["output"], "grads": grads}


# -- heads ------------------------------------------------------------------------------------------

class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; its backward sums the gradients over ranks too (each rank's output is a copy of
    the sum). torch.distributed.nn.functional.all_reduce does the same and is deprecated as of torch 2.13;
    the functional collectives' replacement is not differentiable."""

    @staticmethod
    def forward(ctx, x):
        y = x.detach().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(g)
        return g


def _norm_all(config, p, q, k, heads, kvh, owned, dtype):
    """QK-norm of scope "all" (functional.norm over every head's features) on heads-sharded projections
    q (B, T, n_local*H) and k (B, S, k_local*H): each statistic is this rank's sum over its own heads
    (for k: the kv heads it owns), summed over ranks by one all_reduce for q and k together, so that
    autograd runs the same collectives in the same order on every rank."""
    n = config.qk_norm
    H = config.head_dim
    ct = compute_dtype(dtype)
    yq, yk = q.to(ct), k.to(ct)
    k_cols = torch.tensor([i * H + j for i in owned for j in range(H)], dtype=torch.int64)

    def summed(a, b):  # (B, T, 1) and (B, S, 1): sums over every head's features, all ranks
        sq, sk = a.sum(dim=-1, keepdim=True), b.index_select(-1, k_cols).sum(dim=-1, keepdim=True)
        total = _AllReduceSum.apply(torch.cat([sq.reshape(-1), sk.reshape(-1)]))
        return total[: sq.numel()].reshape(sq.shape), total[sq.numel():].reshape(sk.shape)

    widths = (config.num_heads * H, config.num_kv_heads * H)
    if n.type == "layer":
        mq, mk = summed(yq, yk)
        yq, yk = yq - mq / widths[0], yk - mk / widths[1]
    vq, vk = summed(yq * yq, yk * yk)
    yq = yq / torch.sqrt(vq / widths[0] + n.eps) * p["query.norm.scale"].index_select(0, heads).to(ct).reshape(-1)
    yk = yk / torch.sqrt(vk / widths[1] + n.eps) * p["key.norm.scale"].index_select(0, kvh).to(ct).reshape(-1)
    if "query.norm.bias" in p:
        yq = yq + p["query.norm.bias"].index_select(0, heads).to(ct).reshape(-1)
        yk = yk + p["key.norm.bias"].index_select(0, kvh).to(ct).reshape(-1)
    return yq.to(dtype), yk.to(dtype)


def _heads(config, leaves, xs, others, options, dtype, rank, world):
    from .attention import prepare

    N, K = config.num_heads, config.num_kv_heads
    G = N // K
    n_local = N // world
    n0, n1 = rank * n_local, (rank + 1) * n_local
    kv_heads = sorted({n // G for n in range(n0, n1)})  # the kv heads this rank's query heads read
    call = prepare(config, leaves, xs["query"], xs.get("key"), xs.get("value"), mask=others.get("mask"),
                   bias=others.get("bias"), dropout_mask=others.get("dropout_mask"),
                   is_causal=bool(options.get("is_causal", False)),
                   causal_alignment=options.get("causal_alignment", "top_left"),
                   training=bool(options.get("training", False)), seed=options.get("seed"),
                   return_weights=bool(options.get("return_weights", False)), dtype=dtype,
                   positions=others.get("positions"), key_positions=others.get("key_positions"),
                   past_key=xs.get("past_key"), past_value=xs.get("past_value"),
                   segment_ids=others.get("segment_ids"), key_segment_ids=others.get("key_segment_ids"),
                   return_cache=bool(options.get("return_cache", False)), materializes_scores=False)
    p = call.params
    heads = torch.arange(n0, n1)
    kvh = torch.tensor(kv_heads)

    def cols(name, index):  # a kernel (D, heads, width) or bias (heads, width): these heads
        if name not in p:
            return None
        t = p[name]
        return t.index_select(1 if name.endswith("kernel") else 0, index)

    q = F.project(call.query, cols("query.kernel", heads), cols("query.bias", heads))  # (B, T, n_local*H)
    k = F.project(call.key, cols("key.kernel", kvh), cols("key.bias", kvh))  # (B, S, k_local*H)
    v = F.project(call.value, cols("value.kernel", kvh), cols("value.bias", kvh))  # (B, S, k_local*V)
    if config.qk_norm is not None and config.qk_norm.scope == "all":
        # kv head h is counted by the first rank that holds it (a replicated head is summed once)
        owned = [i for i, h in enumerate(kv_heads) if (h * G) // n_local == rank]
        q, k = _norm_all(config, p, q, k, heads, kvh, owned, dtype)
    elif config.qk_norm is not None:  # scope "head": per head, scale (H,) shared by the heads
        nq = config.qk_norm
        q = F.norm(q, p["query.norm.scale"], p.get("query.norm.bias"), nq.type, nq.eps, n_local, nq.scope)
        k = F.norm(k, p["key.norm.scale"], p.get("key.norm.bias"), nq.type, nq.eps, len(kv_heads), nq.scope)
    q, k, v = F.split_heads(q, n_local), F.split_heads(k, len(kv_heads)), F.split_heads(v, len(kv_heads))
    if config.rope is not None:

        inv_freq, factor = rope_tables(config.rope)
        R, inter = config.rope.rotary_dim, config.rope.interleaved
        q = F.rope(q, F.rope_angles(call.positions, inv_freq, dtype), R, inter, factor)  # (B, n_local, T, H)
        k = F.rope(k, F.rope_angles(call.key_positions, inv_freq, dtype), R, inter, factor)
    if call.past_key is not None:
        k = torch.cat([call.past_key.index_select(1, kvh), k], dim=2)  # (B, k_local, P+S, H)
        v = torch.cat([call.past_value.index_select(1, kvh), v], dim=2)
    present = (k, v)
    # Query head n reads kv head n // G; where this rank's heads do not form whole groups of its kv heads
    # (K < n without K dividing n), each query head gets its own copy of its kv head.
    reads = [n // G - kv_heads[0] for n in range(n0, n1)]
    groups = n_local // len(kv_heads) if n_local % len(kv_heads) == 0 else 0
    if not groups or reads != [i // groups for i in range(n_local)]:
        index = torch.tensor(reads)
        k, v = k.index_select(1, index), v.index_select(1, index)  # (B, n_local, S_total, H)

    def local(t):  # a rank-4 (B|1, N|1, T|1, S|1) mask / bias / keep: these heads
        return t if t is None or t.shape[1] == 1 else t.index_select(1, heads)

    x = F.logits(q, k, config.effective_scale)  # (B, n_local, T, S_total)
    if config.logit_softcap is not None:
        x = F.softcap(x, config.logit_softcap)
    x = F.mask_stage(x, local(call.allowed), local(call.bias4))
    w = F.softmax(x, config.masked_row, None if "sinks" not in p else p["sinks"].index_select(0, heads))
    ctx = F.merge_heads(F.attend(F.dropout(w, local(call.keep), config.dropout), v))  # (B, T, n_local*V)
    ct = compute_dtype(dtype)
    kernel = p["output.kernel"].index_select(0, heads)  # (n_local, V, O): row-parallel
    partial = torch.einsum(F.OUTPUT, ctx.to(ct), kernel.reshape(-1, kernel.shape[-1]).to(ct))  # (B, T, O)
    total = _AllReduceSum.apply(partial)  # the heads' partial outputs summed once, in the compute dtype
    if "output.bias" in p:
        total = total + p["output.bias"].to(ct)  # once, after the sum
    out = total.to(dtype)
    piece = {"output": out.detach(), "kv_heads": kv_heads}
    if options.get("return_weights"):
        piece["weights"] = w.detach()
    if options.get("return_cache"):
        piece["present_key"], piece["present_value"] = (t.detach() for t in present)
    return piece, out


# -- sequence (the ring) ----------------------------------------------------------------------------

def split(length: int, parts: int, zigzag: bool) -> list[np.ndarray]:
    """Positions 0..length-1 in `parts` blocks: contiguous, or zigzag (2*parts chunks, block r = chunks r
    and 2*parts-1-r: early and late positions together, so causal work is even across ranks)."""
    positions = np.arange(length)
    if not zigzag:
        return np.array_split(positions, parts)
    chunks = np.array_split(positions, 2 * parts)
    return [np.concatenate([chunks[r], chunks[2 * parts - 1 - r]]) for r in range(parts)]


def _start_exchange(x: torch.Tensor, send_to: int, recv_from: int, recv_shape, counter: str):
    """Start sending x to one rank and receiving a tensor of recv_shape (x's dtype) from another; raw bytes
    on the wire, so that every dtype (bfloat16 too) travels unchanged. -> what _finish_exchange takes."""
    out = torch.empty(recv_shape, dtype=x.dtype)
    send = x.detach().contiguous().reshape(-1).view(torch.uint8)
    recv = out.reshape(-1).view(torch.uint8)
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, send_to, tag=_TAGS[counter]))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, recv_from, tag=_TAGS[counter]))
    _SENT[counter] += send.numel()
    return out, send, (dist.batch_isend_irecv(ops) if ops else [])


def _finish_exchange(pending) -> torch.Tensor:
    out, _send, requests = pending  # the send buffer stays referenced until its request is done
    for request in requests:
        request.wait()
    return out


def _exchange(x: torch.Tensor, send_to: int, recv_from: int, recv_shape, counter: str) -> torch.Tensor:
    return _finish_exchange(_start_exchange(x, send_to, recv_from, recv_shape, counter))


class _RingShift(torch.autograd.Function):
    """Forward: send this block to rank+1, receive rank-1's. Backward: the gradient goes the other way."""

    @staticmethod
    def forward(ctx, x, recv_shape):
        rank, world = dist.get_rank(), dist.get_world_size()
        ctx.shape = tuple(x.shape)
        return _exchange(x, (rank + 1) % world, (rank - 1) % world, recv_shape, "kv")

    @staticmethod
    def backward(ctx, g):
        rank, world = dist.get_rank(), dist.get_world_size()
        return _exchange(g, (rank - 1) % world, (rank + 1) % world, ctx.shape, "grad"), None


class _Anchor(torch.autograd.Function):
    """out unchanged; `blocks` get zero gradients. Ties every received block to the output so that
    backward reaches every ring shift on every rank (a rank that skipped a hidden block would otherwise
    skip that shift's backward and leave its neighbours waiting)."""

    @staticmethod
    def forward(ctx, out, *blocks):
        ctx.shapes = [(b.shape, b.dtype) for b in blocks]
        return out.clone()

    @staticmethod
    def backward(ctx, g):
        return (g, *(torch.zeros(s, dtype=d) for s, d in ctx.shapes))


def _sequence(config, leaves, xs, others, options, dtype, rank, world):

    N, K, H, V = config.num_heads, config.num_kv_heads, config.head_dim, config.value_head_dim
    G = N // K
    ct = compute_dtype(dtype)
    p = {name: t.to(dtype) for name, t in leaves.items()}
    query = xs["query"].to(dtype)
    key = query if xs.get("key") is None else xs["key"].to(dtype)
    value = key if xs.get("value") is None else xs["value"].to(dtype)
    past_key, past_value = xs.get("past_key"), xs.get("past_value")
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    P = 0 if past_key is None else past_key.shape[2]
    S_total = P + S
    is_causal = bool(options.get("is_causal", False))
    offset = 0 if options.get("causal_alignment", "top_left") == "top_left" else S_total - T
    left, right = config.window_left, config.window_right
    zigzag = is_causal
    rows_of = [torch.from_numpy(i) for i in split(T, world, zigzag)]
    keys_of = [torch.from_numpy(np.concatenate([c, P + s]))
               for c, s in zip(split(P, world, zigzag), split(S, world, zigzag))]  # cache part, then new keys
    rows, my_keys = rows_of[rank], keys_of[rank]
    new_keys = my_keys[my_keys >= P] - P
    cached = my_keys[my_keys < P]

    grad = torch.is_grad_enabled()
    rope = None
    if config.rope is not None:
        inv_freq, factor = rope_tables(config.rope)
        R, inter = config.rope.rotary_dim, config.rope.interleaved

        def positions(given, index):  # (B|1, len): the given positions of these tokens, or P + index
            if given is None:
                return (P + index)[None]
            given = given.to(torch.int64)
            return (given[None] if given.ndim == 1 else given).index_select(1, index)

        def rope(t, given, index):
            return F.rope(t, F.rope_angles(positions(given, index), inv_freq, dtype), R, inter, factor)

    # The rank's own rows of the inputs (copies, dropped once projected); self-attention without a cache
    # takes its keys from the same rows, so one copy serves q, k and v.
    x_rows = query.index_select(1, rows)
    x_keys = x_rows if key is query and torch.equal(new_keys, rows) else key.index_select(1, new_keys)
    x_values = x_keys if value is key else value.index_select(1, new_keys)
    q = F.project(x_rows, p["query.kernel"], p.get("query.bias"))  # (B, t, N*H)
    del x_rows
    if config.qk_norm is not None:  # per position: the shard's rows are enough
        nq = config.qk_norm
        q = F.norm(q, p["query.norm.scale"], p.get("query.norm.bias"), nq.type, nq.eps, N, nq.scope)
    q = F.split_heads(q, N)  # (B, N, t, H)
    if rope is not None:
        q = rope(q, others.get("positions"), rows)

    def keys(x_keys):  # (B, K, s_total, H): projected, normed, rotated, the cache part first
        k = F.project(x_keys, p["key.kernel"], p.get("key.bias"))  # (B, s, K*H)
        if config.qk_norm is not None:
            k = F.norm(k, p["key.norm.scale"], p.get("key.norm.bias"), nq.type, nq.eps, K, nq.scope)
        k = F.split_heads(k, K)  # (B, K, s, H)
        if rope is not None:
            k = rope(k, others.get("key_positions"), new_keys)
        return k if past_key is None else torch.cat([past_key.to(dtype).index_select(2, cached), k], dim=2)

    def values(x_values):  # (B, K, s_total, V)
        v = F.split_heads(F.project(x_values, p["value.kernel"], p.get("value.bias")), K)  # (B, K, s, V)
        return v if past_value is None else torch.cat([past_value.to(dtype).index_select(2, cached), v], dim=2)

    # What each query row sees, taken per block: mask and bias rows here, their columns per block.
    def rows_here(t):
        return None if t is None else (t.index_select(2, rows) if t.shape[2] == T else t)

    def rank4(name, cast=None):  # a mask / bias as (B|1, N|1, T|1, S_total|1), its rows here
        if others.get(name) is None:
            return None
        t = others[name] if cast is None else others[name].to(cast)
        return rows_here(t.reshape(broadcast_shape(name, tuple(t.shape), B, N, T, S_total)))

    mask, bias = rank4("mask"), rank4("bias", ct)
    keep = None  # dropout's keep-mask, this rank's rows (B, N, t, S_total): functional.dropout per block
    if options.get("training"):
        keep = others.get("dropout_mask")
        if keep is None and config.dropout > 0:  # the unsharded call's own seeded stream, drawn whole on every rank
            keep = F.dropout_keep_mask((B, N, T, S_total), config.dropout, options.get("seed"), query.device)
        keep = rows_here(keep)
    rate = 1.0 - config.dropout
    q_ids = k_ids = None
    if others.get("segment_ids") is not None:
        ids = others["segment_ids"].to(torch.int64)
        kids = others.get("key_segment_ids", others["segment_ids"]).to(torch.int64)
        q_ids = (ids[None] if ids.ndim == 1 else ids).index_select(1, rows)  # (B|1, t)
        k_ids = (kids[None] if kids.ndim == 1 else kids).index_select(1, my_keys)  # (B|1, s_total): travels
    aligned = rows + offset  # (t,): each local query's aligned position

    def visible(at, index):  # (r, c) bool: causal and window for these aligned rows and key indices, or None
        vis = None
        i, j = at[:, None], index[None, :]
        for bound in ((j <= i) if is_causal else None, (j >= i - left) if left >= 0 else None,
                      (j <= i + right) if right >= 0 else None):
            if bound is not None:
                vis = bound if vis is None else vis & bound
        return vis

    t = len(rows)
    chunk = int(options.get("chunk_size") or CHUNK)
    row_chunk = min(chunk, QUERY_ROWS)
    parts = [(r0, min(t, r0 + row_chunk)) for r0 in range(0, t, row_chunk)]  # query rows, each with its own running state
    sinks = p.get("sinks")
    uniform = config.masked_row == "uniform"

    def new_states():
        """Each query part's running state [max, sum, numerator, the uniform policy's own sum under dropout];
        -> (states, the sums, the numerators). Without gradients every part's sum and numerator are views
        of one (B, N, t, 1) and one (B, N, t, V) array, updated in place: the merge allocates no new state
        per sub-block, and the result needs no concatenation at the end. Autograd gets new tensors per
        update instead (the two arrays are then None)."""
        l_all = None if grad else torch.zeros((B, N, t, 1), dtype=ct)
        acc_all = None if grad else torch.zeros((B, N, t, V), dtype=ct)
        states = []
        for r0, r1 in parts:
            if sinks is not None:  # the sink joins each row once, before any block: max = sink, sum = 1
                sink = sinks.to(ct).reshape(1, N, 1, 1)
                m = sink.detach().expand(B, N, r1 - r0, 1)
                l = torch.exp(sink - sink.detach()).expand(B, N, r1 - r0, 1)  # 1, with the sink's gradient
            else:
                m = torch.full((B, N, r1 - r0, 1), float("-inf"), dtype=ct)
                l = torch.zeros((B, N, r1 - r0, 1), dtype=ct)
            if grad:
                states.append([m, l, torch.zeros((B, N, r1 - r0, V), dtype=ct)])
            else:
                l_all[:, :, r0:r1] = l
                states.append([m, l_all[:, :, r0:r1], acc_all[:, :, r0:r1]])
        for (r0, r1), state in zip(parts, states):  # with dropout, a masked row's uniform context is its own
            state.append(torch.zeros((B, N, r1 - r0, V), dtype=ct) if uniform and keep is not None else None)
        return states, l_all, acc_all

    def rows_part(t_, r0, r1):  # a (B|1, N|1, t|1, ...) array's rows r0..r1
        return None if t_ is None else (t_[:, :, r0:r1] if t_.shape[2] == t else t_)

    scratch = []  # without gradients: one (B, N, rows, chunk) buffer for every sub-block's scores

    def logits(r0, r1, kc):
        """functional.logits of rows r0..r1 against kc (compute dtype, scaled, stored in the storage dtype),
        as one matmul per key/value head. Without gradients into the scratch buffer, scaled in place: under
        the fixed mmap threshold a fresh (B, N, 128, chunk) array per sub-block would be a fresh mapping,
        its pages faulted in and zeroed each time (the forward took 1.4x as long so)."""
        r, c = r1 - r0, kc.shape[2]
        qg = q[:, :, r0:r1].reshape(B, K, G * r, H).to(ct)  # (B, K, G*r, H): query head n reads kv head n // G
        kt = kc.to(ct).transpose(-1, -2)  # (B, K, H, c)
        if grad:
            x = torch.matmul(qg, kt) * config.effective_scale
        else:
            if not scratch:
                scratch.append(torch.empty(B * N * row_chunk * chunk, dtype=ct))
            x = torch.matmul(qg, kt, out=scratch[0][: B * N * r * c].view(B, K, G * r, c))
            x.mul_(config.effective_scale)
        return x.reshape(B, N, r, c).to(dtype)

    def fold(index, block_ids, c0, kc, vc):
        """Key columns c0.. of a block (kc (B, K, c, H), vc (B, K, c, V); index: the block's global key
        indices, block_ids its key segment ids) into every query part's running state; temporaries stay
        (B, N, rows, c)."""
        c1 = c0 + kc.shape[2]
        cols = index[c0:c1]
        mask_cols = None if mask is None else (mask.index_select(3, cols) if mask.shape[3] == S_total else mask)
        bias_cols = None if bias is None else (bias.index_select(3, cols) if bias.shape[3] == S_total else bias)
        keep_cols = None if keep is None else keep.index_select(3, cols)
        for (r0, r1), state in zip(parts, states):
            if state[3] is not None:  # weight 1/S_total on every key, hidden ones too, then dropout
                dropped = (rows_part(keep_cols, r0, r1).to(ct) / (rate * S_total)).reshape(B, K, G, r1 - r0, -1)
                state[3] = state[3] + torch.einsum(F.ATTEND, dropped, vc.to(ct)).reshape(B, N, r1 - r0, V)
            vis = visible(aligned[r0:r1], cols)
            if vis is not None and not bool(vis.any()):
                continue  # causal or the window hides these keys from every row here
            allowed = None if vis is None else vis[None, None]  # (1, 1, r, c)
            if mask_cols is not None:
                allowed = rows_part(mask_cols, r0, r1) if allowed is None else allowed & rows_part(mask_cols, r0, r1)
            if block_ids is not None:
                same = (q_ids[:, r0:r1, None] == block_ids[:, None, c0:c1])[:, None]  # (B|1, 1, r, c)
                allowed = same if allowed is None else allowed & same
            x = logits(r0, r1, kc)  # (B, N, r, c)
            if config.logit_softcap is not None:
                x = F.softcap(x, config.logit_softcap)
            if grad or bias_cols is not None:
                x = F.mask_stage(x, allowed, rows_part(bias_cols, r0, r1)).to(ct)
            else:  # functional.mask's select without a bias, in place on the scratch
                if allowed is not None:
                    x.masked_fill_(~allowed, float("-inf"))
                x = x.to(ct)
            # The online-softmax merge (impl_numpy/chunked.py's _core); the shifts are constants, not
            # functions of x (detached), so the gradient is the softmax's own.
            m, l, acc = state[:3]
            m_new = torch.maximum(m, x.amax(dim=-1, keepdim=True).detach())
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            # hidden -> exactly 0; without gradients in place (x is this sub-block's own temporary)
            e = torch.exp(x - m_safe) if grad else x.sub_(m_safe).exp_()
            correction = torch.exp(m - m_safe)  # 0 where m was -inf
            row_sum = e.sum(dim=-1, keepdim=True)  # before dropout: the softmax's denominator
            if keep_cols is not None:
                e = torch.where(rows_part(keep_cols, r0, r1), e / rate, 0.0)
            pv = torch.einsum(F.ATTEND, e.reshape(B, K, G, r1 - r0, c1 - c0), vc.to(ct))
            if grad:
                state[:3] = [m_new, l * correction + row_sum, acc * correction + pv.reshape(B, N, r1 - r0, V)]
            else:
                l.mul_(correction).add_(row_sum)
                acc.mul_(correction).add_(pv.reshape(B, N, r1 - r0, V))
                state[0] = m_new

    v_sum = torch.zeros((B, K, V), dtype=ct)  # every value row, for the "uniform" masked-row policy
    block_ids = k_ids
    send_to, recv_from = (rank + 1) % world, (rank - 1) % world
    present = None
    if grad:
        # Autograd: the rank's keys and values travel as one tensor, a function of k and v, whole blocks
        # shifted by _RingShift; every received block is kept for the backward.
        k, v = keys(x_keys), values(x_values)
        del x_keys, x_values
        packed = torch.cat([k.reshape(-1), v.reshape(-1)])
        present = (k, v) if options.get("return_cache") else None
        del k, v
        states, _, _ = new_states()
        received = [packed]
        for step in range(world):
            index = keys_of[(rank - step) % world]
            s = len(index)
            kb = packed[: B * K * s * H].view(B, K, s, H)
            vb = packed[B * K * s * H: B * K * s * (H + V)].view(B, K, s, V)
            if step < world - 1:  # waited for before the next block is used
                nxt = len(keys_of[(rank - step - 1) % world])
                packed = _RingShift.apply(packed, (B * K * nxt * (H + V),))
                received.append(packed)
                next_ids = None if block_ids is None else _exchange(block_ids, send_to, recv_from,
                                                                    (block_ids.shape[0], nxt), "ids")
            for c0 in range(0, s, chunk):
                if uniform:  # summed per piece, as without gradients: the same roundings either way
                    v_sum = v_sum + vb[:, :, c0:c0 + chunk].to(ct).sum(dim=2)
                fold(index, block_ids, c0, kb[:, :, c0:c0 + chunk], vb[:, :, c0:c0 + chunk])
            if step < world - 1:
                block_ids = next_ids
        l = torch.cat([state[1] for state in states], dim=2) if states else torch.zeros((B, N, 0, 1), dtype=ct)
        acc = torch.cat([state[2] for state in states], dim=2) if states else torch.zeros((B, N, 0, V), dtype=ct)
    else:
        # Without gradients a block travels in pieces of `chunk` keys, each [its keys (B, K, c, H) | its
        # values (B, K, c, V)] in a buffer of its own. At every piece of a step the rank sends its piece c to
        # rank+1, receives rank-1's piece c into a free buffer, folds its own piece c in meanwhile, and waits
        # for both: the piece just sent and folded is then free for the next receive. So a rank holds one
        # block and a piece or two, not two blocks, and the transfer still runs while the rank computes.
        # The rank's own block is written into its pieces, k and then v, each dropped once written.
        width = B * K * min(chunk, max(len(index) for index in keys_of) or 1) * (H + V)  # a whole piece

        def sizes(s):  # the key counts of a block's pieces
            return [min(chunk, s - c0) for c0 in range(0, s, chunk)]

        own = sizes(len(my_keys))
        pieces = [torch.empty(width, dtype=dtype) for _ in own]
        k = keys(x_keys)
        for i, c in enumerate(own):
            pieces[i][: B * K * c * H].view(B, K, c, H).copy_(k[:, :, i * chunk: i * chunk + c])
        present_key = k if options.get("return_cache") else None
        del k
        v = values(x_values)
        for i, c in enumerate(own):
            pieces[i][B * K * c * H: B * K * c * (H + V)].view(B, K, c, V).copy_(v[:, :, i * chunk: i * chunk + c])
        present = None if present_key is None else (present_key, v)
        del v, x_keys, x_values
        states, l_all, acc_all = new_states()  # after the inputs' rows are freed: not at the same time
        free = []  # piece buffers sent and folded, ready for a receive
        for step in range(world):
            index = keys_of[(rank - step) % world]
            here = sizes(len(index))
            last = step == world - 1
            coming = [] if last else sizes(len(keys_of[(rank - step - 1) % world]))
            next_ids = None
            if not last and block_ids is not None:
                next_ids = _exchange(block_ids, send_to, recv_from, (block_ids.shape[0], sum(coming)), "ids")
            arrived = []
            for i in range(max(len(here), len(coming))):
                ops = []
                if i < len(here) and not last:
                    sent = pieces[i][: B * K * here[i] * (H + V)].view(torch.uint8)
                    ops.append(dist.P2POp(dist.isend, sent, send_to, tag=_TAGS["kv"]))
                    _SENT["kv"] += sent.numel()
                if i < len(coming):
                    arrived.append(free.pop() if free else torch.empty(width, dtype=dtype))
                    ops.append(dist.P2POp(dist.irecv, arrived[-1][: B * K * coming[i] * (H + V)].view(torch.uint8),
                                          recv_from, tag=_TAGS["kv"]))
                requests = dist.batch_isend_irecv(ops) if ops else []
                if i < len(here):
                    c = here[i]
                    kc = pieces[i][: B * K * c * H].view(B, K, c, H)
                    vc = pieces[i][B * K * c * H: B * K * c * (H + V)].view(B, K, c, V)
                    if uniform:
                        v_sum = v_sum + vc.to(ct).sum(dim=2)
                    fold(index, block_ids, i * chunk, kc, vc)
                for request in requests:
                    request.wait()
                if i < len(here):
                    free.append(pieces[i])
            pieces = arrived
            if next_ids is not None:
                block_ids = next_ids
        # the pieces, the free buffers and the queries are done with: freed before the output's arrays
        pieces = arrived = free = kc = vc = q = None
        scratch.clear()
        l, acc = l_all, acc_all
    empty = l == 0  # rows with no visible key (never with sinks: the sink's 1 stays)
    ctx = acc / torch.where(empty, 1.0, l) if grad else acc.div_(torch.where(empty, 1.0, l))
    if config.masked_row == "uniform":
        if keep is not None:
            mean = torch.cat([state[3] for state in states], dim=2) if states else acc
        else:
            mean = (v_sum / S_total)[:, :, None, None, :].expand(B, K, G, 1, V).reshape(B, N, 1, V)
        ctx = torch.where(empty, mean, ctx)
    elif config.masked_row == "nan":
        ctx = ctx * torch.where(empty, float("nan"), 1.0)  # NaN in the gradient too, as the reference VJP
    ctx = F.merge_heads(ctx.to(dtype))  # (B, t, N*V)
    out = F.output(ctx, p["output.kernel"], p.get("output.bias"))  # (B, t, O)
    if torch.is_grad_enabled():
        out = _Anchor.apply(out, *received)
    piece = {"output": out.detach(), "rows": rows, "key_index": my_keys}
    if options.get("return_cache"):
        piece["present_key"], piece["present_value"] = (t_.detach() for t_ in present)
    return piece, out
