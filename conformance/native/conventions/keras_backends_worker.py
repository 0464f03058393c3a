"""The worker of the Keras-backends tables: one process per Keras backend.

Keras fixes its backend when it is imported, so keras_backends.py starts this
module once per backend with KERAS_BACKEND set:

    python -m conformance.native.conventions.keras_backends_worker BACKEND IN.npz OUT.json OUT.npz [--plant WHAT]

It measures, on that backend, the conventions rows of Keras's own attention
(keras.layers.MultiHeadAttention, both paths, and keras.ops.dot_product_attention)
with the harness of the first table, what each accepts as a mask shape, which
kernel the backend really runs and what flash_attention=None / True do; and
it runs every call of keras_backends.CALLS on the shared weights and inputs of
IN.npz, writing the outputs to OUT.npz (the parent compares the backends).

--plant polarity: the mask is complemented before it reaches Keras, as a port
that read Keras's mask the wrong way round would; the tables must report it
(tests/test_conventions_keras_backends.py).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

PLANTS = ("polarity",)

# the mask shapes tried: (label, the shape's letters, the axes of (B, N, T, S) its axes are meant as); a 1
# broadcasts; (B, S) is meant as a padding mask over the keys
MHA_MASK_SHAPES = (("(B, T, S)", "BTS", "BTS"), ("(B, 1, S)", "B1S", "BTS"), ("(1, T, S)", "1TS", "BTS"),
                   ("(T, S)", "TS", "TS"), ("(B, S)", "BS", "BS"))
DPA_MASK_SHAPES = (("(B, N, T, S)", "BNTS", "BNTS"), ("(B, 1, T, S)", "B1TS", "BNTS"),
                   ("(B, 1, 1, S)", "B11S", "BNTS"), ("(1, 1, T, S)", "11TS", "BNTS"), ("(B, T, S)", "BTS", "BTS"),
                   ("(T, S)", "TS", "TS"))


def _keras():
    import keras

    return keras


def _np(x) -> np.ndarray:
    return np.asarray(_keras().ops.convert_to_numpy(x))


class Kernels:
    """Which kernel a call really ran on this backend, recorded by hooks on the functions the
    backend's dot_product_attention calls (keras/src/backend/*/nn.py, keras 3.15) or, on torch, by
    the profiler's aten op names."""

    def __init__(self, backend: str):
        self.backend = backend
        self.seen: list[str] = []
        self.missing: str | None = None
        self._undo = []

    def __enter__(self):
        self.seen = []
        self.missing: str | None = None
        self.dtypes: list[str] = []
        if self.backend == "tensorflow":
            from keras.src.backend.tensorflow import nn as knn

            self._wrap(knn, "_dot_product_attention_xla",
                       lambda *a, **k: f"keras _dot_product_attention_xla (tf.einsum, tf.nn.softmax) in {_dt(a[0])}")
        elif self.backend == "jax":
            import jax
            from keras.src.backend.jax import nn as knn

            self._wrap(jax.nn, "dot_product_attention",
                       lambda *a, **k: f"jax.nn.dot_product_attention(implementation={k.get('implementation')!r}) "
                                       f"in {_dt(a[0] if a else k['query'])}")
            self._wrap(knn, "_dot_product_attention_core",
                       lambda *a, **k: f"keras _dot_product_attention_core in {_dt(a[0])}")
        elif self.backend == "torch":
            import torch

            def record(*a, **k):
                self.dtypes.append(_dt(a[0] if a else k["query"]))
                return None

            self._wrap(torch.nn.functional, "scaled_dot_product_attention", record, keep=False)
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._prof.__enter__()
        return self

    def _wrap(self, module, name, label, keep=True):
        original = getattr(module, name, None)
        if original is None:  # another Keras than 3.15 may have renamed it: the kernel is then unknown
            self.missing = f"unknown ({module.__name__}.{name} not found)"
            return

        def hooked(*a, **k):
            seen = label(*a, **k)
            if keep:
                self.seen.append(seen)
            return original(*a, **k)

        setattr(module, name, hooked)
        self._undo.append((module, name, original))

    def __exit__(self, *exc):
        for module, name, original in reversed(self._undo):
            setattr(module, name, original)
        self._undo = []
        if self.backend == "torch":
            self._prof.__exit__(*exc)
            names = [e.key for e in self._prof.key_averages()]
            # the innermost SDPA op names the kernel (the outer scaled_dot_product_attention only dispatches)
            kernels = [n for n in names if "scaled_dot_product" in n and n != "aten::scaled_dot_product_attention"]
            dtype = f" in {', '.join(dict.fromkeys(self.dtypes))}" if self.dtypes else ""
            self.seen = [f"torch {n}{dtype}" for n in kernels] or (
                [f"torch F.scaled_dot_product_attention (no inner kernel op recorded){dtype}"]
                if "aten::scaled_dot_product_attention" in names else [])
        return False

    def label(self) -> str:
        if self.seen:
            return " + ".join(dict.fromkeys(self.seen))
        return self.missing or "no fused kernel (einsum and the Softmax layer)"


