"""`mha bench --shapes v4`: a DeepSeek V4 decode step (issue 41) against a dense MQA step over the same history.

The layers: DeepSeek V4's attention at transformers' DeepseekV4Config() defaults (5.23.0, DeepSeek-V4-Flash's
sizes per its docstring checkpoint: D 4096, N 64 query heads, one kv head of H 512 read as key and as value, RoPE
on the last 64 features, q_lora_rank 1024, o_groups 8, o_lora_rank 1024, a window of 128 keys, csa m 4 with
overlap and an indexer of I 64 heads of J 128 keeping k 512 entries, hca m 128), float32, B 1, read through the
project's own hf-deepseek reader (weights.layouts.deepseek_v4.v4_config), so every field is the contract's. Not
scaled down: a worker holds 481 + 16 MiB of weights (one copy of the shared tensors) and the caches, a few GB at
most at P 131072 (measured figures: docs/performance.md, the DeepSeek V4 decode section).
One new token at position P after a history of P tokens, P 8192 ... 131072 (64k and 128k opt-in: --v4-max).
Per P and backend, in a worker process of its own, each step the backend's call returning its present cache, on
every backend the in-place call (impl_numpy.compressed, in_place=True: buffers for P + 1 tokens that the step writes
its token into, no copy of the cache; docs/spec-frontier.md, "The in-place cache"; tf (Keras on TensorFlow): the
buffers tf.Variables written by XLA):

  csa      the compressed sparse layer: the last W - 1 keys, P // 4 entries (every one in the logits: the
           reference masks the entries its indexer leaves out, it does not gather), the indexer over its P // 4
           index entries, the compressors' open windows and overlap halves
  hca      the heavily compressed layer: the last W - 1 keys and P // 128 entries, its compressor's open window
  sliding  the sliding layer: the last W - 1 keys alone (its cache is constant in P)
  dense    the yardstick: the same layer (the sliding kind's tensors) with a window of 2^20 keys (the model's
           max_position_embeddings), so every one of the P + 1 keys is attended: dense multi-query attention,
           one kv head of H 512 shared by key and value, over the whole history
  read     one read of the dense cache and every weight (a sum per array in the backend): the read bandwidth

The caches are drawn at random with the shapes impl_numpy.compressed.cache_shapes gives for P tokens (a step's
cost does not depend on the values; a real prefill of 128k tokens cannot run here: it needs (P, P) logits per
head); tests/test_bench_v4.py checks the steps against the float64 reference on a real prefill's cache at small
P. Each row reports the cache bytes per token of history (the present cache the backend returned, over P + 1: in
place, the buffers, whose open windows hold m slots whatever P is),
the step's time (median, min) and its ratio to the dense step of the same backend and P (paired: each over the
matmul just before it), and x bound: the time over max(bytes / read bandwidth, FLOPs / matmul rate) with bytes
what the step must read and FLOPs its own (bounds()), as conformance/bench/sparse.py does.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

from conformance.bench.child import run_worker_process
from conformance.bench.sparse import x_bound

FAMILY = "v4"
V4_LENGTHS = (8192, 16384, 32768, 65536, 131072)
DEFAULT_MAX = 32768  # 64k and 128k opt-in (--v4-max): minutes per backend on the shared 2-core VM
QUICK_V4_LENGTHS = (16, 32, 64)
KINDS = ("csa", "hca", "sliding", "dense")
PATHS = (*KINDS, "read")
BACKENDS = ("numpy", "torch", "jax", "mlx", "tf")
DENSE_WINDOW = 2**20  # the dense step's window: DeepseekV4Config's max_position_embeddings (1048576)


@dataclasses.dataclass(frozen=True)
class Dims:
    D: int  # hidden_size
    N: int  # num_attention_heads
    H: int  # head_dim (the one kv head's, key and value)
    R: int  # rotary features (head_dim x partial_rotary_factor)
    Qr: int  # q_lora_rank
    G: int  # o_groups
    Or: int  # o_lora_rank
    W: int  # sliding_window: keys visible, the query's own included
    csa_m: int  # compress_rates["compressed_sparse_attention"]
    hca_m: int  # compress_rates["heavily_compressed_attention"]
    I: int  # index_n_heads
    J: int  # index_head_dim
    k: int  # index_topk
    B: int = 1

    def hf_config(self) -> dict:
        """A deepseek_v4 config.json (the fields weights.layouts.deepseek_v4.v4_config reads): layer 0 sliding,
        1 csa, 2 hca; rope_parameters as DeepseekV4Config builds them with no rope arguments."""
        return {"model_type": "deepseek_v4", "hidden_size": self.D, "num_attention_heads": self.N,
                "head_dim": self.H, "partial_rotary_factor": self.R / self.H, "q_lora_rank": self.Qr,
                "o_groups": self.G, "o_lora_rank": self.Or, "rms_norm_eps": 1e-6, "sliding_window": self.W,
                "attention_bias": False,
                "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                "compress_rates": {"compressed_sparse_attention": self.csa_m,
                                   "heavily_compressed_attention": self.hca_m},
                "index_n_heads": self.I, "index_head_dim": self.J, "index_topk": self.k,
                "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                                    "compress": {"rope_type": "default", "rope_theta": 160000.0}}}


# transformers 5.23.0 configuration_deepseek_v4.py:128-161 (DeepseekV4Config's defaults)
FULL = Dims(D=4096, N=64, H=512, R=64, Qr=1024, G=8, Or=1024, W=128, csa_m=4, hca_m=128, I=64, J=128, k=512)
# --quick: the tests' sizes; P 16 ... 64 closes csa and hca windows and csa's top 2 drops entries
QUICK = Dims(D=32, N=4, H=16, R=8, Qr=12, G=2, Or=8, W=6, csa_m=4, hca_m=8, I=2, J=8, k=2)


def dims(quick: bool) -> Dims:
    return QUICK if quick else FULL


def configs(d: Dims) -> dict:
    """kind -> AttentionConfig: csa, hca and sliding read from d.hf_config() by the hf-deepseek reader; dense the
    sliding layer with a window of DENSE_WINDOW keys."""
    from weights.layouts.deepseek_v4 import v4_config

    hf = d.hf_config()
    out = {"csa": v4_config(hf, 1), "hca": v4_config(hf, 2), "sliding": v4_config(hf, 0)}
    out["dense"] = out["sliding"].replace(window_left=DENSE_WINDOW - 1)
    return out


def layers(d: Dims) -> dict:
    """kind -> (config, tensors float32). csa's tensors are drawn (seed 0); hca takes csa's shared tensors and
    draws its own compressor's (seed 1); sliding and dense take the shared ones: one copy of the common weights."""
    import weights

    by_kind = configs(d)
    csa = weights.init(by_kind["csa"], seed=0, dtype="float32")
    hca_own = weights.init(by_kind["hca"], seed=1, dtype="float32")
    out = {}
    for kind, config in by_kind.items():
        names = config.tensor_shapes()
        out[kind] = (config, {n: (hca_own[n] if kind == "hca" and n.startswith("compressor.") else csa[n])
                              for n in names})
    return out


