"""`mha verify --impl MODULE:FUNCTION`: check an outside implementation
against the shipped vectors.

The function is called as `fn(config, tensors, inputs, options)`:
  config   the AttentionConfig as a plain dict (its JSON fields)
  tensors  canonical tensors, name -> ndarray in the case's dtype
  inputs   query, key, value and, when the case has them, mask (bool, True =
           may attend), bias and dropout_mask (bool, True = keep)
  options  is_causal, causal_alignment, return_weights, dtype (a name such as
           "bfloat16"), training
and returns a dict with `output` (and `weights` when options["return_weights"]).
Raising NotImplementedError marks a case "unsupported" (a failure unless
--allow-unsupported). Exit 0 only if every case passes.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
from pathlib import Path

import numpy as np

from conformance.tolerance import Tolerance, compare
from conformance.vectors import DEFAULT_DIR, Vector, load_all


@dataclasses.dataclass
class VerifyResult:
    name: str
    status: str  # pass | fail | unsupported | error
    detail: str
    margin: float = 0.0


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


def verify_vector(fn, vector: Vector) -> VerifyResult:
    options = dict(vector.options)
    try:
        result = fn(vector.config.to_dict(), {k: v.copy() for k, v in vector.tensors.items()},
                    {k: v.copy() for k, v in vector.inputs.items()}, options)
    except NotImplementedError as err:
        return VerifyResult(vector.name, "unsupported", str(err) or "NotImplementedError")
    except Exception as err:  # the implementation under test crashed: report, go on
        return VerifyResult(vector.name, "error", f"{type(err).__name__}: {err}".replace("\n", " ")[:300])
    if not isinstance(result, dict) or "output" not in result:
        return VerifyResult(vector.name, "error", f"returned {type(result).__name__}, expected a dict with 'output'")
    quantities = ["output"] + (["weights"] if options.get("return_weights") else [])
    worst = None
    for q in quantities:
        if q not in result:
            return VerifyResult(vector.name, "fail", f"no {q!r} in the result although return_weights was requested")
        t = vector.tolerance[q]
        try:
            actual = np.asarray(result[q])
        except Exception as err:
            return VerifyResult(vector.name, "error", f"{q} is not an array: {err}")
        c = compare(q, actual, vector.expected[q], Tolerance(t["rtol"], t["atol"], t["reason"]))
        if worst is None or c.margin > worst.margin:
            worst = c
        if not c.ok:
            return VerifyResult(vector.name, "fail", c.describe(), c.margin)
    return VerifyResult(vector.name, "pass", worst.describe(), worst.margin)


def verify(fn, directory=DEFAULT_DIR, *, only=None) -> list[VerifyResult]:
    vectors = load_all(directory)
    if only:
        vectors = [v for v in vectors if any(v.name.startswith(o) for o in only)]
    return [verify_vector(fn, v) for v in vectors]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("verify", help="check your own implementation against the shipped vectors")
    p.add_argument("--impl", required=True, help="MODULE:FUNCTION taking (config, tensors, inputs, options)")
    p.add_argument("--vectors", default=str(DEFAULT_DIR), help="directory of vector files (default: the shipped ones)")
    p.add_argument("--cases", nargs="+", default=None, help="only vectors whose name starts with one of these")
    p.add_argument("--allow-unsupported", action="store_true", help="unsupported cases do not fail the run")
    p.add_argument("--verbose", action="store_true", help="a line per vector, passing ones too")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console

    fn = load_function(args.impl)
    started = time.perf_counter()
    results = verify(fn, args.vectors, only=args.cases)
    console = Console(highlight=False)
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
        if r.status != "pass" or args.verbose:
            colour = {"pass": "green", "fail": "red", "error": "red", "unsupported": "yellow"}[r.status]
            console.print(f"[{colour}]{r.status:11}[/] {r.name}: {r.detail}")
    worst = max((r.margin for r in results if r.status in ("pass", "fail")), default=0.0)
    console.print(f"{args.impl}: {len(results)} vectors, " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                  + f"; worst margin {worst:.3g}; {time.perf_counter() - started:.1f} s")
    bad = counts.get("fail", 0) + counts.get("error", 0) + (0 if args.allow_unsupported else counts.get("unsupported", 0))
    return 0 if bad == 0 else 1
