"""`mha verify --impl MODULE:FUNCTION`: check an outside implementation
against the shipped vectors (docs/verify-in-ci.md is the user's guide).

The function is called once per vector as `fn(config, tensors, inputs, options)`:
  config   the AttentionConfig as a plain dict (its JSON fields)
  tensors  canonical tensors, name -> ndarray in the vector's dtype
  inputs   every `inputs.*` array of the vector, unchanged: query, key, value
           and, where the vector has them, mask (bool, True = may attend),
           bias, dropout_mask (bool, True = keep), and whatever inputs later
           vector formats add (some of them integer arrays)
  options  every option of the vector, unchanged (is_causal,
           causal_alignment, return_weights, dtype, training, ...), plus
           `cotangent`: the vector's output cotangent, float64 (B, T, O),
           where the vector carries gradients
and returns a dict with
  output   (B, T, O), and every other quantity the vector's tolerance names
           (weights (B, N, T, S) when options["return_weights"], ...)
  grads    optional: name -> gradient of sum(output * cotangent), for query,
           key, value and every canonical tensor name (query.kernel ...):
           each `expected.grad.<name>` of the vector is checked. Without it
           the vector is verified on the forward pass only ("forward only");
           --require-gradients makes that a failure.
  trace    optional: a list of (stage name, array) pairs of the forward pass;
           a failing vector then names the first stage that left the
           tolerance, against impl_numpy's stages of the same name.
  not_returned  optional: quantity -> reason, for what the implementation's
           API has no way to give (a layer that returns no attention
           weights: {"weights": "..."}; a self-attention layer's one input:
           {"grad query": ..., "grad key": ..., "grad value": ...}). Those
           are not checked, and the reason is reported; "output" always is.
Raising NotImplementedError marks a vector "unsupported" (a failure unless
--allow-unsupported). Exit 0 only if every vector passes.

A user's own sharded attention (`--shard sequence:N` or `--shard heads:N`,
docs/sharding.md): the function wraps its own sharding. It is called as
`fn(config, tensors, inputs, options, mesh=mesh)` with the same whole arrays
and returns the same whole results; `mesh` is a jax.sharding.Mesh over the
first N of jax.devices() with one axis named after the kind ("sequence" or
"heads"). On a CPU the N devices are XLA host devices, asked for through
XLA_FLAGS before JAX starts (conformance.suite.sharded.force_host_devices). Each
result, the --json records and the JUnit classname carry the sharding
{"engine": "jax", "kind", "devices"}. A torch process-group mode is not
built: --shard-engine torch is refused with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from conformance.suite.tolerance import Comparison, Tolerance, compare, comparison_status, policy_for
from conformance.suite.vectors import DEFAULT_DIR, Vector, load_all
from weights.dtypes import is_float

STATUS_PASS, STATUS_FAIL, STATUS_UNSUPPORTED, STATUS_ERROR = "pass", "fail", "unsupported", "error"
# What a passing vector's gradients were: checked, not returned by the function, or none in the vector.
GRADIENTS_CHECKED, GRADIENTS_FORWARD_ONLY, GRADIENTS_NONE = "checked", "forward only", "none in vector"
GRAD_PREFIX = "grad "  # tolerance keys of gradients: "grad query.kernel"


@dataclasses.dataclass
class VerifyResult:
    name: str
    status: str  # pass | fail | unsupported | error
    detail: str  # one line: why, or the worst comparison of a pass
    margin: float = 0.0
    gradients: str = GRADIENTS_NONE
    comparisons: list[Comparison] = dataclasses.field(default_factory=list)
    divergence: str | None = None  # the first divergent stage (a failing vector whose function returned a trace)
    seconds: float = 0.0
    traceback: str = ""  # the function's own traceback, for status error
    unchecked: dict[str, str] = dataclasses.field(default_factory=dict)  # quantity -> why the function has none
    sharding: dict | None = None  # {"engine", "kind", "devices"} when the function ran on a mesh (--shard)

    @property
    def forward_only(self) -> bool:
        return self.status == STATUS_PASS and self.gradients == GRADIENTS_FORWARD_ONLY

    @property
    def label(self) -> str:
        return "pass (forward only)" if self.forward_only else self.status

    def to_json(self) -> dict:
        """The `--json` record of this vector."""
        margin = self.margin if np.isfinite(self.margin) else str(self.margin)
        return {"name": self.name, "status": self.status, "label": self.label, "detail": self.detail,
                "margin": margin, "gradients": self.gradients, "seconds": round(self.seconds, 4),
                "unchecked": dict(self.unchecked), "divergence": self.divergence, "sharding": self.sharding,
                "not_judged": sum(c.ok and not c.judged for c in self.comparisons),
                "comparisons": [{"name": c.name, "ok": c.ok, "status": comparison_status(c),
                                 "margin": c.margin if np.isfinite(c.margin) else str(c.margin),
                                 "rtol": c.tolerance.rtol, "atol": c.tolerance.atol, "reason": c.tolerance.reason,
                                 "not_judged": c.not_judged} for c in self.comparisons]}

    def message(self) -> str:
        """What `mha verify --verbose` prints for this vector (and a failing pytest item says)."""
        lines = [f"{self.label} {self.name}: {self.detail}"]
        if self.status == STATUS_FAIL:
            lines += [f"  {c.describe()}" for c in self.comparisons if not c.ok]
        if self.divergence:
            lines.append(f"  {self.divergence}")
        return "\n".join(lines)


def load_function(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--impl must be MODULE:FUNCTION: got {spec!r}")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # let users point at a module beside them
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--impl {spec}: cannot import {module_name}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--impl {spec}: {module_name} has no callable {attr!r}")
    return fn


def gradient_names(vector: Vector) -> list[str]:
    """Every gradient the vector carries (expected.grad.<name>)."""
    return [key[len("grad."):] for key in vector.expected if key.startswith("grad.")]


def forward_quantities(vector: Vector) -> list[str]:
    """Every non-gradient quantity the vector's tolerance names, output first."""
    names = [q for q in vector.tolerance if not q.startswith(GRAD_PREFIX)]
    return sorted(names, key=lambda q: (q != "output", q))


