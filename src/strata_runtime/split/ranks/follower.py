"""The ranks other than 0 of a split across processes: each runs its layers on command."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...faults import is_out_of_memory
from ...models import finish
from ...state import KVCache, store_fields
from ..pipeline import StagePlan
from .common import IDLE_WAIT, StageLost, first_line
from .setup import join_stage, ready
from .wire import Wire, as_bytes

log = logging.getLogger(__name__)


class Follower:
    """A rank other than 0: its layers (and, on the last rank, the final norm
    and output head), and a twin of each of rank 0's caches, run on command.

    Invariant: ``caches[id]`` holds, for this rank's layers, the rows rank
    0's cache ``id`` holds for them; its ``length`` is set from each
    ``forward`` command (rank 0 owns the bookkeeping)."""

    def __init__(self, model: nn.Module, stages: list[StagePlan], rank: int, wire: "Wire"):
        self.stages = stages
        self.rank = rank
        self.last = rank == len(stages) - 1
        self.device = torch.device(stages[rank].device)
        self.model = model  # its tensors outside this rank's stage are shapes on the meta device
        self.mine = stages[rank].layers
        self.wire = wire
        self.caches: dict[int, KVCache] = {}
        self._bounce: torch.Tensor | None = None  # a GPU rank's host buffer for copies (``_bounce_for``)

    def run(self) -> None:
        """Serve commands until rank 0 says stop; ``StageLost`` when it is gone."""
        with torch.inference_mode():
            while True:
                cmd = self.wire.recv_obj(self.rank - 1, IDLE_WAIT)
                op = cmd["op"]
                if op == "forward":
                    self._forward(cmd)
                    continue
                if not self.last:
                    self.wire.send_obj(cmd, self.rank + 1)
                if op == "stop":
                    return
                if op == "new_cache":
                    self.caches[cmd["id"]] = self.model.new_cache(cmd["max_tokens"], cmd["kv"])
                elif op == "free_cache":
                    self.caches.pop(cmd["id"], None)
                elif op in ("read_parts", "write_parts") and cmd["stage"] == self.rank:
                    self._parts(cmd)

    def _forward(self, cmd: dict[str, Any]) -> None:
        error, out_of_memory = cmd.get("error"), cmd.get("out_of_memory", False)
        x = None
        if error is None:
            x = self.wire.recv_tensor((cmd["tokens"], self.model.hidden_size), getattr(torch, cmd["dtype"]),
                                      self.rank - 1)
            try:
                # Each host resolves dtype="auto" for its own CPU: the stream arrives in the sender's dtype.
                x = self._run_layers(cmd, x.to(self.device, self.model.activations))
            except Exception as e:  # reported to rank 0, which raises it into the request
                log.exception("rank %d: forward failed", self.rank)
                error = f"{type(e).__name__}: {first_line(e)}"
                out_of_memory = is_out_of_memory(e)
        if not self.last:
            self.wire.send_obj({**cmd, "error": error, "out_of_memory": out_of_memory} if error else cmd, self.rank + 1)
            if error is None:
                self.wire.send_tensor(x, self.rank + 1)
        elif error:
            self.wire.send_obj({"error": error, "out_of_memory": out_of_memory}, 0)
        else:
            self.wire.send_obj({"ok": True, "shape": list(x.shape)}, 0)
            self.wire.send_tensor(x, 0)

    def _run_layers(self, cmd: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        cache = self.caches[cmd["id"]]
        start, t = cmd["start"], cmd["tokens"]
        cache.length = start
        positions = torch.arange(start, start + t, device=self.device)
        for i in self.mine:
            x = self.model.layers[i](x, positions, cache)
        if not self.last:
            cache.advance(t)
            return x
        return finish(self.model, x, cache, cmd["last_only"])

    def _bounce_for(self, sizes: list[list[int]]) -> torch.Tensor:
        """The host buffer a GPU rank's rows pass through (gloo sends host
        memory): one chunk (a page of rank 0's pool) at a time, so it is
        reserved once, at the first copy, at the pool's page size."""
        need = max((s for chunk in sizes for s in chunk), default=0)
        if self._bounce is None or self._bounce.numel() < need:
            self._bounce = torch.empty(need, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._bounce

    def _parts(self, cmd: dict[str, Any]) -> None:
        """Send or receive this rank's rows of a snapshot, chunked as rank 0's
        pages are; a GPU rank's rows pass through one reserved host buffer."""
        reading = cmd["op"] == "read_parts"
        try:
            cache = self.caches[cmd["id"]]
            rows = [(as_bytes(store_fields(cache.stores[layer])[name][slot:slot + n]), sizes)
                    for layer, name, slot, n, sizes in cmd["pieces"]]
            bounce = None if self.device.type == "cpu" else self._bounce_for([s for _, s in rows])
        except Exception as e:
            self._refuse_parts(cmd, e)
            return
        if reading:
            self.wire.send_obj({"ok": True}, 0)
        error = None
        for flat, sizes in rows:
            at = 0
            for size in sizes:
                piece = flat[at:at + size]
                at += size
                if bounce is None:
                    (self.wire.send_bytes if reading else self.wire.recv_bytes)(piece, 0)
                    continue
                # The bytes cross whatever the device copy did, so rank 0 stays in step.
                host = bounce[:size]
                if reading:
                    error = error or self._device_copy(host, piece)
                    self.wire.send_bytes(host, 0)
                else:
                    self.wire.recv_bytes(host, 0)
                    error = error or self._device_copy(piece, host)
        if not reading:
            self.wire.send_obj({"ok": True} if error is None else self._error(error), 0)
        elif error is not None:
            # Rank 0 has read the (partly stale) bytes; a device that failed a copy must not go on.
            raise error

    def _device_copy(self, dst: torch.Tensor, src: torch.Tensor) -> BaseException | None:
        """``dst.copy_(src)`` between the device and the host buffer; its failure, logged, or None."""
        try:
            dst.copy_(src)
        except Exception as e:
            log.exception("rank %d: copying its part of a snapshot failed", self.rank)
            return e
        return None

    @staticmethod
    def _error(e: BaseException) -> dict[str, Any]:
        return {"error": f"{type(e).__name__}: {first_line(e)}", "out_of_memory": is_out_of_memory(e)}

    def _refuse_parts(self, cmd: dict[str, Any], e: BaseException) -> None:
        self.wire.send_obj(self._error(e), 0)
        if cmd["op"] == "write_parts":  # rank 0 sends the bytes regardless: take them
            sink = torch.empty(max((s for *_, sizes in cmd["pieces"] for s in sizes), default=0), dtype=torch.uint8)
            for *_, sizes in cmd["pieces"]:
                for size in sizes:
                    self.wire.recv_bytes(sink[:size], 0)


def follow(path=None, **options: Any) -> int:
    """Run this rank's stage until rank 0 stops the job (0) or is lost (1).
    Options as ``load()``; every rank must be given the same ones."""
    from ...config import EngineConfig

    config = EngineConfig.from_options({**options, "distributed": True})
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    stage = join_stage(path, config)
    rank, stages = stage.rank, stage.stages
    follower = Follower(stage.model, stages, rank, stage.wire)
    del stage  # the follower keeps only its layers (and, last, the norm and head)
    ready(rank)
    log.info("rank %d: serving layers %d-%d on %s", rank, stages[rank].layers.start, stages[rank].layers.stop - 1,
             stages[rank].device)
    try:
        follower.run()
    except StageLost as e:
        log.error("rank %d: stopping: %s", rank, e)
        return 1
    finally:
        dist.destroy_process_group()
    return 0
