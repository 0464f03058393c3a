"""Conformance vectors: one self-contained safetensors file per case and dtype.

The language-neutral interface: any implementation, in any framework or
language, can be checked against these files without this package.

File `<case>.<dtype>.safetensors`:
  weights.<canonical name>   the case's canonical tensors, in <dtype>
  inputs.query|key|value     in <dtype>; inputs.bias in <dtype> when present
  inputs.mask                bool, True = may attend (when present)
  inputs.dropout_mask        bool, True = keep (training cases)
  inputs.positions, inputs.key_positions, inputs.segment_ids, inputs.key_segment_ids
                             int64 (cases with explicit positions / packed rows)
  inputs.topk_indices        int64 (cases with a selection: the keys each query may see, -1 unused)
  inputs.past_key|past_value in <dtype> (cases with a cache)
  cotangent.output           (B, T, O) float64: the output cotangent
  expected.output            float64
  expected.weights           float64, (B, N, T, P+S) (when the case asks for them)
  expected.present_key|present_value
                             float64 (when options.return_cache; a DeepSeek V4 layer, config.compressed:
                             expected.present_<name> for every name of impl_numpy.compressed.cache_names)
  expected.selection         int64, -1 padding (a layer with an indexer, a DeepSeek V4 csa layer: the float64
                             reference's selection; verify judges a returned one by the top-k rule)
  expected.grad.<name>       float64 gradients of sum(output * cotangent)
  allowance.<quantity>       float64, the shape of expected.<quantity> (output, present_key,
                             present_value): each element's absolute allowance where it is
                             larger than the tolerance's atol, rtol * (1 + z) * the magnitude of
                             what that element is summed from (conformance/suite/tolerance.py)
__metadata__: format "mha-vectors", format_version "1", case, dtype, config
(AttentionConfig JSON), options (JSON: is_causal, causal_alignment,
return_weights, dtype, training, and return_cache where true), tolerance (JSON: quantity -> {rtol, atol,
reason[, not_judged]}, from conformance/suite/tolerance.py; not_judged, where present, says why the quantity's
allowance is no check: it is not well below the quantity's own size, a zero result would pass, and `mha verify`
reports the comparison "not judged", never a pass), generator. An element passes iff
|actual - expected| <= max(atol, allowance) + rtol * |expected| (allowance 0
where the file has none).

Expected values are the float64 reference evaluated on the stored (already
rounded) weights and inputs, so they are the exact answer for what an
implementation receives. Files are deterministic: regenerating on the same
machine gives identical bytes (header keys sorted, fixed seeds). On another CPU
OpenBLAS may pick another GEMM kernel, which rounds float64 sums differently: expected
values and the tolerances measured from low-precision runs then differ in their last bits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from conformance.io import write_arrays
from conformance.suite.cases import ALL_CASES, CASES, DTYPE_NAMES, PROFILE_DTYPES, PROFILES, Case
from conformance.suite.compare import case_policy, expected_for
from conformance.suite.tolerance import not_judged_reason
from weights import AttentionConfig, read_safetensors

FORMAT = "mha-vectors"
FORMAT_VERSION = "1"
DEFAULT_DIR = Path(__file__).resolve().parent / "vectors"


class VectorFormatError(ValueError):
    pass


def vector_name(case: str, dtype: str) -> str:
    return f"{case}.{dtype}"


def build_vector(case: Case, dtype: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    exp = expected_for(case, dtype)
    arrays: dict[str, np.ndarray] = {}
    arrays.update({f"weights.{k}": v for k, v in exp["tensors"].items()})
    arrays.update({f"inputs.{k}": v for k, v in exp["inputs"].items()})
    arrays["cotangent.output"] = exp["d_output"]
    arrays["expected.output"] = exp["output"]
    tolerance = {}

    def tol(name, quantity, reference, floor=0.0, logits=True):
        t = case_policy(case, dtype, name, quantity, reference, scale_floor=floor, logits=logits)
        tolerance[name] = {"rtol": t.rtol, "atol": t.atol, "reason": t.reason}
        why = not_judged_reason(t, reference)
        if why is not None:  # an allowance not well below the quantity: verify reports it "not judged"
            tolerance[name]["not_judged"] = why
        if t.floor is not None:
            arrays[f"allowance.{name}"] = np.broadcast_to(t.floor, np.shape(reference)).astype(np.float64)

    tol("output", "output", exp["output"])
    if case.return_weights:
        arrays["expected.weights"] = exp["weights"]
        tol("weights", "weights", exp["weights"])
    if exp.get("selection") is not None:  # the indexer's selection (int64, -1 padding): verify judges a returned one
        arrays["expected.selection"] = np.asarray(exp["selection"], dtype=np.int64)
    cache = ("present_key", "present_value") + (("present_index_keys",) if "present_index_keys" in exp else ())
    if case.config.compressed is not None:  # DeepSeek V4's cache: every array of impl_numpy.compressed.cache_names
        from impl_numpy.compressed import cache_names

        cache = tuple(f"present_{name}" for name in cache_names(case.config))
    for name in cache if case.return_cache else ():
        arrays[f"expected.{name}"] = exp[name]
        tol(name, "output", exp[name], logits=case.config.compressed is None)  # V4's: before the logits (judge)
    for name, grad in exp["grads"].items():
        arrays[f"expected.grad.{name}"] = grad
        tol(f"grad {name}", "grad", grad)
    metadata = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "case": case.name, "dtype": dtype,
        "config": case.config.to_json(), "options": json.dumps(case.options(dtype), sort_keys=True),
        "tolerance": json.dumps(tolerance, sort_keys=True), "generator": "impl_numpy float64 reference",
    }
    return arrays, metadata


def generate(directory: str | os.PathLike = DEFAULT_DIR, *, cases=None, dtypes=DTYPE_NAMES, overwrite: bool = True) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in cases or CASES:
        for dtype in dtypes:
            arrays, metadata = build_vector(ALL_CASES[name], dtype)
            path = directory / f"{vector_name(name, dtype)}.safetensors"
            write_arrays(path, arrays, overwrite=overwrite, metadata=metadata)
            written.append(path)
    return written


class Vector:
    """One loaded vector file, split back into its parts."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        metadata, arrays = read_safetensors(self.path, error=VectorFormatError)
        if metadata.get("format") != FORMAT or metadata.get("format_version") != FORMAT_VERSION:
            raise VectorFormatError(f"{self.path}: not an {FORMAT} v{FORMAT_VERSION} file")
        try:
            self.name = f"{metadata['case']}.{metadata['dtype']}"
            self.dtype = metadata["dtype"]
            self.config = AttentionConfig.from_json(metadata["config"])
            self.options = json.loads(metadata["options"])
            self.tolerance = json.loads(metadata["tolerance"])
        except (KeyError, ValueError) as err:
            raise VectorFormatError(f"{self.path}: bad metadata: {err}") from None
        groups: dict[str, dict[str, np.ndarray]] = {"weights": {}, "inputs": {}, "expected": {}, "cotangent": {},
                                                    "allowance": {}}
        for key, value in arrays.items():
            group, _, rest = key.partition(".")
            if group not in groups:
                raise VectorFormatError(f"{self.path}: unexpected tensor {key}")
            groups[group][rest] = value
        self.tensors = {k: groups["weights"][k] for k in self.config.tensor_shapes() if k in groups["weights"]}
        self.inputs = groups["inputs"]
        self.expected = groups["expected"]
        self.allowance = groups["allowance"]  # elementwise floors of atol, by quantity (files since 2026-11-27)
        self.cotangent = groups["cotangent"].get("output")