def _tolerance(vector: Vector, key: str) -> Tolerance:
    t = vector.tolerance[key]
    return Tolerance(t["rtol"], t["atol"], t["reason"], floor=vector.allowance.get(key))


def _call(fn, vector: Vector):
    options = dict(vector.options)
    if vector.cotangent is not None:
        options["cotangent"] = vector.cotangent.copy()
    return fn(vector.config.to_dict(), {k: v.copy() for k, v in vector.tensors.items()},
              {k: v.copy() for k, v in vector.inputs.items()}, options)


def verify_vector(fn, vector: Vector, *, require_gradients: bool = False) -> VerifyResult:
    """Call `fn` on one vector and judge every quantity it carries."""
    started = time.perf_counter()
    result = _verify(fn, vector, require_gradients)
    result.seconds = time.perf_counter() - started
    return result


def core_backend(fn) -> str | None:
    """The core backend (backends.CORE) a function of an impl_<backend> package runs as, named as `mha check` names
    its column: its adapter's NAME where it has one (impl_tf's: the Keras backend Keras runs on, tf, keras-jax or
    keras-torch), else the package's (impl_mlx: mlx); None for a function of no impl_ package (a user's)."""
    module = getattr(fn, "__module__", "") or ""
    if not module.startswith("impl_"):
        return None
    package = module.split(".")[0]
    try:
        adapter = importlib.import_module(f"{package}.adapter")  # imported already where fn is its own
    except ImportError:
        adapter = None
    return getattr(adapter, "NAME", None) or package.removeprefix("impl_")


def _not_yet(fn, config) -> str | None:
    """A core backend's own function (impl_<backend>.adapter:attention) on a config field that backend does not
    take yet: conformance.suite.backends.NOT_YET's reason for the backend it runs as (core_backend), or None."""
    backend_id = core_backend(fn)
    if backend_id is None:
        return None
    from conformance.suite import backends

    return backends.not_yet(backend_id, config)


