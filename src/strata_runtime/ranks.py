"""Layer-split stages across processes: one stage per ``torch.distributed`` rank.

Launched by ``torchrun`` (or anything that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``). Rank 0 runs the engine: it tokenizes,
samples, keeps the conversation cache and serves; its model is the first
stage. Every other rank runs ``follow()``: it loads only the weights of its
own layers (the others stay shapes on the meta device) and runs them when
rank 0 says so. Every rank plans the same split from the GGUF metadata, so a
bad split fails on every rank before any weight is read.

The wire: gloo over TCP, and NCCL for the hidden states and logits when
every stage has a GPU of its own (``open_wire``). Rank 0 drives. Each command travels the chain
0 -> 1 -> ... -> last, every follower acting on it and passing it on, so a
follower only ever listens to its predecessor. Replies go straight to rank 0,
which waits for each before it sends the next command, so messages never
interleave. Commands are small JSON objects:

- ``new_cache`` / ``free_cache``: a follower keeps a twin, over its own
  layers, of every cache rank 0 makes.
- ``forward``: the hidden state ``[T, hidden]`` follows the command; each
  follower runs its layers and passes the state on; the last applies the
  final norm and the output head and sends the logits to rank 0.
- ``read_parts`` / ``write_parts``: one stage's part of a snapshot or
  checkpoint, moved between that rank's cache and rank 0's staging pool. The
  bytes are received into (or sent from) the pool's pages and the cache's
  rows directly: parking allocates no host memory (ARCHITECTURE's memory
  rule), so the parked parts of every stage live in rank 0's pool.
- ``stop``: the job is over.

Failure. A follower that fails a command (an error in its layers, a bad
part) reports it to rank 0 and stays up. A rank that dies closes its
connections; one that hangs stops answering: either way rank 0's next wait
fails at once or after ``rank_timeout_s`` and raises ``StageLost``, which
names the rank. A follower whose predecessor is gone stops with an error.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import json
import logging
import os
import socket
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from strata_kernels import KVStore

from .errors import StrataError
from .gguf_file import GGUFFile
from .kv_cache import KVCache, store_fields
from .memory import HostMemory
from .pipeline import SplitError, StagePlan, free_device_bytes, parse_devices, plan_split

log = logging.getLogger(__name__)

DEFAULT_RANK_TIMEOUT_S = 120.0
# Joining the job, planning and loading wait for the slowest rank to load its
# weights: far longer than one step may take. Steps use the rank timeout.
SETUP_TIMEOUT_S = 1800.0
# A follower waits this long for rank 0's next command: a server may sit idle
# for days; rank 0 dying still ends the wait at once (its sockets close).
_IDLE_WAIT = datetime.timedelta(days=365)
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class StageLost(StrataError):
    """A rank of a split across processes died or stopped answering: the job
    cannot go on without it."""


def launched_with_ranks() -> bool:
    """Whether this process is one of several ranks (``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def join(timeout_s: float = SETUP_TIMEOUT_S) -> tuple[int, int]:
    """Join the job's process group (gloo) from the launcher's environment;
    return (rank, world size). ``timeout_s`` bounds the setup collectives
    (joining, planning, ``ready``), not the steps."""
    if not dist.is_initialized():
        missing = [k for k in _LAUNCH_ENV if k not in os.environ]
        if missing:
            raise StrataError(f"a split across processes needs {', '.join(missing)} in the environment; "
                              f"launch it with torchrun --nproc-per-node N ...")
        try:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:  # DistStoreError is a RuntimeError
            raise StageLost(f"rank {os.environ['RANK']} could not join the job at {os.environ['MASTER_ADDR']}:"
                            f"{os.environ['MASTER_PORT']} within {timeout_s:.0f} s: {_first_line(e)}") from None
    return dist.get_rank(), dist.get_world_size()


def ready(rank: int) -> None:
    """Wait until every rank has loaded its stage (a rank that died while
    loading ends the wait at once)."""
    try:
        dist.barrier()
    except RuntimeError as e:
        raise StageLost(f"rank {rank}: another rank failed while loading ({_first_line(e)}); "
                        f"see its log, then restart the job") from None


def plan_ranks(gguf: GGUFFile, config, rank: int, world: int, memory: HostMemory | None = None) -> list[StagePlan]:
    """The split, one stage per rank; the same on every rank. ``"auto"``
    gathers each rank's own free memory first (every rank must call this)."""
    devices = parse_devices(config.devices) if config.devices else [config.device] * world
    if len(devices) != world:
        raise SplitError(f"{len(devices)} devices were given but the job has {world} ranks; "
                         f"give one device per rank in --devices (e.g. {','.join(['cpu'] * world)})")
    context = min(config.context_length, gguf.config.context_length)
    split = config.layer_split if config.layer_split is not None else "auto"
    free = None
    if split == "auto":
        mine = free_device_bytes([devices[rank]], memory or HostMemory())[0]
        # Ranks sharing a host share its memory.
        mine //= int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torch.device(devices[rank]).type == "cpu" else 1
        free = [0] * world
        dist.all_gather_object(free, mine)
    return plan_split(gguf, devices, split, context, config.kv, memory=memory, free_bytes=free, dtype=config.dtype)


def tensor_owners(name: str, stages: list[StagePlan], tied_head: bool) -> set[int]:
    """The stages that hold a GGUF tensor: a layer's tensors its stage; the
    token table the first stage (and the last, when the head is tied to it);
    the final norm and output head the last."""
    last = len(stages) - 1
    if name.startswith("blk."):
        layer = int(name.split(".")[1])
        return {next(i for i, s in enumerate(stages) if layer in s.layers)}
    if name.startswith("token_embd"):
        return {0, last} if tied_head else {0}
    return {last}


@dataclass
class JoinedStage:
    """This rank's part of the job: the file, the plan (the same on every
    rank), the plain model with only this rank's tensors loaded, the wire."""

    rank: int
    gguf: GGUFFile
    stages: list[StagePlan]
    model: nn.Module
    wire: "_Wire"


def join_stage(path, config, memory: HostMemory | None = None, rank0: bool = False) -> JoinedStage:
    """What every rank does to start, in the same order (the collectives in
    it must match): join, plan, load this rank's tensors (every other tensor
    stays on the meta device: no bytes), open the wire."""
    from .default_model import default_model_path
    from .engine import DTYPES, check_device
    from .models import build_model, model_module

    rank, world = join()
    if rank0 and rank != 0:
        raise StrataError(f"load(distributed=True) runs on rank 0; rank {rank} runs strata_runtime.ranks.follow()")
    if not rank0 and rank == 0:
        raise StrataError("follow() runs the ranks other than 0; rank 0 calls load(..., distributed=True)")
    gguf = GGUFFile.open(path if path is not None else default_model_path(config.cache_dir, progress=config.progress))
    module = model_module(gguf.architecture, gguf.path)
    stages = plan_ranks(gguf, config, rank, world, memory)
    device = torch.device(stages[rank].device)
    check_device(str(device))
    tied = "output.weight" not in gguf.tensor_names()
    # The vocabulary size shapes the token table; read it from the table itself.
    args = module.ModelArgs.from_config(gguf.config, gguf.tensor("token_embd.weight").shape[0])
    model = build_model(gguf, module, args, DTYPES[config.dtype],
                        lambda name: device if rank in tensor_owners(name, stages, tied) else "meta",
                        config.progress, f"loading {gguf.path.name} (rank {rank})")
    return JoinedStage(rank, gguf, stages, model, open_wire(stages, rank, config.rank_timeout_s))


# --- the wire ---------------------------------------------------------------------


def open_wire(stages: list[StagePlan], rank: int, timeout_s: float) -> "_Wire":
    """The messages of this job. Every rank calls this at the same point
    (it is collective). When every stage is on its own GPU, the hidden states
    and logits go GPU to GPU over NCCL; otherwise, and always for commands
    and snapshot parts (rank 0's pool is host memory), over gloo."""
    wire = _Wire(stages, timeout_s)
    places = [None] * len(stages)
    device = torch.device(stages[rank].device)
    dist.all_gather_object(places, (socket.gethostname(), str(device)))
    if device.type == "cuda" and all(torch.device(d).type == "cuda" for _, d in places) \
            and len(set(places)) == len(places):
        torch.cuda.set_device(device)
        wire.nccl = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=timeout_s))
        wire.device = device
    return wire