def _dt(x) -> str:
    """A tensor's dtype, as Keras names it."""
    return _keras().backend.standardize_dtype(x.dtype)


# -- the conventions rows (the first table's harness, on this backend) ------------------------

def _layer(num_heads, key_dim, dtype="float32", use_bias=False):
    keras = _keras()
    return keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=key_dim, use_bias=use_bias, dtype=dtype)


def _identity_mha():
    from conformance.native.conventions.harness import B, D, H, N, S, T

    layer = _layer(N, H)
    layer.build((B, T, D), (B, S, D), (B, S, D))
    eye = np.eye(D, dtype=np.float32)
    for dense, kernel in ((layer.query_dense, eye.reshape(D, N, H)), (layer.key_dense, eye.reshape(D, N, H)),
                          (layer.value_dense, eye.reshape(D, N, H)), (layer.output_dense, eye.reshape(N, H, D))):
        if tuple(dense.kernel.shape) != kernel.shape:
            raise RuntimeError(f"unexpected keras kernel shape {tuple(dense.kernel.shape)}, expected {kernel.shape}")
        dense.kernel.assign(kernel)
    return layer


def _short(err: BaseException) -> str:
    """harness._short, through Keras's "Exception encountered when calling X.call()" wrapper to the message
    inside (its first line after the wrapper, ANSI codes dropped)."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text)  # TensorFlow's op-location prefix
    if text.startswith("Exception encountered when calling"):
        inner = [line.strip() for line in text.splitlines()[1:] if line.strip()]
        text = inner[0] if inner else text
    text = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".split(". ")[0].rstrip(".")
    return text if len(text) <= 160 else text[:157] + "..."


def _planted(mask, plant):
    return None if mask is None else (~np.asarray(mask) if plant == "polarity" else np.asarray(mask))


def _mask_shapes(call, shapes) -> dict:
    """Each mask shape: does the call take it, and does it mean the pattern broadcast as its letters say?
    -> {label: {"label": "ok" | "runs, other meaning" | "refused", ...}}"""
    from conformance.native.conventions.harness import B, N, S, T, _inputs, _max_err

    q, k, v = _inputs(T, S, seed=3)
    sizes = {"B": B, "N": N, "T": T, "S": S, "1": 1}
    out: dict[str, Any] = {}
    for label, letters, meant in shapes:
        shape = tuple(sizes[c] for c in letters)
        pattern = np.random.default_rng(11).random(shape) < 0.6
        pattern[..., 0] = True  # every row keeps a key: the empty row is its own column
        full = pattern.reshape([shape[meant.index(d)] if d in meant else 1 for d in "BNTS"])
        allowed4 = np.broadcast_to(full, (B, N, T, S))
        try:
            got = call(q, k, v, pattern)
        except Exception as err:  # noqa: BLE001 - the API refusing the shape is the measured fact
            out[label] = {"label": "refused", "why": _short(err)}
            continue
        err = _max_err(got, _reference4(q, k, v, allowed4))
        if err <= 1e-4:
            out[label] = {"label": "ok", "err": err}
            continue
        out[label] = {"label": "runs, another meaning", "err": err}
        try:  # NumPy's broadcasting: the shape right-aligned against (B, N, T, S)
            right = np.broadcast_to(pattern, (B, N, T, S))
        except ValueError:
            continue
        err_right = _max_err(got, _reference4(q, k, v, right))
        if err_right <= 1e-4:
            out[label] = {"label": "runs, read right-aligned against (B, N, T, S)", "err": err_right,
                          "err_as_named": err}
    return out


def _padding_mask_when_b_is_t(call) -> dict:
    """A (B, S) padding mask where B == T (3): refused like any (B, S), or does it run, and as what?"""
    from conformance.native.conventions.harness import D, N, S

    rng = np.random.default_rng(13)
    Bt = 3
    q = rng.standard_normal((Bt, Bt, D)).astype(np.float32)
    k, v = (rng.standard_normal((Bt, S, D)).astype(np.float32) for _ in range(2))
    pattern = rng.random((Bt, S)) < 0.6
    pattern[:, 0] = True
    try:
        got = call(q, k, v, pattern)
    except Exception as err:  # noqa: BLE001
        return {"label": "refused", "why": _short(err)}
    meant = np.broadcast_to(pattern[:, None, None, :], (Bt, N, Bt, S))  # key padding per batch
    as_queries = np.broadcast_to(pattern[None, None, :, :], (Bt, N, Bt, S))  # query t reads row t
    errs = {"ok": _diff(got, _reference4(q, k, v, meant)),
            "runs, read as (T, S): query t gets batch t's padding": _diff(got, _reference4(q, k, v, as_queries))}
    best = min(errs, key=errs.get)
    return {"label": best if errs[best] <= 1e-4 else "runs, another meaning", "err": errs[best]}


def _diff(a, b) -> float:
    from conformance.native.conventions.harness import _max_err

    return _max_err(a, b)


def _reference4(q, k, v, allowed4):
    """impl_numpy with identity projections and a (B, N, T, S) mask."""
    from conformance.native.conventions.harness import _config, _identity_tensors
    from impl_numpy import multi_head_attention

    cast = [np.asarray(x, dtype=np.float64) for x in (q, k, v)]
    return multi_head_attention(_config("zero"), _identity_tensors(), *cast, mask=np.asarray(allowed4, bool))


def _flash(call) -> dict:
    """What flash_attention=True does here: runs (and matches the default call) or refused, with Keras's reason."""
    from conformance.native.conventions.harness import S, T, _inputs, _max_err

    q, k, v = _inputs(T, S, seed=5)
    try:
        got = call(q, k, v, None, flash=True)
    except Exception as err:  # noqa: BLE001
        return {"label": "refused", "why": _short(err)}
    return {"label": "runs", "err_vs_default": _max_err(got, call(q, k, v, None, flash=None))}


