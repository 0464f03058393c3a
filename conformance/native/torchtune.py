"""Backend torchtune: torchtune.modules.MultiHeadAttention with its
RotaryPositionalEmbeddings, KVCache and RMSNorm (torchtune 0.6.1).

The module is built from the canonical tensors: q_proj, k_proj, v_proj and
output_proj are nn.Linear filled through the torch-linears layout table (one
bias flag per projection), num_kv_heads carries GQA, pos_embeddings is
RotaryPositionalEmbeddings(dim=head_dim, base=theta), q_norm / k_norm are
torchtune's RMSNorm(head_dim, eps). It is called as module(query, key, mask=,
input_pos=); gradients by autograd, mapped back through the same table.

What the API expresses, and how:
- RoPE: RotaryPositionalEmbeddings turns interleaved pairs (2i, 2i+1) of the
  whole head (`mha check --conventions` measures the pairing). A half-split
  config runs through the q/k feature permutation that torchtune's checkpoint
  converter applies to Hugging Face weights (weights.layouts.repair_pairing):
  every q . k is unchanged and the pairs become torchtune's. The cache then
  holds permuted keys: past_key is permuted on the way in, present_key back.
- positions: input_pos, one (B, T) tensor for the queries and the keys alike;
  without it the module counts 0..L-1 on each side (the contract's default
  without a cache).
- decoding: setup_cache(B, dtype, P + S) sizes a KVCache to exactly the keys
  the call sees; the past is written by KVCache.update, the new keys (after
  RoPE and k_norm, as the contract's cache holds them) by the module. With a
  cache the module drops its own causal flag, so causal (either alignment)
  goes into the boolean mask (B, T, P + S), True = attend.
- causal top-left without a mask and without a cache: the module's is_causal.
- gradients: none with a past cache: KVCache.update indexes its buffers with cache_pos and then
  advances cache_pos in place, which autograd refuses ("one of the variables needed for gradient
  computation has been modified by an inplace operation"); such a vjp is refused in torch's words.
- attention weights: the module returns none; its attention call
  (module._attention_call, torch SDPA on CPU) is run a second time with the
  value set to the identity (conformance.native.identity_values' method).

Measured differences ("known difference"): RotaryPositionalEmbeddings builds
its angle table in float32 and rotates x.float(), and RMSNorm normalises
x.float(): in float64 those stages are float32-accurate. q_norm / k_norm run
after pos_embeddings (torchtune's order); the contract normalises before
RoPE, so a config with both computes something else by design.

Cannot express ("unsupported", with the reason): separate key and value
inputs (forward(x, y) projects k and v from the same y), value_head_dim !=
head_dim (v is viewed as head_dim-wide heads), a scale other than
1/sqrt(head_dim), an additive bias, per-head masks that differ, dropout in
training, RoPE scaling (RotaryPositionalEmbeddings takes dim, max_seq_len,
base), partial rotary_dim, query and key positions that differ, a LayerNorm
or whole-width QK-norm, windows, softcap, sinks, and packed segments (a
BlockMask goes to flex_attention only on CUDA devices of capability >= 7.5).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np

from . import (
    SELECTION_WHY,
    allowed4,
    check_default_scale,
    check_dropout,
    check_masked_rows,
    classify_row,
    grads_to_canonical,
    order_grads,
    prepare_call,
    qkv,
    require,
    torch_vjp,
    why_each,
)

require("torch", "torchtune")

NAME = "torchtune"
LAYOUT = "torch-linears"
NAMES = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "output": "output_proj"}
EXPRESSES = ("rope", "positions", "key_positions", "past_key", "past_value", "return_cache", "qk_norm")
WHY = ("torchtune's MultiHeadAttention has pos_embeddings, q_norm/k_norm and kv_cache; no window, softcap or sinks "
       "argument, and a packed-sequence BlockMask reaches flex_attention only on CUDA (capability >= 7.5)")
# The frontier fields: read from torchtune 0.6.1's source (torchtune/modules, torchtune/models): no ALiBi, no
# Llama 4 (so no chunked attention nor its temperature), no LongRoPE (Phi-3's rotary class is the plain one),
# no gate, clip, value norm or latent attention anywhere in it.
FRONTIER_WHY = {
    "topk_indices": SELECTION_WHY,
    "alibi": "torchtune 0.6.1 has no ALiBi (no bias argument, no ALiBi module)",
    "local_chunk": "torchtune 0.6.1 has no chunked attention (no Llama 4; MultiHeadAttention takes one mask)",
    "past_key_positions": "KVCache holds keys and values, not their positions (cache slot j is position j)",
    "query_temperature": "torchtune 0.6.1 has no query temperature (no Llama 4; one scale for every query)",
    "qkv_clip": "MultiHeadAttention has no clip argument and clamps nothing",
    "output_gate": "MultiHeadAttention has no gate argument (torchtune 0.6.1 has no Qwen3-Next)",
    "value_norm": "MultiHeadAttention takes q_norm and k_norm only, no value norm",
    "latent": "torchtune 0.6.1 has no latent attention (no DeepSeek V2/V3 model or module)",
    "rope.scaling longrope": "RotaryPositionalEmbeddings takes dim, max_seq_len and base (torchtune 0.6.1's Phi-3 "
                             "rotary class has no short/long factors)",
    "rope.scaling proportional": "RotaryPositionalEmbeddings turns every pair of the head (dim, max_seq_len, base)",
    "qk_norm.weight": "this wrapper builds q_norm / k_norm as torchtune's RMSNorm, which always has a scale",
    "qk_norm.per_head": "torchtune's RMSNorm(head_dim) has one scale shared by every head",
    "qk_norm.after_rope": "torchtune's own order is this one (q_norm / k_norm after pos_embeddings), but this "
                          "wrapper treats every rope + qk_norm case as the contract's norm-before-RoPE (a known "
                          "difference) and has not been run with after_rope",
}


def _tt():
    """torchtune's modules; torchao (imported by torchtune) logs a warning when its C++ extensions do not match
    the installed torch (its Python still loads), which is no news to the suite."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchtune.modules import MultiHeadAttention, RMSNorm, RotaryPositionalEmbeddings
        from torchtune.modules.attention_utils import _sdpa_or_flex_attention
    return MultiHeadAttention, RotaryPositionalEmbeddings, RMSNorm, _sdpa_or_flex_attention


