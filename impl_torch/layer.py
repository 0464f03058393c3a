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
| query.norm.scale (H,)/(N, H)| query_norm.weight (H,)/(N*H,) | weight.reshape(shape)     |
| query.norm.bias (layer)     | query_norm.bias               | bias.reshape(shape)       |
| key.norm.scale (H,)/(K, H)  | key_norm.weight (H,)/(K*H,)   | weight.reshape(shape)     |
| key.norm.bias (layer)       | key_norm.bias                 | bias.reshape(shape)       |
| value.norm.scale (V,)/(K, V)| value_norm.weight (V,)/(K*V,) | weight.reshape(shape)     |
| value.norm.bias (layer)     | value_norm.bias               | bias.reshape(shape)       |
| sinks (N,)                  | sinks (N,)                    | as is                     |
| alibi.slopes (N,)           | alibi_slopes (N,)             | as is                     |
| gate.kernel (D, N, V)/(D, N)| gate.weight (N*V|N, D)        | weight.T.reshape(shape)   |
| gate.bias (N, V)/(N,)       | gate.bias (N*V|N,)            | bias.reshape(shape)       |

A latent layer (config.latent, MLA) has these instead of query/key/value's
(C = kv_rank, R = rope_dim, Qr = query_rank):

| canonical (weights/)          | here                            | conversion (exact)        |
|-------------------------------|---------------------------------|---------------------------|
| query.down.kernel (D, Qr)     | query_down.weight (Qr, D)       | weight.T                  |
| query.down.bias (Qr,)         | query_down.bias (Qr,)           | as is                     |
| query.down.norm.scale (Qr,)   | query_down_norm.weight (RMSNorm)| as is                     |
| query.kernel (Qr|D, N, H)     | query.weight (N*H, Qr|D)        | weight.T.reshape(., N, H) |
| latent.kernel (Dk, C+R)       | latent.weight (C+R, Dk)         | weight.T                  |
| latent.bias (C+R,)            | latent.bias (C+R,)              | as is                     |
| latent.norm.scale (C,)        | latent_norm.weight (RMSNorm)    | as is                     |
| key.kernel (C, K, H-R)        | key.weight (K*(H-R), C)         | weight.T.reshape(C, K, H-R)|
| value.kernel (C, K, V)        | value.weight (K*V, C)           | weight.T.reshape(C, K, V) |