def selection_verdict(vector: Vector, answer: dict) -> tuple[Comparison | None, dict]:
    """A returned selection (a config with `indexer`: the answer's "selection", topk_indices format) judged
    against the float64 reference's (the vector's expected.selection) by conformance.suite.selection: the same
    keys per query, or swaps within the score allowance. -> (the comparison, or None where nothing was
    returned; the expected values to judge the rest by: the vector's own, or, for an admissible selection of
    its own, the float64 reference attending to it (impl_numpy, computed here)."""
    expected = dict(vector.expected)
    if answer.get("selection") is not None and "selection" in vector.expected and vector.config.compressed is not None:
        return compressed_selection_verdict(vector, answer["selection"], expected)
    if vector.config.indexer is None or answer.get("selection") is None or "selection" not in vector.expected:
        return None, expected
    from conformance.suite.compare import _as_sets
    from conformance.suite.selection import judge_call_selection

    got = np.asarray(answer["selection"])
    want = vector.expected["selection"]
    if got.shape[:-1] == want.shape[:-1] and _as_sets(got) == _as_sets(want):
        return Comparison(True, "selection", 0.0, None, None, None, 0.0,
                          Tolerance(0.0, 0.0, "the reference's keys for every query")), expected
    verdict = judge_call_selection(vector.config, vector.tensors, vector.inputs, vector.options, got,
                                   dtype=vector.dtype)
    comparison = Comparison(verdict.ok, "selection", float("nan"), None, None, None, verdict.margin,
                            Tolerance(0.0, 0.0, verdict.describe()))
    if verdict.ok:
        expected.update(reference_with_selection(vector, got))
    return comparison, expected


def compressed_selection_verdict(vector: Vector, selection, expected: dict) -> tuple[Comparison, dict]:
    """A DeepSeek V4 csa layer's returned selection (config.compressed; (B, T, k) entry indices) judged against
    the vector's expected.selection by the top-k rule (conformance.suite.selection.judge_compressed_selection),
    as run_case judges it (compare.judge_compressed_selection). -> (the comparison; the expected values to judge
    the rest by: the vector's own, or, for an admissible selection of its own, the float64 reference attending to
    it: output, present cache and the gradients the vector carries, computed here)."""
    from conformance.suite.compare import _as_sets
    from conformance.suite.selection import judge_compressed_selection

    got = np.asarray(selection)
    want = vector.expected["selection"]
    if got.shape == want.shape and _as_sets(got) == _as_sets(want):
        return Comparison(True, "selection", 0.0, None, None, None, 0.0,
                          Tolerance(0.0, 0.0, "the reference's entries for every query")), expected
    if got.shape != want.shape:
        return Comparison(False, f"selection (shape {got.shape} != {want.shape})", float("inf"), None, None, None,
                          float("inf"), Tolerance(0.0, 0.0, f"a selection of shape {want.shape} (B, T, index_topk)")
                          ), expected
    verdict = judge_compressed_selection(vector.config, vector.tensors, vector.inputs, got, dtype=vector.dtype)
    comparison = Comparison(verdict.ok, "selection", float("nan"), None, None, None, verdict.margin,
                            Tolerance(0.0, 0.0, verdict.describe()))
    if verdict.ok:
        expected = expected | compressed_reference_with_selection(vector, got)
    return comparison, expected


def compressed_reference_with_selection(vector: Vector, selection) -> dict[str, np.ndarray]:
    """The float64 V4 reference (impl_numpy.compressed) on the vector's inputs attending to a csa `selection`
    (compressed_attention's topk_indices): output, present_<name> and the gradients the vector carries."""
    from impl_numpy.compressed import compressed_attention
    from impl_numpy.compressed_backward import compressed_attention_vjp

    t64 = {n: np.asarray(t).astype(np.float64) for n, t in vector.tensors.items()}
    i64 = {n: (np.asarray(x).astype(np.float64) if is_float(np.asarray(x).dtype) else np.asarray(x))
           for n, x in vector.inputs.items()}
    past = {n.removeprefix("past_"): a for n, a in i64.items() if n.startswith("past_")} or None
    sel = np.asarray(selection, dtype=np.int64)
    out, present = compressed_attention(vector.config, t64, i64["query"], i64["positions"], past, return_cache=True,
                                        topk_indices=sel)
    found = {"output": out, **{f"present_{n}": a for n, a in present.items()}}
    if vector.cotangent is not None:
        _, grads = compressed_attention_vjp(vector.config, t64, i64["query"], i64["positions"], past,
                                            d_output=vector.cotangent, topk_indices=sel)
        found.update({f"grad.{n}": g for n, g in grads.items()})
    return found


