"""Block tables: where each sequence keeps its positions in a layer's store.

A layer's ``KVStore`` is a run of slots cut into blocks of ``block_size``.
A sequence holds some of those blocks, in order: its table. Its positions
go round its blocks as a ring (``len(table) * block_size`` slots), so one
rule covers both layer kinds: a full-attention layer's table grows before
the ring would wrap; a sliding-window layer's table stops at the blocks its
window needs and wraps. A store that one sequence owns outright is one
block of its whole capacity (``BlockTables.contiguous``): the plain ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Sequence

import torch


@dataclass(frozen=True)
class BlockTables:
    """The tables of the sequences of one call, ``B`` of them.

    Invariant: sequence ``b``'s position ``p`` lives in slot
    ``blocks[b][(p // block_size) % len(blocks[b])] * block_size + p % block_size``;
    ``tables`` ``[B, max len]`` int32 holds the same blocks (rows padded with
    0) and ``lengths`` ``[B]`` int32 each row's length, on ``device``.
    """

    blocks: tuple[tuple[int, ...], ...]
    block_size: int
    device: torch.device = field(default=torch.device("cpu"))

    def __post_init__(self) -> None:
        if self.block_size < 1 or not self.blocks or any(not row for row in self.blocks):
            raise ValueError("block tables need a block size >= 1 and at least one block per sequence")

    @cached_property
    def tables(self) -> torch.Tensor:
        width = max(len(row) for row in self.blocks)
        padded = [list(row) + [0] * (width - len(row)) for row in self.blocks]
        return torch.tensor(padded, dtype=torch.int32, device=self.device)

    @cached_property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(row) for row in self.blocks], dtype=torch.int32, device=self.device)

    @staticmethod
    @lru_cache(maxsize=256)
    def contiguous(capacity: int, device: torch.device | str = "cpu") -> "BlockTables":
        """One sequence owning a whole store of ``capacity`` slots (a ring)."""
        return BlockTables(((0,),), capacity, torch.device(device))

    @classmethod
    def of(cls, blocks: Sequence[Sequence[int]], block_size: int, device: torch.device | str = "cpu") -> "BlockTables":
        return cls(tuple(tuple(int(b) for b in row) for row in blocks), block_size, torch.device(device))

    def __len__(self) -> int:
        return len(self.blocks)

    def one(self, b: int) -> "BlockTables":
        """Sequence ``b``'s table alone."""
        return BlockTables((self.blocks[b],), self.block_size, self.device)

    @property
    def division(self) -> tuple[int, int]:
        """``(magic, shift)`` that divide a slot by ``block_size`` (``divide_by_multiplying``)."""
        return divide_by_multiplying(self.block_size)

    def capacity(self, b: int = 0) -> int:
        """Slots in sequence ``b``'s ring: positions further back are overwritten."""
        return len(self.blocks[b]) * self.block_size

    def slot(self, b: int, position: int) -> int:
        row, bs = self.blocks[b], self.block_size
        return row[(position // bs) % len(row)] * bs + position % bs

    def slots(self, b: int, positions: torch.Tensor) -> torch.Tensor:
        """Slots (int64) of ``positions`` of sequence ``b``, on the positions' device."""
        bs = self.block_size
        row = torch.tensor(self.blocks[b], dtype=torch.long, device=positions.device)
        logical = positions.long() % (len(self.blocks[b]) * bs)
        return row[logical // bs] * bs + logical % bs

    def runs(self, b: int, first: int, end: int, limit: int | None = None) -> list[tuple[int, int, int]]:
        """``(first position, first slot, count)`` runs covering positions
        ``first..end-1`` of sequence ``b``, each contiguous in the store and at
        most ``limit`` long (runs of adjacent blocks are merged)."""
        row, bs = self.blocks[b], self.block_size
        ring = len(row) * bs
        runs: list[tuple[int, int, int]] = []
        pos = first
        while pos < end:
            logical = pos % ring
            slot = row[logical // bs] * bs + logical % bs
            n = min(end - pos, bs - logical % bs, limit or end)
            if runs and runs[-1][1] + runs[-1][2] == slot and (limit is None or runs[-1][2] + n <= limit):
                p0, s0, n0 = runs[-1]
                runs[-1] = (p0, s0, n0 + n)
            else:
                runs.append((pos, slot, n))
            pos += n
        return runs


@lru_cache(maxsize=64)
def divide_by_multiplying(d: int) -> tuple[int, int]:
    """``(magic, shift)`` with ``(((2 * x) * magic) >> 32) >> shift == x //
    d`` for every ``0 <= x < 2**31``: a 32-bit high multiply and a shift
    (Granlund and Montgomery: ``magic = ceil(2**(31 + shift) / d)``,
    ``shift = ceil(log2 d)``, so that ``magic * d - 2**(31 + shift) < d <=
    2**shift``; ``2**31 <= magic < 2**32``). A GPU kernel divides by a
    runtime divisor in some 20 instructions. ``magic`` is returned as the
    int32 of its bits (one compiled form for every block size: Triton types
    an argument by its value)."""
    if d < 1:
        raise ValueError(f"a divisor is at least 1, got {d}")
    shift = (d - 1).bit_length()
    magic = -(-(1 << (31 + shift)) // d)
    return magic - (1 << 32) if magic >= 1 << 31 else magic, shift