The QK-norm and value-norm parameters live in nn.RMSNorm / nn.LayerNorm
modules over the normalised width (H, or V for the value norm, for scope
"head"; the whole projection for "all"), as a torch port holds them; a
per_head norm's in a PerHeadNorm whose weight (and bias) is already (heads,
W) (Cohere's); a weightless norm (weight false) has no module at all. Only
their parameters are used (the computation is functional.norm, the spec's
stage, before or after RoPE as the config says). The output gate is one more nn.Linear
from the query input (Qwen3-Next keeps its rows in q_proj; here they stand
apart, as the canonical gate.kernel does).

The forward pass is `attention.multi_head_attention` on those views, so the
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
from weights.alibi import bloom_slopes
from weights.config import QKNorm

from . import functional as F
from .attention import multi_head_attention
from .convert import to_numpy, to_torch, torch_dtype
from .device import matmul_precision, torch_device


def _layout(config: AttentionConfig) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """canonical name -> (submodule ("" for the layer itself), parameter name, canonical shape)."""
    out = {}
    for name, shape in config.tensor_shapes().items():
        *owner, last = name.split(".")
        if name in ("sinks", "alibi.slopes") or name.startswith("differential."):  # sinks, alibi.slopes ->
            # alibi_slopes, differential.lambda_q1 -> differential_lambda_q1: parameters of the layer itself
            out[name] = ("", name.replace(".", "_"), shape)
        else:  # query.kernel -> query.weight (transposed), query.norm.scale -> query_norm.weight,
            # query.down.kernel -> query_down.weight, query.down.norm.scale -> query_down_norm.weight, ...
            out[name] = ("_".join(owner), "weight" if last in ("kernel", "scale") else "bias", shape)
    return out


class PerHeadNorm(nn.Module):
    """A norm over each head's W features with one scale (and, for "layer", one bias) per head: weight and
    bias (heads, W), as Cohere's CohereLayerNorm((heads, head_dim)) holds them. forward(x (B, L, heads*W)) is
    functional.norm with scope "head"."""

    def __init__(self, kind: str, heads: int, width: int, eps: float, *, device=None, dtype=None):
        super().__init__()
        self.kind, self.heads, self.eps = kind, heads, eps
        self.weight = nn.Parameter(torch.ones(heads, width, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(heads, width, device=device, dtype=dtype)) if kind == "layer" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.norm(x, self.weight, self.bias, self.kind, self.eps, self.heads, "head")

    def extra_repr(self) -> str:
        return f"{self.kind}, heads={self.heads}, width={self.weight.shape[-1]}, eps={self.eps}"


def _norm_module(n: QKNorm, heads: int, width: int, kw) -> nn.Module | None:
    """The module holding a norm's tensors over width W (H, or V for the value norm): nn.RMSNorm /
    nn.LayerNorm over W (scope "head") or heads*W (scope "all"), PerHeadNorm for per_head; None for a
    weightless norm (it has no tensors)."""
    if not n.weight:
        return None
    if n.per_head:
        return PerHeadNorm(n.type, heads, width, n.eps, **kw)
    width = width * (1 if n.scope == "head" else heads)
    if n.type == "rms":
        return nn.RMSNorm(width, eps=n.eps, **kw)
    return nn.LayerNorm(width, eps=n.eps, **kw)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with the contract's options (mask, bias, causal with
    both alignments, masked_row, GQA, dropout with an explicit keep-mask,
    return_weights; RoPE, QK-norm, the value norm, softcap, windows, sinks, ALiBi, local
    chunks, the query temperature, the QKV clip, output gates, latent attention
    (MLA), the KV cache and segment ids where the config and the call ask) on any device and dtype.

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
        if c.latent is not None:
            self._build_latent(kw)
        else:
            self.query = nn.Linear(c.query_dim, c.num_heads * c.head_dim, bias=c.use_query_bias, **kw)
            if not c.kv_shared:  # issue 42: a kv_shared layer has no key or value projection
                self.key = nn.Linear(c.key_dim, c.num_kv_heads * c.head_dim, bias=c.use_key_bias, **kw)
                self.value = nn.Linear(c.value_dim, c.num_kv_heads * c.value_head_dim, bias=c.use_value_bias, **kw)
        self.output = nn.Linear(c.num_heads * c.value_head_dim, c.out_dim, bias=c.use_output_bias, **kw)
        if c.qk_norm is not None and c.qk_norm.weight:
            self.query_norm = _norm_module(c.qk_norm, c.num_heads, c.head_dim, kw)
            if not c.kv_shared:
                self.key_norm = _norm_module(c.qk_norm, c.num_kv_heads, c.head_dim, kw)
        if c.value_norm is not None and c.value_norm.weight:
            self.value_norm = _norm_module(c.value_norm, c.num_kv_heads, c.value_head_dim, kw)
        if c.use_sinks:
            self.sinks = nn.Parameter(torch.zeros(c.num_heads, **kw))  # (N,); 0: the sink starts as one more key
        if c.alibi:  # (N,): BLOOM's (and MPT's default) slopes, as a model that trains them starts
            self.alibi_slopes = nn.Parameter(torch.tensor(bloom_slopes(c.num_heads).tolist(), **kw))
        if c.output_gate is not None:  # gate.kernel (D, N, V) or (D, N) as one nn.Linear from the query input
            per_head = c.value_head_dim if c.output_gate.scope == "element" else 1
            self.gate = nn.Linear(c.query_dim, c.num_heads * per_head, bias=c.output_gate.bias, **kw)
        if c.differential is not None:  # the lambda vectors (H,): diffllama's N(0, lambda_std_dev 0.1)
            for n in ("q1", "k1", "q2", "k2"):
                setattr(self, f"differential_lambda_{n}", nn.Parameter(0.1 * torch.randn(c.head_dim, **kw)))

    def _build_latent(self, kw) -> None:
        """A latent layer's modules (DeepSeek V3's q_a_proj, q_a_layernorm, q_b_proj / q_proj,
        kv_a_proj_with_mqa, kv_a_layernorm and kv_b_proj, this last as its key and value rows apart)."""
        c, L = self.config, self.config.latent
        N, K, H, V, C, R = c.num_heads, c.num_kv_heads, c.head_dim, c.value_head_dim, L.kv_rank, L.rope_dim
        if L.query_rank is not None:
            self.query_down = nn.Linear(c.query_dim, L.query_rank, bias=c.use_query_bias, **kw)
            self.query_down_norm = nn.RMSNorm(L.query_rank, eps=L.eps, **kw)
            self.query = nn.Linear(L.query_rank, N * H, bias=False, **kw)
        else:
            self.query = nn.Linear(c.query_dim, N * H, bias=c.use_query_bias, **kw)
        self.latent = nn.Linear(c.key_dim, C + R, bias=c.use_key_bias, **kw)
        self.latent_norm = nn.RMSNorm(C, eps=L.eps, **kw)
        self.key = nn.Linear(C, K * (H - R), bias=False, **kw)
        self.value = nn.Linear(C, K * V, bias=False, **kw)

    # -- canonical tensors <-> nn.Linear ----------------------------------------
    def canonical_tensors(self) -> dict[str, torch.Tensor]:
        """The canonical tensors as differentiable views of the parameters."""
        out = {}
        for name, (module, param, shape) in _layout(self.config).items():
            tensor = getattr(getattr(self, module) if module else self, param)
            if name.endswith(".kernel"):
                out[name] = tensor.T.reshape(shape)  # (D, heads, width) or (N, V, O)
            else:
                out[name] = tensor.reshape(shape)  # (heads, width), (O,), (H,), (heads, H) or (N,)
        return out

    @torch.no_grad()
    def load_tensors(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Copy canonical NumPy tensors into the parameters (validated by
        weights.validate_tensors; the module's dtype becomes theirs)."""
        dtype = weights.validate_tensors(self.config, tensors)
        self.to(dtype=torch_dtype(dtype.name))
        for name, (module, param, _) in _layout(self.config).items():
            target = getattr(getattr(self, module) if module else self, param)
            source = to_torch(tensors[name])
            if name.endswith(".kernel"):
                target.copy_(source.reshape(-1, target.shape[0]).T)  # (out, in)
            else:
                target.copy_(source.reshape(target.shape))  # (out,), the norm's width, (N,) or the gate's

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
                seed: int | None = None, positions=None, key_positions=None, past_key=None, past_value=None,
                segment_ids=None, key_segment_ids=None, return_weights: bool = False, return_cache: bool = False,
                cache_length: int | None = None, past_key_positions=None, use_sdpa: bool | None = None, precision: str | None = "highest", trace: list | None = None,
                topk_indices=None):
        """query (B, T, query_dim), key (B, S, key_dim) default query, value
        (B, S, value_dim) default key -> output (B, T, O); with
        return_weights also weights (B, N, T, P+S), with return_cache also
        present_key and present_value (functional's return convention).
        positions / key_positions (RoPE), past_key / past_value (the cache;
        with cache_length, buffers written in place), segment_ids / key_segment_ids and topk_indices (the
        keys each query may see: a layer that reuses another layer's selection, GLM-5's shared layers, takes
        it here) as in attention.multi_head_attention. Inputs are cast to the
        module's dtype. precision: "highest" or "tf32" for the call's float32
        matmuls, None to leave torch's global settings as they are. Under
        torch.compile the settings in force at compile time apply (a compiled
        graph cannot switch them): wrap the compiled call in
        `impl_torch.matmul_precision(...)` instead."""
        training = self.training if training is None else training
        if training and self.config.dropout > 0 and dropout_mask is None and seed is None:
            seed = int(torch.randint(0, 2**62, ()))  # torch's global generator, as nn.Dropout
        options = dict(mask=mask, bias=bias, is_causal=is_causal, causal_alignment=causal_alignment,
                       training=training, dropout_mask=dropout_mask, seed=seed, positions=positions,
                       key_positions=key_positions, past_key=past_key, past_value=past_value,
                       segment_ids=segment_ids, key_segment_ids=key_segment_ids, return_weights=return_weights,
                       return_cache=return_cache, cache_length=cache_length, trace=trace,
                       past_key_positions=past_key_positions, topk_indices=topk_indices, use_sdpa=self.use_sdpa if use_sdpa is None else use_sdpa)
        if precision is None or torch.compiler.is_compiling():
            return multi_head_attention(self.config, self.canonical_tensors(), query, key, value, **options)
        with matmul_precision(precision):
            return multi_head_attention(self.config, self.canonical_tensors(), query, key, value, **options)

    def extra_repr(self) -> str:
        c = self.config
        return (f"num_heads={c.num_heads}, num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                f"value_head_dim={c.value_head_dim}, masked_row={c.masked_row!r}, use_sdpa={self.use_sdpa}")
