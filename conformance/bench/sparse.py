"""`mha bench --shapes sparse`: a DSA (DeepSeek V3.2) decode step, each part judged against its own bound.

The layer: the latent family's MLA layer (conformance/bench/latent.py: N 16, C 512, R 64, nope 128, V 128, D
2048, float32, B 1) with a lightning indexer of DeepSeek V3.2's sizes (I 64 index heads, J 128, RoPE on the
first 64 features, LayerNorm on the key, head weights, ReLU; k 2048 selected keys). The index query is taken
from the query input (`query_source: "input"`): the family's layer has no query latent (query_rank None,
as the latent family's), which moves the index query's projection from 1536 to 2048 inputs, a
negligible part of the step. One new token after a cache of P tokens, P 8192 ... 131072 (64k and 128k
opt-in: --sparse-max). Per P and backend, each in a worker process of its own:

  dense     the absorbed latent step over the whole cache: the backend's public call, in-place latent cache
            (cache_length=P): every key attended
  sparse    the same call given topk_indices (B, 1, k): k keys of the P + 1 drawn at random (the new token's
            among them), the attention over the selected keys alone: what the step costs once the indexer
            has chosen (the attention part of a DSA step)
  indexer   the backend's lightning_indexer (impl_*/indexer.py) over the whole index cache (B, P, J) and the
            new token: its scores for every key and the top k (the other part of a DSA step); in place
            (cache_length, index_buffer): every indexer but MLX's takes it (NumPy, torch, JAX, tf)
  read      one read of the latent cache (np.sum / torch.sum / jnp.sum / tf.reduce_sum / mx.sum over its buffers
            and every weight): the machine's read bandwidth, measured in the same run

Each step is judged against its own physical bound (bounds()): max(bytes / read bandwidth, flops / matmul
rate), the bytes being one read of what the step must read and the flops its own, the bandwidth that of the
read path and the matmul rate that of the backend's 2048^3 float32 matmul, all in the same run, paired
(measure_paired: every time is a ratio to the matmul run just before it, so the shared VM's drift cancels).
The figure is `x bound`: the step's time over its bound (1 = at the bound). No target is judged (see
docs/performance.md: the issue's 2x at P >= 64k is reported, not passed or failed, as the family's sizes
above 32k are opt-in on this VM).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

from conformance.bench.child import run_worker_process
from conformance.bench.latent import FULL as LATENT_FULL
from conformance.bench.latent import QUICK as LATENT_QUICK
from conformance.bench.latent import Dims

FAMILY = "sparse"
SPARSE_LENGTHS = (8192, 16384, 32768, 65536, 131072)
DEFAULT_MAX = 32768  # 64k and 128k opt-in (--sparse-max): on the shared 2-core VM they take minutes per backend
QUICK_SPARSE_LENGTHS = (16, 32, 64)
PATHS = ("dense", "sparse", "indexer", "read")
BACKENDS = ("numpy", "torch", "tf", "jax", "mlx")


@dataclasses.dataclass(frozen=True)
class Index:
    I: int  # index heads
    J: int  # index head_dim
    rotary: int  # features that turn (the first ones)
    k: int  # keys selected per query

    def weight_bytes(self, D: int) -> int:
        """float32 bytes of the indexer's tensors: the query (D, I, J), key (D, J), the key's LayerNorm (2 J),
        the head weights (D, I)."""
        return 4 * (D * self.I * self.J + D * self.J + 2 * self.J + D * self.I)


FULL_INDEX = Index(I=64, J=128, rotary=64, k=2048)
QUICK_INDEX = Index(I=4, J=8, rotary=4, k=8)


def dims(quick: bool) -> tuple[Dims, Index]:
    return (LATENT_QUICK, QUICK_INDEX) if quick else (LATENT_FULL, FULL_INDEX)


def layer(d: Dims, ix: Index):
    """(config, tensors float32): the latent family's layer with the indexer, seeded."""
    import weights

    config = weights.AttentionConfig(
        num_heads=d.N, query_dim=d.D, head_dim=d.H, value_head_dim=d.V, use_query_bias=False,
        use_key_bias=False, use_value_bias=False, use_output_bias=False, rope={"theta": 10000.0},
        latent={"query_rank": None, "kv_rank": d.C, "rope_dim": d.R},
        indexer={"heads": ix.I, "head_dim": ix.J, "topk": ix.k, "query_source": "input",
                 "key_norm": {"type": "layer"}, "rope": {"rotary_dim": ix.rotary, "theta": 10000.0}})
    return config, weights.init(config, seed=0, dtype="float32")


