"""Keras measured against itself: keras.layers.MultiHeadAttention and
keras.ops.dot_product_attention on each Keras 3 backend (tensorflow, jax,
torch), the fifth and sixth tables of `mha check --conventions`.

Keras fixes its backend when it is imported, so each backend runs in a worker
process of its own (keras_backends_worker.py, KERAS_BACKEND set before the
import); the three start together and the parent waits for all.

The fifth table is the first table's measurement (harness.py: mask polarity,
the fully masked row, causal alignment when T != S, the default float32
matmul), per backend, plus what each call accepts as a mask shape (and
whether it means the broadcast its shape says), what flash_attention=None
and True do, and which kernel the backend really runs (hooks on the
functions keras/src/backend/<backend>/nn.py calls; on torch the profiler's
aten op names).

The sixth table runs the same calls (CALLS) with the same weights and
inputs (one .npz, written here) on every backend and compares them: each
backend's error against the float64 NumPy reference (impl_numpy), the
largest difference between two backends (max abs and normwise relative), and
why. The why is measured too: each backend's output is compared with NumPy
emulations of the call that differ in one stage (the empty row's policy, the
mask's polarity, the causal alignment, the dtype the logits, the softmax and
the probabilities are held in, the scale's dtype), and the closest is named,
with its error; where the backends' closest emulations are the same, the
difference is the kernels' rounding, named by the kernel each ran.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BACKENDS = ("tensorflow", "jax", "torch")
BACKEND_MODULES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}
INSTALL = {"tensorflow": "pip install -c constraints/cpu.txt '.[tf]'",
           "jax": "pip install -c constraints/cpu.txt '.[tf,jax]'",
           "torch": "pip install -c constraints/cpu.txt '.[tf,torch]'"}
# the fifth table's rows: each API on each backend, named "<API> on <backend>"
API_LABELS = ("keras MultiHeadAttention (fused)", "keras MultiHeadAttention (return_attention_scores=True)",
              "keras.ops.dot_product_attention")
API_NAMES = tuple(f"{label} on {backend}" for backend in BACKENDS for label in API_LABELS)
WORKER_TIMEOUT_S = 600
JAX_FAST_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_cpu_parallel_codegen_split_count=1")

# the cross-backend calls: one set of weights and inputs for every backend
CROSS = {"B": 2, "N": 2, "H": 8, "D": 16, "L": 7}  # L: the longest query / key length of a call


@dataclasses.dataclass(frozen=True)
class CallSpec:
    name: str
    api: str  # "mha" (the layer, fused path), "mha_scores" (return_attention_scores=True), "dpa" (keras.ops)
    dtype: str
    T: int = 5
    S: int = 7
    mask: str = "none"  # "none", "mask" (every row keeps a key), "empty_row" (query 1 of batch 0 has none)
    causal: bool = False


CALLS: tuple[CallSpec, ...] = (
    CallSpec("MHA, no mask", "mha", "float32"),
    CallSpec("MHA, mask with an empty row", "mha", "float32", mask="empty_row"),
    CallSpec("MHA with scores, mask with an empty row", "mha_scores", "float32", mask="empty_row"),
    CallSpec("MHA, use_causal_mask, T=5 < S=7", "mha", "float32", causal=True),
    CallSpec("MHA, use_causal_mask, T=7 > S=5", "mha", "float32", T=7, S=5, causal=True),
    CallSpec("dot_product_attention, mask with an empty row", "dpa", "float32", mask="empty_row"),
    CallSpec("dot_product_attention, is_causal, T=5 < S=7", "dpa", "float32", causal=True),
    CallSpec("MHA, mask, float16", "mha", "float16", mask="mask"),
    CallSpec("MHA, mask, bfloat16", "mha", "bfloat16", mask="mask"),
    CallSpec("MHA with scores, mask, bfloat16", "mha_scores", "bfloat16", mask="mask"),
    CallSpec("dot_product_attention, mask, bfloat16", "dpa", "bfloat16", mask="mask"),
    CallSpec("MHA, no mask, float64", "mha", "float64"),
    CallSpec("dot_product_attention, no mask, float64", "dpa", "float64"),
)
EMPTY = (0, 1)  # (b, t) of the empty row
# `quick` runs (the cheap test): these calls only
QUICK_CALLS = ("MHA, mask with an empty row", "dot_product_attention, mask with an empty row",
               "dot_product_attention, no mask, float64")


def shared_arrays(seed: int = 40) -> dict[str, np.ndarray]:
    """The weights and inputs every backend gets (float32 values; each call casts them to its dtype)."""
    B, N, H, D, L = (CROSS[k] for k in ("B", "N", "H", "D", "L"))
    rng = np.random.default_rng(seed)
    f32 = lambda *shape, scale=1.0: (rng.standard_normal(shape) * scale).astype(np.float32)  # noqa: E731
    arrays = {"query.kernel": f32(D, N, H, scale=D ** -0.5), "query.bias": f32(N, H, scale=0.1),
              "key.kernel": f32(D, N, H, scale=D ** -0.5), "key.bias": f32(N, H, scale=0.1),
              "value.kernel": f32(D, N, H, scale=D ** -0.5), "value.bias": f32(N, H, scale=0.1),
              "output.kernel": f32(N, H, D, scale=(N * H) ** -0.5), "output.bias": f32(D, scale=0.1),
              "xq": f32(B, L, D), "xk": f32(B, L, D), "xv": f32(B, L, D),
              "q4": f32(B, L, N, H), "k4": f32(B, L, N, H), "v4": f32(B, L, N, H)}
    mask = rng.random((B, L, L)) < 0.6
    mask[..., 0] = True  # every row keeps a key
    arrays["mask"] = mask
    return arrays


def call_arrays(shared: dict[str, np.ndarray], spec: CallSpec) -> dict[str, np.ndarray]:
    """The inputs of one call, cut from the shared arrays: x* (B, L, D) or *4 (B, L, N, H); mask (B, T, S)."""
    T, S = spec.T, spec.S
    out = {"xq": shared["xq"][:, :T], "xk": shared["xk"][:, :S], "xv": shared["xv"][:, :S],
           "q4": shared["q4"][:, :T], "k4": shared["k4"][:, :S], "v4": shared["v4"][:, :S]}
    if spec.mask != "none":
        mask = shared["mask"][:, :T, :S].copy()
        if spec.mask == "empty_row":
            mask[EMPTY] = False
        out["mask"] = mask
    return out


# -- the workers ------------------------------------------------------------------------------------

class Run:
    """The workers of one measurement, started together (start()); finish() waits for them and builds both
    tables. Between the two the caller may measure other tables: the workers run alongside."""

    def __init__(self, backends=BACKENDS, plant: dict[str, str] | None = None, quick: bool = False):
        self.backends, self.quick = tuple(backends), quick
        self.started = time.perf_counter()
        self._tmp = tempfile.TemporaryDirectory(prefix="mha-keras-backends-")
        tmp = Path(self._tmp.name)
        src = tmp / "shared.npz"
        np.savez(src, **shared_arrays())
        self.results: dict[str, dict] = {}
        self.procs: dict[str, tuple] = {}
        for backend in self.backends:
            if backend not in BACKENDS:
                raise ValueError(f"backends: expected some of {BACKENDS}, got {backend!r}")
            missing = [m for m in ("keras", BACKEND_MODULES[backend]) if importlib.util.find_spec(m) is None]
            if missing:
                self.results[backend] = {"status": "not installed",
                                         "reason": f"{', '.join(missing)} not installed ({INSTALL[backend]})"}
                continue
            env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
                       PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            if backend == "jax" and "XLA_FLAGS" not in env:
                # Keras on jax runs eagerly: one small XLA compile per op and shape. The CPU compile options
                # `mha check` and tox use (impl_jax.adapter.FAST_CPU_COMPILE: the same HLO, LLVM -O0) took
                # this worker from 23.3 s of CPU to 9.7 s on a 2-core VM (docs/conventions.md)
                env["XLA_FLAGS"] = JAX_FAST_FLAGS
            out_json, out_npz = tmp / f"{backend}.json", tmp / f"{backend}.npz"
            cmd = [sys.executable, "-m", "conformance.native.conventions.keras_backends_worker", backend, str(src),
                   str(out_json), str(out_npz)]
            if plant and backend in plant:
                cmd += ["--plant", plant[backend]]
            if quick:
                cmd.append("--quick")
            # stderr to a file: a pipe left unread while another worker is awaited could fill and stall it
            log = open(tmp / f"{backend}.log", "w", encoding="utf-8")  # closed in _wait
            self.procs[backend] = (subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log),
                                   out_json, out_npz, log)

    def _wait(self) -> None:
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        for backend, (proc, out_json, out_npz, log) in self.procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                self.results[backend] = {"status": "error", "reason": f"worker ran past {WORKER_TIMEOUT_S} s"}
                continue
            finally:
                log.close()
            if proc.returncode != 0 or not out_json.exists():
                err = Path(log.name).read_text(encoding="utf-8", errors="replace")
                last = [line for line in err.strip().splitlines() if line.strip()][-1:] or ["no output"]
                self.results[backend] = {"status": "error",
                                         "reason": f"worker exit {proc.returncode}: {last[0][:200]}"}
                continue
            data = json.loads(out_json.read_text(encoding="utf-8"))
            with np.load(out_npz) as f:
                data["outputs"] = {k: f[k] for k in f.files}
            data["status"] = "measured"
            self.results[backend] = data

    def finish(self) -> dict:
        """Both tables: {"rows": the fifth table's rows, "cross": the sixth's, "versions", "worker_seconds",
        "seconds"}."""
        try:
            self._wait()
        finally:
            self._tmp.cleanup()
        rows, versions, seconds = [], {}, {}
        for backend in self.backends:
            res = self.results[backend]
            if res["status"] != "measured":
                rows.append({"api": f"keras on {backend}", "backend": backend, "status": res["status"],
                             "reason": res["reason"], "evidence": {}, "notes": []})
                continue
            rows += res["rows"]
            versions.update(res["versions"])
            seconds[backend] = res["seconds"]
        calls = tuple(c for c in CALLS if not self.quick or c.name in QUICK_CALLS)
        cross = cross_rows(self.results, self.backends, calls)
        return {"rows": rows, "cross": cross, "versions": versions, "worker_seconds": seconds,
                "seconds": round(time.perf_counter() - self.started, 2)}


def start(backends=BACKENDS, plant: dict[str, str] | None = None, quick: bool = False) -> Run:
    """Start the workers (see Run)."""
    return Run(backends, plant, quick)


def measure(backends=BACKENDS, plant: dict[str, str] | None = None, quick: bool = False) -> dict:
    """Both tables (Run.finish()). plant: backend -> what to plant in its worker (keras_backends_worker.PLANTS),
    for the tests; quick: the calls of QUICK_CALLS only in the sixth table (the cheap test)."""
    return start(backends, plant, quick).finish()


# -- the cross-backend comparison -------------------------------------------------------------------

def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to dtype, back in float64."""
    import ml_dtypes

    dt = {"bfloat16": ml_dtypes.bfloat16}.get(dtype, dtype)
    return np.asarray(x, dtype=np.float64).astype(dt).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class Stages:
    """One NumPy emulation of a call: the dtype each stage is held in, and the conventions."""

    logits: str  # q k^T (scaled) rounded to this dtype
    softmax: str  # the softmax computed in this dtype
    probs: str  # the probabilities rounded to this dtype before P V
    scale: str = "float64"  # 1/sqrt(H) rounded to this dtype
    io: str | None = None  # inputs, weights, projections and the output in this dtype (None: the call's)
    masked_row: str = "zero"
    alignment: str = "top_left"
    mask_inverted: bool = False


