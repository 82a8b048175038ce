"""One forward step over several sequences: the state argument of the model
interface when a step carries more than one sequence (a ``KVCache`` alone is
a step of one sequence; both offer what the layers call)."""

from __future__ import annotations

from typing import Sequence

import torch
from strata_kernels import KVStore
from strata_kernels.attention import cpu_decode_reads, decode_attention
from strata_kernels.paging import BlockTables

from ..state import KVCache, RecurrentRuns


class Batch:
    """The sequences of one step and the rows each brings.

    Invariant: the step's hidden states hold sequence ``i``'s ``counts[i]``
    rows after those of sequences ``0..i-1``, at its next positions
    ``caches[i].length ..`` (consecutive). The first ``decoding`` sequences'
    rows (``decode_rows`` of them) are decode rows: one query each at its own
    position, attending up to it, all of them in one batched attention call;
    a sequence there with several rows is a verify (its last token and a
    draft), its rows decoded side by side as one decode step each would (the
    same kernel, the same bits). The rest are prompt chunks. Every cache
    holds the blocks its rows write (checked here, before any layer runs),
    and every cache is a different sequence of one shared pool.
    """

    def __init__(self, caches: Sequence[KVCache], counts: Sequence[int], verifies: int = 0):
        """``verifies``: how many sequences after those with one row are
        verifies (decode rows; every row gets logits), not prompt chunks."""
        if len(caches) != len(counts) or not caches or min(counts) < 1:
            raise ValueError("a batch needs at least one sequence, each with at least one row")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a sequence can be in a batch once")
        self.caches = list(caches)
        self.counts = list(counts)
        self.decoding = 0
        while self.decoding < len(counts) and counts[self.decoding] == 1:
            self.decoding += 1
        if not 0 <= verifies <= len(counts) - self.decoding:
            raise ValueError(f"{verifies} verifies in a batch of {len(counts)} sequences, {self.decoding} decoding")
        self.decoding += verifies
        # Logit rows per sequence: every row of a decode sequence, a prompt chunk's last.
        self.outputs = [n if i < self.decoding else 1 for i, n in enumerate(self.counts)]
        self.decode_rows = sum(self.counts[:self.decoding])
        self._decode_caches = [c for c, n in zip(self.caches[:self.decoding], self.counts) for _ in range(n)]
        for cache, n in zip(self.caches, self.counts):
            cache.check_write(cache.length, n)  # reserves the blocks, or says why not
        self.positions = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(self.caches, self.counts)])
        self.rows = sum(self.counts)
        self._decode_positions = self.positions[:self.decode_rows]
        self._decode_tables: dict[int, BlockTables] = {}

    def __len__(self) -> int:
        return len(self.caches)

    @property
    def pool(self):
        return self.caches[0].pool

    def decode_tables(self, layer: int) -> BlockTables:
        """The decode sequences' block tables for ``layer``'s group, made once a step."""
        g = self.pool.layer_group[layer]
        tables = self._decode_tables.get(g)
        if tables is None:
            store = self.caches[0].stores[layer]
            tables = BlockTables.of([c.blocks[g] for c in self._decode_caches],
                                    self.pool.groups[g].block_size, store.k.device)
            self._decode_tables[g] = tables
        return tables

    def write_and_attend(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                         backend: str = "auto") -> torch.Tensor:
        """Every sequence's rows written at its next positions, then its
        queries attending over its own positions: ``[rows, H, D]`` float32."""
        d = self.decode_rows
        store = self.caches[0].stores[layer]
        window = self.caches[0].windows[layer]
        outs = []
        if d:
            outs.append(decode_attention(q[:d], keys[:d], values[:d], store, self._decode_positions, window, scale,
                                         self.decode_tables(layer), backend))
        at = d
        for cache, n in zip(self.caches[self.decoding:], self.counts[self.decoding:]):
            outs.append(cache.write_and_attend(layer, q[at:at + n], keys[at:at + n], values[at:at + n], scale,
                                               backend))
            at += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def recurrent_runs(self, layer: int, rows: int) -> RecurrentRuns:
        """How this step's rows meet recurrent ``layer``: the decoding
        sequences' slots (one row each), then each prompt chunk's run."""
        if rows != self.rows:
            raise ValueError(f"the step has {self.rows} rows, the layer got {rows}")
        store = self.caches[0].stores[layer]
        slots = [cache.recurrent_slot(layer) for cache in self.caches]
        d = self.decoding
        firsts = [sum(self.counts[:i]) for i in range(len(self.caches))]
        if any(c.shadow is not None for c in self.caches):
            # A speculative step: every sequence's state goes to its spare slots (``KVCache.shadow``).
            if not all(c.shadow is not None for c in self.caches):
                raise ValueError("a step that writes recurrent state to spare slots writes all of it there")
            chains = [(at, n, slot, c.shadow[:n]) for at, n, slot, c in
                      zip(firsts[:d], self.counts[:d], slots[:d], self.caches[:d])]
            chunks = [(at, n, c.shadow[0]) for at, n, c in zip(firsts[d:], self.counts[d:], self.caches[d:])]
            copies = [(slot, c.shadow[0]) for slot, c in zip(slots[d:], self.caches[d:])]
            return RecurrentRuns(store, None, chunks, chains, copies)
        if self.decode_rows != self.decoding:
            raise ValueError("a verify steps a recurrent layer through spare slots (KVCache.shadow): none were given")
        decode = torch.tensor(slots[:d], device=store.device) if d else None
        return RecurrentRuns(store, decode, [(at, n, slot) for at, n, slot in
                                             zip(firsts[d:], self.counts[d:], slots[d:])])

    def decode_view(self, layer: int, positions: torch.Tensor) -> tuple[KVStore, int | None, BlockTables] | None:
        """Where every row is a decode row: ``layer``'s store, window and
        the rows' tables, if the CPU decode kernel reads that storage in
        place; None otherwise."""
        store = self.caches[0].stores[layer]
        if self.decoding != len(self.caches) or not cpu_decode_reads(store):
            return None
        return store, self.caches[0].windows[layer], self.decode_tables(layer)

    def advance(self, n: int) -> None:
        """After the last layer: every sequence holds its rows' positions."""
        if n != self.rows:
            raise ValueError(f"the step ran {n} rows but the batch holds {self.rows}")
        for cache, count in zip(self.caches, self.counts):
            cache.advance(count)

    def last_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows a ``last_only`` step gives logits for: every decode row
        (a verify's every row), each prompt chunk's last, in order."""
        ends = torch.tensor(self.counts).cumsum(0)
        if all(o == 1 for o in self.outputs):
            return x[(ends - 1).to(x.device)]
        rows = torch.cat([torch.arange(e - o, e) for e, o in zip(ends.tolist(), self.outputs)])
        return x[rows.to(x.device)]
