"""Run one case on one backend and judge it against the float64 reference.

A CaseResult holds every compared quantity (output, weights, each gradient)
with its margin, and, when something failed, the first stage of the forward
pass whose values left the tolerance (divergence localisation).

A core backend computes a call on one of several paths (its adapter's
PATHS: the stages, its fast path, the chunked core, an in-place cache); a
case run on a named path is judged as such, so a bug in one path alone is a
failure of that path's column (run_case(path=...), conformance/suite/check.py).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import traceback
from typing import Any

import numpy as np

from conformance.suite import backends, reference_cache
from conformance.suite.cases import Case, cast_inputs, cast_tensors, make_inputs, make_tensors, output_cotangent
from conformance.suite.tolerance import Comparison, compare, comparison_status, policy_for
from impl_numpy import adapter as reference
from impl_numpy.backward import multi_head_attention_vjp
from impl_numpy.magnitudes import forward_magnitudes
from weights.call import INDEXER_INPUTS
from weights.paths import IN_PLACE_FORWARD_ONLY, chunk_size

STATUS_PASS, STATUS_FAIL, STATUS_UNSUPPORTED, STATUS_ERROR = "pass", "fail", "unsupported", "error"
# The path of a result whose backend has one (the native layers, a user's function) or that was run with the
# case's own options, the backend choosing its path as a user's call would.
DEFAULT_PATH = "default"


@dataclasses.dataclass
class Divergence:
    stage: str
    index: tuple[int, ...] | None
    actual: float | None
    expected: float | None
    margin: float
    detail: str | None = None  # what differs where no element does (the indexer's selection: queries and keys)

    def describe(self) -> str:
        if self.detail is not None:
            return f"first divergent stage: {self.stage} ({self.detail})"
        return (f"first divergent stage: {self.stage} (worst at {list(self.index) if self.index else '-'}: "
                f"backend {self.actual!r}, reference {self.expected!r}, margin {self.margin:.3g})")


@dataclasses.dataclass
class CaseResult:
    case: str
    backend: str
    device: str
    dtype: str
    precision: str
    status: str
    comparisons: list[Comparison] = dataclasses.field(default_factory=list)
    divergence: Divergence | None = None
    message: str = ""
    seconds: float = 0.0
    arrays: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)  # for heatmaps
    path: str = DEFAULT_PATH  # the backend's path that computed it (its adapter's PATHS), or DEFAULT_PATH

    @property
    def margin(self) -> float:
        """The worst margin of the judged comparisons (and of any that failed); a not-judged one's says nothing."""
        return max((c.margin for c in self.comparisons if c.judged or not c.ok), default=0.0)

    @property
    def worst(self) -> Comparison | None:
        judged = [c for c in self.comparisons if c.judged or not c.ok]
        return max(judged, key=lambda c: c.margin, default=None)

    @property
    def not_judged(self) -> list[Comparison]:
        """Comparisons that passed an allowance not well below the quantity's size: no check, never a pass."""
        return [c for c in self.comparisons if c.ok and not c.judged]

    def to_json(self) -> dict:
        worst = self.worst
        return {
            "case": self.case, "backend": self.backend, "path": self.path, "device": self.device, "dtype": self.dtype,
            "precision": self.precision, "status": self.status, "margin": _finite_or_str(self.margin),
            "seconds": round(self.seconds, 4), "message": self.message,
            "worst": None if worst is None else worst.describe(),
            "divergence": None if self.divergence is None else self.divergence.describe(),
            "not_judged": len(self.not_judged),
            "comparisons": [
                {"name": c.name, "ok": c.ok, "status": comparison_status(c), "margin": _finite_or_str(c.margin),
                 "max_abs_error": _finite_or_str(c.max_abs_error), "rtol": c.tolerance.rtol, "atol": c.tolerance.atol,
                 "reason": c.tolerance.reason, "not_judged": c.not_judged}
                for c in self.comparisons
            ],
        }


def _finite_or_str(x: float):
    return x if math.isfinite(x) else str(x)


# (case, dtype) -> what expected_for computed; cases are frozen dataclasses.
_EXPECTED_CACHE: dict[tuple[Case, str], dict] = {}
_DISK_KEYS: dict[tuple[Case, str], str] = {}  # (case, dtype) -> its reference_cache key, where one is kept


def clear_cache() -> None:
    """Drop the cached references, and JAX's compiled programs."""
    _EXPECTED_CACHE.clear()
    _DISK_KEYS.clear()
    release_compiled_programs()


def flush_references() -> None:
    """Write this process's references to the on-disk cache (reference_cache), where one is set: those
    computed here, and those that gained a lazily computed error since they were read."""
    reference_cache.flush({disk: _EXPECTED_CACHE[key] for key, disk in _DISK_KEYS.items() if key in _EXPECTED_CACHE})


