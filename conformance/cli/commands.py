"""The `mha` command line. Every error is one line on stderr with exit code 2.

Subcommands live in their own modules and register themselves through
`add_parser(subparsers)` + `run(args) -> int`; this file holds the small ones
(init, run, trace) and the error handling shared by all.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
from pathlib import Path

import numpy as np

from conformance.console import (
    DISTRIBUTION,
    EXIT_FAIL,
    EXIT_OK,
    OneLineParser,
    full_width_output,
    guarded,
    package_version,
)

# Subcommands defined in other modules, registered if the module exists.
EXTERNAL_COMMANDS = ("conformance.cli.convert", "conformance.suite.check", "conformance.suite.verify", "conformance.suite.vectors",
                     "conformance.bench")


def _read_config(path: str):
    from weights import AttentionConfig

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--config {path}: cannot read: {getattr(err, 'strerror', None) or err}") from None
    try:
        return AttentionConfig.from_json(text)
    except ValueError as err:
        raise ValueError(f"--config {path}: {err}") from None


def cmd_init(args) -> int:
    import weights

    config = _read_config(args.config)
    tensors = weights.init(config, seed=args.seed, dtype=args.dtype)
    weights.save(args.out, config, tensors, overwrite=args.overwrite)
    print(f"wrote {args.out}: {len(tensors)} tensors, {args.dtype}, seed {args.seed}")
    return EXIT_OK


def _call_options(args) -> dict:
    return {
        "is_causal": args.causal, "causal_alignment": args.causal_alignment,
        "return_weights": getattr(args, "return_weights", False), "dtype": args.dtype,
        "return_cache": getattr(args, "return_cache", False),
        "training": getattr(args, "training", False), "seed": getattr(args, "seed", None),
    }


def _load_run_inputs(args):
    import weights
    from conformance.io import read_inputs
    from conformance.suite import backends

    config, tensors = weights.load(args.weights)
    inputs = read_inputs(args.inputs)
    adapter = backends.load(args.backend)
    available = adapter.devices()
    if args.device not in available:
        raise ValueError(f"--device {args.device}: backend {args.backend} has no such device here (available: {', '.join(available)})")
    return config, tensors, inputs, adapter


def _run_sharded(args):
    """`mha run --shard KIND:N`: the backend's sharded engine (conformance.suite.sharded.ENGINES) on N devices."""
    import weights
    from conformance.io import read_inputs
    from conformance.suite import sharded

    kind, count = sharded.parse_shard(args.shard)
    if args.backend not in sharded.ENGINES:
        raise ValueError(f"--shard {args.shard}: backend {args.backend} has no sharded engine (sharded engines: "
                         f"{', '.join(sharded.ENGINES)}); run it unsharded")
    if args.backend == "jax":
        sharded.force_host_devices(count)  # before JAX starts its backend (read once, when it does)
    config, tensors = weights.load(args.weights)
    inputs = read_inputs(args.inputs)
    try:
        engine = sharded.load_engine(args.backend)
        if hasattr(engine, "initialize_from_environment"):  # several hosts: docs/sharding.md
            engine.initialize_from_environment()
        return engine.forward(config, tensors, inputs, _call_options(args), kind=kind, devices=count)
    except (NotImplementedError, sharded.EngineUnavailable) as err:
        raise ValueError(f"--shard {args.shard} --backend {args.backend}: unsupported: {err}") from None


def cmd_run(args) -> int:
    from conformance.io import write_arrays

    expected = _read_expected(args) if getattr(args, "expect", None) else None  # before any work
    if getattr(args, "shard", None):
        result = _run_sharded(args)
        args.device = args.shard  # the metadata and the message name the sharding instead of one device
    else:
        config, tensors, inputs, adapter = _load_run_inputs(args)
        result = adapter.forward(config, tensors, inputs, _call_options(args), device=args.device,
                                 precision=args.precision)
    arrays = {"output": result["output"]}
    if args.return_weights:
        arrays["weights"] = result["weights"]
    if args.return_cache:  # the cache for the next call: feed them back as past_key / past_value
        arrays["present_key"], arrays["present_value"] = result["present_key"], result["present_value"]
        if "present_index_keys" in result:  # a config with indexer: fed back as past_index_keys
            arrays["present_index_keys"] = result["present_index_keys"]
    if "selection" in result:  # a config with indexer: the keys each query attended to (topk_indices format)
        arrays["selection"] = result["selection"]
    write_arrays(args.out, arrays, overwrite=args.overwrite,
                 metadata={"backend": args.backend, "device": args.device, "dtype": str(result["output"].dtype)})
    shape = "x".join(map(str, result["output"].shape))
    also = [name for name, asked in (("weights", args.return_weights), ("present_key/present_value", args.return_cache))
            if asked]
    print(f"wrote {args.out}: output {shape}{''.join(' and ' + a for a in also)} ({args.backend}, {args.device})")
    if expected is not None:
        return _held_to(args, arrays, expected)
    return EXIT_OK