def emulate(spec: CallSpec, shared: dict[str, np.ndarray], st: Stages) -> np.ndarray:
    """The call in NumPy float64, each stage rounded as `st` says; projections and the output in the call's
    dtype (an independent formulation: the stage-by-stage explanation of a backend's numbers, never the
    reference the errors are measured against)."""
    a = call_arrays(shared, spec)
    dt = st.io or spec.dtype
    r = lambda x: _round(x, dt)  # noqa: E731
    if spec.api == "dpa":
        q, k, v = (r(a[n]) for n in ("q4", "k4", "v4"))  # (B, L, N, H)
    else:
        w = {n: r(x) for n, x in shared.items() if "." in n}
        xq, xk, xv = (r(a[n]) for n in ("xq", "xk", "xv"))
        q = r(np.einsum("btd,dnh->btnh", xq, w["query.kernel"]) + w["query.bias"])
        k = r(np.einsum("bsd,dnh->bsnh", xk, w["key.kernel"]) + w["key.bias"])
        v = r(np.einsum("bsd,dnh->bsnh", xv, w["value.kernel"]) + w["value.bias"])
    H = q.shape[-1]
    scale = _round(1.0 / np.sqrt(H), st.scale)
    logits = _round(np.einsum("btnh,bsnh->bnts", q, k) * scale, st.logits)  # (B, N, T, S)
    T_, S_ = logits.shape[-2:]
    allowed = np.ones((logits.shape[0], T_, S_), bool)
    if "mask" in a:
        allowed &= ~a["mask"] if st.mask_inverted else a["mask"]
    if spec.causal:
        i, j = np.arange(T_)[:, None], np.arange(S_)[None, :]
        allowed &= (j <= i) if st.alignment == "top_left" else (j <= i + S_ - T_)
    allowed4 = np.broadcast_to(allowed[:, None], logits.shape)
    x = _round(np.where(allowed4, logits, -np.inf), st.softmax)
    empty = ~allowed4.any(-1, keepdims=True)
    x = np.where(empty, 0.0, x)
    e = _round(np.exp(x - x.max(-1, keepdims=True)), st.softmax)
    p = _round(e / _round(e.sum(-1, keepdims=True), st.softmax), st.softmax)
    if st.masked_row == "zero":
        p = np.where(empty, 0.0, p)
    elif st.masked_row == "nan":
        p = np.where(empty, np.nan, p)
    p = _round(p, st.probs)
    ctx = r(np.einsum("bnts,bsnh->btnh", p, v))  # (B, T, N, H)
    if spec.api == "dpa":
        return ctx
    return r(np.einsum("btnh,nhd->btd", ctx, w["output.kernel"]) + w["output.bias"])