class _Wire:
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
        text = _first_line(e)
        if "Timed out" in text or "timed out" in text:
            return StageLost(f"{what} did not answer within {self.timeout.total_seconds():.0f} s ({text}); "
                             f"the split cannot go on without it: restart the job")
        return StageLost(f"{what} is gone ({text}); the split cannot go on without it: restart the job")

    def send_bytes(self, t: torch.Tensor, dst: int) -> None:
        try:
            dist.isend(_as_bytes(t), dst).wait(self.timeout)
        except RuntimeError as e:
            raise self._lost(dst, e) from None

    def recv_bytes(self, into: torch.Tensor, src: int, timeout: datetime.timedelta | None = None) -> None:
        try:
            dist.irecv(_as_bytes(into), src).wait(timeout or self.timeout)
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


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes (gloo moves bytes; bfloat16 and the
    like need not be a type it knows)."""
    if not t.is_contiguous():
        raise ValueError("ranks exchange contiguous tensors only")
    return t.reshape(-1).view(torch.uint8)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    # gloo prefixes its messages with a source location: "[.../pair.cc:553] Connection closed by peer ..."
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". This is typically")[0][:200]


# --- rank 0 -------------------------------------------------------------------------


class RankPipeline(nn.Module):
    """Rank 0's model in a split across processes: the first stage's layers
    here, the rest on the other ranks, applied from outside a plain model.

    The model's forward is unchanged: its layer list ends in a hand-off that
    sends the hidden state to rank 1, its final norm is the identity here,
    and its head receives the logits from the last rank. Invariant: every
    cache ``new_cache`` returns has a twin with the same id on every
    follower until it is freed; layers of other ranks have meta stores here.
    """

    def __init__(self, model: nn.Module, stages: list[StagePlan], wire: "_Wire"):
        super().__init__()
        self.stages = stages
        self.args = model.args
        self.wire = wire
        self.layer_stages = [i for i, s in enumerate(stages) for _ in s.layers]
        self._windows = model.attention_windows()  # read before the layers are replaced
        device = torch.device(stages[0].device)
        mine = stages[0].layers
        model.embedding = _LogitsFromLastRank(model.embedding, self)
        model.output = None  # the head is scored on the last rank, tied or not
        model.embed_scale = model.embed_scale.to(device)
        model.layers = nn.ModuleList([*(model.layers[i].to(device) for i in mine), _ToNextRank(self)])
        model.norm = nn.Identity()  # applied on the last rank
        self.model = model
        self._last_only = False
        self._cache_ids = itertools.count(1)
        self._freed: list[int] = []  # caches rank 0 dropped; their twins go with the next command
        self._stopped = False
        atexit.register(self.close)

    def forward(self, tokens, positions, cache, last_only: bool = False) -> torch.Tensor:
        self._last_only = last_only
        return self.model(tokens, positions, cache, last_only=last_only)

    @property
    def device(self) -> torch.device:
        return torch.device(self.stages[0].device)

    @property
    def last_rank(self) -> int:
        return len(self.stages) - 1

    def attention_windows(self) -> list[int | None]:
        return list(self._windows)

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

    def reply(self, rank: int) -> dict[str, Any]:
        """A follower's answer to the last command; its error raised as RuntimeError
        (a device failure: the conversation cache skips on those)."""
        answer = self.wire.recv_obj(rank)
        if "error" in answer:
            raise RuntimeError(f"rank {rank}: {answer['error']}")
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
        a = self.args
        here = torch.device(self.stages[0].device)
        devices = [here if s == 0 else torch.device("meta") for s in self.layer_stages]
        cache = KVCache(kv, self.attention_windows(), a.n_kv_heads, a.head_dim, max_tokens, devices,
                        layer_stages=self.layer_stages)
        for layer, stage in enumerate(self.layer_stages):
            if stage != 0:  # shapes and dtypes as the owning rank stores them
                cache.stores[layer] = _twin_store(cache.stores[layer], kv, a.n_kv_heads, a.head_dim,
                                                  self.stages[stage].device)
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


def _twin_store(store: KVStore, kv: str, kv_heads: int, head_dim: int, device: str) -> KVStore:
    """A meta store shaped like the one ``device`` allocates (float16 f16 on a GPU)."""
    dtype = torch.float16 if torch.device(device).type == "cuda" else None
    return KVStore.allocate(kv, store.capacity, kv_heads, head_dim, "meta", dtype)


class _ToNextRank(nn.Module):
    """The last entry of rank 0's layer list: hands the hidden state to rank 1."""

    def __init__(self, pipeline: RankPipeline):
        super().__init__()
        object.__setattr__(self, "_pipeline", pipeline)  # a back reference, not a submodule

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        p = self._pipeline
        p.command({"op": "forward", "id": cache.remote_id, "start": int(positions[0]), "tokens": int(x.shape[0]),
                   "last_only": p._last_only, "dtype": str(x.dtype).removeprefix("torch.")})
        p.wire.send_tensor(x, 1)
        return x


