"""Live torch objects <-> canonical weights, through weights.layouts.

    from_native(obj, layout=None, **hints) -> (config, tensors)
    to_native(config, tensors, *, into=None, layout=None, **hints) -> nn.Module

`obj` is an nn.MultiheadAttention (layout torch-mha; batch_first does not
change its weights), or any module whose state_dict is in a torch layout
(torch-linears, torch-fused-qkv, torch-per-head, hf-bert, hf-gpt2) named by
`layout=` with that layout's hints (num_heads, names, prefix, ...). Tensors
cross at NumPy, bit-exact (bfloat16 through its 16-bit pattern).

to_native builds nn.MultiheadAttention(batch_first=True) in the tensors'
dtype, in torch's default (training) mode, or with `into=` loads the converted
state dict into an existing module (strict) and returns it.

What nn.MultiheadAttention cannot be: see weights.layouts (torch-mha); it also
always scales by 1/sqrt(head_dim), so a config with another `scale` is refused.
add_bias_kv and add_zero_attn have no canonical counterpart and are refused in
from_native. masked_row is not a weight: the module yields NaN for a query
row with no allowed key whatever the config says (docs/conventions.md measures it).
"""

from __future__ import annotations

import math

import numpy as np
from torch import nn

from weights import AttentionConfig, layouts

from .convert import to_numpy, to_torch, torch_dtype


def state_dict(module: nn.Module) -> dict[str, np.ndarray]:
    return {name: to_numpy(t) for name, t in module.state_dict().items()}


def from_native(obj: nn.Module, layout: str | None = None, **hints):
    if isinstance(obj, nn.MultiheadAttention) and layout in (None, "torch-mha"):
        refused = [name for name in ("bias_k", "bias_v") if getattr(obj, name, None) is not None]
        if refused:
            raise ValueError("nn.MultiheadAttention with add_bias_kv=True has no canonical form: got bias_k, bias_v")
        if obj.add_zero_attn:
            raise ValueError("nn.MultiheadAttention with add_zero_attn=True has no canonical form")
        hints = {"num_heads": obj.num_heads, "dropout": obj.dropout, **hints}
        return layouts.to_canonical("torch-mha", state_dict(obj), **hints)
    if not isinstance(obj, nn.Module):
        raise ValueError(f"obj must be a torch nn.Module: got {type(obj).__name__}")
    if layout is None:
        raise ValueError(f"layout is needed for a {type(obj).__name__} (one of {', '.join(layouts.LAYOUTS)})")
    return layouts.to_canonical(layout, state_dict(obj), **hints)


def _check_scale(config: AttentionConfig, what: str) -> None:
    default = 1.0 / math.sqrt(config.head_dim)
    if config.scale is not None and not math.isclose(config.scale, default, rel_tol=1e-12):
        raise ValueError(f"{what} always scales by 1/sqrt(head_dim) = {default:.6g}: got scale={config.scale}")


def to_native(config: AttentionConfig, tensors, *, into: nn.Module | None = None, layout: str | None = None,
              **hints) -> nn.Module:
    if into is not None:
        if layout is None:
            raise ValueError(f"layout is needed to load into a {type(into).__name__}")
        # The module's parameters name the variant: seed 000's qkv_proj or seed 002's qkv, say.
        parameters = {name for name, _ in into.named_parameters()}
        tries = [hints] if "names" in hints else [{**hints, "names": r} for r in layouts.spec(layout).roles]
        states = [layouts.from_canonical(layout, config, tensors, **h) for h in tries]
        state = next((s for s in states if set(s) == parameters), None)
        if state is None:
            raise ValueError(
                f"the {type(into).__name__}'s parameters ({', '.join(sorted(parameters))}) are not {layout}'s "
                f"({', '.join(states[0])}); pass names="
            )
        missing, unexpected = into.load_state_dict({k: to_torch(v) for k, v in state.items()}, strict=False)
        assert not unexpected and set(missing) <= {name for name, _ in into.named_buffers()}, (missing, unexpected)
        return into
    if layout not in (None, "torch-mha"):
        raise ValueError(f"to_native builds nn.MultiheadAttention (torch-mha); pass into= for layout {layout!r}")
    state = layouts.from_canonical("torch-mha", config, tensors, **hints)
    _check_scale(config, "nn.MultiheadAttention")
    dtype = torch_dtype(np.dtype(next(iter(tensors.values())).dtype).name)
    module = nn.MultiheadAttention(
        embed_dim=config.query_dim, num_heads=config.num_heads, dropout=config.dropout,
        bias=config.use_query_bias, kdim=config.key_dim, vdim=config.value_dim, batch_first=True, dtype=dtype,
    )
    module.load_state_dict({k: to_torch(v) for k, v in state.items()}, strict=True)
    return module