def reference(spec: CallSpec, shared: dict[str, np.ndarray]) -> np.ndarray:
    """impl_numpy's float64 forward of the call on the values the backend holds (inputs and weights in the
    call's dtype), the empty row 0 (masked_row="zero"): (B, T, D) or, for dot_product_attention, (B, T, N, H)."""
    from impl_numpy import multi_head_attention
    from weights import AttentionConfig

    a = call_arrays(shared, spec)
    r = lambda x: _round(x, spec.dtype)  # noqa: E731
    B, N, H, D = (CROSS[k] for k in ("B", "N", "H", "D"))
    mask = None if "mask" not in a else a["mask"][:, None]  # (B, 1, T, S)
    if spec.api == "dpa":
        cfg = AttentionConfig(num_heads=N, query_dim=N * H, head_dim=H, use_query_bias=False, use_key_bias=False,
                              use_value_bias=False, use_output_bias=False)
        eye = np.eye(N * H)
        tensors = {"query.kernel": eye.reshape(N * H, N, H), "key.kernel": eye.reshape(N * H, N, H),
                   "value.kernel": eye.reshape(N * H, N, H), "output.kernel": eye.reshape(N, H, N * H)}
        q, k, v = (r(a[n]).reshape(B, -1, N * H) for n in ("q4", "k4", "v4"))
        out = multi_head_attention(cfg, tensors, q, k, v, mask=mask, is_causal=spec.causal)
        return np.asarray(out[0] if isinstance(out, tuple) else out).reshape(B, spec.T, N, H)
    cfg = AttentionConfig(num_heads=N, query_dim=D, head_dim=H)
    tensors = {n: r(x) for n, x in shared.items() if "." in n}
    out = multi_head_attention(cfg, tensors, r(a["xq"]), r(a["xk"]), r(a["xv"]), mask=mask, is_causal=spec.causal)
    return np.asarray(out[0] if isinstance(out, tuple) else out)