# --- the bounds ----------------------------------------------------------------------------------------------------


def entries_seen(d: Dims, kind: str, P: int) -> int:
    """Entries visible to the query at position P: windows closed by then, (P + 1) // m."""
    return 0 if kind in ("sliding", "dense") else (P + 1) // (d.csa_m if kind == "csa" else d.hca_m)


def bounds(d: Dims, kind: str, P: int, weight_bytes: int, kernel_elements: int) -> dict:
    """{"bytes": one read of what the step must read, "flops": its FLOPs}, float32.

    bytes: the kind's weights, and of its cache: the keys in the window (min(P, W - 1): the new token's own is
    computed), hca every visible entry (H each), csa the k entries its indexer keeps (H each) and every index
    entry (J each: all are scored); the compressors' open windows and overlap halves only where the step closes
    a window ((P + 1) % m == 0: a step that closes none only appends its token's projections).
    flops: 2 per kernel element (one token through every projection); the logits and the context, 4 N H per
    key attended (the window's min(P + 1, W) keys, hca's visible entries, csa's k kept ones); csa's indexer,
    2 I (J + 1) per index entry (its dots and the weighted sum over heads; the top-k's compares are not FLOPs).
    Not counted: norms, RoPE, softmax, a closing window's pooling (m slots per feature)."""
    H, W, J = d.H, d.W, d.J
    window_keys = min(P, W - 1) if kind != "dense" else P
    nbytes, attended = weight_bytes + 4 * window_keys * H, min(P + 1, W) if kind != "dense" else P + 1
    E = entries_seen(d, kind, P)
    flops = 2 * kernel_elements
    if kind == "hca":
        nbytes += 4 * E * H
        attended += E
    if kind == "csa":
        kept = min(d.k, E)
        nbytes += 4 * (kept * H + E * J)
        attended += kept
        flops += 2 * d.I * E * (J + 1)
    if kind in ("csa", "hca"):
        m = d.csa_m if kind == "csa" else d.hca_m
        if (P + 1) % m == 0:  # the step closes a window: it reads the buffered tokens (and the overlap half)
            widths = [H, J] if kind == "csa" else [H]
            slots = 2 if kind == "csa" else 1
            nbytes += 4 * sum((m - 1) * 2 * slots * w + (2 * m * w if kind == "csa" and P >= m else 0)
                              for w in widths)
    return {"bytes": nbytes, "flops": flops + 4 * d.N * H * attended}


