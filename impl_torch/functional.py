"""Multi-head attention in PyTorch, one function per stage: mirrors impl_numpy/functional.py.

Same stage functions, same names, same order, same einsum strings as the
NumPy spec; torch ops only. Shape letters as in impl_numpy:
  B batch             T query length        S key/value length
  N query heads       K key/value heads     G = N / K query heads per K head
  H head dim (q, k)   V value head dim      D input features    O output features
  F a flattened head axis: N*H, K*H or K*V (N*V after merge_heads)

Stages: project -> split_heads -> logits (scale) -> mask (and bias) ->
softmax -> dropout -> attend -> merge_heads -> output.

Precision rule (as the spec): each stage's result is stored in the storage
dtype; its arithmetic runs in `compute_dtype`, float32 for float16/bfloat16.
Under autocast, torch's own rules pick the matmul dtype instead.

One torch-only addition: `use_sdpa=True` runs logits..attend through
`F.scaled_dot_product_attention` when the call allows it (see `sdpa_attend`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.nn.functional as nnF

from weights import DTYPES, AttentionConfig, WeightsFormatError, validate_tensors
from weights.contract import check_bias_values, check_call

from .convert import TORCH_DTYPES, compute_dtype, dtype_name, to_torch, torch_dtype
from .masks import causal_mask

# The contractions, written once; the same strings as impl_numpy.
PROJECT = "BLD,DF->BLF"
LOGITS = "BKGTH,BKSH->BKGTS"
ATTEND = "BKGTS,BKSV->BKGTV"
OUTPUT = "BTF,FO->BTO"


@dataclasses.dataclass
class TraceEntry:
    stage: str
    value: Any  # the stage's output, a torch tensor


def _record(trace: list | None, stage: str, value):
    if trace is not None:
        trace.append(TraceEntry(stage, value))
    return value


def _einsum(spec: str, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    ct = compute_dtype(dtype)
    return torch.einsum(spec, a.to(ct), b.to(ct)).to(dtype)


# -- stages --------------------------------------------------------------------

def project(x: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """PROJECT: x (B, L, D) times kernel (D, heads, width) flattened -> (B, L, F)."""
    D = kernel.shape[0]
    y = _einsum(PROJECT, x, kernel.reshape(D, -1), x.dtype)  # (B, L, F)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        # In place on the fresh product (its matmul's backward needs only the inputs):
        # one (B, L, F) array fewer at the peak.
        y = y.to(ct).add_(bias.reshape(-1).to(ct)).to(x.dtype)  # bias (F,)
    return y


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, L, heads*width) -> (B, heads, L, width), as seed 003's split_heads."""
    B, L, F = x.shape
    x = x.reshape(B, L, num_heads, F // num_heads)  # (B, L, heads, width)
    return x.transpose(1, 2)  # (B, heads, L, width)


def logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """LOGITS times scale: q (B, N, T, H), k (B, K, S, H) -> (B, N, T, S).
    Query head n reads key head n // G."""
    B, N, T, H = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, K, N // K, T, H)  # (B, K, G, T, H)
    ct = compute_dtype(q.dtype)
    scores = torch.einsum(LOGITS, qg.to(ct), k.to(ct))  # (B, K, G, T, S)
    return (scores * scale).reshape(B, N, T, S).to(q.dtype)  # (B, N, T, S)


def mask(x: torch.Tensor, allowed: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """Add bias, then set disallowed positions to -inf. allowed and bias are
    rank-4 and broadcast to (B, N, T, S). A select, so a masked position gets
    no gradient (as in impl_numpy/backward.py); a -inf in bias masks, so it
    joins the select (the value is -inf either way): otherwise a "nan" row
    masked by bias alone would pass its NaN to the query and key gradients."""
    if bias is not None:
        ct = compute_dtype(x.dtype)
        x = (x.to(ct) + bias).to(x.dtype)
        finite = bias > float("-inf")  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else allowed & finite
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    return x


def softmax(x: torch.Tensor, masked_row: str) -> torch.Tensor:
    """Softmax over S in compute dtype. A row with no finite logit (every key
    masked) becomes: "zero" all 0, "uniform" all 1/S, "nan" all NaN."""
    ct = compute_dtype(x.dtype)
    xc = x.to(ct)
    row_max = xc.amax(dim=-1, keepdim=True).detach()  # (B, N, T, 1); a shift, not a function of x
    empty = row_max == float("-inf")
    e = torch.exp(xc - torch.where(empty, 0.0, row_max))  # masked -> exactly 0
    total = e.sum(dim=-1, keepdim=True)
    w = e / torch.where(empty, 1.0, total)  # an empty row is all 0 here: "zero" done
    if masked_row == "uniform":
        w = torch.where(empty, 1.0 / x.shape[-1], w)
    elif masked_row == "nan":
        w = w * torch.where(empty, float("nan"), 1.0)  # NaN in the gradient too, as the reference VJP
    return w.to(x.dtype)


def dropout(w: torch.Tensor, keep: torch.Tensor | None, rate: float) -> torch.Tensor:
    """Inverted dropout with an explicit keep-mask (B, N, T, S)."""
    if keep is None:
        return w
    ct = compute_dtype(w.dtype)
    return torch.where(keep, w.to(ct) / (1.0 - rate), 0.0).to(w.dtype)


def attend(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """ATTEND: weights (B, N, T, S), v (B, K, S, V) -> (B, N, T, V)."""
    B, N, T, S = w.shape
    K = v.shape[1]
    wg = w.reshape(B, K, N // K, T, S)  # (B, K, G, T, S)
    return _einsum(ATTEND, wg, v, w.dtype).reshape(B, N, T, v.shape[-1])  # (B, N, T, V)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, N, T, V) -> (B, T, N*V)."""
    B, N, T, V = x.shape
    return x.transpose(1, 2).reshape(B, T, N * V)  # (B, T, N*V)


def output(x: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """OUTPUT: (B, T, N*V) times kernel (N, V, O) flattened -> (B, T, O)."""
    y = _einsum(OUTPUT, x, kernel.reshape(-1, kernel.shape[-1]), x.dtype)  # (B, T, O)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        y = y.to(ct).add_(bias.to(ct)).to(x.dtype)  # in place, as in project
    return y


# -- the SDPA core (torch only) -------------------------------------------------

def sdpa_attend(config: AttentionConfig, q, k, v, *, allowed, bias, plain_causal: bool) -> torch.Tensor:
    """logits -> mask -> softmax -> attend through F.scaled_dot_product_attention:
    q (B, N, T, H), k (B, K, S, H), v (B, K, S, V) -> (B, N, T, V).

    `plain_causal`: the only masking is top-left causal, so SDPA's own
    is_causal (top-left) applies. Otherwise the mask is built here (both
    causal alignments, padding, bias).

    Rows with no allowed key never reach SDPA: what kernels return for them
    differs (0 from the CPU kernels of torch 2.13, measured in
    tests/test_torch.py; NaN from others), so such rows are opened to every key
    and their result is then replaced by the masked_row policy's: 0, the mean
    of v, or NaN. Gradients follow the policy too.
    """
    gqa = config.num_kv_heads != config.num_heads
    scale = config.effective_scale
    dtype = v.dtype  # the storage dtype: the result is stored in it even under autocast
    if plain_causal:
        return nnF.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa).to(dtype)
    if allowed is None and bias is None:
        return nnF.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa).to(dtype)
    finite = torch.ones((), dtype=torch.bool, device=q.device) if allowed is None else allowed
    if bias is not None:
        finite = finite & ~torch.isneginf(bias)  # (B|1, N|1, T|1, S|1)
    T, S = q.shape[2], k.shape[2]
    finite = finite.expand(*finite.shape[:2], T, S)
    empty = ~finite.any(dim=-1, keepdim=True)  # (B|1, N|1, T, 1)
    open_rows = finite | empty
    if bias is None:
        attn_mask = open_rows
    else:
        safe_bias = bias.masked_fill(torch.isneginf(bias), 0.0).to(q.dtype)
        attn_mask = safe_bias.masked_fill(~open_rows, float("-inf"))
    ctx = nnF.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=gqa)  # (B, N, T, V)
    ctx = ctx.to(dtype)
    # The policy's weights (0, 1/S or NaN) on every key times V, as the spec's attend: "zero" is
    # NaN in a value column holding a NaN (0 * NaN), "uniform" the mean of V, "nan" NaN, and V's
    # gradient is the spec's. The factor is 0 on every other row, so no NaN reaches their gradients.
    ct = compute_dtype(v.dtype)
    weight = {"zero": 0.0, "uniform": 1.0 / v.shape[2], "nan": float("nan")}[config.masked_row]
    zero = torch.zeros((), dtype=ct, device=v.device)
    factor = torch.where(empty, zero + weight, zero)  # (B|1, N|1, T, 1), 1/S in the compute dtype
    v_sum = v.to(ct).sum(dim=2, keepdim=True).repeat_interleave(config.group_size, dim=1)  # (B, N, 1, V)
    return torch.where(empty, (factor * v_sum).to(dtype), ctx)


# -- helpers shared by the whole call ---------------------------------------------

def dropout_keep_mask(shape: tuple[int, ...], rate: float, seed: int, device: torch.device) -> torch.Tensor:
    """torch's own seeded keep-mask. Seeds are per framework: for the same
    dropout across frameworks pass an explicit dropout_mask instead."""
    generator = torch.Generator(device=device).manual_seed(int(seed))
    return torch.rand(shape, generator=generator, device=device) >= rate


def allowed_mask(shapes, mask_tensor, is_causal: bool, causal_alignment: str, device) -> torch.Tensor | None:
    """mask AND causal, rank 4, broadcastable to (B, N, T, S); None if neither."""
    allowed = None
    if mask_tensor is not None:
        allowed = mask_tensor.to(device=device, dtype=torch.bool).reshape(shapes.mask_shape)
    if is_causal:
        causal = causal_mask(shapes.T, shapes.S, causal_alignment, device=device)[None, None]  # (1, 1, T, S)
        allowed = causal if allowed is None else allowed & causal
    return allowed


def check_tensors(config: AttentionConfig, tensors) -> torch.dtype:
    """Names, shapes and the one dtype of canonical torch tensors; returns that dtype.

    Shapes and dtypes only (values are never read, so a call does not wait on
    the device; the layer and the adapter check values once, in NumPy, when
    they load tensors). Plain Python on the happy path, so torch.compile
    traces it; a problem is worded by weights.validate_tensors itself, run on
    shape-only NumPy stand-ins.
    """
    expected = config.tensor_shapes()
    names_ok = len(tensors) == len(expected) and all(name in tensors for name in expected)
    if names_ok and all(isinstance(t, torch.Tensor) for t in tensors.values()):
        dtypes = [t.dtype for t in tensors.values()]
        if (all(tuple(tensors[name].shape) == shape for name, shape in expected.items())
                and all(d == dtypes[0] for d in dtypes) and dtypes[0] in TORCH_DTYPES.values()):
            return dtypes[0]
    strangers = [f"{name} is a {type(t).__name__}, not a torch tensor"
                 for name, t in tensors.items() if not isinstance(t, torch.Tensor)]
    if strangers:
        raise WeightsFormatError("tensors: " + "; ".join(strangers))
    stand_ins = {}
    for name, t in tensors.items():
        try:
            np_dtype = DTYPES.get(dtype_name(t.dtype)) or np.dtype(dtype_name(t.dtype))
        except TypeError:
            np_dtype = np.dtype(object)
        stand_ins[name] = np.broadcast_to(np.zeros((), np_dtype), tuple(t.shape))
    validate_tensors(config, stand_ins)  # raises, in the format's words
    found = {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()}
    raise AssertionError(f"check_tensors found a problem that validate_tensors did not: {found}")


def _check_bias_values(bias: torch.Tensor) -> None:
    """The contract's NaN / +inf check on bias values. It needs the values on
    the host, so torch.compile skips it (it would split the graph)."""
    if torch.compiler.is_compiling():
        return
    bad = torch.isnan(bias) | torch.isposinf(bias)
    if bool(bad.any()):
        check_bias_values(bias[bad][:1].double().cpu().numpy())  # raises, in the contract's words


def prepare(config, tensors, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, return_weights, dtype, materializes_scores=True, sdpa=False):
    """Validate a call and cast everything to the storage dtype. sdpa: the
    core will run through SDPA; when SDPA's own is_causal can apply (returned
    as plain_causal), the (T, S) causal mask is not built at all."""
    stored = check_tensors(config, tensors)
    dtype = stored if dtype is None else torch_dtype(dtype)
    device = next(iter(tensors.values())).device  # where the weights live; every input follows them
    query = to_torch(query, device)
    key = query if key is None else to_torch(key, device)
    value = key if value is None else to_torch(value, device)
    mask_t = None if mask is None else to_torch(mask, device)
    bias_t = None if bias is None else to_torch(bias, device)
    keep_t = None if dropout_mask is None else to_torch(dropout_mask, device)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not x.is_floating_point() and x.dtype != dtype:
            raise ValueError(f"{name} must be a float array: got dtype {dtype_name(x.dtype)}")
    shapes = check_call(
        config, query_shape=tuple(query.shape), key_shape=tuple(key.shape), value_shape=tuple(value.shape),
        mask_shape=None if mask_t is None else tuple(mask_t.shape),
        mask_dtype=None if mask_t is None else dtype_name(mask_t.dtype),
        bias_shape=None if bias_t is None else tuple(bias_t.shape),
        bias_dtype=None if bias_t is None else dtype_name(bias_t.dtype),
        dropout_mask_shape=None if keep_t is None else tuple(keep_t.shape),
        dropout_mask_dtype=None if keep_t is None else dtype_name(keep_t.dtype),
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        return_weights=return_weights,
        # The memory guard reads /proc/meminfo: done eagerly, skipped while
        # torch.compile traces (it would break the graph), and on a GPU whose
        # memory the host's MemAvailable does not describe.
        materializes_scores=materializes_scores and not torch.compiler.is_compiling() and query.device.type == "cpu",
        scores_itemsize=torch.finfo(compute_dtype(dtype)).bits // 8,
    )
    if bias_t is not None:
        _check_bias_values(bias_t)
        bias_t = bias_t.to(compute_dtype(dtype)).reshape(shapes.bias_shape)
    params = {name: t.to(dtype) for name, t in tensors.items()}
    if training and keep_t is None and config.dropout > 0:
        keep_t = dropout_keep_mask((shapes.B, config.num_heads, shapes.T, shapes.S), config.dropout, seed, device)
    if not training:
        keep_t = None
    plain_causal = (sdpa and is_causal and mask_t is None and bias_t is None
                    and (causal_alignment == "top_left" or shapes.T == shapes.S))
    allowed = allowed_mask(shapes, mask_t, is_causal and not plain_causal, causal_alignment, device)
    cast = [x.to(dtype) for x in (query, key, value)]
    return shapes, params, cast, allowed, bias_t, keep_t, dtype, plain_causal


def multi_head_attention(
    config: AttentionConfig,
    tensors: dict[str, torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    training: bool = False,
    dropout_mask: torch.Tensor | None = None,
    seed: int | None = None,
    return_weights: bool = False,
    dtype: str | torch.dtype | None = None,
    trace: list | None = None,
    use_sdpa: bool = False,
):
    """The forward pass. Returns output (B, T, O), or (output, weights) with
    weights (B, N, T, S) after softmax and before dropout when return_weights.

    tensors: the canonical tensors (impl_numpy's names and layouts) as torch
    tensors on one device; inputs, masks and bias are moved to it. dtype: compute in this storage dtype
    (default: the tensors' dtype). use_sdpa: run logits..attend through
    F.scaled_dot_product_attention when nothing needs the (T, S) weights
    (no return_weights, no trace) and no dropout mask applies; else, and by
    default, the explicit stages.
    """
    # SDPA computes the core blockwise on its own: no (B, N, T, S) scores to guard.
    will_use_sdpa = (use_sdpa and not return_weights and trace is None
                     and not (training and (dropout_mask is not None or config.dropout > 0)))
    shapes, p, (query, key, value), allowed, bias_r4, keep, dtype, plain_causal = prepare(
        config, tensors, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        return_weights=return_weights, dtype=dtype, materializes_scores=not will_use_sdpa, sdpa=will_use_sdpa,
    )
    rec = lambda stage, value: _record(trace, stage, value)  # noqa: E731
    q = rec("query.project", project(query, p["query.kernel"], p.get("query.bias")))  # (B, T, N*H)
    k = rec("key.project", project(key, p["key.kernel"], p.get("key.bias")))  # (B, S, K*H)
    v = rec("value.project", project(value, p["value.kernel"], p.get("value.bias")))  # (B, S, K*V)
    q = rec("query.split_heads", split_heads(q, config.num_heads))  # (B, N, T, H)
    k = rec("key.split_heads", split_heads(k, config.num_kv_heads))  # (B, K, S, H)
    v = rec("value.split_heads", split_heads(v, config.num_kv_heads))  # (B, K, S, V)
    w = None
    if will_use_sdpa:
        ctx = sdpa_attend(config, q, k, v, allowed=allowed, bias=bias_r4, plain_causal=plain_causal)  # (B, N, T, V)
    else:
        x = rec("logits", logits(q, k, config.effective_scale))  # (B, N, T, S)
        x = rec("mask", mask_stage(x, allowed, bias_r4))
        w = rec("softmax", softmax(x, config.masked_row))  # (B, N, T, S)
        wd = rec("dropout", dropout(w, keep, config.dropout))
        ctx = rec("attend", attend(wd, v))  # (B, N, T, V)
    ctx = rec("merge_heads", merge_heads(ctx))  # (B, T, N*V)
    out = rec("output", output(ctx, p["output.kernel"], p.get("output.bias")))  # (B, T, O)
    return (out, w) if return_weights else out


# `mask` is both a stage and an argument name; the call uses this alias.
mask_stage = mask

STAGES = (
    "query.project", "key.project", "value.project",
    "query.split_heads", "key.split_heads", "value.split_heads",
    "logits", "mask", "softmax", "dropout", "attend", "merge_heads", "output",
)