def _variants(spec: CallSpec) -> dict[str, Stages]:
    """The named emulations a backend's output is matched against: the conventions that can differ in this
    call, and the dtype of each stage."""
    dt = spec.dtype
    if dt in ("float16", "bfloat16"):
        base = {f"logits in {dt}, softmax in float32, probabilities in {dt}": Stages(dt, "float32", dt),
                f"logits and softmax in float32, probabilities in {dt}": Stages("float32", "float32", dt),
                "logits, softmax and probabilities in float32": Stages("float32", "float32", "float32"),
                f"every stage in {dt}": Stages(dt, dt, dt)}
    elif dt == "float64":
        base = {"every stage in float64": Stages("float64", "float64", "float64"),
                "scale 1/sqrt(H) rounded to float32": Stages("float64", "float64", "float64", scale="float32"),
                "softmax in float32": Stages("float64", "float32", "float64"),
                "attention in float32 (projections in float64)": Stages("float32", "float32", "float32",
                                                                        scale="float32"),
                "the whole call in float32": Stages("float32", "float32", "float32", scale="float32",
                                                    io="float32")}
    else:
        base = {"float32 stages": Stages("float32", "float32", "float32")}
    out = dict(base)
    first = next(iter(base.values()))
    if spec.mask == "empty_row":
        out = {}
        for name, st in base.items():
            for policy, label in (("zero", "empty row 0"), ("uniform", "empty row mean of V"),
                                  ("nan", "empty row NaN")):
                key = label if len(base) == 1 else f"{name}; {label}"
                out[key] = dataclasses.replace(st, masked_row=policy)
    if spec.mask != "none":  # the complement can empty a row (one with every key allowed): each policy
        for policy, label in (("zero", "empty row 0"), ("uniform", "empty row mean of V"), ("nan", "empty row NaN")):
            out[f"mask complemented (True = masked); {label}"] = dataclasses.replace(
                first, mask_inverted=True, masked_row=policy)
    if spec.causal:
        out["causal bottom_right"] = dataclasses.replace(first, alignment="bottom_right")
    return out


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    """Max abs difference; a NaN in one but not the other counts as infinitely far, NaN in both as equal."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = np.isnan(a), np.isnan(b)
    if (na != nb).any():
        return float("inf")
    d = np.abs(np.where(na, 0.0, a) - np.where(nb, 0.0, b))
    return float(d.max()) if d.size else 0.0


def _rel(a: np.ndarray, b: np.ndarray, ref: np.ndarray) -> float:
    keep = ~(np.isnan(a) | np.isnan(b))
    if not keep.all() and (np.isnan(a) != np.isnan(b)).any():
        return float("inf")
    den = float(np.linalg.norm(np.nan_to_num(ref[keep])))
    return float(np.linalg.norm(a[keep] - b[keep]) / den) if den else 0.0


# a closest emulation is named only where it fits at least this many times better than the next one
SINGLED_OUT = 4.0


def _allowance(spec: CallSpec, ref: np.ndarray, shared) -> np.ndarray:
    """The suite's forward allowance (conformance.suite.tolerance) of one backend's output, elementwise. For a
    16-bit call the careful implementation's error is that of the emulation with every stage in float32."""
    from conformance.suite.tolerance import allowance_of, reduction_length, tolerance

    H, D = CROSS["H"], (CROSS["N"] * CROSS["H"] if spec.api == "dpa" else CROSS["D"])
    length = reduction_length("output", D=D, H=H, S=spec.S, NV=H)
    scale = float(np.nanmax(np.abs(ref)))
    same = None
    if spec.dtype in ("float16", "bfloat16"):
        careful = emulate(spec, shared, Stages("float32", "float32", "float32"))
        same = _diff(careful, ref)
    return allowance_of(tolerance(spec.dtype, length=length, reference_scale=scale, same_precision_error=same), ref)