def _kernels(backend, call) -> dict:
    from conformance.native.conventions.harness import T, _inputs, full_pattern

    q, k, v = _inputs(T, T, seed=9)
    out = {}
    for what, mask, causal in (("no mask", None, False), ("bool mask", full_pattern(T, T), False),
                               ("causal", None, True)):
        with Kernels(backend) as seen:
            call(q, k, v, mask, causal=causal)
        out[what] = seen.label()
    return out


def _runners(backend: str, plant: str | None) -> list:
    from conformance.native.conventions.harness import Api, Runner, _merge, _split

    keras = _keras()

    def mha_call(layer, scores):
        def call(q, k, v, mask, causal=False, flash=None):
            saved = layer._flash_attention
            if flash is not None:
                layer._flash_attention = flash
            try:
                result = layer(q, v, key=k, attention_mask=mask, use_causal_mask=causal,
                               return_attention_scores=scores)
            finally:
                layer._flash_attention = saved
            return _np(result[0] if scores else result)
        return call

    def dpa_call(q, k, v, mask, causal=False, flash=None):
        out = keras.ops.dot_product_attention(_split(q), _split(k), _split(v), mask=mask, is_causal=causal,
                                              flash_attention=flash)  # (B, T, N, H)
        return _merge(_np(out))

    def build_mha(scores):
        def build():
            layer = _identity_mha()
            call = mha_call(layer, scores)

            def run(q, k, v, masks=None, causal=False, want_weights=True):
                mask = _planted(None if not masks else masks.get("attention_mask"), plant)
                result = layer(q, v, key=k, attention_mask=mask, return_attention_scores=scores, use_causal_mask=causal)
                if scores:
                    return _np(result[0]), _np(result[1])
                return _np(result), None

            def extra():
                ex = {"mask_shapes": {**_mask_shapes(lambda q, k, v, m: call(q, k, v, m), MHA_MASK_SHAPES),
                                      "(B, S) with B = T": _padding_mask_when_b_is_t(
                                          lambda q, k, v, m: call(q, k, v, m))},
                      "kernels": _kernels(backend, call),
                      "flash_default": repr(layer._flash_attention)}
                ex["flash_true"] = ({"label": "refused", "why": "ValueError: Returning attention scores is not "
                                     "supported when flash attention is enabled (keras source; not called)"}
                                    if scores else _flash(call))
                return ex

            return Runner(run, {"attention_mask": "full"}, returns_weights=scores, extra=extra)
        return build

    def build_dpa():
        def run(q, k, v, masks=None, causal=False, want_weights=True):
            mask = _planted(None if not masks else masks.get("mask"), plant)
            return dpa_call(q, k, v, None if mask is None else mask[:, None], causal=causal), None

        def extra():
            return {"mask_shapes": _mask_shapes(lambda q, k, v, m: dpa_call(q, k, v, m), DPA_MASK_SHAPES),
                    "kernels": _kernels(backend, lambda q, k, v, m, causal=False: dpa_call(
                        q, k, v, None if m is None else m[:, None], causal=causal)),
                    "flash_default": "None", "flash_true": _flash(dpa_call)}

        return Runner(run, {"mask": "full"}, returns_weights=False, extra=extra)

    from conformance.native.conventions.keras_backends import API_LABELS

    builds = (build_mha(False), build_mha(True), build_dpa)
    return [Api(f"{label} on {backend}", "keras", ("keras",), "", build) for label, build in zip(API_LABELS, builds)]