def known_difference(case, dtype: str) -> str | None:
    """The expected failure of a case, with its reason; None if it must pass."""
    config = case.config
    if config.rope is not None and config.qk_norm is not None:
        return ("by design: torchtune applies q_norm/k_norm after pos_embeddings (RoPE); the contract normalises "
                "before RoPE")
    if dtype == "float64" and config.rope is not None:
        return ("float64: RotaryPositionalEmbeddings builds its cos/sin table in float32 and rotates x.float(), so "
                "the rotated q and k are float32-accurate")
    if dtype == "float64" and config.qk_norm is not None:
        return "float64: torchtune's RMSNorm normalises x.float(), so q_norm and k_norm are float32-accurate"
    return None


def devices() -> list[str]:
    from impl_torch.device import devices as torch_devices

    return torch_devices()


_ROWS: dict[tuple, str] = {}


def native_masked_row(device: str, dtype: str) -> str:
    """What torchtune's attention call gives for a query row with no allowed key, measured on a small call."""
    key = (device, dtype)
    if key not in _ROWS:
        import torch

        from impl_torch.device import resolve_device

        attend = _tt()[3]()
        dev, dt = resolve_device(device), getattr(torch, dtype)
        q = torch.ones(1, 1, 2, 2, device=dev, dtype=dt)  # (B, N, T, H)
        v = torch.tensor([[[[0.0, 2.0], [2.0, 4.0], [4.0, 0.0]]]], device=dev, dtype=dt)  # (B, N, S, H)
        mask = torch.tensor([[[False, False, False], [True, True, True]]], device=dev)  # (B, T, S): query 0 no key
        with torch.no_grad():
            out = attend(q, v, v, mask=mask, dropout_p=0.0, is_causal=False)
        _ROWS[key] = classify_row(out[0, 0, 0].float().cpu().numpy(), v[0, 0].float().cpu().numpy())
    return _ROWS[key]