# --- the inputs ----------------------------------------------------------------------------------------------------


def cache(config, d: Dims, P: int, seed: int) -> dict:
    """A cache of P tokens for `config` (impl_numpy.compressed.cache_shapes), float32 normals."""
    from impl_numpy.compressed import cache_shapes

    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in cache_shapes(config, d.B, P).items()}


def inputs(d: Dims, layer: dict, P: int) -> dict:
    """x (B, 1, D) and each kind's past cache after P tokens (the dense one: the P keys)."""
    rng = np.random.default_rng(3)
    return {"x": rng.standard_normal((d.B, 1, d.D), dtype=np.float32),
            "past": {kind: cache(layer[kind][0], d, P, seed) for seed, kind in enumerate(KINDS, start=4)}}


def cache_bytes(present: dict) -> int:
    """Bytes of a cache (a dict of arrays the backend returned, converted to NumPy)."""
    return sum(np.asarray(a).nbytes for a in present.values())


# --- each backend's calls: kind -> a callable running the step once, synchronised, returning (out, present) --------


def buffers(layer, data, P, kind) -> dict:
    """kind's in-place buffers (impl_numpy.compressed.buffer_shapes) for P + 1 tokens, holding data's cache of P
    (to_buffers): the step writes its token at P. Repeated steps write the same rows (the same token at the same
    position) and read as many; only the ring's slot P % (W - 1), read as the key at P - W + 1, then holds the
    key at P: the values change, not the step's work."""
    from impl_numpy.compressed import to_buffers

    return to_buffers(layer[kind][0], data["past"][kind], P, P + 1)


def numpy_paths(layer, data, P, in_place=True):
    from impl_numpy.compressed import compressed_attention

    x, at = data["x"], np.array([P])
    paths = {kind: functools.partial(compressed_attention, config, tensors, x, at,
                                     buffers(layer, data, P, kind) if in_place else data["past"][kind],
                                     return_cache=True, in_place=in_place) for kind, (config, tensors) in layer.items()}
    arrays = [*data["past"]["dense"].values(), *layer["csa"][1].values(), *_own(layer, "hca")]
    paths["read"] = lambda: [np.sum(a) for a in arrays]
    return paths


def _own(layer, kind):
    """kind's tensors that csa's do not hold (hca's compressor)."""
    return [t for n, t in layer[kind][1].items() if t is not layer["csa"][1].get(n)]


def torch_paths(layer, data, P, in_place=True):
    import torch

    from impl_torch.compressed import compressed_attention

    held = {id(a): torch.from_numpy(a) for _, t in layer.values() for a in t.values()}  # one tensor per array
    x, at = torch.from_numpy(data["x"]), np.array([P])

    def step(kind):
        config, tensors = layer[kind]
        t = {n: held[id(a)] for n, a in tensors.items()}
        past = {n: torch.from_numpy(a) for n, a in (buffers(layer, data, P, kind) if in_place
                                                     else data["past"][kind]).items()}

        def call():
            with torch.no_grad():
                return compressed_attention(config, t, x, at, past, return_cache=True, in_place=in_place)
        return call

    paths = {kind: step(kind) for kind in layer}
    arrays = [torch.from_numpy(a) for a in data["past"]["dense"].values()] + list(held.values())
    paths["read"] = lambda: [torch.sum(a) for a in arrays]
    return paths