def reference_with_selection(vector: Vector, selection) -> dict[str, np.ndarray]:
    """The float64 reference (impl_numpy) on the vector's inputs attending to `selection` (its config without
    the indexer, the selection as topk_indices): output, weights, present_key / present_value and the
    gradients the vector carries (the indexer's tensors' zero)."""
    from impl_numpy import adapter as reference

    config = dataclasses.replace(vector.config, indexer=None)
    f64 = {n: np.asarray(t).astype(np.float64) for n, t in vector.tensors.items() if not n.startswith("indexer.")}
    inputs = {n: (np.asarray(x).astype(np.float64) if is_float(np.asarray(x).dtype) else x)
              for n, x in vector.inputs.items() if n != "past_index_keys"} | {"topk_indices": np.asarray(selection)}
    options = dict(vector.options) | {"dtype": "float64", "return_cache": bool(vector.options.get("return_cache"))}
    fwd = reference.forward(config, f64, inputs, options)
    found = {name: fwd[name] for name in ("output", "weights", "present_key", "present_value") if name in fwd}
    if vector.cotangent is not None:
        grads = reference.vjp(config, f64, inputs, options, vector.cotangent)["grads"]
        found.update({f"grad.{name}": g for name, g in grads.items()})
    return found


def _verify(fn, vector: Vector, require_gradients: bool) -> VerifyResult:
    name = vector.name
    reason = _not_yet(fn, vector.config)
    if reason:
        return VerifyResult(name, STATUS_UNSUPPORTED, reason)
    try:
        answer = _call(fn, vector)
    except NotImplementedError as err:
        return VerifyResult(name, STATUS_UNSUPPORTED, str(err) or "NotImplementedError")
    except Exception as err:  # the implementation under test crashed: report, go on
        return VerifyResult(name, STATUS_ERROR, f"{type(err).__name__}: {err}".replace("\n", " ")[:500],
                            traceback=traceback.format_exc())
    if not isinstance(answer, dict) or "output" not in answer:
        return VerifyResult(name, STATUS_ERROR, f"returned {type(answer).__name__}, expected a dict with 'output'")
    not_returned = answer.get("not_returned") or {}
    if not isinstance(not_returned, dict):
        return VerifyResult(name, STATUS_ERROR, f"not_returned is a {type(not_returned).__name__}, expected a dict "
                            "quantity -> reason")
    unchecked: dict[str, str] = {}
    comparisons: list[Comparison] = []
    try:
        chosen, expected = selection_verdict(vector, answer)
    except ValueError as err:  # a selection of the wrong shape
        return VerifyResult(name, STATUS_FAIL, f"selection: {err}")
    if chosen is not None:
        comparisons.append(chosen)
    for q in forward_quantities(vector):
        if q not in answer and q != "output" and q in not_returned:
            unchecked[q] = str(not_returned[q])
            continue
        if q not in answer:
            why = " (options[\"return_weights\"] is true)" if q == "weights" else ""
            return VerifyResult(name, STATUS_FAIL, f"no {q!r} in the result{why}; the vector checks "
                                + ", ".join(forward_quantities(vector)))
        try:
            actual = np.asarray(answer[q])
        except Exception as err:
            return VerifyResult(name, STATUS_ERROR, f"{q} is not an array: {type(err).__name__}: {err}")
        if q not in vector.expected:
            return VerifyResult(name, STATUS_ERROR, f"vector {vector.path}: tolerance names {q!r} but there is no "
                                f"expected.{q}")
        comparisons.append(compare(q, actual, expected[q], _tolerance(vector, q)))

    wanted = gradient_names(vector)
    grads = answer.get("grads")
    gradients = GRADIENTS_NONE
    problem = None
    if wanted and grads is None:
        gradients = GRADIENTS_FORWARD_ONLY
        if require_gradients:
            problem = (f"no 'grads' in the result (gradients required): the vector carries {len(wanted)} gradients "
                       f"({', '.join(wanted)})")
    elif wanted:
        if not isinstance(grads, dict):
            return VerifyResult(name, STATUS_ERROR, f"grads is a {type(grads).__name__}, expected a dict name -> array")
        unchecked |= {GRAD_PREFIX + g: str(not_returned[GRAD_PREFIX + g]) for g in wanted
                      if g not in grads and GRAD_PREFIX + g in not_returned}
        missing = [g for g in wanted if g not in grads and GRAD_PREFIX + g not in not_returned]
        if missing:
            problem = f"grads lacks {', '.join(missing)} (the vector carries {', '.join(wanted)})"
        gradients = GRADIENTS_CHECKED
        for g in wanted:
            if g in grads:
                try:
                    actual = np.asarray(grads[g])
                except Exception as err:
                    return VerifyResult(name, STATUS_ERROR, f"grads[{g!r}] is not an array: {type(err).__name__}: {err}")
                comparisons.append(compare(f"grad {g}", actual, expected[f"grad.{g}"],
                                           _tolerance(vector, GRAD_PREFIX + g)))

    judged = [c for c in comparisons if c.judged or not c.ok]  # a not-judged comparison's margin says nothing
    worst = max(judged or comparisons, key=lambda c: c.margin)
    failed = [c for c in comparisons if not c.ok]
    not_judged = [c for c in comparisons if c.ok and not c.judged]
    if not failed and problem is None:
        detail = f"worst {worst.describe()}"
        if not_judged:
            detail += (f"; {len(not_judged)} not judged ({', '.join(c.name for c in not_judged)}: the allowance is "
                       "not well below the quantity's size)")
        if unchecked:
            detail = f"{describe_unchecked(unchecked)}; {detail}"
        if gradients == GRADIENTS_FORWARD_ONLY:
            detail = f"forward only (no 'grads' returned; {len(wanted)} gradients not checked); {detail}"
        return VerifyResult(name, STATUS_PASS, detail, worst.margin, gradients, comparisons, unchecked=unchecked)
    parts = []
    if failed:
        parts.append(f"{len(failed)} of {len(comparisons)} quantities beyond tolerance ("
                     + ", ".join(f"{c.name} margin {c.margin:.3g}" for c in failed) + ")")
    if problem:
        parts.append(problem)
    divergence = None
    if answer.get("trace") is not None:
        divergence = first_divergent_stage(vector, answer["trace"])
    return VerifyResult(name, STATUS_FAIL, "; ".join(parts), worst.margin, gradients, comparisons, divergence,
                        unchecked=unchecked)


