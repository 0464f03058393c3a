"""The torch.autograd.Function classes of the sharded calls: the heads' all_reduce (_AllReduceSum), the
ring's shift (_RingShift) and the anchor that ties every received block to the output (_Anchor)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .exchange import _exchange


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; its backward sums the gradients over ranks too (each rank's output is a copy of
    the sum). torch.distributed.nn.functional.all_reduce does the same and is deprecated as of torch 2.13;
    the functional collectives' replacement is not differentiable."""

    @staticmethod
    def forward(ctx, x):
        y = x.detach().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(g)
        return g



class _RingShift(torch.autograd.Function):
    """Forward: send this block to rank+1, receive rank-1's. Backward: the gradient goes the other way."""

    @staticmethod
    def forward(ctx, x, recv_shape):
        rank, world = dist.get_rank(), dist.get_world_size()
        ctx.shape = tuple(x.shape)
        return _exchange(x, (rank + 1) % world, (rank - 1) % world, recv_shape, "kv")

    @staticmethod
    def backward(ctx, g):
        rank, world = dist.get_rank(), dist.get_world_size()
        return _exchange(g, (rank - 1) % world, (rank + 1) % world, ctx.shape, "grad"), None


class _Anchor(torch.autograd.Function):
    """out unchanged; `blocks` get zero gradients. Ties every received block to the output so that
    backward reaches every ring shift on every rank (a rank that skipped a hidden block would otherwise
    skip that shift's backward and leave its neighbours waiting)."""

    @staticmethod
    def forward(ctx, out, *blocks):
        ctx.shapes = [(b.shape, b.dtype) for b in blocks]
        return out.clone()

    @staticmethod
    def backward(ctx, g):
        return (g, *(torch.zeros(s, dtype=d) for s, d in ctx.shapes))