def _empty_row_policy(out, empty, variants, bound: float) -> str | None:
    """The masked_row policy whose emulation the empty row matches (the row alone, within bound)."""
    if not empty.any():
        return None
    fits = {name: _diff(out[empty], emu[empty]) for name, emu in variants.items()
            if "empty row" in name and not name.startswith("mask complemented")}
    if not fits:
        return None
    best = min(fits, key=fits.get)
    label = best.split("empty row ")[-1]
    return f"{label} (err {_fmt(fits[best])})" if fits[best] <= bound else f"none (closest {label}, err {_fmt(fits[best])})"


def cross_rows(results: dict[str, dict], backends, calls: tuple[CallSpec, ...] = CALLS) -> list[dict]:
    """The sixth table's rows: one per call."""
    shared = shared_arrays()
    measured = [b for b in backends if results.get(b, {}).get("status") == "measured"]
    rows = []
    for spec in calls:
        if not any(spec.name in results[b].get("facts", {}) for b in measured):
            continue
        ref = reference(spec, shared)
        empty = np.zeros(ref.shape[:2], bool)  # (B, T): rows compared with the reference
        if spec.mask == "empty_row":
            empty[EMPTY] = True
        variants = {name: emulate(spec, shared, st) for name, st in _variants(spec).items()}
        # two backends each within the suite's allowance of the reference may be twice the allowance apart
        bound = 2 * _allowance(spec, ref, shared)
        row: dict = {"call": spec.name, "dtype": spec.dtype, "backends": {}}
        outs = {}
        for b in measured:
            fact = results[b]["facts"].get(spec.name, {})
            if "error" in fact:
                row["backends"][b] = {"error": fact["error"]}
                continue
            out = results[b]["outputs"][spec.name]
            outs[b] = out
            fits = {name: _diff(out, emu) for name, emu in variants.items()}
            ranked = sorted(fits, key=fits.get)
            best = ranked[0]
            runner_up = fits[ranked[1]] if len(ranked) > 1 else float("inf")
            if fits[best] * SINGLED_OUT > runner_up:
                best = f"none singled out (closest {ranked[0]}, err {_fmt(fits[ranked[0]])}; next {_fmt(runner_up)})"
            row["backends"][b] = {
                "err": _diff(out[~empty], ref[~empty]), "dtype": fact["dtype"], "kernel": fact["kernel"],
                "best": best, "best_err": fits[ranked[0]], "fits": fits,
                "empty_row": _empty_row_policy(out, empty, variants, float(bound[empty].max()) if empty.any() else 0.0)}
        pairs = [(a, b) for i, a in enumerate(outs) for b in list(outs)[i + 1:]]
        diffs = {f"{a} vs {b}": (_diff(outs[a], outs[b]), _rel(outs[a], outs[b], ref)) for a, b in pairs}
        row["pairs"] = {k: {"max_abs": v[0], "rel": v[1]} for k, v in diffs.items()}
        worst = max(diffs, key=lambda k: diffs[k][0], default=None)
        row["worst_pair"] = worst
        row["rounding_bound"] = float(bound.max())
        row["verdict"] = _verdict(diffs, outs, bound)
        row["why"] = _why(row, outs)
        rows.append(_jsonable(row))
    return rows