def release_compiled_programs() -> None:
    """Drop JAX's in-memory compiled programs, if JAX is loaded. Each holds
    about a hundred memory mappings: a process that compiles some 600 (150
    random cases x 4 dtypes) reaches the kernel's vm.max_map_count (65530)
    and LLVM aborts the process ("Unable to allocate section memory")."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
    programs = sys.modules.get("impl_jax.programs")
    if programs is not None:
        programs.clear()


def expected_for(case: Case, dtype: str, selection: np.ndarray | None = None) -> dict:
    """float64 reference evaluated on the inputs and weights rounded to `dtype`
    (the exact answer for what the backend actually receives), plus the error
    of the NumPy reference run in `dtype` itself (for the low-precision rule).

    selection: a backend's own (admissible) selection of a case with config.indexer: the reference computed
    attending to it (its config without the indexer, the selection as topk_indices), the indexer's tensors'
    gradients zero as the call gives them, the index cache the case's own."""
    key = (case, dtype) if selection is None else (case, dtype, np.asarray(selection).shape,
                                                   np.asarray(selection).tobytes())
    if key in _EXPECTED_CACHE:
        return _EXPECTED_CACHE[key]
    disk = None if selection is not None or reference_cache.directory() is None else reference_cache.key(case, dtype)
    if disk is not None:
        found = reference_cache.load(disk)
        if found is not None:
            return _remember(key, found, disk)
    if case.config.compressed is not None:
        return _remember(key, _expected_compressed(case, dtype, selection), disk)
    tensors = cast_tensors(make_tensors(case), dtype)
    inputs = cast_inputs(make_inputs(case), dtype)
    config, run_tensors, run_inputs = case.config, tensors, inputs
    if selection is not None:
        config = dataclasses.replace(config, indexer=None)
        run_tensors = {name: t for name, t in tensors.items() if not name.startswith("indexer.")}
        run_inputs = {name: x for name, x in inputs.items() if name != "past_index_keys"} | {
            "topk_indices": np.asarray(selection, dtype=np.int64)}
    t64, i64 = cast_tensors(run_tensors, "float64"), cast_inputs(run_inputs, "float64")
    d_out = output_cotangent(case)
    # the weights always, and the present cache wherever there is a cache (the in-place path returns it)
    options64 = case.options("float64") | {"return_weights": True, "return_cache": case.return_cache or case.P > 0}
    fwd = reference.forward(config, t64, i64, options64, trace=True)
    grads, magnitudes = _reference_grads(case, t64, i64, d_out, config)
    # what each forward value is summed from: the tolerance's elementwise floor, and its logit scale z
    terms, logit_errors = forward_magnitudes(
        config, t64, i64["query"], i64.get("key"), i64.get("value"),
        **{name: i64.get(name) for name in reference.OPTIONAL_INPUTS + INDEXER_INPUTS}, is_causal=case.is_causal,
        causal_alignment=case.causal_alignment, training=case.training, logit_errors=True)
    expected = {"output": fwd["output"], "weights": fwd["weights"], "grads": grads, "magnitudes": magnitudes,
                "forward_magnitudes": terms, "logit_errors": logit_errors, "trace": fwd["trace"],
                "logits": dict(fwd["trace"])["logits"], "tensors": tensors, "inputs": inputs, "d_output": d_out,
                "same_precision": {}, "max_position": max_position(case, inputs), "selection": fwd.get("selection")}
    cache = [name for name in ("present_key", "present_value", "present_index_keys") if name in fwd]
    expected.update({name: fwd[name] for name in cache})
    if selection is not None:
        own = expected_for(case, dtype)
        expected["selection"] = np.asarray(selection)
        if "present_index_keys" in own:
            expected["present_index_keys"] = own["present_index_keys"]
        for name in tensors:  # the indexer's tensors: zero gradients (the selection is a constant)
            if name.startswith("indexer."):
                grads[name] = own["grads"][name]
                magnitudes[name] = own["magnitudes"][name]
    if dtype in ("float16", "bfloat16"):
        if config.indexer is not None:  # the same-dtype reference attends to float64's selection: its rounding alone
            config = dataclasses.replace(config, indexer=None)
            run_tensors = {name: t for name, t in tensors.items() if not name.startswith("indexer.")}
            run_inputs = {name: x for name, x in inputs.items() if name != "past_index_keys"} | {
                "topk_indices": fwd["selection"]}
        expected["low_call"] = (config, run_tensors, run_inputs, options64["return_cache"])  # chunked_same_precision
        low = reference.forward(config, run_tensors, run_inputs, case.options(dtype) | {
            "return_weights": True, "return_cache": options64["return_cache"]})
        low_grads = reference.vjp(config, run_tensors, run_inputs, case.options(dtype),
                                  d_out.astype(tensors["query.kernel"].dtype))["grads"]
        same = {name: _max_err(low[name], fwd[name]) for name in ("output", "weights", *cache) if name in low}
        same.update({f"grad {name}": _max_err(low_grads[name], grads[name]) for name in grads if name in low_grads})
        expected["same_precision"] = same
        nan = {name: _nan_only_in(low[name], fwd[name]) for name in ("output", "weights", *cache) if name in low}
        nan.update({f"grad {name}": _nan_only_in(low_grads[name], grads[name]) for name in grads
                    if name in low_grads})
        expected["same_precision_nan"] = {name: where for name, where in nan.items() if where is not None}
        if config.qkv_clip is not None:
            # The clip's gate as 16 bits see it: a value just above c in float64 can round onto the rounded
            # bound, inside the clip, and its gradient passes there where float64's is 0 with no terms. The
            # magnitudes count the terms the 16-bit gate passes too (the larger of the two runs'), the non-NaN
            # side of same_precision_nan (random_996499: bfloat16, the chunked core's float32 noise, 1e-8 of
            # an exact cancellation, through such a gate into grad key.bias, judged at margin 6e299).
            low_magnitudes = _reference_grads(case, run_tensors, run_inputs,
                                              d_out.astype(tensors["query.kernel"].dtype), config)[1]
            for name, m in low_magnitudes.items():
                if name in magnitudes:
                    magnitudes[name] = np.maximum(magnitudes[name], np.asarray(m, np.float64))
    return _remember(key, expected, disk)


def _remember(key, expected: dict, disk: str | None) -> dict:
    if len(_EXPECTED_CACHE) > 512:  # sweeps make thousands of cases
        flush_references()
        _EXPECTED_CACHE.clear()
        _DISK_KEYS.clear()
    _EXPECTED_CACHE[key] = expected
    if disk is not None:
        _DISK_KEYS[key] = disk
    return expected