def describe_unchecked(unchecked: dict[str, str]) -> str:
    """'not returned: weights (no weights API); grad query, grad key (one input)', quantities grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for quantity, reason in unchecked.items():
        by_reason.setdefault(reason, []).append(quantity)
    return "not returned: " + "; ".join(f"{', '.join(qs)} ({reason})" for reason, qs in by_reason.items())


def reference_trace(vector: Vector, dtype: str = "float64") -> list[tuple[str, np.ndarray]]:
    """impl_numpy's stages for the vector on its stored (already rounded)
    tensors and inputs: in float64 the stages of the exact answer; in the
    vector's own dtype, what a careful implementation in that dtype gets."""
    from impl_numpy import adapter as reference

    def cast(v):
        return np.asarray(v, dtype=np.float64) if dtype == "float64" and is_float(v.dtype) else v

    tensors = {k: cast(v) for k, v in vector.tensors.items()}
    inputs = {k: cast(v) for k, v in vector.inputs.items()}
    options = dict(vector.options) | {"dtype": dtype}
    return reference.forward(vector.config, tensors, inputs, options, trace=True)["trace"]


def _max_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    with np.errstate(invalid="ignore"):
        d = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))
    d = d[np.isfinite(d)]
    return float(d.max()) if d.size else 0.0