def jax_paths(layer, data, P, in_place=True):
    """layer() (the computation on checked arrays) under one jax.jit per kind and P, XLA's default options:
    the public call's jit= builds a new program per call, eager compiles each op. In place: the buffers donated
    (XLA writes them in place), each step handed the buffers the last one returned."""
    import jax
    import jax.numpy as jnp

    from impl_jax.compressed import layer as v4_layer

    dev = jax.devices("cpu")[0]
    held = {id(a): jax.device_put(a, dev) for _, t in layer.values() for a in t.values()}
    x = jax.device_put(data["x"], dev)

    def step(kind):
        config, tensors = layer[kind]
        t = {n: held[id(a)] for n, a in tensors.items()}
        state = {"past": jax.device_put(buffers(layer, data, P, kind) if in_place else data["past"][kind], dev)}
        run = jax.jit(functools.partial(v4_layer, config, p0=P, return_cache=True, return_selection=False,
                                        in_place=in_place), donate_argnums=(2,) if in_place else ())

        def call():
            out = jax.block_until_ready(run(t, x, state["past"]))
            if in_place:
                state["past"] = out[1]
            return out
        return call

    paths = {kind: step(kind) for kind in layer}
    arrays = [jax.device_put(a, dev) for a in data["past"]["dense"].values()] + list(held.values())
    sums = jax.jit(lambda arrays: [jnp.sum(a) for a in arrays])
    paths["read"] = lambda: jax.block_until_ready(sums(arrays))
    return paths


def mlx_paths(layer, data, P, in_place=True):
    """The public call, eager (lazy graph, evaluated): it converts its tensors on every call (np.asarray, then
    to_mx), a copy of the weights each way."""
    import mlx.core as mx

    from impl_mlx.compressed import compressed_attention
    from impl_mlx.convert import to_mx

    held = {id(a): to_mx(a) for _, t in layer.values() for a in t.values()}
    x, at = to_mx(data["x"]), np.array([P])

    def step(kind):
        config, tensors = layer[kind]
        t = {n: held[id(a)] for n, a in tensors.items()}
        past = {n: to_mx(a) for n, a in (buffers(layer, data, P, kind) if in_place else data["past"][kind]).items()}

        def call():
            out = compressed_attention(config, t, x, at, past, return_cache=True, in_place=in_place)
            mx.eval(out)
            return out
        return call

    paths = {kind: step(kind) for kind in layer}
    arrays = [to_mx(a) for a in data["past"]["dense"].values()] + list(held.values())

    def read():
        sums = [mx.sum(a) for a in arrays]
        mx.eval(sums)
        return sums

    paths["read"] = read
    return paths


def tf_paths(layer, data, P, in_place=True):
    """layer() (the computation on checked tensors) in one tf.function per kind and P (Keras on TensorFlow). In
    place: the buffers tf.Variables the function captures (layer's buffers=), the step's rows written where they
    lie by XLA (impl_tf.tf_only.write_rows), the variables themselves the present cache (as the public call's)."""
    from impl_tf._keras import tf
    from impl_tf.compressed import layer as v4_layer

    with tf.device("/CPU:0"):
        held = {id(a): tf.constant(a) for _, t in layer.values() for a in t.values()}
        x = tf.constant(data["x"])
        pasts = {kind: {n: tf.Variable(a) if in_place else tf.constant(a)
                        for n, a in (buffers(layer, data, P, kind) if in_place else data["past"][kind]).items()}
                 for kind in layer}
        dense_arrays = [tf.constant(a) for a in data["past"]["dense"].values()]

    def step(kind):
        config, tensors = layer[kind]
        t = {n: held[id(a)] for n, a in tensors.items()}
        if in_place:  # the function returns the output alone: a variable returned would be read out as a tensor
            written = pasts[kind]
            run = tf.function(lambda tt, xx: v4_layer(config, tt, xx, None, p0=P, return_cache=True,
                                                      return_selection=False, buffers=written)[0])
            return lambda: (run(t, x), written)
        run = tf.function(functools.partial(v4_layer, config, p0=P, return_cache=True, return_selection=False))
        return lambda: run(t, x, pasts[kind])

    paths = {kind: step(kind) for kind in layer}
    arrays = dense_arrays + list(held.values())
    sums = tf.function(lambda arrays: [tf.reduce_sum(a) for a in arrays])  # arguments: captured constants would fold
    paths["read"] = lambda: sums(arrays)
    return paths


BUILDERS = {"numpy": numpy_paths, "torch": torch_paths, "jax": jax_paths, "mlx": mlx_paths, "tf": tf_paths}
NOTES = {"numpy": "compressed_attention in place (the public call: validates the tensors every call); np.sum",
         "torch": "compressed_attention in place under no_grad (validates the tensors every call); torch.sum",
         "jax": "compressed.layer in place under jax.jit (XLA's default options, the buffers donated), one program "
                "per kind and P; jnp.sum jitted",
         "mlx": "compressed_attention in place, mx.eval (converts and validates "
                "the tensors every call); mx.sum",
         "tf": "compressed.layer in place in tf.function (Keras on TensorFlow; the buffers tf.Variables written "
               "by XLA), one per kind and P; tf.reduce_sum"}