def _expected_compressed(case: Case, dtype: str, selection=None) -> dict:
    """expected_for of a DeepSeek V4 case (config.compressed): impl_numpy.compressed's float64 forward on the
    inputs and weights rounded to `dtype`, with its trace, csa's selection and, with a cache, the present one; the
    float64 gradients (impl_numpy.compressed_backward: the layer's input "query", every tensor, the indexer's
    zero, and with a cache every past_<name>) and each gradient element's term magnitude, as the ordinary layer's.
    The output's elementwise term magnitudes come from the backward's magnitude pass (impl_numpy.magnitudes does
    not know the layer; compressed_attention_vjp's output_magnitude): the output is judged by the policy's
    tensor-wide bar at the reference's own size and, element by element, at least rtol * (1 + z) times its
    terms' size, as every other layer's output (a rank-1 output projection cancels: the V4 sweep's
    random_compressed_case(1403362), |output| 0.0069 of terms 1.05, float32 margins 0.72-0.97 on every mirror
    under the tensor-wide bar alone, float64 0.34), with z from the logits' sizes, S every key the case
    has (P + S: more than the window and the entries any query sees, so the bar is the looser for it) and, in
    16 bits, the reference's own error run in `dtype`, the output's and each gradient's (compressed_attention_vjp
    in `dtype`: its stages in float32, stored values and cotangents rounded to `dtype`), as for the ordinary layer.
    selection: a csa port's own admissible selection (judge_compressed_selection): the reference attends to it
    (compressed_attention's topk_indices), forward and gradients; its selection is then that one."""
    from impl_numpy.compressed_backward import compressed_attention_vjp

    tensors = cast_tensors(make_tensors(case), dtype)
    inputs = cast_inputs(make_inputs(case), dtype)
    t64, i64 = cast_tensors(tensors, "float64"), cast_inputs(inputs, "float64")
    options64 = case.options("float64") | {"return_cache": case.return_cache}
    given = {} if selection is None else {"topk_indices": np.asarray(selection, dtype=np.int64)}
    if given:  # the reference attending to the given selection (the adapter's call has no such input)
        fwd = _compressed_forward(case.config, t64, i64, case.return_cache, given["topk_indices"])
    else:
        fwd = reference.forward(case.config, t64, i64, options64, trace=True)
    d_out = output_cotangent(case)
    past = _compressed_past(i64)
    _, grads, magnitudes, out_terms = compressed_attention_vjp(
        case.config, t64, i64["query"], i64["positions"], past, d_output=d_out, gradient_magnitudes=True,
        output_magnitude=True, **given)
    logits = dict(fwd["trace"])["logits"]
    expected = {"output": fwd["output"], "weights": None, "grads": grads, "magnitudes": magnitudes,
                "forward_magnitudes": {"logits": np.abs(logits), "output": out_terms}, "logit_errors": {},
                "trace": fwd["trace"],
                "logits": logits, "tensors": tensors, "inputs": inputs, "d_output": d_out,
                "same_precision": {}, "max_position": case.P + case.T, "selection": fwd.get("selection")}
    expected.update({name: a for name, a in fwd.items() if name.startswith("present_")})
    if dtype in ("float16", "bfloat16"):  # the reference's own rounding in `dtype` (the low-precision rule)
        # attending to the float64 run's selection (csa), as the indexer layers' same-dtype reference does: the
        # error of its rounding alone, not of a selection that 16-bit scores would make otherwise
        chosen = {} if fwd.get("selection") is None else {"topk_indices": np.asarray(fwd["selection"], np.int64)}
        if chosen:
            low = _compressed_forward(case.config, tensors, inputs, False, chosen["topk_indices"])
        else:
            low = reference.forward(case.config, tensors, inputs, case.options(dtype) | {"return_cache": False})
        expected["same_precision"] = {"output": _max_err(low["output"], fwd["output"])}
        low_past = _compressed_past(inputs)
        _, low_grads = compressed_attention_vjp(case.config, tensors, inputs["query"], inputs["positions"], low_past,
                                                d_output=d_out.astype(tensors["query.kernel"].dtype), **chosen)
        expected["same_precision"].update({f"grad {name}": _max_err(low_grads[name], grads[name]) for name in grads})
    return expected


def _compressed_past(inputs: dict) -> dict | None:
    """A V4 call's cache as impl_numpy.compressed takes it: the past_<name> inputs by <name> (None: no cache)."""
    return {name.removeprefix("past_"): a for name, a in inputs.items() if name.startswith("past_")} or None


def _compressed_buffers(config, inputs: dict) -> dict:
    """A V4 case's inputs with its cache (past_<name>) in the in-place cache's buffers for the call's tokens
    (impl_numpy.compressed.to_buffers), under the same names."""
    from impl_numpy.compressed import to_buffers

    positions = np.asarray(inputs["positions"])
    past = to_buffers(config, _compressed_past(inputs), int(positions[0]), int(positions[-1]) + 1)
    return {name: a for name, a in inputs.items() if not name.startswith("past_")} | {
        f"past_{name}": a for name, a in past.items()}


def _compressed_read_back(config, inputs: dict, forward: dict) -> dict:
    """An in-place V4 call's answer with its present_<name> buffers read back as the copying call's cache
    (impl_numpy.compressed.logical_cache), which the judge holds to the reference's."""
    from impl_numpy.compressed import cache_names, logical_cache

    if "present_key" not in forward:
        return forward
    end = int(np.asarray(inputs["positions"])[-1]) + 1
    held = logical_cache(config, {name: np.asarray(forward[f"present_{name}"]) for name in cache_names(config)}, end)
    return forward | {f"present_{name}": a for name, a in held.items()}


def _compressed_forward(config, tensors: dict, inputs: dict, return_cache: bool, topk_indices) -> dict:
    """impl_numpy.compressed's forward (float64 arrays) attending to a given csa selection, as the adapter's
    answer: output, selection, trace, present_<name>."""
    from impl_numpy.compressed import compressed_attention

    past = _compressed_past(inputs)
    trace: list = []
    out, sel, *present = compressed_attention(config, tensors, inputs["query"], inputs["positions"], past,
                                              return_selection=True, return_cache=return_cache, trace=trace,
                                              topk_indices=topk_indices)
    answer = {"output": out, "selection": sel, "trace": [(e.stage, e.value) for e in trace]}
    answer.update({f"present_{name}": a for name, a in (present[0] if present else {}).items()})
    return answer


