"""`mha check --sharded`: sharded attention judged against the unsharded float64 reference.

An engine is a module `impl_<fw>.sharded` (a file or a package) with
    forward(config, tensors, inputs, options, *, kind, devices, trace=False) -> dict
    vjp(config, tensors, inputs, options, d_output, *, kind, devices) -> {"output", "grads"}
(impl_numpy.adapter's results, NumPy in and out); kind "heads" | "sequence",
devices N; NotImplementedError with the reason for what the engine cannot do.

The grid (SHARDED_CASES) is conformance.suite.cases.Case data like the default
grid's, with sizes the shardings must cut unevenly (lengths that do not
divide by 2 or 4 devices, T != S), head counts that divide by 4 and
key/value head counts on both sides of the device count. Every case is run
for each engine x kind x devices x dtype, forward and gradients, and judged
by conformance.suite.compare.judge: the same float64 reference on the same
dtype-rounded inputs, the same tolerance policy. The split reductions need
no term of their own in L: heads sharding sums the output projection's N*V
terms in a different grouping (N/d per shard, then d partial sums): the same
length; sequence sharding sums the softmax's S terms in d blocks, each
rescaled once per later block (at most d - 1 extra roundings of a factor in
[0, 1], far below L's S + D + H + N*V).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
import traceback
from typing import Any

import numpy as np

from conformance.suite.cases import Case
from conformance.suite.compare import (
    STATUS_ERROR,
    STATUS_FAIL,
    STATUS_PASS,
    STATUS_UNSUPPORTED,
    CaseResult,
    expected_for,
    judge,
)
from weights import AttentionConfig

ENGINES = {"jax": "impl_jax.sharded", "torch": "impl_torch.sharded"}
KINDS = ("heads", "sequence")
DEVICE_COUNTS = (2, 4)
DTYPES = ("float32", "bfloat16")
FORCE_DEVICES = "--xla_force_host_platform_device_count"


def force_host_devices(count: int) -> None:
    """Ask XLA for `count` CPU devices (JAX's host devices) unless XLA_FLAGS
    already asks for some. Only effective before JAX starts its backend: call
    it before the first JAX computation of the process."""
    flags = os.environ.get("XLA_FLAGS", "")
    if FORCE_DEVICES not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FORCE_DEVICES}={count}".strip()


def parse_shard(text: str) -> tuple[str, int]:
    """'heads:4' -> ("heads", 4); one-line ValueError naming --shard otherwise."""
    kind, _, count = str(text).partition(":")
    if kind not in KINDS or not count.isdigit() or int(count) < 1:
        raise ValueError(f"--shard must be heads:N or sequence:N with N >= 1: got {text!r}")
    return kind, int(count)


class EngineUnavailable(RuntimeError):
    """The engine's module or its framework is not installed here."""


def load_engine(name: str):
    if name not in ENGINES:
        raise ValueError(f"sharded engine must be one of {', '.join(ENGINES)}: got {name!r}")
    try:
        return importlib.import_module(ENGINES[name])
    except ImportError as err:
        raise EngineUnavailable(f"sharded engine {name}: {ENGINES[name]} cannot be imported ({err})") from None


def _cfg(**kw) -> AttentionConfig:
    base = dict(num_heads=4, query_dim=8, head_dim=4)
    base.update(kw)
    return AttentionConfig(**base)


def _grid() -> list[Case]:
    cross = dict(self_attention=False, T=6, S=9)
    causal = dict(is_causal=True)
    decode = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True, self_attention=False)
    plain = dict(return_weights=False)  # sequence sharding holds no whole row of weights
    cases = [
        Case("sh_self", _cfg(), T=8, S=8),
        Case("sh_cross_dims", _cfg(query_dim=6, key_dim=5, value_dim=7, head_dim=3, value_head_dim=5), **cross),
        Case("sh_gqa_k2", _cfg(num_heads=8, num_kv_heads=2, head_dim=3), **cross),  # K < 4 devices, K >= 2
        Case("sh_gqa_k4", _cfg(num_heads=8, num_kv_heads=4, head_dim=3), **cross),  # K >= devices
        Case("sh_mqa", _cfg(num_kv_heads=1), **cross),
        Case("sh_causal_self", _cfg(), T=11, S=11, **causal),
        Case("sh_causal_top_left", _cfg(num_kv_heads=2), **cross, **causal),
        Case("sh_causal_bottom_right", _cfg(), causal_alignment="bottom_right", **cross, **causal),
        Case("sh_causal_bottom_right_long_query", _cfg(), self_attention=False, T=9, S=5,
             causal_alignment="bottom_right", **causal),
        Case("sh_window_causal", _cfg(window_left=3), T=13, S=13, **causal),
        Case("sh_window_both", _cfg(window_left=2, window_right=1), mask="padding", **cross),
        Case("sh_padding_mask", _cfg(), mask="padding", **cross),
        Case("sh_mask_bnts", _cfg(), mask="random", **cross),
        Case("sh_bias_neg_inf", _cfg(), bias="neg_inf", **cross),
        Case("sh_mask_bias_causal", _cfg(num_kv_heads=2), mask="padding", bias="random", T=10, S=10, **causal),
        Case("sh_masked_rows_zero", _cfg(masked_row="zero"), mask="empty_rows", **cross),
        Case("sh_masked_rows_uniform", _cfg(masked_row="uniform"), mask="empty_rows", **cross),
        Case("sh_masked_rows_nan", _cfg(masked_row="nan"), mask="empty_rows", **cross),
        Case("sh_sinks", _cfg(num_kv_heads=2, use_sinks=True), mask="padding", T=10, S=10, **causal),
        Case("sh_sinks_masked_rows", _cfg(use_sinks=True, masked_row="nan"), mask="empty_rows", **cross),
        Case("sh_softcap", _cfg(scale=1.0, logit_softcap=2.0), input_scale=4.0, **cross),
        Case("sh_rope_positions", _cfg(num_kv_heads=2, rope={}), positions="per_batch", **cross, **causal),
        Case("sh_qk_norm_all", _cfg(num_kv_heads=2, qk_norm={"type": "rms", "scope": "all"}), **cross),
        Case("sh_segments_causal", _cfg(rope={}), T=10, S=10, positions="packed", **causal),
        Case("sh_decode_cache", _cfg(num_kv_heads=2, rope={}), T=1, S=1, P=7, **decode),
        Case("sh_decode_cache_window", _cfg(num_kv_heads=1, rope={}, window_left=4), T=3, S=3, P=8, **decode),
    ]
    return [dataclasses.replace(c, **plain) for c in cases]