def _jsonable(x):
    """Non-finite floats as strings (strict JSON), NumPy scalars as Python ones."""
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if np.isfinite(x) else str(float(x))
    return x


def _verdict(diffs, outs, bound: np.ndarray) -> str:
    if len(outs) < 2:
        return "n/a: fewer than two backends ran it"
    worst = max((d for d, _ in diffs.values()), default=0.0)
    if worst == 0.0:
        return "same numbers"
    names = list(outs)
    within = all(bool((np.abs(outs[a] - outs[b]) <= bound).all())
                 for i, a in enumerate(names) for b in names[i + 1:])
    return "same up to rounding" if within else "differ"


def _why(row, outs) -> str:
    """Which stage or kernel explains the difference, from the fits and kernels measured."""
    per = {b: info for b, info in row["backends"].items() if "best" in info}
    if len(per) < 2:
        return "; ".join(f"{b}: closest emulation {info['best']}" for b, info in per.items()) or "-"
    groups: dict[str, list[str]] = {}
    for b, info in per.items():
        groups.setdefault(info["best"], []).append(b)
    kernels: dict[str, list[str]] = {}
    for b, info in per.items():
        kernels.setdefault(info["kernel"], []).append(b)
    dtypes = {b: info["dtype"] for b, info in per.items() if info["dtype"] != row["dtype"]}
    parts = []
    if dtypes:
        parts.append("computed in " + ", ".join(f"{d} on {b}" for b, d in dtypes.items()))
    if len(groups) > 1:
        parts.append("closest emulation: " + "; ".join(
            f"{', '.join(bs)}: {name}" + ("" if name.startswith("none") else
                                          f" (err {_fmt(max(per[b]['best_err'] for b in bs))})")
            for name, bs in groups.items()))
    elif row["verdict"] != "same numbers":
        parts.append(f"all closest to: {next(iter(groups))}")
    if row["verdict"] != "same numbers" and len(kernels) > 1:
        parts.append("kernels: " + "; ".join(f"{', '.join(bs)}: {k}" for k, bs in kernels.items()))
    elif row["verdict"] != "same numbers":
        parts.append(f"one kernel on all: {next(iter(kernels))}")
    return ". ".join(parts)


