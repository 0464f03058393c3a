"""`mha bench --shapes sequence-sharded`: torch's sequence sharding
(impl_torch.sharded, the ring on gloo processes) against one process's
unsharded call, measured in one run.

Two figures, each judged against its target:

  memory  per-process peak over the call, the largest of the n ranks, over
          the same of one process running the unsharded call; target
          <= 0.35x at T = S = 32768, causal, D 512, N 8, float32, 4 processes.
  bytes   bytes each rank sends on the ring per forward (keys and values,
          key ids; the largest rank) over the ring's minimum, (n-1)/n of the
          call's key/value bytes (every block must reach n-1 other ranks);
          target <= 1.1x.

Peak over a call, for both sides alike: in the process that runs it, after
a warm-up call of the same kernels, free what can be freed (gc, glibc's
malloc_trim), reset the kernel's peak-RSS counter (5 into
/proc/self/clear_refs), read VmRSS ("before"), run the call, read VmHWM:
peak - before is what the call added (its activations, temporaries and
buffers). What was resident before (torch itself, the inputs) is left out of
both sides. Each rank is handed the whole inputs (impl_torch.sharded's start
pickles them to every process) and takes its shard: that copy is in its
"before", as the unsharded process's inputs are in its.

The unsharded call is impl_torch's multi_head_attention with use_sdpa=True
and is_causal: torch has no chunk_size path, and SDPA's kernels work
blockwise (what `mha bench` times at `long`). It runs in a process of its
own (`python -m conformance.bench.sharded --unsharded SPEC OUT`) with torch's default
threads and the same glibc mmap threshold as the ranks
(impl_torch.sharded.bound_heap_retention), so that the two sides differ in
the sharding alone. No gradients: the forward is what the targets name.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

FAMILY = "sequence-sharded"
MEMORY_TARGET = 0.35  # a rank's peak at most 0.35x one process's unsharded call
BYTES_TARGET = 1.1  # ... and its ring bytes within 1.1x of the minimum
DEVICES = 4
FULL = {"B": 1, "T": 32768, "D": 512, "N": 8}
QUICK = {"B": 1, "T": 256, "D": 32, "N": 2}  # --quick: the same pipeline in seconds; not the targets' figures


def shape(quick: bool) -> dict:
    """The family's one point: self-attention, T = S, causal, K = N, H = V = D / N, float32."""
    s = dict(QUICK if quick else FULL)
    s.update(S=s["T"], K=s["N"], H=s["D"] // s["N"], causal=True, dtype="float32", devices=DEVICES)
    return s


def ring_minimum_bytes(s: dict) -> float:
    """Per rank: (n-1)/n of the call's key/value bytes (B, K, S, H + V) in float32, from the shape."""
    kv = s["B"] * s["K"] * s["S"] * (s["H"] + s["H"]) * 4
    return (s["devices"] - 1) / s["devices"] * kv


def _config_and_inputs(s: dict):
    import weights

    config = weights.AttentionConfig(num_heads=s["N"], query_dim=s["D"], head_dim=s["H"], num_kv_heads=s["K"])
    tensors = weights.init(config, seed=0, dtype="float32")
    x = np.random.default_rng(0).standard_normal((s["B"], s["T"], s["D"])).astype(np.float32)
    return config, tensors, x


def warmup_rows(s: dict) -> int:
    """The warm-up call's length, for both sides: a few full sub-blocks per rank (measure()'s own rule)."""
    from impl_torch.sharded import CHUNK

    return max(4 * s["devices"], min(s["T"], 2 * s["devices"] * CHUNK))


def unsharded(s: dict) -> dict:
    """In this process: one warm-up call, then the unsharded call, measured (the module docstring)."""
    import torch

    from conformance.bench.measure import rss_memory
    from impl_torch.attention import multi_head_attention
    from impl_torch.sharded import bound_heap_retention

    bound_heap_retention()
    config, tensors, x = _config_and_inputs(s)
    params = {name: torch.from_numpy(np.asarray(t)) for name, t in tensors.items()}
    query = torch.from_numpy(x)
    with torch.no_grad():
        multi_head_attention(config, params, query[:, : warmup_rows(s)], is_causal=True, use_sdpa=True)
        peak, method, _ = rss_memory(lambda: multi_head_attention(config, params, query, is_causal=True,
                                                                  use_sdpa=True))
    return {"path": "impl_torch multi_head_attention(use_sdpa=True)", "growth_bytes": peak, "method": method,
            "threads": torch.get_num_threads()}


def _run_unsharded(s: dict) -> dict:
    """unsharded() in a child process (its peak is its own, apart from the ranks' and this one's)."""
    with tempfile.TemporaryDirectory(prefix="mha-bench-sharded-") as tmp:
        spec, out = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec.write_text(json.dumps(s))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.run([sys.executable, "-m", "conformance.bench.sharded", "--unsharded", str(spec), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            raise RuntimeError(f"the unsharded process failed: {tail[0]}")
        return json.loads(out.read_text())


def run(quick: bool) -> dict:
    """The family's record: the shape, each rank's memory and bytes, the unsharded call's memory, the two
    ratios; or a status saying why it did not run (torch missing, a process failed)."""
    s = shape(quick)
    record = {"family": FAMILY, "shape": s, "status": "ok", "quick": quick,
              "ring_minimum_bytes": ring_minimum_bytes(s)}
    try:
        import impl_torch.sharded as sharded
    except ImportError as err:
        return record | {"status": f"unavailable: torch not importable ({err})"}
    try:
        config, tensors, x = _config_and_inputs(s)
        measured = sharded.measure(config, tensors, {"query": x}, {"is_causal": True, "dtype": s["dtype"]},
                                   devices=s["devices"], kind="sequence")
        del x
        base = _run_unsharded(s)
    except Exception as err:  # noqa: BLE001 - reported as the family's status, the rest of the run goes on
        return record | {"status": f"failed: {type(err).__name__}: {err}".splitlines()[0][:300]}
    growth = [p - b for p, b in zip(measured["peak_rss_bytes"], measured["rss_before_bytes"])]
    record.update(
        ranks=[{"rank": r, "rss_before_bytes": b, "peak_rss_bytes": p, "growth_bytes": g, "kv_bytes_sent": kv,
                "ids_bytes_sent": ids, "seconds": sec}
               for r, (b, p, g, kv, ids, sec) in enumerate(zip(measured["rss_before_bytes"], measured["peak_rss_bytes"],
                                                               growth, measured["kv_bytes_sent"],
                                                               measured["ids_bytes_sent"], measured["seconds"]))],
        kv_bytes=measured["kv_bytes"], peak_method=measured["peak_method"], unsharded=base)
    record.update(ratios(record))
    return record


def ratios(record: dict) -> dict:
    """memory_ratio: the largest rank's growth over the unsharded call's; bytes_ratio: the largest rank's
    bytes sent over ring_minimum_bytes. None where a number is missing."""
    ranks = record.get("ranks") or []
    base = (record.get("unsharded") or {}).get("growth_bytes")
    memory = max(r["growth_bytes"] for r in ranks) / base if ranks and base else None
    minimum = record.get("ring_minimum_bytes")
    sent = max(r["kv_bytes_sent"] + r["ids_bytes_sent"] for r in ranks) if ranks else None
    return {"memory_ratio": memory, "bytes_ratio": sent / minimum if sent is not None and minimum else None}


def targets(record: dict) -> list[dict]:
    """The family's two targets (memory, bytes) on its record, in conformance.bench.targets' entry form."""
    from conformance.bench.targets import _entry

    s = record["shape"]
    where = f"T=S={s['T']}, causal, D {s['D']}, N {s['N']}, {s['devices']} processes"
    why = None if record["status"] == "ok" else record["status"]
    return [
        _entry(f"torch sequence:{s['devices']} per-process peak memory <= {MEMORY_TARGET:g}x one process's unsharded "
               f"call ({where})", "torch", FAMILY, record.get("memory_ratio"), MEMORY_TARGET, "<=", unit="x",
               path="impl_torch.sharded ring vs multi_head_attention(use_sdpa=True)", why=why),
        _entry(f"torch sequence:{s['devices']} bytes sent per device per forward <= {BYTES_TARGET:g}x the ring's "
               f"minimum (n-1)/n of the key/value bytes ({where})", "torch", FAMILY, record.get("bytes_ratio"),
               BYTES_TARGET, "<=", unit="x", path="impl_torch.sharded ring", why=why),
    ]


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def print_family(console, record: dict) -> None:
    """Per rank: resident before, peak, growth, bytes sent; then the unsharded call's growth."""
    from rich.table import Table

    s = record["shape"]
    if record["status"] != "ok":
        console.print(f"[yellow]{FAMILY}: {record['status']}[/]")
        return
    quick = " (--quick: not the figures the targets ask for)" if record["quick"] else ""
    table = Table(title=f"{FAMILY}: T=S={s['T']}, causal, B {s['B']}, D {s['D']}, N {s['N']}, float32, "
                        f"{s['devices']} processes{quick}")
    for col in ("process", "before MiB", "peak MiB", "peak - before MiB", "x unsharded", "bytes sent", "x ring minimum"):
        table.add_column(col, justify="left" if col == "process" else "right")
    base = record["unsharded"]["growth_bytes"]
    for r in record["ranks"]:
        sent = r["kv_bytes_sent"] + r["ids_bytes_sent"]
        table.add_row(f"rank {r['rank']}", _mib(r["rss_before_bytes"]), _mib(r["peak_rss_bytes"]),
                      _mib(r["growth_bytes"]), f"{r['growth_bytes'] / base:.3f}" if base else "-", f"{sent:,}",
                      f"{sent / record['ring_minimum_bytes']:.3f}" if record["ring_minimum_bytes"] else "-")
    table.add_row("unsharded", "", "", _mib(base), "1", "", "")
    console.print(table)
    console.print(f"{FAMILY}: ring minimum per rank {record['ring_minimum_bytes']:,.0f} bytes ((n-1)/n of "
                  f"{record['kv_bytes']:,} key/value bytes); peak {record['peak_method']} after reset, unsharded: "
                  f"{record['unsharded']['path']}, {record['unsharded']['threads']} threads")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.bench.sharded")
    parser.add_argument("--unsharded", nargs=2, metavar=("SPEC", "OUT"), required=True)
    args = parser.parse_args(argv)
    result = unsharded(json.loads(Path(args.unsharded[0]).read_text()))
    Path(args.unsharded[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