def load_all(directory: str | os.PathLike = DEFAULT_DIR) -> list[Vector]:
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"--vectors {directory}: not a directory")
    paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        raise ValueError(f"--vectors {directory}: no *.safetensors vector files")
    return [Vector(p) for p in paths]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("vectors", help="generate the conformance vectors from the float64 reference")
    sub = p.add_subparsers(dest="vectors_command", required=True, parser_class=type(p))
    g = sub.add_parser("generate", help="write one file per case and dtype")
    g.add_argument("--out", default=None,
                   help=f"directory (default: the shipped vectors, {DEFAULT_DIR}, which takes --overwrite)")
    g.add_argument("--profile", default="default", choices=list(PROFILES),
                   help="default: the shipped grid; long: the long profile's cases (write them with --out: they "
                        "are not shipped)")
    g.add_argument("--cases", nargs="+", choices=list(ALL_CASES), default=None)
    g.add_argument("--dtypes", nargs="+", choices=list(DTYPE_NAMES), default=None,
                   help="default: the profile's (default: all four; long: float32 bfloat16)")
    g.add_argument("--overwrite", action="store_true",
                   help="replace vector files that exist (without --out: regenerate the shipped vectors)")
    g.set_defaults(func=run)


def run(args) -> int:
    # Like `mha init` and `mha run`, never replace a file without --overwrite;
    # checked before the first write, so a refusal leaves the directory as it was.
    # Without --out the files replaced are the ones `mha verify` and `mha check`
    # judge by: the error says so and where they are.
    out = Path(args.out) if args.out is not None else DEFAULT_DIR
    cases = args.cases or list(PROFILES[args.profile])
    dtypes = args.dtypes or list(PROFILE_DTYPES[args.profile])
    if args.out is None and any(name not in CASES for name in cases):
        raise ValueError("the long profile's vectors are not shipped: pass --out DIR to write them")
    names = [vector_name(case, dtype) for case in cases for dtype in dtypes]
    existing = [name for name in names if (out / f"{name}.safetensors").exists()]
    if existing and not args.overwrite:
        where = f"the shipped vectors in {out}" if args.out is None else f"--out {out}"
        raise ValueError(f"{len(existing)} of the {len(names)} vector files exist in {where}: pass --overwrite to "
                         f"replace them{' or --out DIR to write elsewhere' if args.out is None else ''}")
    written = generate(out, cases=cases, dtypes=dtypes, overwrite=args.overwrite)
    total = sum(p.stat().st_size for p in written)
    shipped = " (the shipped vectors)" if out.resolve() == DEFAULT_DIR else ""
    print(f"wrote {len(written)} vector files ({total / 1024:.0f} KiB) to {out}{shipped}")
    return 0
