"""Layer-split pipelines: which layers each device runs.

A model that does not fit one device is split by layers: the first layers on
one device, the rest on the next, the hidden state handed over between them.
The embeddings live with the first stage and the output head with the last.
This module plans a split from the GGUF metadata alone (no weight is read),
so bad split arguments fail before anything is loaded.

Here: planning, and running a split on several devices of one process
(``Pipeline``). Across processes and hosts, one stage per
``torch.distributed`` rank: ``ranks``, on the same plans.

``layer_split`` lists the first layer of every stage after the first
(``[9]`` on two devices: layers 0-8, then 9-end), or is ``"auto"``: stages
sized by each device's free memory after a per-device reserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..conversations import HostMemory, MiB
from ..files import GGUFFile, SplitError, check_split, parse_devices, parse_layer_split, resolve
from ..models import finish, open_model
from ..state import KVCache, LayerState, f16_storage_bytes, kv_bytes

DEFAULT_RESERVE = 1024 * MiB  # left free on every device by "auto"


@dataclass(frozen=True)
class StagePlan:
    """One stage: its device, its layers, and what it holds.

    Invariant: the stages of a plan cover layers ``0..n_layers-1`` in order,
    each at least one layer; ``weight_bytes`` counts the embedding table on
    the first stage and the output head (and final norm) on the last."""

    device: str
    layers: range
    weight_bytes: int
    kv_bytes: int  # KV of the planned sequences at the planned context, in the planned format


@dataclass(frozen=True)
class _ModelBytes:
    per_layer: list[int]
    first_extra: int  # token embeddings
    last_extra: int  # output head (the tied table again when there is no output.weight) and final norm
    spec: list[LayerState]  # the state each layer keeps


def _model_bytes(gguf: GGUFFile) -> _ModelBytes:
    infos = {t.name: t for t in gguf.tensor_infos()}
    per_layer = [0] * gguf.config.block_count
    for name, info in infos.items():
        if name.startswith("blk."):
            per_layer[int(name.split(".")[1])] += info.nbytes
    embed = infos["token_embd.weight"].nbytes
    head = infos["output.weight"].nbytes if "output.weight" in infos else embed
    norm = infos["output_norm.weight"].nbytes if "output_norm.weight" in infos else 0
    return _ModelBytes(per_layer, embed, head + norm, open_model(gguf).state_spec)


def plan_split(gguf: GGUFFile, devices: str | Sequence[str], layer_split: str | Sequence[int] | None,
               context: int, kv: str = "f16", reserve_bytes: int = DEFAULT_RESERVE,
               memory: HostMemory | None = None, free_bytes: Sequence[int] | None = None,
               dtype: str = "auto", sequences: int = 1) -> list[StagePlan]:
    """The stages for ``devices`` and ``layer_split`` (see the module docstring),
    each stage's KV counted for ``sequences`` sequences of ``context`` (the
    engine's pool holds ``parallel`` of them).
    ``free_bytes``: each device's free memory when measured elsewhere (each
    rank of a split across processes measures its own). ``dtype``: the
    activations, which decide how f16 KV is stored on a CPU stage."""
    devices = parse_devices(devices)
    kv_float = resolve(dtype, devices[0]).kv_float
    split = parse_layer_split(layer_split)
    mb = _model_bytes(gguf)
    n = len(mb.per_layer)
    if split is None:
        split = [] if len(devices) == 1 else "auto"
    if split == "auto":
        if len(devices) == 1:
            boundaries = []
        else:
            free = list(free_bytes) if free_bytes is not None else free_device_bytes(devices, memory or HostMemory())
            boundaries = _auto_boundaries(mb, devices, reserve_bytes, free)
    else:
        boundaries = check_split(n, devices, split)
    edges = [0, *boundaries, n]
    stages = []
    for i, device in enumerate(devices):
        layers = range(edges[i], edges[i + 1])
        weights = sum(mb.per_layer[j] for j in layers)
        weights += (mb.first_extra if i == 0 else 0) + (mb.last_extra if i == len(devices) - 1 else 0)
        float_bytes = f16_storage_bytes(device, kv_float)
        stages.append(StagePlan(device, layers, weights, sequences * kv_bytes([mb.spec[j] for j in layers], context,
                                                                              kv, float_bytes)))
    return stages


def free_device_bytes(devices: list[str], memory: HostMemory) -> list[int]:
    """Free memory per device; CPU stages share the host's headroom."""
    cpus = sum(1 for d in devices if torch.device(d).type == "cpu")
    host = None
    out = []
    for d in devices:
        if torch.device(d).type == "cuda":
            if not torch.cuda.is_available():
                raise SplitError(f"device {d!r} was asked for but torch sees no CUDA device")
            out.append(torch.cuda.mem_get_info(torch.device(d))[0])
        else:
            if host is None:
                headroom = memory.headroom()
                if not headroom.known:
                    raise SplitError(f"layer_split='auto' needs the host's free memory: {headroom.reason}; "
                                     f"give explicit first layers instead")
                host = headroom.bytes
            out.append(host // cpus)
    return out


def _auto_boundaries(mb: _ModelBytes, devices: list[str], reserve: int, free: list[int]) -> list[int]:
    """Cut where each stage's share of the weights matches its share of the free memory."""
    n, k = len(mb.per_layer), len(devices)
    if k > n:
        raise SplitError(f"{k} devices but the model has only {n} layers; give at most {n} devices")
    room = [max(0, f - reserve) for f in free]
    total = sum(mb.per_layer) + mb.first_extra + mb.last_extra
    if sum(room) < total:
        raise SplitError(f"the weights need {total / MiB:.0f} MiB but the devices have {sum(room) / MiB:.0f} MiB "
                         f"free after a {reserve / MiB:.0f} MiB reserve each; add devices or free memory")
    boundaries, used, stage, budget = [], mb.first_extra, 0, total * room[0] / sum(room)
    for layer in range(n):
        left_layers, left_stages = n - layer, k - stage - 1
        # Cut when this stage is full, but never leave a later stage without a layer.
        must_cut = left_layers == left_stages
        if stage < k - 1 and layer > (boundaries[-1] if boundaries else 0) and (
                used + mb.per_layer[layer] > budget or must_cut):
            boundaries.append(layer)
            stage += 1
            budget += total * room[stage] / sum(room)
        used += mb.per_layer[layer]
    return boundaries


# --- running a split in one process ---------------------------------------------


class Pipeline(nn.Module):
    """A model run as stages on several devices of one process, through the
    model interface: the embedding on the first stage, each layer on its
    stage's device (the hidden state handed over at each boundary), the
    head on the last. The loader placed every tensor (``loader.Placement``);
    the layers are moved here only for their buffers (RoPE tables).

    Invariant: layer ``i``'s weights and KV store live on ``layer_devices[i]``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.placement = model.placement
        self.layer_devices = self.placement.layer_devices
        if len(self.layer_devices) != len(model.layers):
            raise SplitError(f"the plan covers {len(self.layer_devices)} layers; the model has {len(model.layers)}")
        for layer, device in zip(model.layers, self.layer_devices):
            layer.to(device)

    def forward(self, tokens, positions, cache, last_only: bool = False) -> torch.Tensor:
        x = self.model.embed(tokens.to(self.device))
        for layer, device in zip(self.model.layers, self.layer_devices):
            x = layer(x.to(device), positions.to(device), cache)
        return finish(self.model, x.to(self.placement.last), cache, last_only)

    @property
    def backends(self):
        return self.model.backends

    @property
    def compute_path(self):
        return self.model.compute_path

    @property
    def device(self) -> torch.device:
        """Where token ids are made (the first stage); logits come from the last."""
        return self.placement.first

    def state_spec(self):
        return self.model.state_spec()

    def new_cache(self, max_tokens: int, kv: str) -> KVCache:
        return self.model.new_cache(max_tokens, kv)