def _positions(config, shapes, inputs):
    """input_pos (B|1, T) int64, or None where the module's own count 0..L-1 is the contract's default."""
    from impl_numpy.functional import default_positions

    if config.rope is None:
        return None
    if inputs.get("positions") is None and inputs.get("key_positions") is None and shapes.P == 0:
        return None  # no cache: queries 0..T-1, keys 0..S-1 (RotaryPositionalEmbeddings' own count)
    q_pos = default_positions(inputs.get("positions"), shapes.P, shapes.T)
    k_pos = default_positions(inputs.get("key_positions"), shapes.P, shapes.S)
    if (q_pos < 0).any():
        raise NotImplementedError(f"{NAME}: RotaryPositionalEmbeddings looks input_pos up in its table; the case has "
                                  f"a negative position ({int(q_pos.min())})")
    if q_pos.shape[1] != k_pos.shape[1] or not np.array_equal(np.broadcast_to(q_pos, np.broadcast_shapes(
            q_pos.shape, k_pos.shape)), np.broadcast_to(k_pos, np.broadcast_shapes(q_pos.shape, k_pos.shape))):
        raise NotImplementedError(f"{NAME}: input_pos is one tensor for the queries and the new keys; the case's "
                                  "query and key positions differ")
    return q_pos


def _prepare(config, tensors, inputs, options, device, precision):
    dtype, tensors, inputs, shapes = prepare_call(NAME, config, tensors, inputs, options, device, precision,
                                                  devices(), expresses=EXPRESSES,
                                                  why=why_each(config, inputs, options, WHY, FRONTIER_WHY))
    check_default_scale(NAME, config)
    check_dropout(NAME, config, inputs, options)
    if inputs.get("bias") is not None:
        raise NotImplementedError(f"{NAME}: MultiHeadAttention takes a boolean mask (or a BlockMask), no additive "
                                  "attention bias")
    _, k, v = qkv(inputs)
    if k.shape != v.shape or not np.array_equal(k, v):
        raise NotImplementedError(f"{NAME}: forward(x, y) projects the key and the value from the same input y; the "
                                  "case's key and value inputs differ")
    if config.value_head_dim != config.head_dim:
        raise NotImplementedError(f"{NAME}: values are viewed as head_dim-wide heads; the case asks value_head_dim="
                                  f"{config.value_head_dim} with head_dim={config.head_dim}")
    rope = config.rope
    if rope is not None and rope.scaling is not None:
        raise NotImplementedError(f"{NAME}: RotaryPositionalEmbeddings takes dim, max_seq_len and base, no scaling; "
                                  f"the case asks rope.scaling type {rope.scaling.type!r}")
    if rope is not None and rope.rotary_dim != config.head_dim:
        raise NotImplementedError(f"{NAME}: RotaryPositionalEmbeddings turns the whole head (dim=head_dim="
                                  f"{config.head_dim}); the case asks rotary_dim={rope.rotary_dim}")
    norm = config.qk_norm
    if norm is not None and (norm.type != "rms" or norm.scope != "head"):
        raise NotImplementedError(f"{NAME}: q_norm/k_norm are torchtune's RMSNorm over each head; the case asks "
                                  f"qk_norm type={norm.type!r} scope={norm.scope!r}")
    _positions(config, shapes, inputs)
    allowed = allowed4(shapes, inputs, options)
    if allowed is not None and allowed.shape[1] != 1 and not (allowed == allowed[:, :1]).all():
        raise NotImplementedError(f"{NAME}: the mask is (B, T, S), one for every head; the case's mask differs "
                                  f"between heads (shape {tuple(np.shape(inputs['mask']))})")
    check_masked_rows(NAME, config, shapes, inputs, options, native_masked_row(device, dtype),
                      f"torchtune's attention call (torch SDPA) on {device}, {dtype}")
    return dtype, tensors, inputs, shapes