def chunked_same_precision(case: Case, dtype: str, exp: dict, block: int) -> float:
    """The same-dtype error of the output on a chunked path or a fused kernel: the larger of the NumPy stages'
    (exp's same_precision) and the NumPy chunked core's own, run in `dtype` on the same call with the same
    blocks (a fused kernel: the conformance block size, weights.paths.chunk_size).
    The chunked core keeps the softmax's numerators in the compute dtype where the stages store the weights
    in 16 bits, so the context it stores rounds other values: an element one 16-bit step apart on a context
    of 2 moves an output that cancels (terms of 5 summing to 0.05) by 16 of its own steps, and the stages'
    error is one sample of that noise, not its size (random_982380 bfloat16: the stages' 2.0e-4, NumPy's
    chunked core's, bit for bit MLX's, 1.2e-3; docs/conformance.md). A chunked core is judged against a careful
    chunked implementation in its dtype as well as against the stages; so is a fused kernel, which keeps the
    numerators in float32 too (random_997082, MLX's mx.fast.scaled_dot_product_attention, bfloat16: 6.1e-4
    against the stages' 1.4e-4 and the chunked core's 3.7e-4)."""
    found = exp.setdefault("same_precision_chunked", {})
    if block not in found:
        config, tensors, inputs, return_cache = exp["low_call"]
        low = reference.forward(config, tensors, inputs, case.options(dtype) | {
            "return_weights": False, "return_cache": return_cache, "chunk_size": block})
        found[block] = _max_err(low["output"], exp["output"])
    return max(exp["same_precision"]["output"], found[block])


def kernel_same_precision(case: Case, dtype: str, exp: dict, *, fused: bool) -> dict[str, float]:
    """The same-dtype errors ({"output", "grad <name>"}) of a second 16-bit formulation, the one chunked cores
    and fused kernels compute: NumPy's backward pass (impl_numpy.backward) with the chunked core's precision
    (chunked_core: the softmax's weights, the attend and their cotangents in float32, the context stored);
    for a fused kernel (fused=True) also with the scale folded into the stored query (fold_scale:
    q_s = round(q * round(scale)), logits q_s k^T), the other order a kernel may take. A chunked path's or a
    fused kernel's result is judged against the larger of this error and the stages' (judge,
    judge_gradients): both are careful implementations in the dtype, and one sample of either's rounding
    noise is not its size. (A chunked path rounds the logits as the stages do, the mirrors' chunked cores
    following impl_numpy/chunked.py: it gets no folded scale.)
    - Gradients: the chunked core's backward (autodiff through the online softmax) rounds other values than
      the stages' (their weights, the weights' cotangent, stored in 16 bits): random_differential_1012028
      float16, grad key: the stages' error 0.293, this formulation's 1.02, tf's, jax's and mlx's chunked
      paths' 1.01 (docs/conformance.md).
    - Outputs: MLX's fused kernel on CPU multiplies q by the scale in the inputs' dtype before the product
      (mlx/fast.cpp's fallback), one more 16-bit rounding of every logit's terms: random_1001932 float16, the
      stages' error 1.1e-4, MLX fused's 5.1e-4, the stages with the scale folded (fold_scale alone) 5.1e-4,
      bit for bit MLX's output (docs/conformance.md). ALiBi's bias, in that order, joins the logits rounded to
      the inputs' dtype, as a kernel's additive mask (random_long_2200020, bfloat16, ALiBi over 1038 keys: MLX
      fused 0.0747 from float64, this order 0.0747, the stages 0.0081).
    One backward pass per case, 16-bit dtype and kind (chunked, fused), computed the first time such a result
    is judged and kept in exp (expected_for's cache)."""
    cached = exp.setdefault("same_precision_kernel", {})
    found = cached.get(fused)
    if found is None:
        config, tensors, inputs, _ = exp["low_call"]
        options = case.options(dtype)
        # (a value this order stores past float16's range is its own answer, not a warning: _max_err counts
        # finite errors only, as for the stages' run)
        with np.errstate(over="ignore", invalid="ignore"):
            out, grads = multi_head_attention_vjp(
                config, tensors, inputs["query"], inputs.get("key"), inputs.get("value"),
                d_output=exp["d_output"].astype(tensors["query.kernel"].dtype),
                **{name: inputs.get(name) for name in reference.OPTIONAL_INPUTS + INDEXER_INPUTS},
                is_causal=case.is_causal, causal_alignment=case.causal_alignment, training=case.training,
                seed=options.get("seed"), dtype=options.get("dtype"), chunked_core=True, fold_scale=fused)
        found = {"output": _max_err(out, exp["output"])}
        found.update({f"grad {name}": _max_err(grads[name], exp["grads"][name]) for name in exp["grads"]
                      if name in grads})
        cached[fused] = found
    return found


def max_position(case: Case, inputs) -> int:
    """The largest |position| RoPE sees in the case (the tolerance's angle term)."""
    given = [np.abs(inputs[name]).max() for name in ("positions", "key_positions") if name in inputs]
    return int(max(given, default=case.P + max(case.T, case.S)))


def _reference_grads(case: Case, tensors, inputs, d_out, config=None):
    """float64 gradients and their term magnitudes (impl_numpy.backward)."""
    _, grads, magnitudes = multi_head_attention_vjp(
        case.config if config is None else config, tensors, inputs["query"], inputs.get("key"), inputs.get("value"),
        d_output=d_out, **{name: inputs.get(name) for name in reference.OPTIONAL_INPUTS + INDEXER_INPUTS},
        is_causal=case.is_causal, causal_alignment=case.causal_alignment, training=case.training,
        gradient_magnitudes=True,
    )
    return grads, magnitudes


def _nan_only_in(low, reference):
    """Where the 16-bit reference is NaN and the float64 one is not (None if nowhere). A gate that rounding
    opens or closes decides it: the QKV clip passes the gradient where |x| <= c, and a value rounded onto
    the rounded bound is inside it in 16 bits and outside in float64, so the NaN gradient of a masked_row
    "nan" row passes in one and not the other (the torch sweep's random_961557, bfloat16, grad value.kernel:
    NumPy's bfloat16 run and torch's both NaN where float64 gives 0)."""
    where = np.isnan(np.asarray(low, np.float64)) & ~np.isnan(np.asarray(reference, np.float64))
    return where if where.any() else None


def _max_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    d = np.where(both_nan, 0.0, np.abs(a - b))
    d = d[np.isfinite(d)]
    return float(d.max()) if d.size else 0.0