def attention_config(config):
    """The same layer without its indexer: the dense and sparse steps' config (the selection is an input)."""
    return config.replace(indexer=None)


# --- the bounds ----------------------------------------------------------------------------------------------------


def bounds(d: Dims, ix: Index, P: int) -> dict:
    """path -> {"bytes": one read of what the step must read, "flops": its FLOPs}, float32, B = d.B.

    dense    the latent cache's P rows (C + R values each) and the attention's weights; absorbed FLOPs over
             the P + 1 keys (Dims.absorbed_flops)
    sparse   the k selected rows of the cache, the k indices (int64) and the attention's weights; absorbed
             FLOPs over k keys
    indexer  the index cache's P rows (J values each) and the indexer's weights; the index query (D -> I J),
             key (D -> J) and head weights (D -> I) projections, every head's q.k over P + 1 keys and the
             weighted sum over heads (the top-k itself is not counted: it is compares, not FLOPs)"""
    B, D = d.B, d.D
    attention_weights = 4 * (D * d.N * d.H + D * (d.C + d.R) + d.C + d.C * d.N * d.nope + d.C * d.N * d.V
                             + d.N * d.V * D)
    k = min(ix.k, P + 1)
    return {
        "dense": {"bytes": B * P * (d.C + d.R) * 4 + attention_weights, "flops": d.absorbed_flops(P)},
        "sparse": {"bytes": B * k * ((d.C + d.R) * 4 + 8) + attention_weights, "flops": d.absorbed_flops(k - 1)},
        "indexer": {"bytes": B * P * ix.J * 4 + ix.weight_bytes(D),
                    "flops": 2 * B * (D * ix.I * ix.J + D * ix.J + D * ix.I) + 2 * B * ix.I * (P + 1) * (ix.J + 1)},
    }


def x_bound(step_ratio: float, read_ratio: float, read_bytes: int, nbytes: int, flops: int, matmul_n: int) -> dict:
    """A step against its bound, from paired ratios (each a time over the matmul run just before it).

    The read bandwidth is read_bytes / t_read, the matmul rate 2 n^3 / t_matmul; the step's bound time is
    max(nbytes / bandwidth, flops / rate), so the step over its bound is min(over_read, over_flops) with
    over_read = (t / t_read) (read_bytes / nbytes) and over_flops = (t / t_matmul) (2 n^3 / flops)."""
    over_read = step_ratio / read_ratio * read_bytes / nbytes
    over_flops = step_ratio * 2 * matmul_n ** 3 / flops
    return {"over_read": over_read, "over_flops": over_flops, "x_bound": min(over_read, over_flops),
            "bound": "read" if over_read <= over_flops else "flops"}


# --- the inputs ----------------------------------------------------------------------------------------------------


def inputs(d: Dims, ix: Index, P: int) -> dict:
    """x (B, 1, D), the latent cache (B, 1, P, C) and (B, 1, P, R), the index cache (B, P, J), the selection
    (B, 1, k) int64: k of the P + 1 keys (the new one, P, always among them: a DSA query selects itself),
    sorted."""
    rng = np.random.default_rng(3)
    k = min(ix.k, P + 1)
    chosen = np.sort(np.concatenate([rng.choice(P, size=k - 1, replace=False), [P]]))
    return {"x": rng.standard_normal((d.B, 1, d.D), dtype=np.float32),
            "latent": rng.standard_normal((d.B, 1, P, d.C), dtype=np.float32),
            "rotary": rng.standard_normal((d.B, 1, P, d.R), dtype=np.float32),
            "index_keys": rng.standard_normal((d.B, P, ix.J), dtype=np.float32),
            "topk": np.broadcast_to(chosen, (d.B, 1, k)).astype(np.int64)}


