"""Backend torch-flex: torch.nn.attention.flex_attention around our projections.

Projections, QK-norm, head split, RoPE, the cache append, head merge and
the output projection are impl_torch's stages (impl_torch.attention.qkv_heads,
which mirror impl_numpy); logits, softcap, bias, mask, softmax and attend are
one flex_attention call, run eagerly (not compiled):

- score_mod: the softcap c tanh(s / c) on the scaled logit, then ALiBi's
  -slope_h * |pos_q(i) - pos_k(j)| (positions as RoPE reads them: the call's,
  the cache's keys at 0..P-1), then the case's bias (the contract's order:
  scale, softcap, alibi, bias, mask);
- block_mask from one mask_mod: the case's mask, causal (top-left or
  bottom-right: query i sits at i + S_total - T), the window
  p_i - window_left <= j <= p_i + window_right, local chunks
  (pos_q(i) // C == pos_k(j) // C, from the same positions), segment ids
  (equal ids) and the selection (topk_indices, impl_torch's selection_mask:
  flex's block mask then skips the key blocks nothing selects);
- GQA natively (enable_gqa=True), value_head_dim != head_dim, any scale;
- sinks: flex_attention returns the row's log-sum-exp (return_aux=AuxRequest(lse=True)), so
  a sink logit z joins the denominator by one rescale of the output,
  out * sigmoid(lse - z) = out * e^lse / (e^lse + e^z); a row with no key
  has lse = -inf and gives 0, as the contract's sink row does;
- attention weights: flex returns none; they are read out of the same
  kernel with the value set to the identity (conformance.native.identity_values).

Around the call, as the projections, RoPE and QK-norm already were (flex has
no argument for any of them and needs none: they change q, k, v or the
context, not the scores): the QKV clip, every QK-norm form (weightless, per
head, after RoPE), the value norm, LongRoPE and proportional RoPE, the query
temperature (impl_torch.attention.qkv_heads), a latent layer's expanded
keys and values (latent_heads, expand_latent: flex then sees plain GQA heads)
and the output gate on the attended context (impl_torch.functional.gate).

Cannot express: dropout (flex_attention has no dropout argument). A query row
with no allowed key gives what the kernel gives, measured by a probe
(`native_masked_row`: 0 on CPU, torch 2.13), expressible only where that is
the case's masked_row. Gradients: torch 2.13 refuses flex_attention's
backward on CPU ("FlexAttention does not support backward on CPU"), so on
CPU the backend is forward only and says so with torch's words.
"""

from __future__ import annotations

import warnings

import numpy as np

from . import (
    bias4,
    check_masked_rows,
    classify_row,
    mask4,
    order_grads,
    prepare_call,
    qkv,
    require,
    torch_vjp,
)

require("torch")

NAME = "torch-flex"

# Every modern and frontier feature: flex's score_mod / block_mask / lse take softcap, ALiBi, windows, local
# chunks, segments and sinks; rope, the norms, the clip, the temperature, the latent's expansion, the gate and the
# cache are impl_torch's stages around the call, as the projections are.
EXPRESSES = ("rope", "logit_softcap", "window_left", "window_right", "qk_norm", "use_sinks", "positions",
             "key_positions", "past_key", "past_value", "segment_ids", "key_segment_ids", "return_cache",
             "past_key_positions", "topk_indices",
             "alibi", "local_chunk", "query_temperature", "qkv_clip", "output_gate", "value_norm", "latent",
             "qk_norm.weight", "qk_norm.per_head", "qk_norm.after_rope", "rope.scaling longrope",
             "rope.scaling proportional")


def known_difference(case, dtype: str) -> str | None:
    """The expected failure of a case, with its reason; None if it must pass."""
    return None


def devices() -> list[str]:
    from impl_torch.device import devices as torch_devices

    return torch_devices()


def _flex(*args, **kwargs):
    """flex_attention called eagerly: torch warns that eager flex is a slow
    reference path; that is what the suite wants here (no compile per case)."""
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)
        return flex_attention(*args, **kwargs)


def _block_mask(mask_mod, B, N, T, S, device):
    from torch.nn.attention.flex_attention import create_block_mask

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        return create_block_mask(mask_mod, B, N, T, S, device=device)


_ROWS: dict[tuple, str] = {}


def native_masked_row(device: str, dtype: str) -> str:
    """What flex_attention gives for a query row with no allowed key, measured on a small call."""
    key = (device, dtype)
    if key not in _ROWS:
        import torch

        from impl_torch.device import resolve_device

        dev, dt = resolve_device(device), getattr(torch, dtype)
        q = torch.ones(1, 1, 2, 2, device=dev, dtype=dt)  # (B, N, T, H)
        v = torch.tensor([[[[0.0, 2.0], [2.0, 4.0], [4.0, 0.0]]]], device=dev, dtype=dt)  # (B, N, S, H)
        with torch.no_grad():
            out = _flex(q, v, v, block_mask=_block_mask(lambda b, h, i, j: i > 0, 1, 1, 2, 3, dev))
        _ROWS[key] = classify_row(out[0, 0, 0].float().cpu().numpy(), v[0, 0].float().cpu().numpy())
    return _ROWS[key]


