"""Which native attention API takes which modern feature, read from the
installed frameworks themselves (their signatures and ONNX's operator
schema), not recalled: `python -m conformance.native.conventions.features` prints the
tables that docs/spec-modern.md holds, with the versions it was read from.

A cell names the argument that carries the feature; "-" means the API has
no such argument (a user must build it around the call, as impl_* do);
"mask" means only through a general boolean mask argument, "bias" only
through a general additive (float) bias or mask argument.

Two tables: the modern features (FEATURES, docs/spec-modern.md) and the
frontier ones (FRONTIER_FEATURES, the same doc's next table). A score_mod
(flex_attention) is a function of (score, batch, head, query index, key
index): ALiBi is a term of it and the query temperature a per-query factor
of it, so both cells name it; the QKV clip, the gate, the value norm and
latent attention act on q, k, v or the context, which no score function
reaches.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's C++ start-up lines are not this table

FEATURES = ("rope", "KV cache", "window", "softcap", "QK-norm", "sinks", "packed segments")
FRONTIER_FEATURES = ("ALiBi", "local chunks", "query temperature", "QKV clip", "output gate", "value norm",
                     "latent (MLA)")


def _parameters(target) -> set[str]:
    try:
        return set(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return set()


def _first(params: set[str], *names: str) -> str | None:
    return next((name for name in names if name in params), None)


def _row(params: set[str], *, mask: str | None, bias: str | None = None) -> dict[str, str]:
    """Cells from an API's argument names (exact names, as the frameworks spell them). mask: the API's
    boolean mask argument; bias: its additive float argument (named by the reader: a parameter called
    "bias" is a projection flag in some layers)."""
    masked = "mask" if mask else "-"
    return {
        "ALiBi": _first(params, "alibi_slopes", "alibi", "score_mod") or ("bias" if bias else "-"),
        "local chunks": _first(params, "attention_chunk_size", "chunk_size", "local_chunk", "block_mask") or masked,
        "query temperature": _first(params, "query_temperature", "attn_temperature", "score_mod") or "-",
        "QKV clip": _first(params, "clip_qkv", "qkv_clip") or "-",
        "output gate": _first(params, "output_gate", "attn_output_gate", "gate") or "-",
        "value norm": _first(params, "v_norm", "value_norm") or "-",
        "latent (MLA)": _first(params, "kv_lora_rank", "latent", "kv_rank") or "-",
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
        _parameters(sdpa) or {"attn_mask"}, mask="attn_mask", bias="attn_mask")  # a float attn_mask is added
    try:
        flex = importlib.import_module("torch.nn.attention.flex_attention").flex_attention
        rows[f"torch {torch.__version__} flex_attention"] = _row(_parameters(flex), mask="block_mask")
    except ImportError:
        pass
    rows[f"torch {torch.__version__} nn.MultiheadAttention"] = _row(
        _parameters(torch.nn.MultiheadAttention.__init__) | _parameters(torch.nn.MultiheadAttention.forward),
        mask="attn_mask", bias="attn_mask")
    return rows


def _keras_rows():
    keras = importlib.import_module("keras")
    mha = keras.layers.MultiHeadAttention
    rows = {f"keras {keras.__version__} layers.MultiHeadAttention": _row(
        _parameters(mha.__init__) | _parameters(mha.call), mask="attention_mask")}
    return rows


def _jax_rows():
    jax = importlib.import_module("jax")
    dpa = _parameters(jax.nn.dot_product_attention)
    rows = {f"jax {jax.__version__} nn.dot_product_attention": _row(dpa, mask="mask",
                                                                    bias="bias" if "bias" in dpa else None)}
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
    row = _row(names, mask="attn_mask", bias="attn_mask")  # a float attn_mask is added to the logits
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


def markdown(rows: dict[str, dict[str, str]], features: tuple[str, ...] = FEATURES) -> str:
    lines = ["| API | " + " | ".join(features) + " |", "|---" * (len(features) + 1) + "|"]
    for api, cells in rows.items():
        lines.append(f"| {api} | " + " | ".join(f"`{cells[f]}`" if cells[f] not in ("-", "mask", "bias") else cells[f]
                                                for f in features) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.native.conventions.features", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    rows, notes = measure()
    print(markdown(rows))
    print()
    print(markdown(rows, FRONTIER_FEATURES))
    for note in notes:
        print(f"\n{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