def reference(config, tensors, data: dict, topk) -> np.ndarray:
    """impl_numpy's float64 call over the latent cache (given the selection, or dense)."""
    from impl_numpy.attention import multi_head_attention

    return np.asarray(multi_head_attention(attention_config(config), _split(tensors)[0], data["x"], past_key=data["latent"],
                                           past_value=data["rotary"], topk_indices=topk, is_causal=True,
                                           causal_alignment="bottom_right", dtype="float64"))


IN_PLACE = dict(is_causal=True, causal_alignment="bottom_right")


def _split(tensors: dict) -> tuple[dict, dict]:
    return ({k: v for k, v in tensors.items() if not k.startswith("indexer.")},
            {k: v for k, v in tensors.items() if k.startswith("indexer.")})


def index_buffer(keys: np.ndarray) -> np.ndarray:
    """The in-place index cache (the indexers that take cache_length: NumPy's, torch's, tf's): capacity P + 1, the
    first P rows the cached index keys, the last the step's own (each timed call writes it again, the same
    values), as latent_buffers does for the latent cache."""
    B, P, J = keys.shape
    buffer = np.zeros((B, P + 1, J), keys.dtype)
    buffer[:, :P] = keys
    return buffer


def numpy_paths(config, tensors, data, P):
    from conformance.bench.frameworks.latent import latent_buffers
    from impl_numpy.attention import multi_head_attention
    from impl_numpy.indexer import lightning_indexer
    from weights import CheckedTensors

    ac = attention_config(config)
    # checked once, as impl_numpy's layer holds them (torch's call never reads weight values): a step reads its
    # weights once, for the projections
    att = CheckedTensors(ac, _split(tensors)[0])
    bk, bv = latent_buffers(data["latent"], data["rotary"])
    x, topk, keys = data["x"], data["topk"], index_buffer(data["index_keys"])
    weights = list(att.values())
    return {"dense": lambda: multi_head_attention(ac, att, x, past_key=bk, past_value=bv, cache_length=P, **IN_PLACE),
            "sparse": lambda: multi_head_attention(ac, att, x, past_key=bk, past_value=bv, cache_length=P,
                                                   topk_indices=topk, **IN_PLACE),
            "indexer": lambda: lightning_indexer(config, tensors, x, past_index_keys=keys,
                                                 cache_length=P)["topk_indices"],
            "read": lambda: [np.sum(a) for a in (bk[:, :, :P], bv[:, :, :P], *weights)]}


def torch_paths(config, tensors, data, P):
    import torch

    from conformance.bench.frameworks.latent import latent_buffers
    from impl_torch.attention import multi_head_attention
    from impl_torch.indexer import lightning_indexer

    ac = attention_config(config)
    t = {k: torch.from_numpy(v) for k, v in tensors.items()}
    att, _ = _split(t)
    x, topk = (torch.from_numpy(np.ascontiguousarray(data[n])) for n in ("x", "topk"))
    keys = torch.from_numpy(index_buffer(data["index_keys"]))  # in place (cache_length)
    bk, bv = (torch.from_numpy(a) for a in latent_buffers(data["latent"], data["rotary"]))
    weights = list(att.values())

    def step(selection):
        def call():
            with torch.no_grad():
                return multi_head_attention(ac, att, x, past_key=bk, past_value=bv, cache_length=P, use_sdpa=True,
                                            topk_indices=selection, **IN_PLACE)
        return call

    def indexer():
        with torch.no_grad():
            return lightning_indexer(config, t, x, past_index_keys=keys, cache_length=P)["topk_indices"]

    return {"dense": step(None), "sparse": step(topk), "indexer": indexer,
            "read": lambda: [torch.sum(a) for a in (bk[:, :, :P], bv[:, :, :P], *weights)]}


