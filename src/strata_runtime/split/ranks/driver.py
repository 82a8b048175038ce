"""Rank 0 of a split across processes: the engine's model, driving the others."""

from __future__ import annotations

import atexit
import itertools
import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...faults import RankFailed
from ...state import KVCache
from ..pipeline import StagePlan
from .common import StageLost
from .wire import Wire

log = logging.getLogger(__name__)


class RankPipeline(nn.Module):
    """Rank 0's model in a split across processes, through the model
    interface: the embedding and the first stage's layers here; the hidden
    state then goes to rank 1, and the logits come back from the last rank.

    Invariant: every cache ``new_cache`` returns has a twin with the same id
    on every follower until it is freed; layers of other ranks have meta
    stores here, typed as their ranks store them.
    """

    def __init__(self, model: nn.Module, stages: list[StagePlan], wire: "Wire"):
        super().__init__()
        self.stages = stages
        self.model = model
        self.wire = wire
        self.mine = stages[0].layers
        self._cache_ids = itertools.count(1)
        self._freed: list[int] = []  # caches rank 0 dropped; their twins go with the next command
        self._stopped = False
        atexit.register(self.close)

    def forward(self, tokens, positions, cache, last_only: bool = False) -> torch.Tensor:
        x = self.model.embed(tokens)
        for i in self.mine:
            x = self.model.layers[i](x, positions, cache)
        self.command({"op": "forward", "id": cache.remote_id, "start": int(positions[0]), "tokens": int(x.shape[0]),
                      "last_only": last_only, "dtype": str(x.dtype).removeprefix("torch.")})
        self.wire.send_tensor(x, 1)
        answer = self.reply(self.last_rank, "the split's forward failed on ")
        logits = self.wire.recv_tensor(answer["shape"], torch.float32, self.last_rank)
        cache.advance(x.shape[0])
        return logits.to(x.device)

    @property
    def device(self) -> torch.device:
        return torch.device(self.stages[0].device)

    @property
    def placement(self):
        return self.model.placement

    @property
    def backends(self):
        return self.model.backends

    @property
    def compute_path(self):
        return self.model.compute_path

    @property
    def last_rank(self) -> int:
        return len(self.stages) - 1

    def state_spec(self):
        return self.model.state_spec()

    def is_remote(self, stage: int) -> bool:
        return stage != 0

    # --- commands ---------------------------------------------------------------

    def command(self, cmd: dict[str, Any]) -> None:
        """Send ``cmd`` down the chain (after any pending frees)."""
        if self.wire.lost is not None:
            raise self.wire.lost
        if self._stopped:
            raise StageLost("the split across processes was stopped; load the model again")
        while self._freed:
            self.wire.send_obj({"op": "free_cache", "id": self._freed.pop()}, 1)
        self.wire.send_obj(cmd, 1)

    def reply(self, rank: int, context: str = "") -> dict[str, Any]:
        """A follower's answer to the last command; its error raised as
        ``RankFailed`` (out-of-memory there is an optimization's skip here,
        anything else ends the engine, as a local failure would)."""
        answer = self.wire.recv_obj(rank)
        if "error" in answer:
            raise RankFailed(f"{context}rank {rank}: {answer['error']}", bool(answer.get("out_of_memory")))
        return answer

    def close(self) -> None:
        """End the job: every follower stops. Safe to call more than once."""
        if self._stopped or self.wire.lost is not None or not dist.is_initialized():
            return
        try:
            self.command({"op": "stop"})
        except StageLost as e:
            log.warning("stopping the other ranks: %s", e)
        self._stopped = True

    # --- caches -------------------------------------------------------------------

    def new_cache(self, max_tokens: int, kv: str = "f16") -> KVCache:
        cache = self.model.new_cache(max_tokens, kv)
        cache.remote = self
        cache.remote_id = next(self._cache_ids)
        self.command({"op": "new_cache", "id": cache.remote_id, "max_tokens": max_tokens, "kv": kv})
        weakref.finalize(cache, self._freed.append, cache.remote_id)
        return cache

    def copy_stage(self, cache: KVCache, stage: int, pieces: list, lease, to_pool: bool) -> None:
        """Move one stage's part between its rank's cache and ``lease``, in
        chunks that fall on the lease's pages (received or sent in place)."""
        chunks = [[v.numel() for v in lease.byte_views(at, nbytes)] for *_, at, nbytes in pieces]
        wire_pieces = [[layer, name, slot, n, sizes] for (layer, name, slot, n, _, _), sizes in zip(pieces, chunks)]
        op = "read_parts" if to_pool else "write_parts"
        self.command({"op": op, "id": cache.remote_id, "stage": stage, "pieces": wire_pieces})
        if to_pool:
            self.reply(stage)  # the rank has its rows ready
        for *_, at, nbytes in pieces:
            for view in lease.byte_views(at, nbytes):
                if to_pool:
                    self.wire.recv_bytes(view, stage)
                else:
                    self.wire.send_bytes(view, stage)
        if not to_pool:
            self.reply(stage)  # the rank has written its rows
