"""The float32 matmul precision probe of the conventions table: a
(256, 1024) x (1024, 256) float32 matmul with each framework's default
settings on each device present, against float64."""

from __future__ import annotations

import importlib
import importlib.util
import platform
import sys

import numpy as np

from conformance.logs import import_keras
from conformance.native.conventions.apis import ONNX_IR_VERSION
from conformance.native.conventions.harness import FLOAT32_REL_ERR_MAX, MATMUL_SHAPE, _num

# -- float32 matmul precision ----------------------------------------------------------------

def _precision_inputs():
    M, K, Nn = MATMUL_SHAPE
    rng = np.random.default_rng(1)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, Nn)).astype(np.float32)
    return a, b, a.astype(np.float64) @ b.astype(np.float64)


def _precision_label(c, exact) -> dict:
    c = np.asarray(c, dtype=np.float64)
    rel = float(np.linalg.norm(c - exact) / np.linalg.norm(exact))
    label = "float32" if rel <= FLOAT32_REL_ERR_MAX else "TF32/bf16-like (reduced)"
    return {"label": label, "rel_err": _num(rel)}


def _matmul_torch(a, b, exact, devices):
    import torch

    out = {"cpu": _precision_label(torch.as_tensor(a) @ torch.as_tensor(b), exact)}
    devices["torch"] = {"cpu": platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        out["gpu"] = _precision_label((torch.as_tensor(a, device="cuda") @ torch.as_tensor(b, device="cuda")).cpu(), exact)
        devices["torch"]["gpu"] = torch.cuda.get_device_name(0)
    return out


def _matmul_keras(a, b, exact, devices):
    keras = import_keras()
    backend = keras.backend.backend()
    if backend != "tensorflow":
        c = keras.ops.convert_to_numpy(keras.ops.matmul(a, b))
        devices["keras"] = {"default": backend}
        return {"default": _precision_label(c, exact)}
    import tensorflow as tf

    out, names = {}, {}
    for dev in tf.config.list_logical_devices():
        if dev.device_type not in ("CPU", "GPU"):
            continue
        key = dev.device_type.lower()
        key = key if key not in out else dev.name  # a second GPU goes by its own name
        with tf.device(dev.name):
            out[key] = _precision_label(tf.matmul(a, b).numpy(), exact)
        names[key] = dev.name
    devices["keras"] = names
    return out


def _matmul_jax(a, b, exact, devices):
    import jax
    import jax.numpy as jnp

    out, names = {}, {}
    seen = {d for platform_ in ("cpu", None) for d in (jax.devices(platform_) if platform_ else jax.devices())}
    for d in sorted(seen, key=lambda d: (d.platform != "cpu", d.id)):
        key = "cpu" if d.platform == "cpu" else "gpu" if d.platform in ("gpu", "cuda", "rocm") else d.platform
        if key in out:
            continue
        out[key] = _precision_label(jnp.matmul(jax.device_put(a, d), jax.device_put(b, d)), exact)
        names[key] = d.device_kind
    devices["jax"] = names
    return out


def _onnx_matmul_model():
    from onnx import TensorProto, helper

    M, K, Nn = MATMUL_SHAPE
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["C"])], "mm",
                              [helper.make_tensor_value_info("A", TensorProto.FLOAT, [M, K]),
                               helper.make_tensor_value_info("B", TensorProto.FLOAT, [K, Nn])],
                              [helper.make_tensor_value_info("C", TensorProto.FLOAT, [M, Nn])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=ONNX_IR_VERSION)


def _matmul_onnxruntime(a, b, exact, devices):
    import onnxruntime as ort

    model = _onnx_matmul_model().SerializeToString()
    out, names = {}, {}
    for provider, key in (("CPUExecutionProvider", "cpu"), ("CUDAExecutionProvider", "gpu")):
        if provider in ort.get_available_providers():
            sess = ort.InferenceSession(model, providers=[provider])
            out[key] = _precision_label(sess.run(None, {"A": a, "B": b})[0], exact)
            names[key] = provider
    devices["onnxruntime"] = names
    return out


def _matmul_onnx_reference(a, b, exact, devices):
    from onnx.reference import ReferenceEvaluator

    devices["onnx"] = {"cpu": "onnx.reference.ReferenceEvaluator"}
    return {"cpu": _precision_label(ReferenceEvaluator(_onnx_matmul_model()).run(None, {"A": a, "B": b})[0], exact)}


def _matmul_numpy(a, b, exact, devices):
    devices["numpy"] = {"cpu": platform.processor() or platform.machine()}
    return {"cpu": _precision_label(a @ b, exact)}


def _matmul_mlx(a, b, exact, devices):
    import mlx.core as mx

    out = {"cpu": _precision_label(np.array(mx.matmul(mx.array(a), mx.array(b), stream=mx.cpu)), exact)}
    devices["mlx"] = {"cpu": str(mx.cpu)}
    if mx.metal.is_available():
        out["gpu"] = _precision_label(np.array(mx.matmul(mx.array(a), mx.array(b), stream=mx.gpu)), exact)
        devices["mlx"]["gpu"] = str(mx.gpu)
    return out


# framework key of APIS -> its default-settings float32 matmul on every device present
MATMUL_PROBES = {"torch": _matmul_torch, "keras": _matmul_keras, "jax": _matmul_jax, "onnxruntime": _matmul_onnxruntime,
                 "onnx": _matmul_onnx_reference, "numpy": _matmul_numpy, "mlx": _matmul_mlx}


def _versions(frameworks) -> dict[str, str]:
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for name in ("torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "onnx", "onnxruntime", "mlx"):
        if name in sys.modules or name in frameworks:
            try:
                versions[name] = importlib.import_module("mlx.core" if name == "mlx" else name).__version__
            except Exception:  # noqa: BLE001
                continue
    return versions


