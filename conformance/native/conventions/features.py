"""Which native attention API takes which modern feature, read from the
installed frameworks themselves (their signatures and ONNX's operator
schema), not recalled: `python -m conformance.native.conventions.features` prints the
table that docs/spec.md holds, with the versions it was read from.

A cell names the argument that carries the feature; "-" means the API has
no such argument (a user must build it around the call, as impl_* do);
"mask" means only through a general boolean mask argument.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's C++ start-up lines are not this table

FEATURES = ("rope", "KV cache", "window", "softcap", "QK-norm", "sinks", "packed segments")


def _parameters(target) -> set[str]:
    try:
        return set(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return set()


def _first(params: set[str], *names: str) -> str | None:
    return next((name for name in names if name in params), None)


def _row(params: set[str], *, mask: str | None) -> dict[str, str]:
    """Cells from an API's argument names (exact names, as the frameworks spell them)."""
    masked = "mask" if mask else "-"
    return {
        "rope": _first(params, "rope", "rotary_emb", "position_embeddings", "rotary_dim") or "-",
        "KV cache": _first(params, "past_key_value", "past_key", "kv_cache", "cache", "decode") or "-",
        "window": _first(params, "local_window_size", "window_size", "sliding_window", "block_mask") or masked,
        "softcap": _first(params, "softcap", "logit_softcap", "score_mod", "logits_soft_cap") or "-",
        "QK-norm": _first(params, "normalize_qk", "qk_norm") or "-",
        "sinks": _first(params, "sinks", "s_aux", "attention_sinks") or "-",
        "packed segments": _first(params, "segment_ids", "block_mask", "document_ids") or masked,
    }


def _torch_rows():
    torch = importlib.import_module("torch")
    rows = {}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows[f"torch {torch.__version__} F.scaled_dot_product_attention"] = _row(
        _parameters(sdpa) or {"attn_mask"}, mask="attn_mask")
    try:
        flex = importlib.import_module("torch.nn.attention.flex_attention").flex_attention
        rows[f"torch {torch.__version__} flex_attention"] = _row(_parameters(flex), mask="block_mask")
    except ImportError:
        pass
    rows[f"torch {torch.__version__} nn.MultiheadAttention"] = _row(
        _parameters(torch.nn.MultiheadAttention.__init__) | _parameters(torch.nn.MultiheadAttention.forward),
        mask="attn_mask")
    return rows


def _keras_rows():
    keras = importlib.import_module("keras")
    mha = keras.layers.MultiHeadAttention
    rows = {f"keras {keras.__version__} layers.MultiHeadAttention": _row(
        _parameters(mha.__init__) | _parameters(mha.call), mask="attention_mask")}
    return rows


def _jax_rows():
    jax = importlib.import_module("jax")
    rows = {f"jax {jax.__version__} nn.dot_product_attention": _row(_parameters(jax.nn.dot_product_attention),
                                                                    mask="mask")}
    nnx = importlib.import_module("flax.nnx")
    flax = importlib.import_module("flax")
    mha = nnx.MultiHeadAttention
    rows[f"flax {flax.__version__} nnx.MultiHeadAttention"] = _row(
        _parameters(mha.__init__) | _parameters(mha.__call__), mask="mask")
    return rows


def _onnx_rows():
    onnx = importlib.import_module("onnx")
    schema = onnx.defs.get_schema("Attention")
    names = set(schema.attributes) | {i.name for i in schema.inputs}
    row = _row(names, mask="attn_mask")
    windows = sorted({"left_window_size", "right_window_size"} & names)
    if windows:  # opset 25 names the two sides
        row["window"] = "/".join(windows)
    return {f"onnx {onnx.__version__} Attention (opset {schema.since_version})": row}


def measure() -> tuple[dict[str, dict[str, str]], list[str]]:
    """(rows, notes): every installed API's row, and a note per framework not installed."""
    rows: dict[str, dict[str, str]] = {}
    notes = []
    for name, reader in (("torch", _torch_rows), ("keras", _keras_rows), ("jax/flax", _jax_rows),
                         ("onnx", _onnx_rows)):
        try:
            rows.update(reader())
        except ImportError as err:
            notes.append(f"{name}: not installed ({err})")
    return rows, notes


def markdown(rows: dict[str, dict[str, str]]) -> str:
    lines = ["| API | " + " | ".join(FEATURES) + " |", "|---" * (len(FEATURES) + 1) + "|"]
    for api, cells in rows.items():
        lines.append(f"| {api} | " + " | ".join(f"`{cells[f]}`" if cells[f] not in ("-", "mask") else cells[f]
                                                for f in FEATURES) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.native.conventions.features", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    rows, notes = measure()
    print(markdown(rows))
    for note in notes:
        print(f"\n{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
