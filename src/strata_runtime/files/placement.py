"""Where each tensor of a model lives: one device, a split in this process,
or this process's stage of a split across processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import StrataError

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


class SplitError(StrataError):
    """A layer split that cannot work, with what to change."""


def parse_devices(devices: str | Sequence[str]) -> list[str]:
    """``"cpu,cuda:0"`` or a list -> checked device names."""
    names = [d.strip() for d in devices.split(",")] if isinstance(devices, str) else [str(d) for d in devices]
    if not names or any(not d for d in names):
        raise SplitError(f"devices must be a comma-separated list such as 'cuda:0,cuda:1', got {devices!r}")
    for name in names:
        try:
            kind = torch.device(name).type
        except (RuntimeError, TypeError):
            kind = None
        if kind not in ("cpu", "cuda"):
            raise SplitError(f"device {name!r} is not 'cpu', 'cuda' or 'cuda:N'")
    return names


def parse_layer_split(text: str | Sequence[int] | None) -> list[int] | str | None:
    """``"9,18"`` -> [9, 18]; ``"auto"`` stays; None stays."""
    if text is None or text == "auto":
        return text
    if not isinstance(text, str):
        return [int(x) for x in text]
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SplitError(f"layer_split must be 'auto' or first layers such as '9' or '6,12', got {text!r}") from None


def check_split(n_layers: int, devices: Sequence[str], boundaries: Sequence[int]) -> list[int]:
    """Explicit boundaries, checked against the model and the devices."""
    boundaries = list(boundaries)
    if len(boundaries) != len(devices) - 1:
        stages = len(boundaries) + 1
        raise SplitError(
            f"layer_split {boundaries} makes {stages} stage{'s' if stages != 1 else ''} but {len(devices)} "
            f"device{'s were' if len(devices) != 1 else ' was'} given; give one first layer per device after the first"
        )
    for b in boundaries:
        if not 1 <= b <= n_layers - 1:
            raise SplitError(f"layer_split boundary {b} is out of range: the model has {n_layers} layers, so each "
                             f"boundary must be in 1..{n_layers - 1}")
    if any(b >= c for b, c in zip(boundaries, boundaries[1:])):
        raise SplitError(f"layer_split {boundaries} must be strictly increasing (each stage needs a layer)")
    return boundaries


def check_device(name: str) -> None:
    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        raise StrataError(f"device={name!r} was asked for but torch sees no CUDA device; use device='cpu'")