def _build(config, tensors, shapes, dtype: str, dev, cache: bool, positions):
    """The module on `dev` in `dtype` (RoPE's table stays float32, as torchtune builds it), weights loaded
    strictly, a KVCache of exactly P + S positions when `cache`. Returns (module, the pairing permutation or None)."""
    import torch
    from torch import nn

    from impl_torch.convert import to_torch
    from weights import layouts

    MultiHeadAttention, RotaryPositionalEmbeddings, RMSNorm, _ = _tt()
    perm = None
    if config.rope is not None and not config.rope.interleaved:
        config, tensors = layouts.repair_pairing(config, tensors, True)
        perm = layouts._pairing_permutation(config.head_dim, config.rope.rotary_dim, True)
    N, K, H, dt = config.num_heads, config.num_kv_heads, config.head_dim, getattr(torch, dtype)
    rope = norms = None
    if config.rope is not None:
        # input_pos indexes its table: one row per position up to the largest the call uses
        largest = shapes.P + max(shapes.T, shapes.S) if positions is None else int(positions.max()) + 1
        rope = RotaryPositionalEmbeddings(dim=H, max_seq_len=max(largest, shapes.P + max(shapes.T, shapes.S)),
                                          base=config.rope.theta)
    if config.qk_norm is not None:
        norms = {"q_norm": RMSNorm(H, eps=config.qk_norm.eps), "k_norm": RMSNorm(H, eps=config.qk_norm.eps)}
    module = MultiHeadAttention(
        embed_dim=N * H, num_heads=N, num_kv_heads=K, head_dim=H,
        q_proj=nn.Linear(config.query_dim, N * H, bias=config.use_query_bias, dtype=dt),
        k_proj=nn.Linear(config.key_dim, K * H, bias=config.use_key_bias, dtype=dt),
        v_proj=nn.Linear(config.value_dim, K * H, bias=config.use_value_bias, dtype=dt),
        output_proj=nn.Linear(N * H, config.out_dim, bias=config.use_output_bias, dtype=dt),
        pos_embeddings=rope, **(norms or {}), is_causal=False, attn_dropout=0.0)
    state = layouts.from_canonical(LAYOUT, config, tensors, names=NAMES)
    if norms:
        state.update({"q_norm.scale": tensors["query.norm.scale"], "k_norm.scale": tensors["key.norm.scale"]})
    module.load_state_dict({n: to_torch(np.ascontiguousarray(t)) for n, t in state.items()}, strict=True)
    if cache:
        module.setup_cache(shapes.B, dt, shapes.P + shapes.S)
    return module.to(dev).eval(), perm


def _mask(config, shapes, inputs, options, cache: bool):
    """(mask (B, T, S_total) bool or None, is_causal for the module)."""
    causal = bool(options.get("is_causal"))
    top_left = causal and options.get("causal_alignment", "top_left") == "top_left"
    if top_left and not cache and inputs.get("mask") is None:
        return None, True  # the module's own causal default
    allowed = allowed4(shapes, inputs, options)
    if allowed is None:
        return None, False
    return np.ascontiguousarray(np.broadcast_to(allowed[:, 0], (shapes.B, shapes.T, shapes.S_total))), False