def judge(case: Case, dtype: str, result: dict, grads: dict | None, *, precision: str,
          options: dict | None = None, kernel: bool = False) -> list[Comparison]:
    """Compare a backend's forward result (and gradients) under the policy. options: the call's (default:
    the case's), which say whether weights and the present cache were asked for. kernel: the call ran a
    chunked core or the backend's fused kernel (its FAST_PATH, or the in-place path where the backend has a fused path for
    the call: _fused_in_place), which keep the softmax's numerators in the
    compute dtype: a 16-bit output is judged against a chunked reference too (chunked_same_precision)."""
    exp = expected_for(case, dtype)
    options = case.options(dtype) if options is None else options
    comparisons = []
    own = None  # the backend's own admissible selection, where it differs from the reference's
    if case.config.indexer is not None and result.get("selection") is not None:
        verdict, own = judge_selection(case, dtype, result["selection"], options)
        comparisons.append(verdict)
        exp = expected_for(case, dtype, own) if own is not None else exp
    if case.config.compressed is not None and case.config.compressed.kind == "csa":
        if result.get("selection") is None:
            raise ValueError("backend returned no selection for a csa layer (compressed_attention's "
                             "return_selection)")
        verdict, own = judge_compressed_selection(case, dtype, result["selection"])
        comparisons.append(verdict)
        exp = expected_for(case, dtype, own) if own is not None else exp

    def check(name, quantity, actual, expected, same_precision_error=None, logits=True):
        comparisons.append(compare(name, actual, expected, case_policy(
            case, dtype, name, quantity, expected, precision=precision, selection=own, logits=logits,
            same_precision_error=same_precision_error)))

    chunked = (kernel or options.get("chunk_size") is not None) and "low_call" in exp  # a kernel, in 16 bits
    fused = options.get("chunk_size") is None  # a fused kernel (its own order), not a chunked core
    check("output", "output", result["output"], exp["output"], max(chunked_same_precision(
        case, dtype, exp, options.get("chunk_size") or chunk_size(exp["inputs"])),
        kernel_same_precision(case, dtype, exp, fused=fused)["output"]) if chunked else None)
    if options.get("return_weights"):
        if "weights" not in result:
            raise ValueError("backend returned no weights although return_weights was requested")
        check("weights", "weights", result["weights"], exp["weights"])
    index_cache = ("present_index_keys",) if case.config.indexer is not None and "present_index_keys" in result else ()
    cache = ("present_key", "present_value", *index_cache)
    v4 = case.config.compressed is not None
    if v4:  # DeepSeek V4's cache: the window's keys, the entries, each compressor's open window and overlap half
        from impl_numpy.compressed import cache_names

        cache = tuple(f"present_{name}" for name in cache_names(case.config))
    for name in cache if options.get("return_cache") else ():
        if name not in result:
            raise ValueError(f"backend returned no {name} although return_cache was requested")
        # V4's cache is computed before the logits (the keys, the compressors' stages): the bar of the stages
        # before the logits (localise), no logit scale z; the other layers' present_key / present_value have
        # their elementwise magnitudes, this layer's none (impl_numpy.magnitudes does not know it)
        check(name, "output", result[name], exp[name], logits=not v4)
    if grads is not None:
        comparisons += judge_gradients(case, dtype, grads, precision=precision, selection=own,
                                       kernel=chunked, fused=fused)
    return comparisons


def judge_selection(case: Case, dtype: str, selection, options: dict) -> tuple[Comparison, np.ndarray | None]:
    """A backend's selection (config.indexer) against the float64 reference's: the same keys per query (the
    order of the slots is not judged), or keys swapped within the score allowance of the k-th score
    (conformance.suite.selection.judge_indexer). -> (the comparison, with the query and keys named when it
    fails; the backend's selection where it differs and is admissible, for the reference to attend to, else
    None)."""
    from conformance.suite.selection import judge_call_selection
    from conformance.suite.tolerance import Tolerance

    exp = expected_for(case, dtype)
    got = np.asarray(selection)
    if got.shape[:-1] == exp["selection"].shape[:-1] and _as_sets(got) == _as_sets(exp["selection"]):
        tol = Tolerance(0.0, 0.0, "the reference's keys for every query")
        return Comparison(True, "selection", 0.0, None, None, None, 0.0, tol), None
    verdict = judge_call_selection(case.config, exp["tensors"], exp["inputs"], options, got, dtype=dtype)
    reason = (f"{verdict.describe()} (judge_indexer; the output then judged against the float64 reference "
              "attending to this selection)")
    comparison = Comparison(verdict.ok, "selection", math.nan, None, None, None, verdict.margin,
                            Tolerance(0.0, 0.0, reason))
    return comparison, (got if verdict.ok else None)


def judge_compressed_selection(case: Case, dtype: str, selection) -> tuple[Comparison, np.ndarray | None]:
    """A V4 csa layer's selection (config.compressed, (B, T, k) entry indices) against the float64 reference's by
    the top-k rule (conformance.suite.selection.judge_compressed_selection: the same entries per query, or entries
    swapped within the score allowance of the k-th score; ties go to the earlier entry, the spec's). A comparison
    of its own, named "selection", so a port that selects wrong entries is named there. -> (the comparison; the
    backend's selection where it differs and is admissible, for the reference to attend to (expected_for), else
    None), as judge_selection."""
    from conformance.suite.selection import judge_compressed_selection as judge_entries
    from conformance.suite.tolerance import Tolerance

    exp = expected_for(case, dtype)
    got = np.asarray(selection)
    if got.shape == exp["selection"].shape and _as_sets(got) == _as_sets(exp["selection"]):
        tol = Tolerance(0.0, 0.0, "the reference's entries for every query")
        return Comparison(True, "selection", 0.0, None, None, None, 0.0, tol), None
    if got.shape != exp["selection"].shape:
        tol = Tolerance(0.0, 0.0, f"a selection of shape {exp['selection'].shape} (B, T, index_topk)")
        return Comparison(False, f"selection (shape {got.shape} != {exp['selection'].shape})", math.inf,
                          None, None, None, math.inf, tol), None
    verdict = judge_entries(case.config, exp["tensors"], exp["inputs"], got, dtype=dtype)
    reason = (f"{verdict.describe()} (the top-k rule over the csa index scores: selection.judge_compressed_selection;"
              " the output then judged against the float64 reference attending to this selection)")
    comparison = Comparison(verdict.ok, "selection", math.nan, None, None, None, verdict.margin,
                            Tolerance(0.0, 0.0, reason))
    return comparison, (got.astype(np.int64) if verdict.ok else None)