SHARDED_CASES: dict[str, Case] = {case.name: case for case in _grid()}


@dataclasses.dataclass
class ShardedCaseResult(CaseResult):
    """A CaseResult with the sharding it ran under: {"engine", "kind", "devices"}."""

    sharding: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return super().to_json() | {"sharding": dict(self.sharding)}


def _result(case: Case, engine: str, kind: str, devices: int, dtype: str, status: str, message: str = ""):
    return ShardedCaseResult(case.name, f"{engine} {kind}:{devices}", "cpu", dtype, "highest", status, message=message,
                             sharding={"engine": engine, "kind": kind, "devices": devices})


def run_case(case: Case, engine_name: str, module, kind: str, devices: int, dtype: str, *,
             gradients: bool = True) -> ShardedCaseResult:
    """One sharded (case, engine, kind, devices, dtype): forward (+ gradients) judged as conformance.suite.compare does."""
    started = time.perf_counter()
    result = _result(case, engine_name, kind, devices, dtype, STATUS_PASS)
    try:
        exp = expected_for(case, dtype)
        options = case.options(dtype)
        forward = module.forward(case.config, exp["tensors"], exp["inputs"], options, kind=kind, devices=devices)
        grads = None
        if gradients:
            d_out = exp["d_output"].astype(exp["tensors"]["query.kernel"].dtype)
            grads = module.vjp(case.config, exp["tensors"], exp["inputs"], options, d_out, kind=kind,
                               devices=devices)["grads"]
        result.comparisons = judge(case, dtype, forward, grads, precision="highest")
        if not all(c.ok for c in result.comparisons):
            result.status = STATUS_FAIL
    except NotImplementedError as err:
        result.status, result.message = STATUS_UNSUPPORTED, str(err) or "not implemented"
    except Exception as err:  # an engine crash is a finding, not a crash of the suite
        result.status = STATUS_ERROR
        result.message = f"{type(err).__name__}: {err}".replace("\n", " ")[:500]
        result.arrays = {"traceback": traceback.format_exc()}
    result.seconds = time.perf_counter() - started
    return result


def _judged(case, engine_name, kind, devices, dtype, forward, grads, started) -> ShardedCaseResult:
    result = _result(case, engine_name, kind, devices, dtype, STATUS_PASS)
    try:
        result.comparisons = judge(case, dtype, forward, grads, precision="highest")
        if not all(c.ok for c in result.comparisons):
            result.status = STATUS_FAIL
    except Exception as err:
        result.status, result.message = STATUS_ERROR, f"{type(err).__name__}: {err}".replace("\n", " ")[:500]
    result.seconds = time.perf_counter() - started
    return result