def _prepare(config, tensors, inputs, options, device, precision):
    dtype, tensors, inputs, shapes = prepare_call(NAME, config, tensors, inputs, options, device, precision,
                                                  devices(), expresses=EXPRESSES)
    if options.get("training") and (config.dropout > 0 or inputs.get("dropout_mask") is not None):
        raise NotImplementedError(f"{NAME}: flex_attention has no dropout (no argument for a rate or a keep-mask)")
    check_masked_rows(NAME, config, shapes, inputs, options, native_masked_row(device, dtype),
                      f"flex_attention with a block_mask on {device}, {dtype}")
    return dtype, tensors, inputs, shapes


def _mods(config, shapes, inputs, options, dtype, dev, call):
    """(score_mod or None, mask_mod or None) for the case: softcap, ALiBi and bias
    as a score_mod, mask / causal / window / local chunks / segments as one
    mask_mod. `call`: impl_torch's Call, whose positions ALiBi and the chunks read."""
    import torch

    from impl_torch.convert import to_torch

    B, N, T, S = shapes.B, config.num_heads, shapes.T, shapes.S_total
    offset = S - T if options.get("causal_alignment", "top_left") == "bottom_right" else 0  # query i sits at i + offset
    left, right = config.window_left, config.window_right
    m, b = mask4(shapes, inputs), bias4(shapes, inputs)
    mask = None if m is None else to_torch(np.ascontiguousarray(np.broadcast_to(m, (B, N, T, S)))).to(dev)
    if inputs.get("topk_indices") is not None:  # the selection joins the mask_mod's mask (impl_torch's)
        from impl_torch.functional import selection_mask

        selected = selection_mask(to_torch(np.asarray(inputs["topk_indices"])).to(dev), N, S).expand(B, N, T, S)
        mask = selected if mask is None else mask & selected
    bias = None if b is None else to_torch(np.ascontiguousarray(np.broadcast_to(b, (B, N, T, S)))).to(
        device=dev, dtype=torch.float32 if dtype in ("float16", "bfloat16") else getattr(torch, dtype))
    ids = inputs.get("segment_ids")
    if ids is not None:
        key_ids = inputs.get("key_segment_ids")
        key_ids = ids if key_ids is None else key_ids
        q_ids = to_torch(np.broadcast_to(np.asarray(ids).reshape(-1, T), (B, T)).copy()).to(dev)  # (B, T)
        k_ids = to_torch(np.broadcast_to(np.asarray(key_ids).reshape(-1, S), (B, S)).copy()).to(dev)  # (B, S)
    causal = bool(options.get("is_causal"))
    cap = config.logit_softcap
    chunk = config.local_chunk
    if config.alibi or chunk is not None:
        pos_q = call.positions.expand(B, T).contiguous()  # (B, T) int64
        pos_k = call.every_key_position.expand(B, S).contiguous()  # (B, S_total): the cache's keys' and the new
    if config.alibi:
        slopes = call.params["alibi.slopes"].to(torch.float32 if dtype in ("float16", "bfloat16")
                                                else getattr(torch, dtype))  # (N,) in compute dtype

    def mask_mod(bi, h, i, j):
        ok = j >= 0  # a tensor of True with j's shape
        p = i + offset
        if causal:
            ok = ok & (j <= p)
        if left >= 0:
            ok = ok & (j >= p - left)
        if right >= 0:
            ok = ok & (j <= p + right)
        if chunk is not None:
            ok = ok & (torch.div(pos_q[bi, i], chunk, rounding_mode="floor")
                       == torch.div(pos_k[bi, j], chunk, rounding_mode="floor"))
        if ids is not None:
            ok = ok & (q_ids[bi, i] == k_ids[bi, j])
        if mask is not None:
            ok = ok & mask[bi, h, i, j]
        return ok

    def score_mod(score, bi, h, i, j):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if config.alibi:  # the distance is an integer, exact; one product, as functional.alibi_bias
            score = score - slopes[h] * (pos_q[bi, i] - pos_k[bi, j]).abs().to(slopes.dtype)
        if bias is not None:
            score = score + bias[bi, h, i, j]
        return score

    masked = causal or left >= 0 or right >= 0 or chunk is not None or ids is not None or mask is not None
    scored = cap is not None or config.alibi or bias is not None
    return (score_mod if scored else None), (mask_mod if masked else None)