class _LogitsFromLastRank(nn.Module):
    """Token lookup here; the logits come back from the last rank."""

    def __init__(self, embedding: nn.Module, pipeline: RankPipeline):
        super().__init__()
        self.lookup = embedding
        object.__setattr__(self, "_pipeline", pipeline)  # a back reference, not a submodule

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lookup(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        p = self._pipeline
        try:
            answer = p.reply(p.last_rank)
        except RuntimeError as e:
            raise StrataError(f"the split's forward failed on {e}") from None
        logits = p.wire.recv_tensor(answer["shape"], torch.float32, p.last_rank)
        return logits.to(x.device)


# --- the other ranks -------------------------------------------------------------------


class Follower:
    """A rank other than 0: its layers (and, on the last rank, the final norm
    and output head), and a twin of each of rank 0's caches, run on command.

    Invariant: ``caches[id]`` holds, for this rank's layers, the rows rank
    0's cache ``id`` holds for them; its ``length`` is set from each
    ``forward`` command (rank 0 owns the bookkeeping)."""

    def __init__(self, model: nn.Module, stages: list[StagePlan], rank: int, wire: "_Wire"):
        self.stages = stages
        self.rank = rank
        self.last = rank == len(stages) - 1
        self.device = torch.device(stages[rank].device)
        self.args = model.args
        self.windows = model.attention_windows()
        self.blocks = [model.layers[i].to(self.device) for i in stages[rank].layers]
        # Only the last rank keeps the norm and the head; the rest of the model is dropped.
        self.norm = model.norm if self.last else None
        self.head = model.head if self.last else None  # the output matrix, or the token table when tied
        self.layer_stages = [i for i, s in enumerate(stages) for _ in s.layers]
        self.wire = wire
        self.caches: dict[int, KVCache] = {}

    def run(self) -> None:
        """Serve commands until rank 0 says stop; ``StageLost`` when it is gone."""
        with torch.inference_mode():
            while True:
                cmd = self.wire.recv_obj(self.rank - 1, _IDLE_WAIT)
                op = cmd["op"]
                if op == "forward":
                    self._forward(cmd)
                    continue
                if not self.last:
                    self.wire.send_obj(cmd, self.rank + 1)
                if op == "stop":
                    return
                if op == "new_cache":
                    devices = [self.device if s == self.rank else torch.device("meta") for s in self.layer_stages]
                    self.caches[cmd["id"]] = KVCache(cmd["kv"], self.windows, self.args.n_kv_heads,
                                                     self.args.head_dim, cmd["max_tokens"], devices)
                elif op == "free_cache":
                    self.caches.pop(cmd["id"], None)
                elif op in ("read_parts", "write_parts") and cmd["stage"] == self.rank:
                    self._parts(cmd)

    def _forward(self, cmd: dict[str, Any]) -> None:
        error = cmd.get("error")
        x = None
        if error is None:
            x = self.wire.recv_tensor((cmd["tokens"], self.args.hidden_size), getattr(torch, cmd["dtype"]),
                                      self.rank - 1)
            try:
                x = self._run_layers(cmd, x.to(self.device))
            except Exception as e:  # reported to rank 0, which raises it into the request
                log.exception("rank %d: forward failed", self.rank)
                error = f"{type(e).__name__}: {_first_line(e)}"
        if not self.last:
            self.wire.send_obj({**cmd, "error": error} if error else cmd, self.rank + 1)
            if error is None:
                self.wire.send_tensor(x, self.rank + 1)
        elif error:
            self.wire.send_obj({"error": error}, 0)
        else:
            self.wire.send_obj({"ok": True, "shape": list(x.shape)}, 0)
            self.wire.send_tensor(x, 0)

    def _run_layers(self, cmd: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        cache = self.caches[cmd["id"]]
        start, t = cmd["start"], cmd["tokens"]
        cache.length = start
        positions = torch.arange(start, start + t, device=self.device)
        for block in self.blocks:
            x = block(x, positions, cache)
        cache.advance(t)
        if not self.last:
            return x
        if cmd["last_only"]:
            x = x[-1:]
        return self.head.logits(self.norm(x)).float()

    def _parts(self, cmd: dict[str, Any]) -> None:
        """Send or receive this rank's rows of a snapshot, chunked as rank 0's pages are."""
        try:
            cache = self.caches[cmd["id"]]
            rows = [(store_fields(cache.stores[layer])[name][slot:slot + n], sizes)
                    for layer, name, slot, n, sizes in cmd["pieces"]]
            # A GPU rank goes through host copies: gloo sends host memory.
            host = [(r.cpu() if r.device.type != "cpu" else r, sizes) for r, sizes in rows]
        except Exception as e:
            self.wire.send_obj({"error": f"{type(e).__name__}: {_first_line(e)}"}, 0)
            if cmd["op"] == "write_parts":  # rank 0 sends the bytes regardless: take them
                for _, _, _, _, sizes in cmd["pieces"]:
                    for size in sizes:
                        self.wire.recv_bytes(torch.empty(size, dtype=torch.uint8), 0)
            return
        if cmd["op"] == "read_parts":
            self.wire.send_obj({"ok": True}, 0)
        for (row, sizes), (target, _) in zip(host, rows):
            flat = _as_bytes(row)
            at = 0
            for size in sizes:
                if cmd["op"] == "read_parts":
                    self.wire.send_bytes(flat[at:at + size], 0)
                else:
                    self.wire.recv_bytes(flat[at:at + size], 0)
                at += size
            if cmd["op"] == "write_parts" and target.device.type != "cpu":
                target.copy_(row)
        if cmd["op"] == "write_parts":
            self.wire.send_obj({"ok": True}, 0)


def follow(path=None, **options: Any) -> int:
    """Run this rank's stage until rank 0 stops the job (0) or is lost (1).
    Options as ``load()``; every rank must be given the same ones."""
    from .engine import EngineConfig

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