def _as_sets(selection) -> list:
    """Each query's selected keys as a set (-1 padding dropped): the attention takes a selection as a set."""
    sel = np.asarray(selection)
    return [frozenset(int(j) for j in sel[row] if j >= 0) for row in np.ndindex(*sel.shape[:-1])]


def case_policy(case: Case, dtype: str, name: str, quantity: str, reference, *, precision: str = "highest",
                scale_floor: float = 0.0, logits: bool = True, selection=None, same_precision_error=None):
    """The policy's Tolerance for one quantity of a case (its S is every key, the cache's included): z from the
    logits' magnitudes, and a forward quantity's elementwise floor from its own (output, present_key,
    present_value and every traced stage; the weights are nonnegative, their own magnitude), and a gradient's
    from impl_numpy.backward's gradient magnitudes, element by element. Downstream of
    the softmax (weights, output, the softmax to output stages) the logit term follows the keys that carry
    weight: impl_numpy.magnitudes' logit errors (tolerance.policy_for's logit_error). same_precision_error: the
    16-bit error to judge by where not the NumPy stages' (a chunked core's output: chunked_same_precision)."""
    exp = expected_for(case, dtype, selection)
    terms = exp["forward_magnitudes"]
    logit_terms = terms["alibi"] if "alibi" in terms else terms["logits"]  # ALiBi's bias is part of the logits' size
    # downstream of the softmax z comes from the keys that carry weight (magnitudes' logit errors); the weights
    # are nonnegative, their own magnitude
    stage = "softmax" if name == "weights" else name
    weighted = exp["logit_errors"].get(stage) if quantity != "grad" else None
    magnitude = terms.get(name) if quantity in ("output", "stage") else None
    if quantity == "grad":  # each gradient element's own term magnitude (impl_numpy.backward's)
        magnitude = exp["magnitudes"].get(name.removeprefix("grad "))
    if name == "weights" and weighted is not None:
        magnitude = exp["weights"]
    tol = policy_for(case.config, dtype=dtype, quantity=quantity, B=case.B, T=case.T, S=case.S_total,
                      reference=reference, logits=logit_terms if logits else None, precision=precision,
                      same_precision_error=None if quantity == "stage" else exp["same_precision"].get(name)
                      if same_precision_error is None else same_precision_error,
                      scale_floor=scale_floor, max_position=exp["max_position"], magnitude=magnitude,
                      logit_error=weighted)
    nan_allowed = exp.get("same_precision_nan", {}).get(name) if quantity != "stage" else None
    if nan_allowed is None:
        return tol
    return dataclasses.replace(tol, nan_allowed=nan_allowed, reason=(
        f"{tol.reason}; NaN also where the {dtype} reference is NaN and float64's is not "
        f"({int(nan_allowed.sum())} elements: a gate rounding decides, see compare._nan_only_in)"))


def judge_gradients(case: Case, dtype: str, grads: dict, *, precision: str = "highest",
                    selection=None, kernel: bool = False, fused: bool = False) -> list[Comparison]:
    """Compare gradients (query, key, value, every canonical tensor, past_key
    and past_value with a cache) under the policy: each element allowed at
    least the rounding of the terms it is summed from (case_policy). selection: the backend's own admissible
    selection (expected_for). kernel: a 16-bit chunked core's or fused kernel's gradients, judged against the
    larger of the stages' and the kernel formulation's same-dtype error (kernel_same_precision; fused: a fused
    kernel's formulation, not a chunked core's)."""
    exp = expected_for(case, dtype, selection)
    other = kernel_same_precision(case, dtype, exp, fused=fused) if kernel and "low_call" in exp else {}
    comparisons = []
    for name, expected in exp["grads"].items():
        if name not in grads:
            raise ValueError(f"backend returned no gradient for {name}")
        key = f"grad {name}"
        same = None
        if key in other and key in exp["same_precision"]:
            same = max(exp["same_precision"][key], other[key])
        tol = case_policy(case, dtype, key, "grad", expected, precision=precision, selection=selection,
                          same_precision_error=same)
        comparisons.append(compare(key, grads[name], expected, tol))
    return comparisons


def localise(case: Case, dtype: str, adapter, *, device: str, precision: str) -> Divergence | None:
    """Re-run with the trace and name the first stage beyond tolerance. A layer with an indexer records its
    stages first (weights.call.INDEXER_STAGES): each numeric one judged as any stage, its selection
    (indexer.selection) by the top-k rule (judge_selection: keys swapped within the score allowance agree; the
    blocks are judged through the keys they expand to), and after an admissible selection of the port's own the
    attention's stages against the float64 reference attending to it (a swap there is no divergence)."""
    exp = expected_for(case, dtype)
    options = case.options(dtype)
    try:
        traced = adapter.forward(case.config, exp["tensors"], exp["inputs"], options, device=device,
                                 precision=precision, trace=True)
    except NotImplementedError:
        return None
    ref_stages = dict(exp["trace"])
    seen_logits = False
    own = None  # the port's own admissible selection, where it differs from the reference's
    for stage, value in traced.get("trace", []):
        if stage == "indexer.selection":
            verdict, own = judge_selection(case, dtype, value, options)
            if not verdict.ok:
                return Divergence(stage, None, None, None, verdict.margin, detail=verdict.tolerance.reason)
            if own is not None:
                ref_stages = {**ref_stages, **dict(expected_for(case, dtype, own)["trace"])}
            continue
        if stage not in ref_stages or stage == "indexer.blocks":
            continue
        seen_logits = seen_logits or stage == "logits"
        expected = ref_stages[stage]
        tol = case_policy(case, dtype, stage, "stage", expected, precision=precision, logits=seen_logits,
                          selection=own)
        c = compare(stage, value, expected, tol)
        if not c.ok:
            return Divergence(stage, c.index, c.actual, c.expected, c.margin)
    return None


