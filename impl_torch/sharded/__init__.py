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

Layout (impl_torch/sharded/; the names above are re-exported here):
    checks.py     validation before any process starts: check, refusal, KINDS, DIFFERENTIABLE_INPUTS
    launch.py     forward, vjp, measure, run_jobs (spawned ranks on a free port, env:// init), run_in_group
    jobs.py       one job on one rank (_run_job) and rank 0's assembly of the pieces (_assemble)
    memory.py     peak-memory probes (_peak_begin, _peak_end) and bound_heap_retention
    heads.py      heads sharding (_heads, _norm_all)
    ring.py       sequence sharding: split, the ring with its online-softmax merge (_sequence), CHUNK
    exchange.py   point-to-point exchange of raw bytes and the bytes-sent counters (_SENT, _TAGS)
    autograd.py   the autograd Functions: _AllReduceSum, _RingShift, _Anchor
A name is looked up in the submodule that defines it: to patch one, patch it there (e.g.
impl_torch.sharded.launch.run_jobs), not on this package.
"""

from __future__ import annotations

from .checks import DIFFERENTIABLE_INPUTS, KINDS, check, refusal
from .launch import TIMEOUT, forward, measure, run_in_group, run_jobs, vjp
from .memory import MMAP_THRESHOLD, bound_heap_retention
from .ring import CHUNK, QUERY_ROWS, split

__all__ = [
    "CHUNK", "DIFFERENTIABLE_INPUTS", "KINDS", "MMAP_THRESHOLD", "QUERY_ROWS", "TIMEOUT", "bound_heap_retention",
    "check", "forward", "measure", "refusal", "run_in_group", "run_jobs", "split", "vjp",
]