# --- one backend, in a process of its own -------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _present_bytes(runner, result) -> int:
    _, present = result
    return cache_bytes({n: runner.to_numpy(a) for n, a in present.items()})


def run_worker(spec: dict) -> dict:
    from conformance.bench.measure import MATMUL, measure_paired
    from conformance.bench.runners import RUNNERS

    backend = spec["backend"]
    d = Dims(**spec["dims"])
    started = time.perf_counter()
    if backend not in BUILDERS:
        return {"backend": backend, "status": f"unavailable: no v4 family runner for {backend}"}
    try:
        runner = RUNNERS[backend]("cpu", spec["quick"], "float32")
    except Exception as err:  # noqa: BLE001 - any failure to import or set up means 'unavailable'
        return {"backend": backend, "status": f"unavailable: {type(err).__name__}: {err}".splitlines()[0]}
    layer = layers(d)
    weight_bytes = {kind: sum(t.nbytes for t in tensors.values()) for kind, (_, tensors) in layer.items()}
    all_weights = weight_bytes["csa"] + sum(t.nbytes for t in _own(layer, "hca"))
    rows = []
    for P in spec["lengths"]:
        data = inputs(d, layer, P)
        try:
            calls = BUILDERS[backend](layer, data, P)
        except Exception as err:  # noqa: BLE001 - reported in the backend's rows
            rows += [{"backend": backend, "P": P, "path": name, "status": f"failed: setting up: "
                      f"{type(err).__name__}: {err}"[:300]} for name in PATHS]
            continue
        measured = measure_paired(calls, runner.matmul(spec["matmul_n"]), repeats=spec["repeats"],
                                  max_seconds=spec["max_seconds"])
        mm = measured.pop(MATMUL)
        for name in PATHS:
            row = {"backend": backend, "P": P, "path": name, "status": "ok", "matmul_median_s": mm["median_s"]}
            m = measured[name]
            if isinstance(m, Exception):
                row["status"] = f"failed: {type(m).__name__}: {m}".splitlines()[0][:300]
                rows.append(row)
                continue
            row.update({k: m[k] for k in ("median_s", "min_s", "max_s", "repeats", "first_call_s", "matmul_ratio")})
            if name == "read":
                row["bytes_read"] = sum(a.nbytes for a in data["past"]["dense"].values()) + all_weights
            else:
                try:
                    row["cache_bytes"] = _present_bytes(runner, calls[name]())
                    row["past_cache_bytes"] = cache_bytes(data["past"][name])
                    row["weight_bytes"] = weight_bytes[name]
                except Exception as err:  # noqa: BLE001
                    row["status"] = f"failed: {type(err).__name__}: {err}".splitlines()[0][:300]
            rows.append(row)
            _log(f"  {backend:5} v4 P={P:<6} {name:8} " + (
                f"{row['median_s'] * 1e3:10.2f} ms" if row["status"] == "ok" else row["status"]))
        del calls, measured, data
        gc.collect()
    kernels = {kind: sum(t.size for n, t in tensors.items() if n.endswith("kernel"))
               for kind, (_, tensors) in layer.items()}
    return {"backend": backend, "status": "ok", "info": runner.info, "note": NOTES[backend], "rows": rows,
            "weight_bytes": weight_bytes, "kernel_elements": kernels, "worker_s": time.perf_counter() - started}


def judge(record: dict) -> None:
    """Every ok step row gets its bytes, flops, x_bound (from the read row and the matmul of the same backend
    and P), its cache bytes per token of history and its ratio to the dense step (paired ratios)."""
    d = Dims(**record["dims"])
    by = {(r["backend"], r["P"], r["path"]): r for r in record["rows"]}
    for r in record["rows"]:
        if r["path"] == "read" or r["status"] != "ok":
            continue
        info = record["backends"][r["backend"]]
        b = bounds(d, r["path"], r["P"], info["weight_bytes"][r["path"]], info["kernel_elements"][r["path"]])
        r.update(b)
        r["bytes_per_token"] = r["cache_bytes"] / (r["P"] + 1)
        read, dense = by.get((r["backend"], r["P"], "read")), by.get((r["backend"], r["P"], "dense"))
        if read is not None and read["status"] == "ok":
            r.update(x_bound(r["matmul_ratio"], read["matmul_ratio"], read["bytes_read"], b["bytes"], b["flops"],
                             record["matmul_n"]))
        if dense is not None and dense["status"] == "ok" and "cache_bytes" in dense:
            r["x_dense"] = r["matmul_ratio"] / dense["matmul_ratio"]
            r["cache_x_dense"] = r["cache_bytes"] / dense["cache_bytes"]
    for r in record["rows"]:
        if r["path"] == "read" and r["status"] == "ok":
            r["read_GBps"] = r["bytes_read"] / r["median_s"] / 1e9
            r["matmul_GFLOPs"] = 2 * record["matmul_n"] ** 3 / r["matmul_median_s"] / 1e9


