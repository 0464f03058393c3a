"""Point-to-point exchange between the ranks of the ring (raw bytes, so that every dtype travels unchanged)
and the bytes this process has sent, per kind of message (_SENT, reset per job by run_in_group)."""

from __future__ import annotations

import torch
import torch.distributed as dist

# Bytes this process has sent on the ring (sequence sharding): keys and values, key ids, gradients.
_SENT = {"kv": 0, "ids": 0, "grad": 0}
_TAGS = {"kv": 1, "ids": 2, "grad": 3}  # a message of each kind can be in flight at once: each has its tag


def _start_exchange(x: torch.Tensor, send_to: int, recv_from: int, recv_shape, counter: str):
    """Start sending x to one rank and receiving a tensor of recv_shape (x's dtype) from another; raw bytes
    on the wire, so that every dtype (bfloat16 too) travels unchanged. -> what _finish_exchange takes."""
    out = torch.empty(recv_shape, dtype=x.dtype)
    send = x.detach().contiguous().reshape(-1).view(torch.uint8)
    recv = out.reshape(-1).view(torch.uint8)
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, send_to, tag=_TAGS[counter]))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, recv_from, tag=_TAGS[counter]))
    _SENT[counter] += send.numel()
    return out, send, (dist.batch_isend_irecv(ops) if ops else [])


def _finish_exchange(pending) -> torch.Tensor:
    out, _send, requests = pending  # the send buffer stays referenced until its request is done
    for request in requests:
        request.wait()
    return out


def _exchange(x: torch.Tensor, send_to: int, recv_from: int, recv_shape, counter: str) -> torch.Tensor:
    return _finish_exchange(_start_exchange(x, send_to, recv_from, recv_shape, counter))