def measure_rows(backend: str, plant: str | None) -> list[dict]:
    from conformance.native.conventions.harness import measure_api
    from conformance.native.conventions.precision import MATMUL_PROBES, _precision_inputs

    a, b, exact = _precision_inputs()
    devices: dict = {}
    try:
        matmul = MATMUL_PROBES["keras"](a, b, exact, devices)
    except Exception as err:  # noqa: BLE001
        matmul = {"error": {"label": f"error: {_short(err)}", "rel_err": "n/a"}}
    rows = []
    for api in _runners(backend, plant):
        row = measure_api(api)
        row["backend"] = backend
        if row["status"] == "measured":
            row["float32_matmul"] = matmul
        rows.append(row)
    return rows


# -- the cross-backend calls ---------------------------------------------------------------

def run_calls(backend: str, shared: dict[str, np.ndarray], plant: str | None, quick: bool = False) -> tuple[dict, dict]:
    """Every call of keras_backends.CALLS on the shared weights and inputs: (outputs, facts per call)."""
    from conformance.native.conventions.keras_backends import CALLS, QUICK_CALLS, call_arrays

    keras = _keras()
    outputs, facts = {}, {}
    layers: dict[str, Any] = {}
    for spec in CALLS:
        if quick and spec.name not in QUICK_CALLS:
            continue
        arrays = call_arrays(shared, spec)
        dt = spec.dtype
        try:
            mask = _planted(arrays.get("mask"), plant)
            with Kernels(backend) as seen:
                if spec.api == "dpa":
                    q, k, v = (keras.ops.cast(arrays[n], dt) for n in ("q4", "k4", "v4"))
                    out = keras.ops.dot_product_attention(q, k, v, mask=None if mask is None else mask[:, None],
                                                          is_causal=spec.causal)
                else:
                    layer = layers.get(dt)
                    if layer is None:
                        layer = layers[dt] = _weighted_layer(shared, dt)
                    q, k, v = (keras.ops.cast(arrays[n], dt) for n in ("xq", "xk", "xv"))
                    result = layer(q, v, key=k, attention_mask=mask, use_causal_mask=spec.causal,
                                   return_attention_scores=spec.api == "mha_scores")
                    out = result[0] if spec.api == "mha_scores" else result
            host = _np(out)
            outputs[spec.name] = host.astype(np.float64)
            facts[spec.name] = {"dtype": str(host.dtype), "kernel": seen.label()}
        except Exception as err:  # noqa: BLE001 - a call a backend refuses is a measured fact
            facts[spec.name] = {"error": _short(err)}
    return outputs, facts


def _weighted_layer(shared, dtype):
    from conformance.native.conventions.keras_backends import CROSS

    keras = _keras()
    N, H, D = CROSS["N"], CROSS["H"], CROSS["D"]
    layer = _layer(N, H, dtype=dtype, use_bias=True)
    layer.build((1, 1, D), (1, 1, D), (1, 1, D))
    for name, dense in (("query", layer.query_dense), ("key", layer.key_dense), ("value", layer.value_dense),
                        ("output", layer.output_dense)):
        dense.kernel.assign(keras.ops.cast(shared[f"{name}.kernel"], dense.kernel.dtype))
        dense.bias.assign(keras.ops.cast(shared[f"{name}.bias"], dense.bias.dtype))
    return layer


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    backend, src, out_json, out_npz = argv[:4]
    plant = argv[argv.index("--plant") + 1] if "--plant" in argv else None
    quick = "--quick" in argv
    if plant is not None and plant not in PLANTS:
        raise ValueError(f"--plant: expected one of {PLANTS}, got {plant!r}")
    if os.environ.get("KERAS_BACKEND") != backend:
        raise ValueError(f"KERAS_BACKEND: expected {backend!r} (set before keras is imported), got "
                         f"{os.environ.get('KERAS_BACKEND')!r}")
    import warnings

    warnings.filterwarnings("ignore")
    import time

    started = time.perf_counter()
    keras = _keras()
    if keras.backend.backend() != backend:
        raise ValueError(f"keras runs on {keras.backend.backend()!r}, expected {backend!r}")
    with np.load(src) as f:
        shared = {k: f[k] for k in f.files}
    rows = measure_rows(backend, plant)
    outputs, facts = run_calls(backend, shared, plant, quick)
    np.savez(out_npz, **outputs)
    from conformance.native.conventions.precision import _versions

    versions = _versions({"keras", backend})
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump({"backend": backend, "rows": rows, "facts": facts, "versions": versions,
                   "seconds": round(time.perf_counter() - started, 2)}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
