"""One job on one rank (_run_job: the leaves, the kind's shard of the call, the gradients) and rank 0's
whole answer from every rank's piece (_assemble)."""

from __future__ import annotations

import numpy as np
import torch

from weights.call import OPTIONAL_INPUTS

from ..convert import to_numpy, to_torch, torch_dtype
from .checks import DIFFERENTIABLE_INPUTS
from .heads import _heads
from .ring import _sequence


def _run_job(job, kind, rank, world) -> dict:
    config, options, inputs = job["config"], job["options"], job["inputs"]
    grad = job["op"] == "vjp"
    dtype = torch_dtype(options.get("dtype") or np.asarray(job["tensors"]["query.kernel"]).dtype)
    leaves = {name: to_torch(t).requires_grad_(grad) for name, t in job["tensors"].items()}
    xs = {name: to_torch(inputs[name]).requires_grad_(grad)
          for name in DIFFERENTIABLE_INPUTS if inputs.get(name) is not None}
    others = {name: to_torch(inputs[name]) for name in OPTIONAL_INPUTS
              if name not in xs and inputs.get(name) is not None}
    run = _heads if kind == "heads" else _sequence
    with torch.set_grad_enabled(grad):
        piece, out = run(config, leaves, xs, others, options, dtype, rank, world)
    if grad:
        d_out = to_torch(np.asarray(job["d_output"])).to(out.dtype)
        if kind == "heads":
            d_local = d_out if rank == 0 else torch.zeros_like(d_out)  # the all_reduce's backward sums it to all
        else:
            d_local = d_out.index_select(1, piece["rows"])
        named = {**xs, **leaves}
        grads = torch.autograd.grad(out, list(named.values()), grad_outputs=d_local, allow_unused=True)
        piece["grads"] = {name: to_numpy(torch.zeros_like(leaf) if g is None else g)
                          for (name, leaf), g in zip(named.items(), grads)}
    return {name: (to_numpy(v) if isinstance(v, torch.Tensor) else v) for name, v in piece.items()}


def _assemble(job, kind, pieces) -> dict:
    """Rank 0: the whole answer from every rank's piece."""
    config, options, inputs = job["config"], job["options"], job["inputs"]
    dtype = pieces[0]["output"].dtype
    answer = {}
    if kind == "heads":
        answer["output"] = pieces[0]["output"]
        if options.get("return_weights"):
            answer["weights"] = np.concatenate([p["weights"] for p in pieces], axis=1)  # (B, N, T, S_total)
        if options.get("return_cache"):
            for name in ("present_key", "present_value"):
                first = pieces[0][name]
                whole = np.zeros((first.shape[0], config.num_kv_heads, *first.shape[2:]), dtype=dtype)
                for p in pieces:
                    whole[:, p["kv_heads"]] = p[name]  # replicated heads: the same values from each holder
                answer[name] = whole
    else:
        B, O = pieces[0]["output"].shape[0], pieces[0]["output"].shape[2]
        T = np.asarray(inputs["query"]).shape[1]
        out = np.zeros((B, T, O), dtype=dtype)
        for p in pieces:
            out[:, p["rows"]] = p["output"]
        answer["output"] = out
        if options.get("return_cache"):
            S_total = sum(len(p["key_index"]) for p in pieces)
            for name in ("present_key", "present_value"):
                first = pieces[0][name]
                whole = np.zeros((first.shape[0], first.shape[1], S_total, first.shape[3]), dtype=dtype)
                for p in pieces:
                    whole[:, :, p["key_index"]] = p[name]
                answer[name] = whole
    if job["op"] == "forward":
        return answer
    order = [n for n in DIFFERENTIABLE_INPUTS if inputs.get(n) is not None] + list(config.tensor_shapes())
    grads = {}
    for name in order:
        total = sum(np.asarray(p["grads"][name], np.float64) for p in pieces)  # each rank: its shard's part
        grads[name] = total.astype(pieces[0]["grads"][name].dtype)
    return {"output": answer["output"], "grads": grads}