def first_divergent_stage(vector: Vector, trace) -> str:
    """Compare the function's trace with the reference's, stage by stage by
    name, under the policy (as conformance.suite.compare.localise does for mha
    check); one line naming the first stage beyond tolerance."""
    try:
        pairs = [(str(stage), value) for stage, value in trace]
    except (TypeError, ValueError):
        return "trace: not a list of (stage name, array) pairs; no stage compared"
    reference = dict(reference_trace(vector))
    logits = reference.get("logits")
    B, T = np.shape(vector.inputs["query"])[:2]
    S = np.shape(logits)[-1] if logits is not None else np.shape(vector.inputs.get("key", vector.inputs["query"]))[1]
    # 16-bit stages are judged as the vector's own quantities are: against the
    # error of the reference run in that dtype (the u*sqrt(L) formula with a
    # 16-bit u lets large-logit stages off by a quarter through).
    same_precision = {}
    if vector.dtype in ("float16", "bfloat16"):
        same_precision = {stage: _max_error(value, reference[stage])
                          for stage, value in reference_trace(vector, vector.dtype) if stage in reference}
    seen_logits = False
    compared = []
    for stage, value in pairs:
        if stage not in reference:
            continue
        seen_logits = seen_logits or stage == "logits"
        expected = reference[stage]
        tol = policy_for(vector.config, dtype=vector.dtype, quantity="output", B=B, T=T, S=S, reference=expected,
                         logits=logits if seen_logits else None, same_precision_error=same_precision.get(stage))
        try:
            c = compare(stage, np.asarray(value), expected, tol)
        except Exception as err:
            return f"first divergent stage: {stage} (not an array: {type(err).__name__}: {err})"
        compared.append(stage)
        if not c.ok:
            if c.index is None:  # a shape mismatch
                return f"first divergent stage: {c.name}; stages before it agree ({', '.join(compared[:-1]) or 'none'})"
            return (f"first divergent stage: {stage} (worst at {list(c.index)}: got {c.actual!r}, reference "
                    f"{c.expected!r}, margin {c.margin:.3g}; rtol {tol.rtol:.3g}, atol {tol.atol:.3g}: {tol.reason})")
    if not compared:
        return (f"trace: none of its {len(pairs)} stage names is a reference stage ({', '.join(reference)}); "
                "no stage compared")
    return f"trace: all {len(compared)} stages with reference names agree ({', '.join(compared)})"


def select(vectors: list[Vector], *, only=None, dtypes=None) -> list[Vector]:
    if only:
        vectors = [v for v in vectors if any(v.name.startswith(o) for o in only)]
    if dtypes:
        vectors = [v for v in vectors if v.dtype in dtypes]
    return vectors


SHARD_ENGINES = ("jax",)  # what --shard-engine builds; torch is refused with the reason (TORCH_SHARD_REFUSAL)
TORCH_SHARD_REFUSAL = (
    "unsupported: not built yet (a torch process-group mode would start N processes of torch.distributed and "
    "call the function in each); a torch function that starts its own processes and returns whole arrays is "
    "verified by plain `mha verify` without --shard")


