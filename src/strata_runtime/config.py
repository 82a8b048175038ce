"""``EngineConfig``: an engine's settings, checked once, fixed at load time."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from strata_kernels import KV_FORMATS

from .files import DTYPE_NAMES, parse_devices, parse_layer_split
from .speculation import check_settings
from .text import TOOL_CALL_FORMATS


@dataclass(frozen=True)
class EngineConfig:
    """The settings of one engine, fixed at load time."""

    dtype: str = "auto"  # auto: the fastest path whose accuracy holds; float32: the exact path (compute_path.py)
    device: str = "cpu"  # "cuda" / "cuda:N": weights stay as GGUF blocks, matmuls run in Triton
    kv: str = "f16"  # KV cache format: f16 (float32 storage on the CPU, bfloat16 with dtype=bfloat16), int8, k8v4
    context_length: int = 4096  # tokens one sequence can hold (capped by the model's)
    parallel: int | None = None  # sequences decoded together; None: 4 (on a CPU, 2 where host memory is short)
    kv_memory_mib: int | None = None  # the KV pool for them; None: `parallel` sequences of context_length
    threads: int | None = None  # torch intra-op threads; None leaves torch's default
    conversation_cache_mib: int = 1024  # host staging pool for parked conversations (0: none)
    conversation_cache_slots: int = 8  # parked conversations kept at most
    min_free_mib: int = 1024  # host memory the pool must leave free
    checkpoint_every: int = 2048  # running-state checkpoints every N prompt tokens (0: only at turn boundaries)
    strict_conversation_cache: bool = False  # refuse the pool rather than shrink it to fit
    conversation_cache_dir: str | None = None  # the disk tier: parked conversations written through to files here
    conversation_cache_disk_mib: int = 4096  # what the disk tier may hold
    devices: tuple[str, ...] | None = None  # a layer split over these devices (None: just ``device``)
    layer_split: str | tuple[int, ...] | None = None  # first layer of each later stage, or "auto"
    distributed: bool = False  # one stage per torch.distributed rank (torchrun); this process is rank 0
    rank_timeout_s: float = 120.0  # a rank silent this long is lost (split across processes)
    spec: str = "off"  # speculative decoding: "suffix" (from the sequence's own earlier tokens), "draft", or "off"
    spec_tokens: int = 7  # draft tokens per verify at most (7: one sequence's verify stays on the CPU's GEMV)
    draft_model: str | None = None  # spec="draft": a GGUF sharing the target's vocabulary
    tool_call_format: str = "auto"  # how the model writes tool calls: auto (read from its template) or a format
    cache_dir: str | None = None  # where the default model is assembled
    progress: bool = True  # progress bars while assembling and loading

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if not isinstance(self.context_length, int) or self.context_length < 1:
            raise ValueError(f"context_length must be a positive integer, got {self.context_length!r}")
        for name in ("parallel", "kv_memory_mib"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer (or None: sized for you), got {value!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        for name in ("conversation_cache_mib", "conversation_cache_slots", "min_free_mib", "checkpoint_every",
                     "conversation_cache_disk_mib"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        if self.conversation_cache_mib and not self.conversation_cache_slots:
            raise ValueError("conversation_cache_slots must be at least 1 while conversation_cache_mib is above 0 "
                             "(to park no conversation, set conversation_cache_mib to 0)")
        if self.conversation_cache_dir is not None and not self.conversation_cache_mib:
            raise ValueError("conversation_cache_dir needs conversation_cache_mib above 0: conversations come back "
                             "from disk through the staging pool")
        check_settings(self.spec, self.spec_tokens, self.draft_model)
        if self.tool_call_format not in ("auto", *TOOL_CALL_FORMATS):
            raise ValueError(f"tool_call_format must be auto or one of {', '.join(TOOL_CALL_FORMATS)}, "
                             f"got {self.tool_call_format!r}")
        if self.kv not in KV_FORMATS:
            raise ValueError(f"kv must be one of {', '.join(KV_FORMATS)}, got {self.kv!r}")
        try:
            kind = torch.device(self.device).type
        except (RuntimeError, TypeError):
            kind = None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not isinstance(self.rank_timeout_s, (int, float)) or self.rank_timeout_s <= 0:
            raise ValueError(f"rank_timeout_s must be a positive number of seconds, got {self.rank_timeout_s!r}")
        if self.layer_split is not None and self.devices is None and not self.distributed:
            raise ValueError("layer_split needs devices (the devices the stages run on)")
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(parse_devices(self.devices)))
            split = parse_layer_split(self.layer_split)
            object.__setattr__(self, "layer_split", split if isinstance(split, str) or split is None else tuple(split))

    def sequences(self, device: str) -> int:
        """Sequences decoded together: ``parallel``, or 4 (a decode step of 4
        costs about one weight read, as one does; on a CPU the engine takes 2
        where the host's memory is short, ``Engine._reserve_scheduler``); 1 for
        a split across processes (its ranks keep one cache)."""
        if self.distributed:
            return 1
        return self.parallel or 4

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; load() accepts {', '.join(sorted(known))}")
        return cls(**options)