def _read_expected(args) -> dict:
    from weights.format import read_safetensors

    try:
        expected = read_safetensors(args.expect, error=ValueError)[1]
    except ValueError as err:
        raise ValueError(f"--expect {err}") from None
    written = ["output"] + ["weights"] * args.return_weights + ["present_key", "present_value"] * args.return_cache
    if not expected or set(expected) - set(written):
        raise ValueError(f"--expect {args.expect}: holds {', '.join(sorted(expected)) or 'no tensors'}; this run "
                         f"writes {', '.join(written)} (add --return-weights / --return-cache for the others)")
    return expected


def _held_to(args, arrays: dict, expected: dict) -> int:
    """`mha run --expect FILE`: every array FILE holds, against the one this run wrote, under the tolerance
    policy of the run's dtype (FILE's numbers playing the reference: a model's own output, a float64 run).
    One line per array; exit 1 when any is over its allowance."""
    import weights
    from conformance.io import read_inputs
    from conformance.suite.tolerance import compare, policy_for

    config, _ = weights.load(args.weights)
    inputs = read_inputs(args.inputs)
    B, T = arrays["output"].shape[:2]
    past = inputs.get("past_key")
    key = inputs.get("key")
    S = (T if key is None else key.shape[-2]) + (0 if past is None else past.shape[-2])
    dtype = str(arrays["output"].dtype)
    failed = 0
    for name in sorted(expected):
        want = expected[name]
        tol = policy_for(config, dtype=dtype, quantity="weights" if name == "weights" else "output", B=B, T=T, S=S,
                         reference=want)
        verdict = compare(f"{name} vs {args.expect}", arrays[name], want, tol)
        failed += not verdict.ok
        print(verdict.describe())
    return EXIT_FAIL if failed else EXIT_OK


def _summary(value: np.ndarray, count: int) -> dict:
    flat = np.asarray(value, dtype=np.float64).reshape(-1)
    finite = flat[np.isfinite(flat)]
    return {
        "first": [float(x) for x in flat[:count]],
        "min": float(finite.min()) if finite.size else None,
        "max": float(finite.max()) if finite.size else None,
        "nonfinite": int(flat.size - finite.size),
    }


def cmd_trace(args) -> int:
    config, tensors, inputs, adapter = _load_run_inputs(args)
    options = _call_options(args)
    result = adapter.forward(config, tensors, inputs, options, device=args.device, precision=args.precision, trace=True)
    stages = [
        {"stage": stage, "shape": list(value.shape), "dtype": str(value.dtype), **_summary(value, args.values)}
        for stage, value in result["trace"]
    ]
    verdict = divergence = None
    if args.against_reference:  # the first stage beyond its tolerance of the float64 reference's, or none
        from conformance.suite.compare import localise_call

        divergence = localise_call(config, tensors, inputs, options, result["trace"], precision=args.precision)
        verdict = ("every stage within its tolerance of the float64 reference" if divergence is None
                   else divergence.describe())
    code = EXIT_FAIL if divergence is not None else EXIT_OK
    if args.json:
        print(json.dumps({"config": config.to_dict(), "options": options, "backend": args.backend, "stages": stages}
                         | ({} if verdict is None else {"against_reference": verdict}), indent=1))
        return code
    from rich.console import Console
    from rich.table import Table

    console = Console()
    B, T, _ = inputs["query"].shape
    S = inputs["key"].shape[1] if "key" in inputs else T
    console.print(
        f"[bold]{args.backend}[/] on {args.device}: B={B} T={T} S={S} N={config.num_heads} K={config.num_kv_heads} "
        f"H={config.head_dim} V={config.value_head_dim} scale={config.effective_scale:.6g} "
        f"causal={args.causal}{' (' + args.causal_alignment + ')' if args.causal else ''} masked_row={config.masked_row}"
    )
    table = Table(show_lines=False)
    for column in ("#", "stage", "shape", "dtype"):
        table.add_column(column, no_wrap=True)
    for column in (f"first {args.values} values", "min", "max"):
        table.add_column(column, overflow="fold")
    for i, s in enumerate(stages, 1):
        first = " ".join(f"{x:.4g}" for x in s["first"])
        lo = "-" if s["min"] is None else f"{s['min']:.4g}"
        hi = "-" if s["max"] is None else f"{s['max']:.4g}"
        if s["nonfinite"]:
            hi += f" ({s['nonfinite']} non-finite)"
        table.add_row(str(i), s["stage"], "x".join(map(str, s["shape"])), s["dtype"], first, lo, hi)
    console.print(table)
    if verdict is not None:
        console.print(f"against the float64 reference: {verdict}", markup=False)
    return code