def localise_call(config, tensors: dict, inputs: dict, options: dict, traced, *,
                  precision: str = "highest") -> Divergence | None:
    """localise for one call outside the grid (`mha trace --against-reference`): `traced`, a backend's trace of
    the call ([(stage, array)], run with these tensors, inputs and options: options["dtype"], else the tensors'
    dtype), against the float64 reference's trace of the same values rounded to that dtype, stage by stage
    under the policy (tensor-wide: a grid case's elementwise magnitudes are not computed here); the indexer's
    selection by the top-k rule, and after an admissible selection of the port's own the attention's stages
    against the reference attending to it. -> the first stage beyond its tolerance, or None."""
    from conformance.suite.selection import judge_call_selection

    dtype = options.get("dtype") or np.asarray(next(iter(tensors.values()))).dtype.name
    t64 = cast_tensors(cast_tensors(tensors, dtype), "float64")
    i64 = cast_inputs(cast_inputs(inputs, dtype), "float64")
    plain = {k: v for k, v in options.items() if k not in ("return_weights", "return_cache")} | {"dtype": "float64"}
    ref = dict(reference.forward(config, t64, i64, plain, trace=True)["trace"])
    B, T = np.shape(inputs["query"])[:2]
    S_total = ref["logits"].shape[-1] if "logits" in ref else T
    given = [np.abs(inputs[name]).max() for name in ("positions", "key_positions") if name in inputs]
    last = int(max(given, default=S_total))
    seen_logits = False
    for stage, value in traced:
        if stage == "indexer.selection":
            verdict = judge_call_selection(config, t64, i64, options, value, dtype=dtype)
            if not verdict.ok:
                return Divergence(stage, None, None, None, verdict.margin, detail=verdict.describe())
            if _as_sets(value) != _as_sets(ref[stage]):  # the attention given the port's own (admissible) keys
                own = dataclasses.replace(config, indexer=None)
                t_own = {n: t for n, t in t64.items() if not n.startswith("indexer.")}
                i_own = {n: x for n, x in i64.items() if n != "past_index_keys"} | {
                    "topk_indices": np.asarray(value, dtype=np.int64)}
                ref |= dict(reference.forward(own, t_own, i_own, plain, trace=True)["trace"])
            continue
        if stage not in ref or stage == "indexer.blocks":
            continue
        seen_logits = seen_logits or stage == "logits"
        expected = ref[stage]
        tol = policy_for(config, dtype=dtype, quantity="stage", B=B, T=T, S=S_total, reference=expected,
                         logits=ref["logits"] if seen_logits else None, precision=precision, max_position=last)
        c = compare(stage, value, expected, tol)
        if not c.ok:
            return Divergence(stage, c.index, c.actual, c.expected, c.margin)
    return None


def path_options(adapter, path: str, case: Case, dtype: str) -> dict | None:
    """The call options that run `path` of the adapter on the case (its path_options), the case's own for
    DEFAULT_PATH; None where the path does not exist for this case and dtype (an in-place cache without a
    cache, a fused core that 16-bit storage never takes). Raises NotImplementedError with the reason where
    the path exists but cannot take this call (SDPA and a softcap)."""
    options = case.options(dtype)
    if case.config.compressed is not None:  # DeepSeek V4's layer: its compressed module, copying its cache ...
        if path in (DEFAULT_PATH, "stages"):
            return options
        # ... and in place, on a case with a cache, where the adapter runs it in a plain check (COMPRESSED_IN_PLACE:
        # numpy, torch, jax, mlx)
        if path == "in_place" and getattr(adapter, "COMPRESSED_IN_PLACE", False) and "past_key" in expected_for(
                case, dtype)["inputs"]:
            return options | {"in_place": True, "forward_only": IN_PLACE_FORWARD_ONLY}
        # ... and block-wise (compressed_attention's chunk_size=: attend_blockwise) where the adapter has that path
        # (COMPRESSED_CHUNKED: numpy, torch, jax, mlx), in the chunked path's blocks: weights.paths.chunk_size (2 on
        # the grid's V4 cases: query blocks of 2 rows, the window's 4 keys and the entries in blocks of 2, so that
        # blocks are skipped and the online softmax crosses blocks). Forward and gradients, by the backend's own
        # autodiff through the block-wise path; forward only where the backend's backward is not of that path
        # (COMPRESSED_CHUNKED_FORWARD_ONLY: NumPy's, compressed_backward.py, is the stages' VJP)
        if path == "chunked" and getattr(adapter, "COMPRESSED_CHUNKED", False):
            found = options | {"chunk_size": chunk_size(expected_for(case, dtype)["inputs"])}
            reason = getattr(adapter, "COMPRESSED_CHUNKED_FORWARD_ONLY", None)
            return found | ({"forward_only": reason} if reason else {})
        # ... refused with the reason where the adapter's backend cannot run the path (Keras on jax and torch:
        # COMPRESSED_REFUSED), on the cases that would have the row
        refused = getattr(adapter, "COMPRESSED_REFUSED", {}).get(path)
        if refused and (path == "chunked" or "past_key" in expected_for(case, dtype)["inputs"]):
            raise NotImplementedError(refused)
        return None
    if path == DEFAULT_PATH:
        return options
    if path == "chunked" and path not in getattr(adapter, "PATHS", ()) and getattr(adapter, "COMPRESSED_CHUNKED", False):
        return None  # a backend whose chunked path is DeepSeek V4's block-wise one alone (torch): no row here
    if path not in getattr(adapter, "PATHS", ()):
        raise ValueError(f"path must be one of {', '.join(getattr(adapter, 'PATHS', ())) or DEFAULT_PATH}: "
                         f"got {path!r}")
    return adapter.path_options(path, case.config, expected_for(case, dtype)["inputs"], options)


def _fused_in_place(adapter, case: Case, dtype: str, options: dict) -> bool:
    """Whether an in-place call may run the backend's fused kernel: no weights asked for, and the backend has a
    fused path that takes this call (MLX's in-place call runs mx.fast.scaled_dot_product_attention; NumPy's, in
    16 bits, the stages, its fused path not existing there). Its 16-bit result is then judged as a kernel's."""
    fast = getattr(adapter, "FAST_PATH", None)
    if options.get("return_weights") or fast is None:
        return False
    try:
        return path_options(adapter, fast, case, dtype) is not None
    except NotImplementedError:
        return False


