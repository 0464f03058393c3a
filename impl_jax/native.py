"""Live Flax objects <-> canonical weights, through weights.layouts.

    from_native(obj) -> (config, tensors)
    to_native(config, tensors, *, kind="nnx") -> module (nnx) or (module, variables) (linen)

`obj` is a flax.nnx.MultiHeadAttention (layout flax-nnx-mha: its Params
flattened with "/"), or a (module, variables) pair for
flax.linen.MultiHeadDotProductAttention (flax-linen-mha; `variables` is what
init returned, {"params": {...}}, or the params dict itself).

to_native builds the module with param_dtype = the tensors' dtype
(float64 needs jax x64: `with jax.enable_x64():` or jax_enable_x64=True).
Flax always scales the query by 1/sqrt(head_dim): other scales are refused, as
is normalize_qk (LayerNorm on q and k) in from_native. masked_row is not a
weight: Flax yields uniform weights for a row with no allowed key.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from weights import AttentionConfig, layouts

KINDS = ("nnx", "linen")


def _flatten(tree, prefix: str = "") -> dict[str, np.ndarray]:
    flat = {}
    for key, value in tree.items():
        if hasattr(value, "items"):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = np.array(value, copy=True)
    return flat


def _nest(state: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for key, value in state.items():
        *groups, leaf = key.split("/")
        node = tree
        for group in groups:
            node = node.setdefault(group, {})
        node[leaf] = jnp.asarray(value)
    return tree


def from_native(obj, **hints):
    if isinstance(obj, nnx.MultiHeadAttention):
        if obj.normalize_qk:
            raise ValueError("nnx.MultiHeadAttention with normalize_qk=True has no canonical form")
        state = {"/".join(map(str, path)): np.array(v.get_value(), copy=True)
                 for path, v in nnx.to_flat_state(nnx.state(obj, nnx.Param))}
        return layouts.to_canonical("flax-nnx-mha", state, **{"dropout": obj.dropout_rate, **hints})
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], linen.MultiHeadDotProductAttention):
        module, variables = obj
        if module.normalize_qk:
            raise ValueError("linen MultiHeadDotProductAttention with normalize_qk=True has no canonical form")
        params = variables["params"] if "params" in variables else variables
        return layouts.to_canonical("flax-linen-mha", _flatten(params), **{"dropout": module.dropout_rate, **hints})
    raise ValueError(
        "obj must be an nnx.MultiHeadAttention or a (linen.MultiHeadDotProductAttention, variables) pair: "
        f"got {type(obj).__name__}"
    )


def to_native(config: AttentionConfig, tensors, *, kind: str = "nnx", seed: int = 0):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}: got {kind!r}")
    layout = "flax-nnx-mha" if kind == "nnx" else "flax-linen-mha"
    state = layouts.from_canonical(layout, config, tensors)
    default = 1.0 / math.sqrt(config.head_dim)
    if config.scale is not None and not math.isclose(config.scale, default, rel_tol=1e-12):
        raise ValueError(f"Flax attention always scales by 1/sqrt(head_dim) = {default:.6g}: got scale={config.scale}")
    dtype = np.dtype(next(iter(tensors.values())).dtype)
    if dtype == np.float64 and not jax.config.jax_enable_x64:
        raise ValueError("float64 tensors need jax x64: use `with jax.enable_x64():` or jax_enable_x64=True")
    common = dict(num_heads=config.num_heads, qkv_features=config.num_heads * config.head_dim,
                  out_features=config.out_dim, use_bias=config.use_query_bias, dropout_rate=config.dropout,
                  param_dtype=dtype)
    if kind == "linen":
        module = linen.MultiHeadDotProductAttention(**common)
        return module, {"params": _nest(state)}
    module = nnx.MultiHeadAttention(
        in_features=config.query_dim, in_kv_features=config.key_dim, num_kv_heads=config.num_kv_heads,
        decode=False, rngs=nnx.Rngs(seed), **common,
    )
    params = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    for key, value in state.items():
        params[tuple(key.split("/"))].set_value(jnp.asarray(value))
    return module
