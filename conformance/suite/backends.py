"""Backend registry: one small adapter per implementation, imported lazily.

An adapter module (`impl_*/adapter.py`) offers `devices()`, `forward(config,
tensors, inputs, options, *, device, precision, trace)` and `vjp(config,
tensors, inputs, options, d_output, *, device, precision)`, NumPy in and out.
A backend whose framework is missing is reported "not installed"; the others
still run.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from types import ModuleType

from conformance.console import BackendUnavailable
from conformance.logs import quiet_python_loggers

DEVICES = ("cpu", "gpu")
CORE = ("numpy", "torch", "tf", "keras-jax", "keras-torch", "jax", "mlx")
NATIVE = ("torch-native-mha", "torch-sdpa", "torch-flex", "keras-native-mha", "flax-linen-mha", "flax-nnx-mha",
          "jax-dpa", "onnxruntime", "keras-hub", "torchtune")


# MLX has wheels for Linux x86-64 (mlx-cpu) and macOS arm64 (mlx) only; the `mlx` extra installs nothing
# elsewhere, and the backend is then "not installed" with this.
MLX_INSTALL = ("mlx: the mlx extra, pip install -c constraints/cpu.txt '.[mlx]' (wheels: mlx-cpu on Linux x86-64, "
               "mlx on macOS arm64; none for this platform otherwise)")


@dataclasses.dataclass(frozen=True)
class Backend:
    id: str
    adapter: str  # module path of the adapter
    framework: str  # what a user installs to get it
    description: str
    # The Keras backend the adapter needs (KERAS_BACKEND), for a Keras one; Keras fixes its backend when it is
    # first imported, so a process runs one: `mha check` runs those other than TensorFlow in workers of their own
    keras_backend: str | None = None


REGISTRY: dict[str, Backend] = {
    b.id: b
    for b in (
        Backend("numpy", "impl_numpy.adapter", "numpy", "the NumPy reference (impl_numpy)"),
        Backend("torch", "impl_torch.adapter", "torch", "impl_torch, PyTorch"),
        Backend("tf", "impl_tf.adapter", "tensorflow + keras", "impl_tf, Keras split_heads layer on TensorFlow",
                "tensorflow"),
        Backend("keras-jax", "impl_tf.adapter", "jax + keras", "impl_tf, the same Keras layer on Keras's jax backend",
                "jax"),
        Backend("keras-torch", "impl_tf.adapter", "torch + keras",
                "impl_tf, the same Keras layer on Keras's torch backend", "torch"),
        Backend("jax", "impl_jax.adapter", "jax + flax", "impl_jax, JAX / Flax NNX"),
        Backend("mlx", "impl_mlx.adapter", MLX_INSTALL, "impl_mlx, MLX (mlx.nn.Module)"),
        # The frameworks' own layers, run on the canonical weights (interop).
        Backend("torch-native-mha", "conformance.native.torch_native_mha", "torch", "torch nn.MultiheadAttention"),
        Backend("torch-sdpa", "conformance.native.torch_sdpa", "torch",
                "F.scaled_dot_product_attention around our projections"),
        Backend("torch-flex", "conformance.native.torch_flex", "torch",
                "flex_attention (eager) around our projections, RoPE, QK-norm and cache"),
        Backend("keras-native-mha", "conformance.native.keras_native_mha", "tensorflow + keras",
                "keras.layers.MultiHeadAttention", "tensorflow"),
        Backend("flax-linen-mha", "conformance.native.flax_linen_mha", "jax + flax",
                "flax.linen.MultiHeadDotProductAttention"),
        Backend("flax-nnx-mha", "conformance.native.flax_nnx_mha", "jax + flax", "flax.nnx.MultiHeadAttention"),
        Backend("jax-dpa", "conformance.native.jax_dpa", "jax", "jax.nn.dot_product_attention around our projections"),
        Backend("onnxruntime", "conformance.native.onnxruntime", "onnx + onnxruntime",
                "our layer exported to ONNX (opset 23), run by onnxruntime"),
        Backend("keras-hub", "conformance.native.keras_hub",
                "the keras-hub extra: pip install -c constraints/cpu.txt '.[keras-hub]'",
                "keras_hub CachedMultiHeadAttention with its RotaryEmbedding"),
        Backend("torchtune", "conformance.native.torchtune",
                "the torchtune extra: pip install -c constraints/cpu.txt '.[torchtune]'",
                "torchtune.modules.MultiHeadAttention with RotaryPositionalEmbeddings and KVCache"),
    )
}


# Config fields a core backend does not take yet, with the reason its cases are reported "unsupported" for
# (the one place that decides it: run_case and the backend's `mha verify` function read not_yet). Remove the
# entry when the backend gains the field.
NOT_YET: dict[str, dict[str, str]] = {}
# (Issue 41's DeepSeek V4 layer, config.compressed, runs on every mirror column through its adapter's
# compressed_call: no entry.)


def not_yet(backend_id: str, config) -> str | None:
    """Why this backend cannot take this config yet (NOT_YET), or None."""
    reasons = [why for field, why in NOT_YET.get(backend_id, {}).items() if getattr(config, field, None) is not None]
    return "; ".join(reasons) or None


def get(backend_id: str) -> Backend:
    try:
        return REGISTRY[backend_id]
    except KeyError:
        raise ValueError(f"backend must be one of {', '.join(REGISTRY)}: got {backend_id!r}") from None


def own_process(backend_id: str) -> bool:
    """Whether the backend runs Keras on another backend than TensorFlow: a process (a worker) of its own."""
    return get(backend_id).keras_backend not in (None, "tensorflow")


def _check_keras_backend(backend: Backend) -> None:
    """Keras on the backend's Keras backend in this process, or BackendUnavailable saying why not. Keras not yet
    imported: KERAS_BACKEND is set here for it (a worker of the backend's own, or a user's process)."""
    wanted = backend.keras_backend
    keras = sys.modules.get("keras")
    if keras is None:
        os.environ["KERAS_BACKEND"] = wanted
        return
    running = keras.backend.backend()
    if running != wanted:
        raise BackendUnavailable(
            f"backend {backend.id}: Keras runs on {running} in this process and fixes its backend when first "
            f"imported; {backend.id} needs a process of its own with KERAS_BACKEND={wanted} (mha check starts one)")


def load(backend_id: str) -> ModuleType:
    """Import a backend's adapter; BackendUnavailable says why it can't be."""
    backend = get(backend_id)
    if backend.keras_backend is not None:
        _check_keras_backend(backend)
    try:
        module = importlib.import_module(backend.adapter)
    except ModuleNotFoundError as err:
        if err.name and (backend.adapter + ".").startswith(err.name + "."):
            raise BackendUnavailable(f"backend {backend_id}: not implemented in this checkout ({backend.adapter})") from None
        raise BackendUnavailable(f"backend {backend_id}: not installed ({err.name} missing; install {backend.framework})") from None
    except ImportError as err:  # installed but unusable (e.g. Keras already on another backend)
        raise BackendUnavailable(f"backend {backend_id}: cannot be imported: {err}".replace("\n", " ")) from None
    quiet_python_loggers()
    return module


def availability(backend_id: str) -> tuple[bool, str]:
    try:
        load(backend_id)
    except BackendUnavailable as err:
        return False, str(err)
    return True, "installed"


def devices(backend_id: str) -> list[str]:
    return list(load(backend_id).devices())
