"""The `mha` command line. Every error is one line on stderr with exit code 2.

Subcommands live in their own modules and register themselves through
`add_parser(subparsers)` + `run(args) -> int`; this file holds the small ones
(init, run, trace) and the error handling shared by all.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3

# Subcommands defined in other modules, registered if the module exists.
EXTERNAL_COMMANDS = ("conformance.convert", "conformance.check", "conformance.verify", "conformance.vectors", "bench")


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus an error; we print only the error, on one line."""

    def error(self, message: str):  # noqa: D401
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


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
        "training": getattr(args, "training", False), "seed": getattr(args, "seed", None),
    }


def _load_run_inputs(args):
    import weights
    from conformance import backends
    from conformance.io import read_inputs

    config, tensors = weights.load(args.weights)
    inputs = read_inputs(args.inputs)
    adapter = backends.load(args.backend)
    available = adapter.devices()
    if args.device not in available:
        raise ValueError(f"--device {args.device}: backend {args.backend} has no such device here (available: {', '.join(available)})")
    return config, tensors, inputs, adapter


def cmd_run(args) -> int:
    from conformance.io import write_arrays

    config, tensors, inputs, adapter = _load_run_inputs(args)
    result = adapter.forward(config, tensors, inputs, _call_options(args), device=args.device, precision=args.precision)
    arrays = {"output": result["output"]}
    if args.return_weights:
        arrays["weights"] = result["weights"]
    write_arrays(args.out, arrays, overwrite=args.overwrite,
                 metadata={"backend": args.backend, "device": args.device, "dtype": str(result["output"].dtype)})
    shape = "x".join(map(str, result["output"].shape))
    print(f"wrote {args.out}: output {shape}{' and weights' if args.return_weights else ''} ({args.backend}, {args.device})")
    return EXIT_OK


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
    if args.json:
        print(json.dumps({"config": config.to_dict(), "options": options, "backend": args.backend, "stages": stages}, indent=1))
        return EXIT_OK
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
    return EXIT_OK


def _add_call_arguments(p, *, write: bool) -> None:
    from conformance.backends import DEVICES, REGISTRY
    from weights import DTYPES

    p.add_argument("--backend", default="numpy", choices=list(REGISTRY), help="implementation to run (default numpy)")
    p.add_argument("--weights", required=True, help="weight file (mha-weights safetensors)")
    p.add_argument("--inputs", required=True, help="inputs safetensors: query [key value mask bias dropout_mask]")
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
        p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def build_parser() -> argparse.ArgumentParser:
    from weights import DTYPES

    parser = OneLineParser(prog="mha", description="Multi-head attention across frameworks: run, trace, check.")
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
    # Quiet TensorFlow's C++ start-up logging before anything imports it.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser()
    args = parser.parse_args(argv)
    from conformance.backends import BackendUnavailable

    try:
        return args.func(args)
    except (ValueError, OSError, BackendUnavailable) as err:
        message = str(err).replace("\n", " ") or type(err).__name__
        if isinstance(err, OSError) and err.filename and err.strerror:
            message = f"{err.filename}: {err.strerror}"
        sys.stderr.write(f"mha: error: {message}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("mha: interrupted\n")
        return 130
    except Exception as err:  # a bug in mha itself: still one line, but say so
        if os.environ.get("MHA_DEBUG"):
            raise
        sys.stderr.write(f"mha: internal error: {type(err).__name__}: {err} (MHA_DEBUG=1 shows the traceback)\n")
        return EXIT_INTERNAL


if __name__ == "__main__":
    raise SystemExit(main())