def _add_call_arguments(p, *, write: bool) -> None:
    from conformance.suite.backends import DEVICES, REGISTRY
    from weights import DTYPES

    p.add_argument("--backend", default="numpy", choices=list(REGISTRY), help="implementation to run (default numpy)")
    p.add_argument("--weights", required=True, help="weight file (mha-weights safetensors)")
    p.add_argument("--inputs", required=True, help="inputs safetensors: query [key value mask bias dropout_mask positions key_positions past_key past_value segment_ids key_segment_ids past_key_positions topk_indices past_index_keys]")
    p.add_argument("--causal", action="store_true", help="apply a causal mask")
    p.add_argument("--causal-alignment", default="top_left", choices=["top_left", "bottom_right"])
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="compute dtype (default: the weights' dtype)")
    p.add_argument("--device", default="cpu", choices=list(DEVICES))
    p.add_argument("--precision", default="highest", choices=["highest", "tf32"],
                   help="float32 matmul precision on GPUs (default highest: TF32 off)")
    p.add_argument("--training", action="store_true", help="training mode: dropout with the inputs' dropout_mask or --seed")
    p.add_argument("--seed", type=int, default=None, help="dropout seed when the inputs have no dropout_mask")
    if write:
        p.add_argument("--out", required=True, help="output safetensors file")
        p.add_argument("--return-weights", action="store_true", help="also write the attention weights")
        p.add_argument("--return-cache", action="store_true",
                       help="also write present_key and present_value (the KV cache for the next call's past_key/past_value)")
        p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
        p.add_argument("--expect", metavar="FILE", default=None,
                       help="safetensors with the numbers to reproduce (output, and weights/present_key/present_value "
                            "if written): each compared under the tolerance policy; exit 1 if any is over")
        p.add_argument("--shard", metavar="KIND:N", default=None,
                       help="run sharded on N devices: heads:N or sequence:N (backends jax, torch; same output file; "
                            "docs/sharding.md)")


def build_parser() -> argparse.ArgumentParser:
    from weights import DTYPES

    parser = OneLineParser(prog="mha", description="Multi-head attention across frameworks: run, trace, check.")
    parser.add_argument("--version", action="version", version=f"mha ({DISTRIBUTION}) {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    p = sub.add_parser("init", help="write random weights for a config")
    p.add_argument("--config", required=True, help="AttentionConfig as JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("run", help="run one backend on an inputs file")
    _add_call_arguments(p, write=True)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("trace", help="print every stage of the forward pass")
    _add_call_arguments(p, write=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--values", type=int, default=4, help="values shown per stage (default 4)")
    p.add_argument("--against-reference", action="store_true",
                   help="also run the float64 NumPy reference on the same values (rounded to the dtype) and name "
                        "the first stage beyond its tolerance (the indexer's selection by the top-k rule); exit 1 "
                        "if there is one")
    p.set_defaults(func=cmd_trace)

    for module_name in EXTERNAL_COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:
                continue  # that subcommand has not landed in this checkout
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    def command() -> int:
        args = build_parser().parse_args(argv)
        with full_width_output():
            return args.func(args)

    return guarded(command)


if __name__ == "__main__":
    raise SystemExit(main())
