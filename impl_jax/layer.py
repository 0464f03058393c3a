"""A Flax NNX layer around the pure `apply`: it holds a config and nnx.Params.

Parameters live in submodules named after the canonical tensors, so the NNX
state path ("query", "kernel") *is* the canonical name "query.kernel" and the
layout is the canonical one: query.kernel (D, N, H), query.bias (N, H), ...,
output.kernel (N, V, O), output.bias (O). Flax's own attention calls the
output projection `out`; this layer keeps the contract's `output`. The
frontier tensors follow the same rule: ("alibi", "slopes") is alibi.slopes,
("gate", "kernel") and ("gate", "bias") the output gate's, ("latent", "norm",
"scale") and ("query", "down", "kernel") a latent layer's.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx

import weights
from weights import AttentionConfig

from .attention import apply
from .call import X64_MESSAGE, x64_enabled

DEVICES = ("cpu", "gpu")
NO_GPU_MESSAGE = "device gpu requested but JAX sees no GPU (jax.devices('gpu') fails)"


def gpu_available() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def resolve_device(device: str) -> jax.Device:
    """"cpu" or "gpu" -> the first jax.Device of that platform."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}: got {device!r}")
    try:
        return jax.devices(device)[0]
    except RuntimeError:
        if device == "gpu":
            raise ValueError(NO_GPU_MESSAGE) from None
        raise


class Norm(nnx.Module):
    """QK-norm tensors of one projection: scale, and bias for a layer norm
    ((H,) for scope "head", (heads, H) for "all")."""

    def __init__(self, scale: jax.Array, bias: jax.Array | None):
        self.scale = nnx.Param(scale)
        self.bias = None if bias is None else nnx.Param(bias)


class Projection(nnx.Module):
    """One canonical projection: kernel (in, heads, width) or (N, V, O), an
    optional bias, and for query and key under qk_norm a `norm` (state path
    ("query", "norm", "scale") = canonical "query.norm.scale")."""

    def __init__(self, kernel: jax.Array, bias: jax.Array | None, norm: Norm | None = None):
        self.kernel = nnx.Param(kernel)
        self.bias = None if bias is None else nnx.Param(bias)
        if norm is not None:
            self.norm = norm


class Alibi(nnx.Module):
    """ALiBi's slopes (N,): a submodule so that the state path ("alibi", "slopes") is the canonical name."""

    def __init__(self, slopes: jax.Array):
        self.slopes = nnx.Param(slopes)


class Differential(nnx.Module):
    """Differential attention's lambda vectors (H,) each: a submodule so that the state paths ("differential",
    "lambda_q1"), ... are the canonical names."""

    def __init__(self, lambda_q1: jax.Array, lambda_k1: jax.Array, lambda_q2: jax.Array, lambda_k2: jax.Array):
        self.lambda_q1, self.lambda_k1 = nnx.Param(lambda_q1), nnx.Param(lambda_k1)
        self.lambda_q2, self.lambda_k2 = nnx.Param(lambda_q2), nnx.Param(lambda_k2)


class MultiHeadAttention(nnx.Module):
    """Multi-head attention on the common weight format.

    `MultiHeadAttention(config, seed=0, dtype="float32")` draws weights with
    weights.init (the same numbers every framework draws for that seed);
    `from_tensors` / `from_file` load canonical tensors. The call takes
    apply's options and passes them through: mask, bias, is_causal,
    causal_alignment, training, dropout_mask, seed, rng, positions,
    key_positions, past_key, past_value, segment_ids, key_segment_ids,
    return_weights, return_cache, precision, dtype, chunk_size, trace.
    Modern configs hold their tensors as Params too: query.norm.scale /
    .bias, key.norm.scale / .bias, value.norm.scale / .bias (submodule
    `norm` of the projection; none for a weightless norm),
    sinks, alibi.slopes (submodule `alibi`) and the output gate's
    gate.kernel / gate.bias (a Projection named `gate`). A latent layer
    (MLA) holds latent.kernel / .bias / .norm.scale (a Projection named
    `latent`) and, with a query rank, query.down.kernel / .bias /
    .norm.scale (submodule `down` of the query's Projection).
    """

    def __init__(self, config: AttentionConfig, tensors: dict[str, np.ndarray] | None = None, *,
                 seed: int = 0, dtype: str = "float32", device: str = "cpu"):
        target = resolve_device(device)  # a bad or missing device fails first
        if tensors is None:
            tensors = weights.init(config, seed=seed, dtype=dtype)
        stored = weights.validate_tensors(config, tensors)
        if stored == np.float64 and not x64_enabled():
            raise ValueError(X64_MESSAGE)
        self.config = config
        self.device = device
        placed = jax.device_put({name: np.asarray(t) for name, t in tensors.items()}, target)
        for name in ("query", "key", "value", "output"):
            if f"{name}.kernel" not in placed:  # issue 42: a kv_shared layer has no key or value projection
                continue
            norm = None
            if f"{name}.norm.scale" in placed:
                norm = Norm(placed[f"{name}.norm.scale"], placed.get(f"{name}.norm.bias"))
            setattr(self, name, Projection(placed[f"{name}.kernel"], placed.get(f"{name}.bias"), norm))
        if "latent.kernel" in placed:  # MLA: the latent's down-projection and norm; the query's, with a rank
            self.latent = Projection(placed["latent.kernel"], placed.get("latent.bias"),
                                     Norm(placed["latent.norm.scale"], None))
            if "query.down.kernel" in placed:
                self.query.down = Projection(placed["query.down.kernel"], placed.get("query.down.bias"),
                                             Norm(placed["query.down.norm.scale"], None))
        if "sinks" in placed:
            self.sinks = nnx.Param(placed["sinks"])  # (N,)
        if "alibi.slopes" in placed:
            self.alibi = Alibi(placed["alibi.slopes"])  # (N,)
        if "gate.kernel" in placed:  # (query_dim, N, V) or (query_dim, N), and (N, V) or (N,)
            self.gate = Projection(placed["gate.kernel"], placed.get("gate.bias"))
        if "differential.lambda_q1" in placed:  # (H,) each
            self.differential = Differential(*(placed[f"differential.lambda_{n}"] for n in ("q1", "k1", "q2", "k2")))

    @classmethod
    def from_tensors(cls, config: AttentionConfig, tensors: dict[str, np.ndarray], *,
                     device: str = "cpu") -> MultiHeadAttention:
        return cls(config, tensors, device=device)

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, device: str = "cpu") -> MultiHeadAttention:
        config, tensors = weights.load(path)
        return cls(config, tensors, device=device)

    @property
    def params(self) -> dict[str, jax.Array]:
        """Canonical name -> jax.Array, the `params` argument of `apply`."""
        flat = nnx.to_flat_state(nnx.state(self, nnx.Param))
        found = {".".join(map(str, path)): variable[...] for path, variable in flat}
        return {name: found[name] for name in self.config.tensor_shapes()}

    def to_tensors(self) -> dict[str, np.ndarray]:
        """Canonical NumPy arrays (bfloat16 as ml_dtypes.bfloat16), bit-exact."""
        return {name: np.array(jax.device_get(t)) for name, t in self.params.items()}

    def __call__(self, query, key=None, value=None, **options):
        """apply() on this layer's parameters; arrays made from NumPy arguments
        (and masks built inside) land on the layer's device."""
        with jax.default_device(resolve_device(self.device)):
            return apply(self.config, self.params, query, key, value, **options)
