"""Joining a split across processes: every rank joins, plans the same split
and loads its own stage's tensors (the rest stay shapes on the meta device)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...conversations import HostMemory
from ...errors import StrataError
from ...files import GGUFFile, Placement, SplitError, parse_devices
from ..pipeline import StagePlan, free_device_bytes, plan_split
from .common import LAUNCH_ENV, SETUP_TIMEOUT_S, StageLost, first_line
from .wire import Wire, open_wire


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
        missing = [k for k in LAUNCH_ENV if k not in os.environ]
        if missing:
            raise StrataError(f"a split across processes needs {', '.join(missing)} in the environment; "
                              f"launch it with torchrun --nproc-per-node N ...")
        try:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:  # DistStoreError is a RuntimeError
            raise StageLost(f"rank {os.environ['RANK']} could not join the job at {os.environ['MASTER_ADDR']}:"
                            f"{os.environ['MASTER_PORT']} within {timeout_s:.0f} s: {first_line(e)}") from None
    return dist.get_rank(), dist.get_world_size()


def ready(rank: int) -> None:
    """Wait until every rank has loaded its stage (a rank that died while
    loading ends the wait at once)."""
    try:
        dist.barrier()
    except RuntimeError as e:
        raise StageLost(f"rank {rank}: another rank failed while loading ({first_line(e)}); "
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


@dataclass
class JoinedStage:
    """This rank's part of the job: the file, the plan (the same on every
    rank), the plain model with only this rank's tensors loaded, the wire."""

    rank: int
    gguf: GGUFFile
    stages: list[StagePlan]
    model: nn.Module
    wire: "Wire"


def join_stage(path, config, memory: HostMemory | None = None, rank0: bool = False) -> JoinedStage:
    """What every rank does to start, in the same order (the collectives in
    it must match): join, plan, load this rank's tensors (every other tensor
    stays on the meta device: no bytes), open the wire."""
    from ...files import check_device, default_model_path
    from ...models import build_model, open_model

    rank, world = join()
    if rank0 and rank != 0:
        raise StrataError(f"load(distributed=True) runs on rank 0; rank {rank} runs strata_runtime.split.follow()")
    if not rank0 and rank == 0:
        raise StrataError("follow() runs the ranks other than 0; rank 0 calls load(..., distributed=True)")
    opened = open_model(path if path is not None else default_model_path(config.cache_dir, progress=config.progress))
    stages = plan_ranks(opened.gguf, config, rank, world, memory)
    check_device(stages[rank].device)
    model = build_model(opened, Placement.of_stages(stages, stage=rank), config.dtype, config.progress,
                        f"loading {opened.gguf.path.name} (rank {rank})")
    return JoinedStage(rank, opened.gguf, stages, model, open_wire(stages, rank, config.rank_timeout_s))
