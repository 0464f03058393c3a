"""The whole conventions measurement (the four tables in one run, and mlx-lm's ports judged:
conformance/native/mlx_lm_ports.py) and its
command, `python -m conformance.native.conventions`."""

from __future__ import annotations

import time

from conformance.logs import quiet_python_loggers
from conformance.native.conventions.apis import APIS
from conformance.native.conventions.expectations import EXPECTED_SOURCE
from conformance.native.conventions.harness import (
    CAUSAL_SHAPES,
    MATMUL_SHAPE,
    TOL,
    Api,
    B,
    H,
    N,
    S,
    T,
    _short,
    measure_api,
)
from conformance.native.conventions.precision import MATMUL_PROBES, _precision_inputs, _versions
from conformance.native.conventions.render import render_terminal, to_markdown


def measure(console=None, apis: tuple[Api, ...] | None = None, modern_apis=None, packed_apis=None,
            alibi_apis=None, mlx_lm_ports=None, keras_backends=None) -> dict:
    """Measure every API (default APIS), every modern API (default
    modern.APIS), every packed/sharded path (default packed.APIS),
    transformers' ALiBi models (default alibi_models.APIS), mlx-lm's ports
    (default conformance.native.mlx_lm_ports.APIS) and Keras's own
    attention on each Keras backend (default keras_backends.BACKENDS, one
    worker process each, started first so they run alongside; each of the
    last five none when `apis` is given). JSON-serialisable."""
    from conformance.native import mlx_lm_ports as ports
    from conformance.native.conventions import alibi_models, modern, packed
    from conformance.native.conventions import keras_backends as kb

    if keras_backends is None:
        keras_backends = kb.BACKENDS if apis is None else ()
    keras_run = kb.start(keras_backends) if keras_backends else None

    if modern_apis is None:
        modern_apis = modern.APIS if apis is None else ()
    if packed_apis is None:
        packed_apis = packed.APIS if apis is None else ()
    if alibi_apis is None:
        alibi_apis = alibi_models.APIS if apis is None else ()
    if mlx_lm_ports is None:
        mlx_lm_ports = ports.APIS if apis is None else ()
    apis = APIS if apis is None else apis
    started = time.perf_counter()
    a, b, exact = _precision_inputs()
    matmul: dict[str, dict] = {}
    devices: dict[str, dict] = {}
    rows = []
    status = console.status("measuring conventions") if console is not None else None
    if status is not None:
        status.start()
    try:
        for api in apis:
            if status is not None:
                status.update(f"measuring conventions: {api.name}")
            row = measure_api(api)
            quiet_python_loggers()  # under the CLI: the framework this API imported logs errors only
            if row["status"] == "measured" and api.framework not in matmul and api.framework in MATMUL_PROBES:
                try:
                    matmul[api.framework] = MATMUL_PROBES[api.framework](a, b, exact, devices)
                except Exception as err:  # noqa: BLE001
                    matmul[api.framework] = {"error": {"label": f"error: {_short(err)}", "rel_err": "n/a"}}
            if row["status"] == "measured":
                row["float32_matmul"] = matmul.get(api.framework, {})
            rows.append(row)
    finally:
        if status is not None:
            status.stop()
    if status is not None:
        status.start()
        status.update("measuring conventions: the modern arguments")
    try:
        modern_rows = modern.measure(modern_apis)
        if status is not None:
            status.update("measuring conventions: the packed and sharded paths")
        packed_rows = packed.measure(packed_apis)
        if status is not None:
            status.update("measuring conventions: transformers' ALiBi models")
        alibi_rows = alibi_models.measure(alibi_apis)
        if status is not None:
            status.update("measuring conventions: mlx-lm's ports")
        port_rows = ports.measure(mlx_lm_ports)
        if status is not None and keras_run is not None:
            status.update("measuring conventions: Keras on its backends (the workers)")
        keras_data = keras_run.finish() if keras_run is not None else None
    finally:
        if status is not None:
            status.stop()
    present = {r["framework"].split(" ")[0] for r in rows if r["status"] == "measured"}
    versions = {**_versions(present), **modern.versions(), **ports.versions(port_rows)}
    if keras_data is not None:
        versions.update({k: v for k, v in keras_data["versions"].items() if k not in versions})
    return {"versions": versions, "devices": devices, "rows": rows, "modern_rows": modern_rows,
            "packed_rows": packed_rows, "alibi_rows": alibi_rows, "mlx_lm_rows": port_rows,
            "keras_backends": keras_data,
            "shapes": {"B": B, "T": T, "S": S, "N": N, "H": H, "causal_T_S": [list(p) for p in CAUSAL_SHAPES]},
            "tolerance": TOL, "matmul_shape": list(MATMUL_SHAPE),
            "seconds": round(time.perf_counter() - started, 2)}



def main(argv: list[str] | None = None) -> int:
    """python -m conformance.native.conventions [--json | --markdown]"""
    import json

    from conformance.console import OneLineParser, full_width_output, guarded

    def command() -> int:
        parser = OneLineParser(
            prog="python -m conformance.native.conventions",
            description="Measure the conventions of each framework's own attention API (bool mask polarity, the "
                        "output and weights of a fully masked row, causal alignment when T != S, the default float32 "
                        "matmul precision on each device; RoPE pairing, window meaning, softcap order, sinks and the QK-norm "
                        "option of the APIs that have them; the packed and sharded paths; where transformers' "
                        "ALiBi models add the bias, and how many times) against the NumPy reference, and print the "
                        "tables with "
                        f"every disagreement with {EXPECTED_SOURCE}. Frameworks that are not installed are rows "
                        "saying so. `mha check --conventions` prints the same table after the main job.")
        form = parser.add_mutually_exclusive_group()
        form.add_argument("--json", action="store_true", help="print the whole measurement, evidence included, as JSON")
        form.add_argument("--markdown", action="store_true", help="print the table as Markdown")
        args = parser.parse_args(argv)
        with full_width_output():
            result = measure()
            if args.json:
                print(json.dumps(result, indent=1))
            elif args.markdown:
                print(to_markdown(result))
            else:
                render_terminal(result)
        return 0

    return guarded(command)


if __name__ == "__main__":
    raise SystemExit(main())