def _run(config, tensors, inputs, options, device, precision, *, requires_grad: bool):
    """Build and call the module. Returns (output, weights or None, present (k, v) or None, the input leaves,
    the parameters by name, the pairing permutation or None)."""
    import torch

    from impl_torch.convert import to_torch
    from impl_torch.device import matmul_precision, resolve_device

    dtype, tensors, inputs, shapes = _prepare(config, tensors, inputs, options, device, precision)
    dev, dt = resolve_device(device), getattr(torch, dtype)
    cache = inputs.get("past_key") is not None or bool(options.get("return_cache"))
    positions = _positions(config, shapes, inputs)
    module, perm = _build(config, tensors, shapes, dtype, dev, cache, positions)
    q, k, v = (to_torch(np.ascontiguousarray(a)).to(dev).requires_grad_(requires_grad) for a in qkv(inputs))
    leaves = {"query": q, "key": k, "value": v}
    if requires_grad:
        # forward(x, y) feeds y to k_proj and v_proj alike (equal inputs here, checked): each projection reads its
        # own leaf, so the key and value gradients come apart as the contract reports them
        module.k_proj.register_forward_pre_hook(lambda mod, args: (k,))
        module.v_proj.register_forward_pre_hook(lambda mod, args: (v,))
    if inputs.get("past_key") is not None:
        past_key, past_value = (to_torch(np.ascontiguousarray(inputs[n])).to(device=dev, dtype=dt)
                                for n in ("past_key", "past_value"))
        module.kv_cache.update(past_key if perm is None else past_key[..., perm], past_value)  # torchtune's pairing
    mask, module.is_causal = _mask(config, shapes, inputs, options, cache)
    want = bool(options.get("return_weights", False))
    seen = {}
    if want:
        attend = module._attention_call

        def attend_and_read_weights(q_, k_, v_, **kw):
            eye = torch.eye(k_.shape[2], dtype=v_.dtype, device=v_.device).expand(*k_.shape[:2], -1, -1)
            with torch.no_grad():
                seen["weights"] = attend(q_, k_, eye, **kw)  # (B, N, T, S): weights @ I
            return attend(q_, k_, v_, **kw)

        module._attention_call = attend_and_read_weights
    with matmul_precision(precision), torch.set_grad_enabled(requires_grad):
        out = module(q, k, mask=None if mask is None else to_torch(mask).to(dev),
                     input_pos=None if positions is None else to_torch(positions).to(dev))
    present = None
    if options.get("return_cache"):
        key_cache, value_cache = module.kv_cache.k_cache, module.kv_cache.v_cache  # (B, K, P+S, H)
        if perm is not None:
            key_cache = key_cache[..., np.argsort(perm)]  # back to the contract's pairing
        present = (key_cache, value_cache)
    return out, seen.get("weights"), present, leaves, dict(module.named_parameters()), perm


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    from impl_torch.convert import to_numpy

    out, weights, present, _, _, _ = _run(config, tensors, inputs, options, device, precision, requires_grad=False)
    answer = {"output": to_numpy(out)}
    if weights is not None:
        answer["weights"] = to_numpy(weights)
    if present is not None:
        answer["present_key"], answer["present_value"] = (to_numpy(t) for t in present)
    return answer


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    options = dict(options, return_weights=False, return_cache=False)
    out, _, _, leaves, params, perm = _run(config, tensors, inputs, options, device, precision, requires_grad=True)
    try:
        out, grads = torch_vjp(out, {**leaves, **params}, d_output)
    except RuntimeError as err:  # torch's own words: KVCache.update indexes with cache_pos, then advances it in place
        if "inplace operation" not in str(err):
            raise
        raise NotImplementedError(f"{NAME}: no gradient through KVCache.update (it advances cache_pos in place after "
                                  f"indexing with it): {str(err).splitlines()[0][:160]}") from None
    state = {n: grads.pop(n) for n in params}  # named as the module's parameters (torch-linears with NAMES)
    norm = {n: state.pop(n) for n in ("q_norm.scale", "k_norm.scale") if n in state}
    canonical = grads_to_canonical(LAYOUT, state, num_heads=config.num_heads, names=NAMES)
    if norm:
        canonical["query.norm.scale"], canonical["key.norm.scale"] = norm["q_norm.scale"], norm["k_norm.scale"]
    if perm is not None:  # the permuted features' gradients back in the contract's order
        back = np.argsort(perm)
        for name in ("query.kernel", "query.bias", "key.kernel", "key.bias", "query.norm.scale", "key.norm.scale"):
            if name in canonical:
                canonical[name] = np.ascontiguousarray(canonical[name][..., back])
    canonical.update(grads)  # query, key, value
    return {"output": out, "grads": order_grads(config, canonical)}