# -- rendering ------------------------------------------------------------------------------------

def _fmt(x) -> str:
    return f"{x:.1e}" if isinstance(x, float) else str(x)


class RowsTable:
    """The fifth table (the harness's columns per backend, and the mask shapes, flash and kernel)."""

    SETUP = ("a worker process per KERAS_BACKEND, B=2 T=4 S=5 N=2 H=4, identity "
             "projections, float32 against the float64 reference, match tolerance 0.0001; mask shapes as named, "
             "each meant as its letters say; kernels recorded by hooks on what keras/src/backend/*/nn.py calls "
             "(torch: the profiler's aten ops)")
    COLUMNS = (("API", "api"), ("bool True means", "mask_true_means"), ("mask shapes taken", "mask_shapes"),
               ("fully masked row: output", "fully_masked_row"), ("its weights", "fully_masked_weights"),
               ("causal T=2, S=4", "causal_T2_S4"), ("causal T=4, S=2", "causal_T4_S2"),
               ("default float32 matmul", "float32_matmul"), ("flash_attention", "flash"),
               ("kernel run (no mask; bool mask; causal)", "kernels"))

    @staticmethod
    def cells(rows: list[dict]) -> list[list[str]]:
        return [[_rows_cell(row, key) for _, key in RowsTable.COLUMNS] for row in rows]


def _err_of(row: dict, key: str) -> str:
    """The measured error of the label in a harness cell, from the row's evidence."""
    ev = row.get("evidence", {})
    value = row.get(key)
    if key == "mask_true_means" and value in ("attend", "masked"):
        errs = [e.get(f"max_err_if_true_{value}") for n, e in ev.items() if n.startswith("polarity[")]
        errs = [e for e in errs if isinstance(e, float)]
        return f" (err {_fmt(max(errs))})" if errs else ""
    if key in ("causal_T2_S4", "causal_T4_S2") and isinstance(value, str):
        e = ev.get(key, {}).get(f"max_err_if_{value.replace(' ', '_')}")
        return f" (err {_fmt(e)})" if isinstance(e, float) else ""
    if key in ("fully_masked_row", "fully_masked_weights"):
        fm = next((e for n, e in ev.items() if n.startswith("fully_masked[")), {})
        e = fm.get("row_max_err" if key == "fully_masked_row" else "weights_row_max_err")
        return f" (err {_fmt(e)})" if isinstance(e, float) else ""
    return ""


def _rows_cell(row: dict, key: str) -> str:
    if row.get("status") != "measured":
        if key == "api":
            return row["api"]
        return f"{row['status']}: {row.get('reason', '')}" if key == "mask_true_means" else ""
    if key == "mask_shapes":
        shapes = row.get("mask_shapes", {})
        return "; ".join(f"{label}: {m['label']}" + (f" (err {_fmt(m['err'])})" if "err" in m else "")
                         + (f" ({m['why']})" if m["label"] == "refused" else "") for label, m in shapes.items())
    if key == "float32_matmul":
        return "; ".join(f"{dev}: {m['label']} ({_fmt(m['rel_err'])})" for dev, m in row.get(key, {}).items()) or "-"
    if key == "flash":
        ft = row.get("flash_true", {})
        true = ft.get("label", "")
        if true == "refused":
            true += f": {ft.get('why', '')}"
        elif "err_vs_default" in ft:
            true += f" (vs the default call: {_fmt(ft['err_vs_default'])})"
        return f"default {row.get('flash_default')}; True: {true}"
    if key == "kernels":
        k = row.get("kernels", {})
        if len(set(k.values())) == 1:
            return f"{', '.join(k)}: {next(iter(k.values()))}"
        return "; ".join(f"{what}: {label}" for what, label in k.items())
    return f"{row.get(key, '')}{_err_of(row, key)}"