def jax_paths(config, tensors, data, P):
    import jax
    import jax.numpy as jnp

    from conformance.bench.frameworks.latent import latent_buffers
    from impl_jax.attention import apply
    from impl_jax.indexer import lightning_indexer

    ac = attention_config(config)
    dev = jax.devices("cpu")[0]
    p = jax.device_put(tensors, dev)
    att, _ = _split(p)
    x, topk = (jax.device_put(data[n], dev) for n in ("x", "topk"))
    index = [jax.device_put(index_buffer(data["index_keys"]), dev)]  # donated by each call: the next reads its result
    # dense: cache_length traced (as the latent family's); sparse: a Python int (impl_jax refuses topk_indices
    # with a traced cache_length: the selection's width is sized by P + S)
    dense = jax.jit(lambda pp, inp, k, v, length: apply(ac, pp, inp, past_key=k, past_value=v, cache_length=length,
                                                        return_cache=True, **IN_PLACE), donate_argnums=(2, 3))
    sparse = jax.jit(lambda pp, inp, k, v, sel: apply(ac, pp, inp, past_key=k, past_value=v, cache_length=P,
                                                      topk_indices=sel, return_cache=True, **IN_PLACE),
                     donate_argnums=(2, 3))
    held = list(jax.device_put(latent_buffers(data["latent"], data["rotary"]), dev))
    length = jnp.int32(P)

    def step(selection):
        def call():
            if selection is None:
                out, held[0], held[1] = dense(att, x, held[0], held[1], length)
            else:
                out, held[0], held[1] = sparse(att, x, held[0], held[1], selection)
            return jax.block_until_ready(out)
        return call

    def indexer():
        result = lightning_indexer(config, p, x, past_index_keys=index[0], cache_length=P)
        index[0] = result["present_index_keys"]
        return jax.block_until_ready(result["topk_indices"])

    sums = jax.jit(lambda arrays: [jnp.sum(a) for a in arrays])
    weights = list(att.values())
    return {"dense": step(None), "sparse": step(topk), "indexer": indexer,
            "read": lambda: jax.block_until_ready(sums([held[0], held[1], *weights]))}


def tf_paths(config, tensors, data, P):
    from conformance.bench.frameworks.latent import latent_buffers
    from impl_tf._keras import tf
    from impl_tf.attention import multi_head_attention
    from impl_tf.indexer import lightning_indexer

    ac = attention_config(config)
    with tf.device("/CPU:0"):
        t = {k: tf.constant(v) for k, v in tensors.items()}
        x, topk = (tf.constant(data[n]) for n in ("x", "topk"))
        keys = tf.Variable(index_buffer(data["index_keys"]))  # in place (cache_length)
        bk, bv = (tf.Variable(a) for a in latent_buffers(data["latent"], data["rotary"]))
    att, _ = _split(t)
    weights = list(att.values())
    dense = tf.function(lambda inp, tt: multi_head_attention(ac, tt, inp, past_key=bk, past_value=bv,
                                                             cache_length=P, **IN_PLACE))
    sparse = tf.function(lambda inp, tt, sel: multi_head_attention(ac, tt, inp, past_key=bk, past_value=bv,
                                                                   cache_length=P, topk_indices=sel, **IN_PLACE))
    read = tf.function(lambda: [tf.reduce_sum(a) for a in (bk, bv, *weights)])
    return {"dense": lambda: dense(x, att), "sparse": lambda: sparse(x, att, topk),
            "indexer": lambda: lightning_indexer(config, t, x, past_index_keys=keys, cache_length=P)["topk_indices"],
            "read": read}


def mlx_paths(config, tensors, data, P):
    """impl_mlx's calls, eager (MLX is lazy: each call ends in mx.eval, as the runner's timed calls do): the
    fused path (mx.fast.scaled_dot_product_attention) over the in-place buffers (mx.arrays written by slice
    assignment), given the selection or not; the indexer; mx.sum over the buffers and every weight."""
    import mlx.core as mx

    from conformance.bench.frameworks.latent import latent_buffers
    from impl_mlx.attention import multi_head_attention
    from impl_mlx.indexer import lightning_indexer

    ac = attention_config(config)
    t = {k: mx.array(v) for k, v in tensors.items()}
    att, _ = _split(t)
    x, topk, keys = (mx.array(data[n]) for n in ("x", "topk", "index_keys"))
    bk, bv = (mx.array(a) for a in latent_buffers(data["latent"], data["rotary"]))
    mx.eval(t, x, topk, keys, bk, bv)
    weights = list(att.values())

    def evaluated(f):
        def call():
            out = f()
            mx.eval(out)
            return out
        return call

    def step(selection):
        return evaluated(lambda: multi_head_attention(ac, att, x, past_key=bk, past_value=bv, cache_length=P,
                                                      topk_indices=selection, **IN_PLACE))

    return {"dense": step(None), "sparse": step(topk),
            "indexer": evaluated(lambda: lightning_indexer(config, t, x, past_index_keys=keys)["topk_indices"]),
            "read": evaluated(lambda: [mx.sum(a) for a in (bk, bv, *weights)])}


