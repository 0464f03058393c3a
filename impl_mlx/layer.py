"""An mlx.nn.Module around multi_head_attention: it holds a config and the canonical tensors as parameters.

Parameters live in submodules named after the canonical tensors, so the flattened parameter name
(mlx.utils.tree_flatten of module.parameters()) *is* the canonical name: query.kernel (D, N, H),
query.bias (N, H), ..., output.kernel (N, V, O), output.bias (O); query.norm.scale, sinks, alibi.slopes,
gate.kernel, latent.kernel, query.down.kernel and the rest likewise (the contract's names, as impl_jax's
NNX layer holds them). The weight file is read by weights.load (safetensors, validated by the contract);
module.update / mx.value_and_grad work on these names as on any MLX model.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

import weights
from weights import AttentionConfig

from .attention import multi_head_attention
from .convert import to_mx, to_numpy

DEVICES = ("cpu", "gpu")
NO_GPU_MESSAGE = "device gpu requested but MLX has no GPU here (mx.metal.is_available() is False: Linux CPU wheel)"


def gpu_available() -> bool:
    return bool(mx.metal.is_available()) if hasattr(mx, "metal") else False


def resolve_device(device: str) -> mx.Device:
    """"cpu" or "gpu" -> the mx.Device."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}: got {device!r}")
    if device == "gpu":
        if not gpu_available():
            raise ValueError(NO_GPU_MESSAGE)
        return mx.gpu
    return mx.cpu


class Group(nn.Module):
    """A named group of canonical tensors (a projection's kernel and bias, a norm's scale and bias, ...)."""


def _module_tree(tensors: dict[str, mx.array]) -> dict:
    tree: dict = {}
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = t
    return tree


def _attach(module: nn.Module, tree: dict) -> None:
    for name, value in tree.items():
        if isinstance(value, dict):
            child = Group()
            _attach(child, value)
            setattr(module, name, child)
        else:
            setattr(module, name, value)


class MultiHeadAttention(nn.Module):
    """Multi-head attention on the common weight format.

    `MultiHeadAttention(config, seed=0, dtype="float32")` draws weights with weights.init (the same numbers
    every framework draws for that seed); `from_tensors` / `from_file` load canonical tensors. The call
    takes multi_head_attention's options and passes them through (topk_indices= included: a layer that reuses
    another layer's selection, GLM-5's shared layers, takes it here)."""

    def __init__(self, config: AttentionConfig, tensors: dict[str, np.ndarray] | None = None, *, seed: int = 0,
                 dtype: str = "float32", device: str = "cpu"):
        super().__init__()
        target = resolve_device(device)
        if tensors is None:
            tensors = weights.init(config, seed=seed, dtype=dtype)
        stored = weights.validate_tensors(config, {n: np.asarray(to_numpy(t)) for n, t in tensors.items()})
        if stored == np.float64 and device == "gpu":
            raise ValueError("float64 runs on MLX's CPU device only (Metal has no float64): use device cpu")
        self._config = config
        self._device = target
        _attach(self, _module_tree({name: to_mx(t) for name, t in tensors.items()}))

    @property
    def config(self) -> AttentionConfig:
        return self._config

    @classmethod
    def from_tensors(cls, config: AttentionConfig, tensors, *, device: str = "cpu") -> MultiHeadAttention:
        return cls(config, tensors, device=device)

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, device: str = "cpu") -> MultiHeadAttention:
        config, tensors = weights.load(path)
        return cls(config, tensors, device=device)

    @property
    def params(self) -> dict[str, mx.array]:
        """Canonical name -> mx.array, multi_head_attention's `params`."""
        found = dict(tree_flatten(self.parameters()))
        return {name: found[name] for name in self._config.tensor_shapes()}

    def to_tensors(self) -> dict[str, np.ndarray]:
        """Canonical NumPy arrays (bfloat16 as ml_dtypes.bfloat16), bit-exact."""
        return {name: to_numpy(t) for name, t in self.params.items()}

    def __call__(self, query, key=None, value=None, **options):
        with mx.stream(self._device):
            return multi_head_attention(self._config, self.params, query, key, value, **options)