class CrossTable:
    """The sixth table: each call on every backend, the same weights and inputs."""

    SETUP = ("the same weights and inputs on every Keras backend: B=2 N=2 H=8, D=16, random weights with biases; "
             "err: max |output - float64 reference| over the rows that have a key (the reference on the values the "
             "backend holds, in the call's dtype); difference: the largest between two backends, max abs and "
             "normwise relative; 'same up to rounding': every pair within twice the suite's forward allowance of the reference (each may be one allowance off); "
             "why: each backend's closest NumPy emulation (one stage changed) and the kernel it ran")
    COLUMNS = (("call", "call"), ("dtype", "dtype"), ("tensorflow: err", "tensorflow"), ("jax: err", "jax"),
               ("torch: err", "torch"), ("largest difference between backends", "difference"),
               ("verdict", "verdict"), ("why (measured)", "why"))

    @staticmethod
    def cells(rows: list[dict]) -> list[list[str]]:
        out = []
        for row in rows:
            cells = []
            for _, key in CrossTable.COLUMNS:
                if key in BACKENDS:
                    info = row["backends"].get(key)
                    if info is None:
                        cells.append("-")
                    elif "error" in info:
                        cells.append(f"refused: {info['error']}")
                    else:
                        text = _fmt(info["err"])
                        if info.get("empty_row"):
                            text += f"; empty row: {info['empty_row']}"
                        cells.append(text)
                elif key == "difference":
                    pair = row.get("worst_pair")
                    if pair is None:
                        cells.append("-")
                    else:
                        d = row["pairs"][pair]
                        cells.append(f"{pair}: {_fmt(d['max_abs'])} (rel {_fmt(d['rel'])})")
                else:
                    cells.append(str(row.get(key, "")))
            out.append(cells)
        return out


def notes(data: dict | None) -> list[str]:
    if not data:
        return []
    out = []
    for row in data.get("rows", []):
        for note in row.get("notes", []):
            out.append(f"{row['api']}: {note}")
    return out


def setup_line(data: dict) -> str:
    workers = ", ".join(f"{b} {s} s" for b, s in data.get("worker_seconds", {}).items())
    return (f"Measured in this run: {data['seconds']} s from the workers' start to both tables (each worker's own "
            f"time: {workers or 'none ran'}). Versions: "
            + ", ".join(f"{k} {v}" for k, v in data["versions"].items()) + ".")


def disagreements(data: dict) -> list[str]:
    """One line per measured cell of the fifth table that differs from the recorded expectations."""
    from conformance.native.conventions.expectations import expected

    table = expected()
    lines = []
    for row in data.get("rows", []):
        if row.get("status") != "measured":
            continue
        for key, want in table.get(row["api"], {}).items():
            if row.get(key) != want:
                lines.append(f"{row['api']}: {key} expected {want!r}, measured {row.get(key)!r}")
    return lines


def to_markdown(data: dict) -> str:
    """Both tables as Markdown (the section of docs/conventions.md)."""
    lines = []
    for title, table, rows in (("Keras on its three backends", RowsTable, data["rows"]),
                               ("The same Keras calls across backends", CrossTable, data["cross"])):
        lines += [f"{title} ({table.SETUP}):", "", "| " + " | ".join(t for t, _ in table.COLUMNS) + " |",
                  "|" + "---|" * len(table.COLUMNS)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in table.cells(rows)]
        lines.append("")
    extra = notes(data)
    if extra:
        lines += ["Notes:", *[f"- {n}" for n in extra], ""]
    lines.append(setup_line(data))
    from conformance.native.conventions.expectations import EXPECTED_SOURCE

    found = disagreements(data)
    lines += ["", f"Disagreements with {EXPECTED_SOURCE}:" if found else f"No disagreement with {EXPECTED_SOURCE}."]
    lines += [f"- {line}" for line in found]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """python -m conformance.native.conventions.keras_backends [--json] [--backends ...]"""
    from conformance.console import OneLineParser, guarded

    def command() -> int:
        parser = OneLineParser(
            prog="python -m conformance.native.conventions.keras_backends",
            description="Measure Keras's own attention (MultiHeadAttention, keras.ops.dot_product_attention) on "
                        "each Keras backend, one worker process per backend, and print the two tables (the fifth "
                        "and sixth of `mha check --conventions`) as Markdown.")
        parser.add_argument("--json", action="store_true", help="print the whole measurement as JSON")
        parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                            help="the Keras backends to measure (default: all three)")
        args = parser.parse_args(argv)
        data = measure(tuple(args.backends))
        print(json.dumps(data, indent=1, allow_nan=False) if args.json else to_markdown(data))
        return 0

    return guarded(command)


if __name__ == "__main__":
    raise SystemExit(main())