def run(backends, *, quick: bool, lengths, repeats: int, max_seconds: float, matmul_n: int) -> dict:
    d = dims(quick)
    spec = {"dims": dataclasses.asdict(d), "lengths": list(lengths), "quick": quick, "repeats": repeats,
            "max_seconds": max_seconds, "matmul_n": matmul_n}
    record = {"family": FAMILY, "quick": quick, "dims": dataclasses.asdict(d), "lengths": list(lengths),
              "matmul_n": matmul_n, "backends": {}, "rows": []}
    for backend in backends:
        _log(f"{backend}: v4 family, P {', '.join(map(str, lengths))} ...")
        out = run_worker_process("conformance.bench.v4", backend, spec) if backend in BUILDERS else {
            "backend": backend, "status": f"unavailable: no v4 family runner for {backend}"}
        record["backends"][backend] = {k: out.get(k) for k in ("status", "info", "note", "worker_s", "weight_bytes",
                                                               "kernel_elements")}
        record["rows"] += out.get("rows", [])
    judge(record)
    return record


def print_family(console, record: dict) -> None:
    """Per backend and P: each kind's ms, x the dense step (paired) and x its bound; then per P each kind's cache
    bytes per token of history and its share of the dense cache's."""
    from rich.table import Table

    d = record["dims"]
    title = (f"{FAMILY}: DeepSeek V4 decode step (N {d['N']}, one kv head of H {d['H']}, W {d['W']}; csa m "
             f"{d['csa_m']} k {d['k']}, hca m {d['hca_m']}) against dense MQA over the same history, float32: ms median "
             "(min) / x dense / x its bound (r: read-bound, f: flops-bound), paired" + (" --quick" if record["quick"] else ""))
    table = Table(title=title)
    for col in ("backend", "P", *KINDS, "read GB/s", "matmul GFLOP/s"):
        table.add_column(col, justify="right")
    by = {(r["backend"], r["P"], r["path"]): r for r in record["rows"]}
    for b, info in record["backends"].items():
        if info["status"] != "ok":
            console.print(f"[yellow]{FAMILY} {b}: {info['status']}[/]")
            continue
        for P in record["lengths"]:
            cells = []
            for name in KINDS:
                r = by.get((b, P, name))
                if r is None or r["status"] != "ok":
                    cells.append("-" if r is None else r["status"].split(":")[0])
                    continue
                parts = [f"{r['median_s'] * 1e3:.3g} ({r['min_s'] * 1e3:.3g})"]
                if name != "dense":
                    parts.append(f"{r['x_dense']:.2f}x" if "x_dense" in r else "-")
                if "x_bound" in r:
                    parts.append(f"{r['x_bound']:.1f}x {r['bound'][0]}")
                cells.append(" / ".join(parts))
            read = by.get((b, P, "read"), {})
            cells += [f"{read['read_GBps']:.1f}" if "read_GBps" in read else "-",
                      f"{read['matmul_GFLOPs']:.0f}" if "matmul_GFLOPs" in read else "-"]
            table.add_row(b, str(P), *cells)
    console.print(table)
    sizes = Table(title=f"{FAMILY}: cache bytes per token of history (the present cache the step returned / (P + 1)), "
                        "and x the dense cache")
    for col in ("P", *KINDS):
        sizes.add_column(col, justify="right")
    for P in record["lengths"]:
        r = {name: next((x for x in record["rows"] if x["P"] == P and x["path"] == name and "bytes_per_token" in x),
                        None) for name in KINDS}
        sizes.add_row(str(P), *[("-" if r[n] is None else f"{r[n]['bytes_per_token']:.1f}"
                                 + (f" ({r[n]['cache_x_dense']:.3f}x)" if "cache_x_dense" in r[n] and n != "dense"
                                    else "")) for n in KINDS])
    console.print(sizes)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.bench.v4")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.worker[0]).read_text())
    Path(args.worker[1]).write_text(json.dumps(run_worker(spec)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