def _run_batched(engine_name, module, kind, devices, dtype, names, gradients) -> list[ShardedCaseResult]:
    """An engine that starts processes per call (impl_torch.sharded) offers run_jobs(jobs, kind, devices):
    every case of a chunk in one start, refusals (module.refusal) reported unsupported first."""
    started = time.perf_counter()
    results, jobs, runnable = {}, [], []
    for name in names:
        case = SHARDED_CASES[name]
        exp = expected_for(case, dtype)
        options = case.options(dtype)
        reason = module.refusal(case.config, exp["inputs"], options, kind=kind, devices=devices)
        if reason:
            results[name] = _result(case, engine_name, kind, devices, dtype, STATUS_UNSUPPORTED, reason)
            continue
        runnable.append(name)
        jobs.append({"op": "forward", "config": case.config, "tensors": exp["tensors"], "inputs": exp["inputs"],
                     "options": options})
        if gradients:
            jobs.append({**jobs[-1], "op": "vjp",
                         "d_output": exp["d_output"].astype(exp["tensors"]["query.kernel"].dtype)})
    answers = module.run_jobs(jobs, kind=kind, devices=devices) if jobs else []
    per_case = 2 if gradients else 1
    for i, name in enumerate(runnable):
        parts = answers[i * per_case:(i + 1) * per_case]
        grads = parts[1]["result"]["grads"] if gradients else None
        results[name] = _judged(SHARDED_CASES[name], engine_name, kind, devices, dtype, parts[0]["result"], grads,
                                started)
    return [results[name] for name in names]


def _run_chunk(engine_name, kind, devices, dtype, names, gradients):
    """One (engine, kind, devices, dtype) over its cases; runs in a worker process with jobs > 1."""
    module = load_engine(engine_name)
    if hasattr(module, "run_jobs") and hasattr(module, "refusal"):
        try:
            return _run_batched(engine_name, module, kind, devices, dtype, names, gradients)
        except Exception:  # noqa: S110 - one job's crash takes the batch down: find it case by case
            pass
    return [run_case(SHARDED_CASES[name], engine_name, module, kind, devices, dtype, gradients=gradients)
            for name in names]


def run_sharded(engines=tuple(ENGINES), kinds=KINDS, device_counts=DEVICE_COUNTS, dtypes=DTYPES, case_names=None,
                *, gradients: bool = True, jobs: int | None = None) -> tuple[list[ShardedCaseResult], list[tuple]]:
    """Every engine x kind x devices x dtype x case. An engine whose module is
    missing is listed in the second value (engine, "-", reason), not run.
    jobs > 1: chunks in that many spawned worker processes (they inherit
    XLA_FLAGS: call force_host_devices first)."""
    names = list(case_names or SHARDED_CASES)
    chunks, skipped = [], []
    for engine_name in engines:
        try:
            load_engine(engine_name)
        except EngineUnavailable as err:
            skipped.append((f"{engine_name} (sharded)", "-", str(err)))
            continue
        chunks += [(engine_name, kind, devices, dtype) for kind in kinds for devices in device_counts
                   for dtype in dtypes]
    jobs = max(1, min(jobs if jobs is not None else (os.cpu_count() or 1), len(chunks) or 1))
    results: list[ShardedCaseResult] = []
    if jobs == 1:
        for chunk in chunks:
            results += _run_chunk(*chunk, names, gradients)
    else:
        import concurrent.futures
        import multiprocessing

        # spawn: JAX and torch hold threads that a fork would copy half-alive
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for part in pool.map(_run_chunk, *zip(*chunks), *([x] * len(chunks) for x in (names, gradients))):
                results += part
    return results, skipped


def worst_margins(results) -> dict[tuple[str, str, int, str], float]:
    """(engine, kind, devices, dtype) -> the worst margin of its passing or failing cases."""
    worst: dict[tuple[str, str, int, str], float] = {}
    for r in results:
        if r.status in (STATUS_PASS, STATUS_FAIL):
            key = (r.sharding["engine"], r.sharding["kind"], r.sharding["devices"], r.dtype)
            worst[key] = max(worst.get(key, 0.0), r.margin)
    return worst


def summary_lines(results) -> list[str]:
    """One line per (engine, kind, devices, dtype): cases passed / run, worst margin."""
    lines = []
    for (engine, kind, devices, dtype), margin in sorted(worst_margins(results).items()):
        group = [r for r in results if (r.sharding["engine"], r.sharding["kind"], r.sharding["devices"], r.dtype)
                 == (engine, kind, devices, dtype)]
        passed = sum(r.status == STATUS_PASS for r in group)
        unsupported = sum(r.status == STATUS_UNSUPPORTED for r in group)
        lines.append(f"{engine} {kind}:{devices} {dtype}: {passed}/{len(group)} pass"
                     f"{f', {unsupported} unsupported' if unsupported else ''}, worst margin {np.float64(margin):.3g}")
    return lines
