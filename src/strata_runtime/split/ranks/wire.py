"""The wire between the ranks: gloo over TCP for commands and snapshot bytes,
NCCL for hidden states and logits when every stage has a GPU of its own."""

from __future__ import annotations

import datetime
import json
import socket
from typing import Any

import torch
import torch.distributed as dist

from ..pipeline import StagePlan
from .common import StageLost, first_line


def open_wire(stages: list[StagePlan], rank: int, timeout_s: float) -> "Wire":
    """The messages of this job. Every rank calls this at the same point
    (it is collective). When every stage is on its own GPU, the hidden states
    and logits go GPU to GPU over NCCL; otherwise, and always for commands
    and snapshot parts (rank 0's pool is host memory), over gloo."""
    wire = Wire(stages, timeout_s)
    places = [None] * len(stages)
    device = torch.device(stages[rank].device)
    dist.all_gather_object(places, (socket.gethostname(), str(device)))
    if device.type == "cuda" and all(torch.device(d).type == "cuda" for _, d in places) \
            and len(set(places)) == len(places):
        torch.cuda.set_device(device)
        wire.nccl = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=timeout_s))
        wire.device = device
    return wire


class Wire:
    """Messages between ranks: JSON objects and raw tensor bytes, with errors
    turned into ``StageLost`` naming the rank. Tensors (hidden states and
    logits) go over ``nccl`` when ``open_wire`` set it up.

    With NCCL, a rank that dies between a command and its tensor is caught by
    NCCL's own watchdog after the rank timeout (which ends the process), not
    by ``StageLost``; commands and replies, which come first, still raise it."""

    def __init__(self, stages: list[StagePlan], timeout_s: float):
        self.stages = stages
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.lost: StageLost | None = None  # set at the first failure; the wire is dead after it
        self.nccl = None  # a process group for GPU-to-GPU tensors, or None
        self.device = torch.device("cpu")  # where received tensors land

    def _lost(self, peer: int, e: Exception) -> StageLost:
        self.lost = self._describe_loss(peer, e)
        return self.lost

    def _describe_loss(self, peer: int, e: Exception) -> StageLost:
        s = self.stages[peer]
        what = f"rank {peer} (stage {peer}, layers {s.layers.start}-{s.layers.stop - 1} on {s.device})"
        text = first_line(e)
        if "Timed out" in text or "timed out" in text:
            return StageLost(f"{what} did not answer within {self.timeout.total_seconds():.0f} s ({text}); "
                             f"the split cannot go on without it: restart the job")
        return StageLost(f"{what} is gone ({text}); the split cannot go on without it: restart the job")

    def send_bytes(self, t: torch.Tensor, dst: int) -> None:
        try:
            dist.isend(as_bytes(t), dst).wait(self.timeout)
        except RuntimeError as e:
            raise self._lost(dst, e) from None

    def recv_bytes(self, into: torch.Tensor, src: int, timeout: datetime.timedelta | None = None) -> None:
        try:
            dist.irecv(as_bytes(into), src).wait(timeout or self.timeout)
        except RuntimeError as e:
            raise self._lost(src, e) from None

    def send_obj(self, obj: dict[str, Any], dst: int) -> None:
        data = json.dumps(obj).encode()
        self.send_bytes(torch.tensor([len(data)], dtype=torch.int64), dst)
        self.send_bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)

    def recv_obj(self, src: int, timeout: datetime.timedelta | None = None) -> dict[str, Any]:
        size = torch.zeros(1, dtype=torch.int64)
        self.recv_bytes(size, src, timeout)
        data = torch.empty(int(size), dtype=torch.uint8)
        self.recv_bytes(data, src, timeout)
        return json.loads(bytes(data.numpy()))

    def send_tensor(self, t: torch.Tensor, dst: int) -> None:
        if self.nccl is not None:
            dist.send(t.detach().to(self.device).contiguous(), dst, group=self.nccl)
            return
        self.send_bytes(t.detach().cpu().contiguous(), dst)

    def recv_tensor(self, shape, dtype: torch.dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        if self.nccl is not None:
            dist.recv(t, src, group=self.nccl)
            return t
        self.recv_bytes(t, src)
        return t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes (gloo moves bytes; bfloat16 and the
    like need not be a type it knows)."""
    if not t.is_contiguous():
        raise ValueError("ranks exchange contiguous tensors only")
    return t.reshape(-1).view(torch.uint8)