def run_case_paths(case: Case, backend_id: str, paths, *, device: str = "cpu", dtype: str = "float32",
                   precision: str = "highest", gradients: bool = True, adapter=None,
                   keep_arrays: bool = False) -> list[CaseResult]:
    """run_case on each of `paths` (those that exist for the case). Where the adapter runs several calls as one
    program (forward_and_vjp_paths: impl_jax, whose cold cost is a compile per program), the paths that run
    forward and VJP on the case's own inputs (not an in-place cache, not forward only) run together first and
    are judged one by one as run_case judges them; anything that stops the joint run (a path that cannot take
    the call, a crash) leaves each path to run alone, its refusal or error its own."""
    computed: dict = {}
    share = 0.0
    together = getattr(adapter, "forward_and_vjp_paths", None)  # (an adapter not given: each path alone)
    if together is not None and gradients and case.config.compressed is None \
            and not backends.not_yet(backend_id, case.config):
        chosen = {}
        for path in paths:
            try:
                options = path_options(adapter, path, case, dtype)
            except (NotImplementedError, ValueError):
                continue
            if options is not None and not options.get("forward_only") and not options.get("in_place"):
                chosen[path] = options
        if len(chosen) > 1:
            exp = expected_for(case, dtype)
            d_out = exp["d_output"].astype(exp["tensors"]["query.kernel"].dtype)
            started = time.perf_counter()
            try:
                answers = together(case.config, exp["tensors"], exp["inputs"], list(chosen.values()), d_out,
                                   device=device, precision=precision)
                computed = dict(zip(chosen, answers))
            except Exception:  # noqa: BLE001 - each path runs alone below, and reports its own refusal or error
                computed = {}
            share = (time.perf_counter() - started) / len(chosen)  # each joined path's part of the joint run
    results = []
    for path in paths:
        result = run_case(case, backend_id, device=device, dtype=dtype, precision=precision, gradients=gradients,
                          adapter=adapter, keep_arrays=keep_arrays, path=path, computed=computed.get(path))
        if result is not None:
            result.seconds += share if path in computed else 0.0
            results.append(result)
    return results


def run_case(case: Case, backend_id: str, *, device: str = "cpu", dtype: str = "float32", precision: str = "highest",
             gradients: bool = True, adapter=None, keep_arrays: bool = False,
             path: str = DEFAULT_PATH, computed: tuple | None = None) -> CaseResult | None:
    """One (case, backend, device, dtype) on one of the backend's paths: forward (+ gradients), judged.
    None where the path does not exist for this case (path_options). computed: the path's (forward answer,
    gradients), already run with the case's other paths (run_case_paths), judged here."""
    started = time.perf_counter()
    result = CaseResult(case.name, backend_id, device, dtype, precision, STATUS_PASS, path=path)
    try:
        adapter = adapter or backends.load(backend_id)
        reason = backends.not_yet(backend_id, case.config)
        if reason:
            raise NotImplementedError(reason)
        exp = expected_for(case, dtype)
        options = path_options(adapter, path, case, dtype)
        if options is None:
            return None
        forward = grads = None
        inputs, v4_in_place = exp["inputs"], case.config.compressed is not None and options.get("in_place")
        if v4_in_place:  # V4's in-place cache: its buffers hold the case's cache, and are read back as one
            inputs = _compressed_buffers(case.config, inputs)
        d_out = exp["d_output"].astype(exp["tensors"]["query.kernel"].dtype)
        both = getattr(adapter, "forward_and_vjp", None)  # one pass for both, where the backend offers it
        if computed is not None:
            forward, grads = computed
        elif gradients and not options.get("forward_only") and both is not None:
            try:
                forward, grads = both(case.config, exp["tensors"], inputs, options, d_out, device=device,
                                      precision=precision)
            except NotImplementedError:
                pass  # the forward alone, then the gradients' own refusal, below
        if forward is None:
            forward = adapter.forward(case.config, exp["tensors"], inputs, options, device=device,
                                      precision=precision)
        if v4_in_place:
            forward = _compressed_read_back(case.config, inputs, forward)
        if gradients and options.get("forward_only"):
            result.message = f"forward only: {options['forward_only']}"
        elif gradients and grads is None:
            try:
                grads = adapter.vjp(case.config, exp["tensors"], exp["inputs"], options, d_out, device=device,
                                    precision=precision)["grads"]
            except NotImplementedError as err:
                result.message = f"gradients unsupported: {err}"
        result.comparisons = judge(case, dtype, forward, grads, precision=precision, options=options,
                                   kernel=path in ("chunked", getattr(adapter, "FAST_PATH", None))
                                   or (path == "in_place" and _fused_in_place(adapter, case, dtype, options)))
        got_dtype = np.asarray(forward["output"]).dtype
        if got_dtype.name != dtype:
            result.comparisons.append(Comparison(False, f"output dtype {got_dtype.name}, expected {dtype}", math.inf,
                                                 None, None, None, math.inf, result.comparisons[0].tolerance))
        if keep_arrays:
            result.arrays = {"reference_weights": exp["weights"], "backend_weights": forward.get("weights"),
                             "reference_output": exp["output"], "backend_output": forward["output"]}
        if not all(c.ok for c in result.comparisons):
            result.status = STATUS_FAIL
            result.divergence = localise(case, dtype, adapter, device=device, precision=precision)
            if result.divergence is None and path not in (DEFAULT_PATH, "stages"):
                result.message = ((result.message + "; " if result.message else "")
                                  + f"the stages agree with the reference: the difference is the {path} path's own")
            known = getattr(adapter, "known_difference", None)
            reason = known(case, dtype) if known is not None else None
            if reason:  # a native layer that differs by design: still a failure, with its reason
                result.message = (result.message + "; " if result.message else "") + f"known difference: {reason}"
    except NotImplementedError as err:
        result.status, result.message = STATUS_UNSUPPORTED, str(err) or "not implemented"
    except backends.BackendUnavailable as err:
        result.status, result.message = STATUS_UNSUPPORTED, str(err)
    except Exception as err:  # a backend crash is a finding, not a crash of the suite
        result.status = STATUS_ERROR
        result.message = f"{type(err).__name__}: {err}".replace("\n", " ")[:500]
        result.arrays = {"traceback": traceback.format_exc()}
    result.seconds = time.perf_counter() - started
    return result
