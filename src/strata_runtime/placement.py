"""Where each tensor of a model lives: one device, a split in this process,
or this process's stage of a split across processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

EMBEDDING = "token_embd.weight"


@dataclass(frozen=True)
class Placement:
    """Where each tensor of a model lives.

    Invariant: ``layer_devices[i]`` runs layer ``i``, of stage
    ``layer_stages[i]``; the token table (as the embedding) is on the first
    stage's device, the final norm and output head (the token table again,
    when tied) on the last stage's. ``stage``: the one stage this process
    runs in a split across processes (every other stage's tensors are shapes
    on the meta device), or None when this process runs them all.
    """

    stage_devices: tuple[torch.device, ...]
    layer_stages: tuple[int, ...]
    stage: int | None = None

    @classmethod
    def one_device(cls, device: torch.device | str, n_layers: int) -> "Placement":
        return cls((torch.device(device),), (0,) * n_layers)

    @classmethod
    def of_stages(cls, stages: Sequence, stage: int | None = None) -> "Placement":
        """From the split planner's ``StagePlan`` list."""
        return cls(tuple(torch.device(s.device) for s in stages),
                   tuple(i for i, s in enumerate(stages) for _ in s.layers), stage)

    def stage_layers(self) -> list[range]:
        """The layers of each stage, in order."""
        return [range(self.layer_stages.index(s), len(self.layer_stages) - self.layer_stages[::-1].index(s))
                for s in range(len(self.stage_devices))]

    @property
    def layer_devices(self) -> list[torch.device]:
        return [self.stage_devices[s] for s in self.layer_stages]

    @property
    def first(self) -> torch.device:
        return self.stage_devices[0]

    @property
    def last(self) -> torch.device:
        return self.stage_devices[-1]

    def stage_of(self, name: str, head: bool = False) -> int:
        """The stage holding GGUF tensor ``name`` (``head``: read as the output head)."""
        if name.startswith("blk."):
            return self.layer_stages[int(name.split(".")[1])]
        if name == EMBEDDING and not head:
            return 0
        return len(self.stage_devices) - 1

    def device_of(self, name: str, head: bool = False) -> torch.device:
        stage = self.stage_of(name, head)
        if self.stage is not None and stage != self.stage:
            return torch.device("meta")
        return self.stage_devices[stage]