BUILDERS = {"numpy": numpy_paths, "torch": torch_paths, "jax": jax_paths, "tf": tf_paths, "mlx": mlx_paths}
NOTES = {"numpy": "multi_head_attention, cache_length (fused path), CheckedTensors; impl_numpy.indexer, "
                  "cache_length; np.sum",
         "torch": "multi_head_attention, cache_length, use_sdpa; impl_torch.indexer (eager), cache_length; torch.sum",
         "jax": "apply under jax.jit, buffers donated; impl_jax.indexer, cache_length (jitted inside, buffer donated); "
                "jnp.sum under jax.jit",
         "tf": "multi_head_attention in tf.function, variables; impl_tf.indexer (eager), cache_length; tf.reduce_sum",
         "mlx": "multi_head_attention (fused path), cache_length, eager, each call mx.eval'd; impl_mlx.indexer; "
                "mx.sum"}


# --- one backend, in a process of its own -------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_worker(spec: dict) -> dict:
    from conformance.bench.measure import MATMUL, measure_paired
    from conformance.bench.runners import RUNNERS

    backend = spec["backend"]
    d, ix = Dims(**spec["dims"]), Index(**spec["index"])
    started = time.perf_counter()
    try:
        runner = RUNNERS[backend]("cpu", spec["quick"], "float32")
    except Exception as err:  # noqa: BLE001 - any failure to import or set up means 'unavailable'
        return {"backend": backend, "status": f"unavailable: {type(err).__name__}: {err}".splitlines()[0]}
    if backend not in BUILDERS:
        return {"backend": backend, "status": f"unavailable: no sparse family runner for {backend}"}
    config, tensors = layer(d, ix)
    att, _ = _split(tensors)
    read_extra = sum(t.nbytes for t in att.values())
    rows = []
    for P in spec["lengths"]:
        data = inputs(d, ix, P)
        try:
            calls = BUILDERS[backend](config, tensors, data, P)
        except Exception as err:  # noqa: BLE001 - reported in the backend's rows
            rows += [{"backend": backend, "P": P, "path": name, "status": f"failed: setting up: "
                      f"{type(err).__name__}: {err}"[:300]} for name in PATHS]
            continue
        measured = measure_paired(calls, runner.matmul(spec["matmul_n"]), repeats=spec["repeats"],
                                  max_seconds=spec["max_seconds"])
        mm = measured.pop(MATMUL)
        expected = {"dense": reference(config, tensors, data, None), "sparse": reference(config, tensors, data,
                                                                                          data["topk"])}
        read_bytes = data["latent"].nbytes + data["rotary"].nbytes + read_extra
        for name in PATHS:
            row = {"backend": backend, "P": P, "path": name, "status": "ok", "matmul_median_s": mm["median_s"]}
            m = measured[name]
            if isinstance(m, Exception):
                row["status"] = f"failed: {type(m).__name__}: {m}".splitlines()[0][:300]
                rows.append(row)
                continue
            row.update({k: m[k] for k in ("median_s", "min_s", "max_s", "repeats", "first_call_s", "matmul_ratio")})
            if name in expected:
                try:
                    y = np.asarray(runner.to_numpy(calls[name]()), np.float64)
                    row["max_abs_diff"] = float(np.abs(y - expected[name]).max())
                except Exception as err:  # noqa: BLE001
                    row["status"] = f"failed: {type(err).__name__}: {err}".splitlines()[0][:300]
            if name == "read":
                row["bytes_read"] = read_bytes
            rows.append(row)
            _log(f"  {backend:5} sparse P={P:<6} {name:8} " + (
                f"{row['median_s'] * 1e3:10.2f} ms" if row["status"] == "ok" else row["status"]))
        del calls, measured, data
        gc.collect()
    return {"backend": backend, "status": "ok", "info": runner.info, "note": NOTES[backend], "rows": rows,
            "worker_s": time.perf_counter() - started}


