"""`MultiHeadAttention(nn.Module)`: four nn.Linear projections around the functional stages.

Parameters are stored the torch way (nn.Linear, weight (out, in)); the
canonical tensors are views of them:

| canonical (weights/)        | nn.Linear here                | conversion (exact)        |
|-----------------------------|-------------------------------|---------------------------|
| query.kernel (D, N, H)      | query.weight (N*H, D)         | weight.T.reshape(D, N, H) |
| query.bias (N, H)           | query.bias (N*H,)             | bias.reshape(N, H)        |
| key.kernel (D, K, H)        | key.weight (K*H, D)           | weight.T.reshape(D, K, H) |
| key.bias (K, H)             | key.bias (K*H,)               | bias.reshape(K, H)        |
| value.kernel (D, K, V)      | value.weight (K*V, D)         | weight.T.reshape(D, K, V) |
| value.bias (K, V)           | value.bias (K*V,)             | bias.reshape(K, V)        |
| output.kernel (N, V, O)     | output.weight (O, N*V)        | weight.T.reshape(N, V, O) |
| output.bias (O,)            | output.bias (O,)              | as is                     |

The forward pass is `functional.multi_head_attention` on those views, so the
layer computes exactly what the functional mirror computes, with gradients
reaching the nn.Linear parameters through autograd.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

import weights
from weights import AttentionConfig

from .convert import to_numpy, to_torch, torch_dtype
from .device import matmul_precision, torch_device
from .functional import multi_head_attention


def _linear_layout(config: AttentionConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """canonical name -> (projection, canonical shape)."""
    return {name: (name.split(".")[0], shape) for name, shape in config.tensor_shapes().items()}


class MultiHeadAttention(nn.Module):
    """Multi-head attention with the contract's options (mask, bias, causal with
    both alignments, masked_row, GQA, dropout with an explicit keep-mask,
    return_weights) on any device and dtype.

    `training` follows the module's mode (`.train()` / `.eval()`) unless a call
    passes it; in training with dropout > 0 and neither `dropout_mask` nor
    `seed`, the keep-mask is drawn from torch's global generator, as
    nn.Dropout does. `from_file` and `from_tensors` return the module in eval
    mode, as loaders of trained weights do.
    """

    def __init__(self, config: AttentionConfig, *, device=None, dtype=None, use_sdpa: bool = False):
        super().__init__()
        c = config
        dtype = None if dtype is None else torch_dtype(dtype)
        kw = dict(device=device if device == "meta" else torch_device(device), dtype=dtype)
        self.config = config
        self.use_sdpa = use_sdpa  # default for forward(use_sdpa=None)
        self.query = nn.Linear(c.query_dim, c.num_heads * c.head_dim, bias=c.use_query_bias, **kw)
        self.key = nn.Linear(c.key_dim, c.num_kv_heads * c.head_dim, bias=c.use_key_bias, **kw)
        self.value = nn.Linear(c.value_dim, c.num_kv_heads * c.value_head_dim, bias=c.use_value_bias, **kw)
        self.output = nn.Linear(c.num_heads * c.value_head_dim, c.out_dim, bias=c.use_output_bias, **kw)

    # -- canonical tensors <-> nn.Linear ----------------------------------------
    def canonical_tensors(self) -> dict[str, torch.Tensor]:
        """The canonical tensors as differentiable views of the parameters."""
        out = {}
        for name, (proj, shape) in _linear_layout(self.config).items():
            linear = getattr(self, proj)
            if name.endswith(".kernel"):
                out[name] = linear.weight.T.reshape(shape)  # (D, heads, width) or (N, V, O)
            else:
                out[name] = linear.bias.reshape(shape)  # (heads, width) or (O,)
        return out

    @torch.no_grad()
    def load_tensors(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Copy canonical NumPy tensors into the parameters (validated by
        weights.validate_tensors; the module's dtype becomes theirs)."""
        dtype = weights.validate_tensors(self.config, tensors)
        self.to(dtype=torch_dtype(dtype.name))
        for name, (proj, _) in _linear_layout(self.config).items():
            linear = getattr(self, proj)
            source = to_torch(tensors[name])
            if name.endswith(".kernel"):
                linear.weight.copy_(source.reshape(-1, linear.weight.shape[0]).T)  # (out, in)
            else:
                linear.bias.copy_(source.reshape(-1))  # (out,)

    def to_tensors(self) -> dict[str, np.ndarray]:
        """The canonical tensors as NumPy arrays (bfloat16 as ml_dtypes.bfloat16), bit-exact."""
        return {name: to_numpy(t) for name, t in self.canonical_tensors().items()}

    @classmethod
    def from_tensors(cls, config: AttentionConfig, tensors: Mapping[str, np.ndarray], *, device=None,
                     use_sdpa: bool = False) -> MultiHeadAttention:
        if not isinstance(tensors, Mapping):
            raise ValueError(f"tensors must map canonical names to arrays: got {type(tensors).__name__}")
        tensors = {name: to_numpy(t) if isinstance(t, torch.Tensor) else t for name, t in tensors.items()}
        dtype = weights.validate_tensors(config, tensors)
        layer = cls(config, device="meta", dtype=dtype.name, use_sdpa=use_sdpa)
        layer.to_empty(device=torch_device(device))
        layer.load_tensors(tensors)
        return layer.eval()

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, device=None, use_sdpa: bool = False) -> MultiHeadAttention:
        return cls.from_tensors(*weights.load(path), device=device, use_sdpa=use_sdpa)

    # -- the call ------------------------------------------------------------------
    def forward(self, query, key=None, value=None, *, mask=None, bias=None, is_causal: bool = False,
                causal_alignment: str = "top_left", training: bool | None = None, dropout_mask=None,
                seed: int | None = None, return_weights: bool = False, use_sdpa: bool | None = None,
                precision: str | None = "highest", trace: list | None = None):
        """query (B, T, query_dim), key (B, S, key_dim) default query, value
        (B, S, value_dim) default key -> output (B, T, O), or (output,
        weights (B, N, T, S)) with return_weights. Inputs are cast to the
        module's dtype. precision: "highest" or "tf32" for the call's float32
        matmuls, None to leave torch's global settings as they are. Under
        torch.compile the settings in force at compile time apply (a compiled
        graph cannot switch them): wrap the compiled call in
        `impl_torch.matmul_precision(...)` instead."""
        training = self.training if training is None else training
        if training and self.config.dropout > 0 and dropout_mask is None and seed is None:
            seed = int(torch.randint(0, 2**62, ()))  # torch's global generator, as nn.Dropout
        options = dict(mask=mask, bias=bias, is_causal=is_causal, causal_alignment=causal_alignment,
                       training=training, dropout_mask=dropout_mask, seed=seed, return_weights=return_weights,
                       trace=trace, use_sdpa=self.use_sdpa if use_sdpa is None else use_sdpa)
        if precision is None or torch.compiler.is_compiling():
            return multi_head_attention(self.config, self.canonical_tensors(), query, key, value, **options)
        with matmul_precision(precision):
            return multi_head_attention(self.config, self.canonical_tensors(), query, key, value, **options)

    def extra_repr(self) -> str:
        c = self.config
        return (f"num_heads={c.num_heads}, num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                f"value_head_dim={c.value_head_dim}, masked_row={c.masked_row!r}, use_sdpa={self.use_sdpa}")