def _run(config, call, score_mod, block_mask, *, want_weights, trace, want_cache):
    """Our stages around flex_attention. Returns output (B, T, O), weights or None, present (k, v), trace entries."""
    import torch

    from impl_torch import functional as f
    from impl_torch.attention import expand_latent, latent_heads, qkv_heads

    entries = []
    rec = lambda stage, value: (entries.append((stage, value)) if trace else None, value)[1]  # noqa: E731
    if config.latent is not None:  # the expanded form: flex sees each head's keys and values
        q, latent, rotary = latent_heads(config, call, rec)  # (B, N, T, H), (B, 1, S_total, C), (B, 1, S_total, R)
        k, v = expand_latent(config, call, latent, rotary, rec)  # (B, K, S_total, H), (B, K, S_total, V)
        present = (latent, rotary)  # a latent layer's cache
    else:
        q, k, v = qkv_heads(config, call, rec)  # (B, N, T, H), (B, K, S_total, H), (B, K, S_total, V)
        present = (k, v)
    from torch.nn.attention.flex_attention import AuxRequest

    common = dict(score_mod=score_mod, block_mask=block_mask, scale=config.effective_scale,
                  enable_gqa=config.num_kv_heads != config.num_heads)
    if config.use_sinks:
        common["return_aux"] = AuxRequest(lse=True)

    def core(values):
        got = _flex(q, k, values, **common)
        if not config.use_sinks:
            return got
        out, lse = got[0], got[1].lse  # lse (B, N, T): natural log of the row's sum of exp(logit)
        sink = call.params["sinks"].to(lse.dtype)[None, :, None]  # (1, N, 1)
        return (out.to(lse.dtype) * torch.sigmoid(lse - sink)[..., None]).to(out.dtype)

    weights = None
    if want_weights or trace:
        B, K, S = v.shape[0], v.shape[1], v.shape[2]
        eye = torch.eye(S, dtype=v.dtype, device=v.device).expand(B, K, S, S)  # (B, K, S, S): V = I
        with torch.no_grad():
            weights = rec("softmax", core(eye))  # (B, N, T, S)
    ctx = rec("attend", core(v))  # (B, N, T, V)
    if config.output_gate is not None:
        g = rec("gate.project", f.gate_project(call.query, call.params["gate.kernel"], call.params.get("gate.bias")))
        ctx = rec("gate", f.gate(ctx, g, config.num_heads))  # (B, N, T, V)
    ctx = rec("merge_heads", f.merge_heads(ctx))  # (B, T, N*V)
    out = rec("output", f.output(ctx, call.params["output.kernel"], call.params.get("output.bias")))  # (B, T, O)
    return out, weights, present if want_cache else None, entries


def _call(config, tensors, inputs, options, device, precision, *, requires_grad=False):
    """Validated inputs as impl_torch's Call (its own checks, positions and cache), and the flex arguments."""
    from impl_torch.attention import prepare
    from impl_torch.convert import to_torch
    from impl_torch.device import resolve_device

    dtype, tensors, inputs, shapes = _prepare(config, tensors, inputs, options, device, precision)
    dev = resolve_device(device)
    params = {n: to_torch(t).to(dev).requires_grad_(requires_grad) for n, t in tensors.items()}
    x = {n: to_torch(a).to(dev).requires_grad_(requires_grad) for n, a in zip(("query", "key", "value"), qkv(inputs))}
    given = {n: to_torch(inputs[n]).to(dev) for n in ("positions", "key_positions", "past_key", "past_value",
                                                      "past_key_positions") if inputs.get(n) is not None}
    for name in ("past_key", "past_value"):
        if name in given:
            given[name].requires_grad_(requires_grad)
    call = prepare(config, params, x["query"], x["key"], x["value"], mask=None, bias=None, dropout_mask=None,
                   is_causal=False, causal_alignment=options.get("causal_alignment", "top_left"), training=False,
                   seed=None, return_weights=False, dtype=dtype, materializes_scores=False, **given)
    score_mod, mask_mod = _mods(config, shapes, inputs, options, dtype, dev, call)
    block_mask = None if mask_mod is None else _block_mask(mask_mod, shapes.B, config.num_heads, shapes.T,
                                                           shapes.S_total, dev)
    leaves = {**x, **params, **{n: given[n] for n in ("past_key", "past_value") if n in given}}
    return call, score_mod, block_mask, leaves


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    import torch

    from impl_torch.convert import to_numpy
    from impl_torch.device import matmul_precision

    call, score_mod, block_mask, _ = _call(config, tensors, inputs, options, device, precision)
    want = bool(options.get("return_weights", False))
    want_cache = bool(options.get("return_cache", False))
    with matmul_precision(precision), torch.no_grad():
        out, w, present, entries = _run(config, call, score_mod, block_mask, want_weights=want, trace=trace,
                                        want_cache=want_cache)
    answer = {"output": to_numpy(out)}
    if want:
        answer["weights"] = to_numpy(w)
    if want_cache:
        answer["present_key"], answer["present_value"] = (to_numpy(t) for t in present)
    if trace:
        answer["trace"] = [(stage, to_numpy(value)) for stage, value in entries]
    return answer


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    from impl_torch.device import matmul_precision

    call, score_mod, block_mask, leaves = _call(config, tensors, inputs, options, device, precision,
                                                requires_grad=True)
    with matmul_precision(precision):
        try:
            out, _, _, _ = _run(config, call, score_mod, block_mask, want_weights=False, trace=False,
                                want_cache=False)
        except NotImplementedError as err:  # torch's own words, e.g. no backward on CPU
            raise NotImplementedError(f"{NAME}: {str(err).splitlines()[0]}") from None
        out, grads = torch_vjp(out, leaves, d_output)
    return {"output": out, "grads": order_grads(config, grads)}