def judge(record: dict) -> None:
    """Every ok row of dense, sparse and indexer gets its bytes, flops and x_bound (from the read row and the
    matmul of the same backend and P)."""
    d, ix = Dims(**{k: v for k, v in record["dims"].items() if k != "H"}), Index(**record["index"])
    by = {(r["backend"], r["P"], r["path"]): r for r in record["rows"]}
    for r in record["rows"]:
        if r["path"] == "read" or r["status"] != "ok":
            continue
        read = by.get((r["backend"], r["P"], "read"))
        b = bounds(d, ix, r["P"])[r["path"]]
        r.update(b)
        if read is not None and read["status"] == "ok":
            r.update(x_bound(r["matmul_ratio"], read["matmul_ratio"], read["bytes_read"], b["bytes"], b["flops"],
                             record["matmul_n"]))
    for r in record["rows"]:
        if r["path"] == "read" and r["status"] == "ok":
            r["read_GBps"] = r["bytes_read"] / r["median_s"] / 1e9
            r["matmul_GFLOPs"] = 2 * record["matmul_n"] ** 3 / r["matmul_median_s"] / 1e9


def run(backends, *, quick: bool, lengths, repeats: int, max_seconds: float, matmul_n: int) -> dict:
    d, ix = dims(quick)
    spec = {"dims": dataclasses.asdict(d), "index": dataclasses.asdict(ix), "lengths": list(lengths),
            "quick": quick, "repeats": repeats, "max_seconds": max_seconds, "matmul_n": matmul_n}
    record = {"family": FAMILY, "quick": quick, "dims": d.to_dict(), "index": dataclasses.asdict(ix),
              "lengths": list(lengths), "matmul_n": matmul_n, "backends": {}, "rows": []}
    for backend in backends:
        _log(f"{backend}: sparse family, P {', '.join(map(str, lengths))} ...")
        out = run_worker_process("conformance.bench.sparse", backend, spec) if backend in BUILDERS else {
            "backend": backend, "status": f"unavailable: no sparse family runner for {backend}"}
        record["backends"][backend] = {k: out.get(k) for k in ("status", "info", "note", "worker_s")}
        record["rows"] += out.get("rows", [])
    judge(record)
    return record


def print_family(console, record: dict) -> None:
    """Per backend and P: each step's ms and x its bound (which bound binds), the read bandwidth and the
    matmul rate measured in the same run."""
    from rich.table import Table

    d, ix = record["dims"], record["index"]
    table = Table(title=f"{FAMILY}: DSA decode step, MLA absorbed (N {d['N']}, C {d['C']}, R {d['R']}), indexer "
                        f"I {ix['I']} J {ix['J']}, k {ix['k']}, float32: ms / x its bound (r: read-bound, f: "
                        "flops-bound), paired" + (" --quick" if record["quick"] else ""))
    for col in ("backend", "P", "dense", "sparse (given k)", "indexer", "read GB/s", "matmul GFLOP/s"):
        table.add_column(col, justify="right")
    by = {(r["backend"], r["P"], r["path"]): r for r in record["rows"]}
    for b, info in record["backends"].items():
        if info["status"] != "ok":
            console.print(f"[yellow]{FAMILY} {b}: {info['status']}[/]")
            continue
        for P in record["lengths"]:
            cells = []
            for name in ("dense", "sparse", "indexer"):
                r = by.get((b, P, name))
                if r is None or r["status"] != "ok":
                    cells.append("-" if r is None else r["status"].split(":")[0])
                elif "x_bound" not in r:
                    cells.append(f"{r['median_s'] * 1e3:.3g}")
                else:
                    cells.append(f"{r['median_s'] * 1e3:.3g} / {r['x_bound']:.1f}x {r['bound'][0]}")
            read = by.get((b, P, "read"), {})
            cells += [f"{read['read_GBps']:.1f}" if "read_GBps" in read else "-",
                      f"{read['matmul_GFLOPs']:.0f}" if "matmul_GFLOPs" in read else "-"]
            table.add_row(b, str(P), *cells)
    console.print(table)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.bench.sparse")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.worker[0]).read_text())
    Path(args.worker[1]).write_text(json.dumps(run_worker(spec)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