def make_mesh(shard, engine: str = "jax"):
    """The device set a sharded function receives: a jax.sharding.Mesh over
    the first N of jax.devices(), one axis named after the kind. `shard` is
    "sequence:4" or ("sequence", 4). On a CPU, asks XLA for N host devices
    first: effective only if JAX has not started its backend yet."""
    from conformance.suite.sharded import force_host_devices, parse_shard

    kind, devices = parse_shard(shard) if isinstance(shard, str) else parse_shard(f"{shard[0]}:{shard[1]}")
    text = f"{kind}:{devices}"
    if engine == "torch":
        raise ValueError(f"--shard-engine torch: {TORCH_SHARD_REFUSAL}")
    if engine not in SHARD_ENGINES:
        raise ValueError(f"--shard-engine must be one of {', '.join(SHARD_ENGINES)} or torch: got {engine!r}")
    force_host_devices(devices)  # before JAX starts its backend (it reads XLA_FLAGS once, then)
    try:
        import jax
        from jax.sharding import Mesh
    except ImportError as err:
        raise ValueError(f"--shard {text}: needs JAX (pip install 'mha-conformance[jax]'): {err}") from None
    present = jax.devices()
    if devices > len(present):
        raise ValueError(
            f"--shard {text}: {devices} devices asked for, {len(present)} {present[0].platform} device(s) present; "
            f"on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={devices} must be set before JAX starts "
            f"(mha verify sets it; a Python program sets it before its first JAX computation; got "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
    return Mesh(np.array(present[:devices]), (kind,))


def mesh_sharding(mesh, engine: str = "jax") -> dict:
    """{"engine", "kind", "devices"}: what each result of a sharded run records."""
    return {"engine": engine, "kind": str(mesh.axis_names[0]), "devices": int(mesh.size)}


def check_takes_mesh(fn, spec: str = "the function") -> None:
    """A sharded run passes mesh=...: refuse a function that cannot take it before any vector runs."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: let the call say
        return
    if not any(p.name == "mesh" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.kind == p.VAR_KEYWORD
               for p in parameters):
        raise ValueError(f"--impl {spec}: --shard calls fn(config, tensors, inputs, options, mesh=mesh), but "
                         f"{spec} takes no mesh argument: its signature is {inspect.signature(fn)}")


def needs_mesh(fn) -> bool:
    """Whether fn has a parameter `mesh` without a default (a sharded function run without --shard)."""
    try:
        parameter = inspect.signature(fn).parameters.get("mesh")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is parameter.empty


def verify(fn, directory=DEFAULT_DIR, *, only=None, dtypes=None, require_gradients: bool = False,
           mesh=None) -> list[VerifyResult]:
    """Every selected vector. With `mesh` (make_mesh), fn is called with mesh=mesh and each result records the
    sharding."""
    vectors = select(load_all(directory), only=only, dtypes=dtypes)
    sharding = None
    if mesh is not None:
        fn, sharding = functools.partial(fn, mesh=mesh), mesh_sharding(mesh)
    results = [verify_vector(fn, v, require_gradients=require_gradients) for v in vectors]
    for r in results:
        r.sharding = sharding
    return results


def summary(results: list[VerifyResult]) -> str:
    """'128 vectors: 120 pass (8 forward only), 8 unsupported; worst margin 0.21'."""
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    parts = []
    for status in (STATUS_PASS, STATUS_FAIL, STATUS_ERROR, STATUS_UNSUPPORTED):
        if counts.get(status):
            text = f"{counts[status]} {status}"
            forward_only = sum(r.forward_only for r in results)
            partial = sum(r.status == STATUS_PASS and bool(r.unchecked) for r in results)
            notes = ([f"{forward_only} forward only: no 'grads' returned"] if forward_only else []) + (
                [f"{partial} with quantities not returned"] if partial else [])
            if status == STATUS_PASS and notes:
                text += f" ({'; '.join(notes)})"
            parts.append(text)
    worst = max((r.margin for r in results if r.status in (STATUS_PASS, STATUS_FAIL) and r.comparisons), default=0.0)
    not_judged = sum(c.ok and not c.judged for r in results for c in r.comparisons)
    judged = f"; {not_judged} comparisons not judged (allowance not well below the quantity's size)" \
        if not_judged else ""
    return f"{len(results)} vectors: {', '.join(parts) or 'none'}; worst margin {worst:.3g}{judged}"


def check_destination(flag: str, path) -> None:
    """Refuse an output file that cannot be written before the run, not after it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {path.parent} does not exist")


def add_parser(subparsers) -> None:
    from conformance.suite.cases import DTYPE_NAMES

    p = subparsers.add_parser("verify", help="check your own implementation against the shipped vectors")
    p.add_argument("--impl", required=True, help="MODULE:FUNCTION taking (config, tensors, inputs, options)")
    p.add_argument("--vectors", default=str(DEFAULT_DIR), help="directory of vector files (default: the shipped ones)")
    p.add_argument("--cases", nargs="+", default=None, help="only vectors whose name starts with one of these")
    p.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPE_NAMES), help="only vectors of these dtypes")
    p.add_argument("--allow-unsupported", action="store_true", help="unsupported cases do not fail the run")
    p.add_argument("--require-gradients", action="store_true",
                   help="a function that returns no 'grads' fails (default: it passes as 'forward only')")
    p.add_argument("--junit", metavar="FILE", help="write JUnit XML, one testcase per vector")
    p.add_argument("--json", metavar="FILE", help="write every vector's result as JSON")
    p.add_argument("--shard", metavar="KIND:N", default=None,
                   help="a sharded function: call it with mesh=, a jax Mesh over N devices (one axis named KIND: "
                        "sequence or heads; forced host devices on a CPU); docs/sharding.md")
    p.add_argument("--shard-engine", default="jax", choices=["jax", "torch"],
                   help="with --shard: the engine whose device set the function receives (jax; torch: not built)")
    p.add_argument("--verbose", action="store_true", help="every vector's message, passing ones too")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console
    from rich.text import Text

    if args.junit:
        check_destination("--junit", args.junit)
    if args.json:
        check_destination("--json", args.json)
    mesh = None
    if args.shard:
        # the mesh first: it sets XLA_FLAGS before the user's module can start JAX
        mesh = make_mesh(args.shard, args.shard_engine)
    elif args.shard_engine != "jax":
        raise ValueError(f"--shard-engine {args.shard_engine}: only with --shard KIND:N")
    fn = load_function(args.impl)
    if mesh is not None:
        check_takes_mesh(fn, args.impl)
    elif needs_mesh(fn):
        raise ValueError(f"--impl {args.impl}: takes a required mesh argument (a sharded function): run it with "
                         "--shard sequence:N or --shard heads:N")
    started = time.perf_counter()
    results = verify(fn, args.vectors, only=args.cases, dtypes=args.dtypes, require_gradients=args.require_gradients,
                     mesh=mesh)
    if not results:
        raise ValueError(f"--cases {' '.join(args.cases or [])} --dtypes {' '.join(args.dtypes or [])}: no vector "
                         f"in {args.vectors} matches")
    elapsed = time.perf_counter() - started
    # soft_wrap: a CI log or a pipe gets each message on one line, not cut at 80 columns
    console = Console(highlight=False, soft_wrap=True)
    colours = {STATUS_PASS: "green", STATUS_FAIL: "red", STATUS_ERROR: "red", STATUS_UNSUPPORTED: "yellow"}
    for r in results:
        if r.status != STATUS_PASS or args.verbose:
            text = Text(r.message())
            text.stylize("yellow" if r.forward_only else colours[r.status], 0, len(r.label))
            console.print(text)
    sharding = mesh_sharding(mesh) if mesh is not None else None
    where = ""
    if sharding:
        platform = mesh.devices.flat[0].platform
        where = f" ({sharding['engine']} {sharding['kind']}:{sharding['devices']}, {sharding['devices']} {platform} devices)"
    backend_id = core_backend(fn)  # a core backend's own function: the column it is (keras-jax, not tf)
    if backend_id is not None:
        where = f" (backend {backend_id}){where}"
    console.print(Text(f"{args.impl}{where}: {summary(results)}; {elapsed:.1f} s"))
    if args.json:
        from weights.atomic import write_bytes_atomic

        payload = {"impl": args.impl, "backend": backend_id, "sharding": sharding, "summary": summary(results), "seconds": round(elapsed, 3),
                   "results": [r.to_json() for r in results]}
        write_bytes_atomic(args.json, json.dumps(payload, indent=1).encode(), overwrite=True)
        console.print(Text(f"json: {args.json}"))
    if args.junit:
        write_junit(args.junit, results, impl=args.impl, seconds=elapsed, sharding=sharding)
        console.print(Text(f"junit: {args.junit}"))
    bad = sum(r.status in (STATUS_FAIL, STATUS_ERROR) or (r.status == STATUS_UNSUPPORTED and not args.allow_unsupported)
              for r in results)
    return 0 if bad == 0 else 1


def write_junit(path, results, *, impl: str, seconds: float, sharding: dict | None = None) -> None:
    """conformance.suite.junit's verify testcases; a sharded run's classname and properties name the sharding
    (mha.verify.jax.sequence:4), so a CI report keeps the sharded and unsharded runs of one function apart."""
    from conformance.suite import junit

    if sharding is None:
        junit.write_verify(path, results, impl=impl, seconds=seconds)
        return
    label = f"{sharding['engine']}.{sharding['kind']}:{sharding['devices']}"
    cases = [dataclasses.replace(c, classname=f"{c.classname}.{label}") for c in junit.verify_cases(results)]
    junit.write(path, f"mha verify {impl} --shard {sharding['kind']}:{sharding['devices']}", cases, seconds=seconds,
                properties={"impl": impl, "sharding": json.dumps(sharding)})
