"""Sequences in flight, and the step that advances them together.

Each ``step()`` runs one forward over a ``Batch``: the next token of every
decoding sequence, then chunks of prompts being read, at most
``chunk_tokens`` prompt rows in all (a long prompt cannot stall the others'
decoding for more than one chunk). Sequences hold KV blocks of one pool
(``kv_pool.KVPool``), reserved once at load:

- admission: a waiting request starts (first come, first served) when the
  blocks its prompt needs are free and fewer than ``max_running`` run;
- growth: a decoding sequence that needs a block when none is free preempts
  the most recently admitted running sequence, whose blocks are released
  and which resumes later by reading its tokens again (``recomputed``), after
  its state is parked on the host where a conversation cache can take it;
- speculation (with a drafter): a decoding sequence with a draft brings
  its last token and the draft (a verify, ``speculation``) and may advance
  several tokens; a verify that cannot get its rows or blocks is skipped;
- residency: a finished sequence keeps its blocks, least recently used
  first to go, parked to the host before they are reused; a new request
  whose prompt extends one (of its scope) takes that sequence's state over.

Nothing here raises into a request for want of memory: the outcomes are
counted (``counters``) and logged.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from typing import Callable, Sequence

import torch

from ..conversations import ConversationCache, Restored, common_prefix
from ..errors import QueueFull, RequestError
from ..faults import StepFailed
from ..speculation import Speculation
from ..state import PREFILL_CHUNK, KVCache, KVPool
from ..testing import armed, fault_point
from .batch import Batch
from .constraint import Constraint
from .sampling import Sampler, SamplingParams
from .sequence import DECODING, FINISHED, PREFILLING, WAITING, Generation, Resident
from .siblings import state_from_sibling
from .slots import slot_rows

log = logging.getLogger(__name__)

class Scheduler:
    """The sequences of one model and one pool.

    Invariant: every block of ``pool`` is free, or held by exactly one
    running sequence's cache or one resident's; ``running`` lists the
    admitted, unfinished sequences in admission order; ``waiting`` is FIFO.
    """

    def __init__(self, model, pool: KVPool, context_length: int, end_of_generation: frozenset[int],
                 max_running: int = 4, max_waiting: int = 64, chunk_tokens: int = PREFILL_CHUNK,
                 conversations: ConversationCache | None = None, max_residents: int = 4,
                 private: KVCache | None = None, drafter=None, spec_tokens: int = 7):
        """``private``: the one cache every sequence uses in turn (a split
        across processes, whose ranks step their twin of it), with
        ``max_running`` and ``max_residents`` 1; else caches come from ``pool``.
        ``drafter`` (``drafting``): decoding sequences verify its drafts of
        up to ``spec_tokens`` tokens (``speculation``)."""
        if max_running < 1 or chunk_tokens < 1:
            raise ValueError("max_running and chunk_tokens must be at least 1")
        self.model = model
        self.pool = pool
        self.context_length = context_length
        self.end_of_generation = end_of_generation
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.chunk_tokens = min(chunk_tokens, PREFILL_CHUNK)  # the rings hold a window plus one chunk
        self.conversations = conversations
        self.max_residents = max_residents
        self.private = private
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []
        self.residents: list[Resident] = []
        self.counters: Counter[str] = Counter()
        self.peak_running = 0  # the most sequences one step has carried
        self._ids = itertools.count()
        self._admissions = itertools.count()
        self.speculation = None if drafter is None else Speculation(drafter, spec_tokens, self.counters)

    # --- requests -----------------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: SamplingParams, scope: str = "",
               boundaries: Sequence[int] = (), root: int | None = None, bounded: bool = True,
               constraint: Constraint | None = None, sibling: Generation | None = None) -> Generation:
        """Queue a request; ``QueueFull`` past ``max_waiting`` waiting ones
        (``bounded``: a server's clients; a notebook's own list is not).
        ``constraint``: the grammar its tokens follow (made from ``params.grammar``); ``sibling``: a
        sequence of the same prompt (``n`` choices) whose prompt state this one copies."""
        if bounded and len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting (the bound); retry shortly")
        prompt = list(prompt)
        short = [g for g in self.pool.groups if g.blocks_for(len(prompt) + 1) > g.n_blocks]
        if short:
            g = short[0]
            raise RequestError(f"the prompt's {len(prompt)} tokens need {g.blocks_for(len(prompt) + 1)} KV blocks "
                              f"but the pool holds {g.n_blocks}; shorten it or give the engine more KV memory")
        seq = Generation(next(self._ids), prompt, params, Sampler(params, constraint),
                        max_tokens=min(params.max_tokens, self.context_length - len(prompt)), scope=scope,
                        boundaries=tuple(boundaries), root=root, tokens=list(prompt), sibling=sibling)
        self.counters["requests"] += 1
        if seq.max_tokens <= 0:  # nothing to generate: no state to compute
            seq.cancel("length")
            return seq
        self.waiting.append(seq)
        return seq

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def run_until(self, done: Callable[[], bool]) -> None:
        while not done() and self.busy:
            self.step()

    # --- one step -------------------------------------------------------------------

    def step(self) -> None:
        """Admit what fits, then one forward over every running sequence's next rows."""
        self.retire()
        self._admit()
        batch_seqs, counts = self._plan()
        if not batch_seqs:
            return
        self.peak_running = max(self.peak_running, len(batch_seqs))
        self.counters["steps"] += 1
        self.counters["prompt_tokens"] += sum(n for s, n in zip(batch_seqs, counts) if s.state == PREFILLING)
        if self.speculation is not None:
            self.speculation.shadow(batch_seqs)  # may drop drafts: _forward counts a decoding sequence's rows
        try:
            starts = [s.cache.length for s in batch_seqs]
            try:
                logits = self._forward(batch_seqs, counts)
            except Exception as e:
                if self.speculation is None or not self.speculation.drop(batch_seqs, e):
                    raise
                # Out of memory with verifies in the step: nothing it wrote is
                # read before it is written again (``speculation``), so it runs
                # again as plain decode steps.
                for seq, start in zip(batch_seqs, starts):
                    seq.cache.length = start
                logits = self._forward(batch_seqs, counts)
            at = 0
            for seq, start in zip(batch_seqs, starts):
                n = 1 + len(seq.draft)
                if seq.cache.shadow is not None and not seq.draft:  # its state went to a spare slot
                    seq.cache.adopt(0, seq.cache.length)
                if seq.draft:
                    self.speculation.accept(seq, logits[at:at + n], self._emit)
                    self._checkpoint(seq, start)
                else:
                    self._after_rows(seq, logits[at], start)
                at += n
        except Exception as e:
            self._abandon(batch_seqs)
            raise StepFailed([s.id for s in batch_seqs], e) from e
        self.retire()

    def _forward(self, seqs: list[Generation], counts: list[int]) -> torch.Tensor:
        """The model over ``seqs``' next rows (a prompt chunk's ``counts``; a
        decoding sequence's last token and its draft): logits of each
        sequence's last row, or of every row of a verify, in order."""
        counts = [1 + len(s.draft) if s.state == DECODING else n for s, n in zip(seqs, counts)]
        rows: list[int] = []
        for seq, n in zip(seqs, counts):
            at = seq.cache.length
            rows.extend(seq.tokens[at:at + n] if not seq.draft else [seq.tokens[-1], *seq.draft])
        verifies = sum(1 for s in seqs if s.draft)
        # One sequence steps as itself (the model interface's KVCache; a split
        # across processes knows no other), several, or a verify, as a Batch
        # (whose decode rows give a verify the bits of one decode step per row).
        if len(seqs) == 1 and (not verifies or self.private is not None):
            state, start = seqs[0].cache, seqs[0].cache.length
            positions = torch.arange(start, start + counts[0])
        else:
            state = Batch([s.cache for s in seqs], counts, verifies)
            positions = state.positions
        if armed("forward"):
            fault_point("forward", subject=[s.tokens for s in seqs])
        ids = torch.tensor(rows, dtype=torch.long, device=self.model.device)
        with torch.inference_mode():
            # A Batch gives each verify's every row; a lone verify of a split across processes asks for all rows.
            last_only = not (verifies and isinstance(state, KVCache))
            logits = self.model(ids, positions.to(self.model.device), state, last_only=last_only)
        if armed("verify_forward") and any(s.draft for s in seqs):
            fault_point("verify_forward", subject=[s.tokens for s in seqs if s.draft])
        return logits

    def _abandon(self, seqs: list[Generation]) -> None:
        """End ``seqs`` after a failed step, dropping their state: layers
        before the failure wrote the step's positions (into sliding rings,
        over older ones; recurrent states in place) while the cache still
        counts what they overwrote, so no prefix of it can be trusted."""
        for seq in seqs:
            seq.draft = []
            if seq.cache is not None:
                seq.cache.drop_shadow()
                if seq.cache is self.private:
                    seq.cache.reset()
                else:
                    seq.cache.release()
                seq.cache = None
            if seq.state != FINISHED:
                seq.cancel("error")
        self.counters["failed_steps"] += 1
        self.retire()
        log.error("scheduler: a step over sequences %s failed; their state was dropped",
                  [s.id for s in seqs])

    def _plan(self) -> tuple[list[Generation], list[int]]:
        """Decode rows first (each decoding sequence's last token), then
        prompt chunks up to ``chunk_tokens``; blocks reserved for all of them."""
        decoding = [s for s in self.running if s.state == DECODING]
        for seq in decoding:
            while seq.state == DECODING and not seq.cache.reserve(1):
                if not self.residents and self.running == [seq]:  # alone, and the pool holds no more
                    log.warning("scheduler: sequence %d ends at %d tokens: the KV pool holds no more (give the "
                                "engine more KV memory)", seq.id, len(seq.tokens))
                    seq.cancel("length")
                    break
                self._preempt_newest()
        decoding = [s for s in self.running if s.state == DECODING]
        budget = self.chunk_tokens
        if self.speculation is not None:  # verify rows come out of the step's row budget
            budget -= self.speculation.plan(decoding, budget)
        # Plain decode rows first, then verifies, then prompt chunks (``Batch``'s order).
        decoding.sort(key=lambda s: bool(s.draft))
        seqs, counts = list(decoding), [1 + len(s.draft) for s in decoding]
        for seq in [s for s in self.running if s.state == PREFILLING]:
            if budget == 0:
                break
            start = seq.cache.length
            end = min(len(seq.tokens), start + budget)  # a resumed sequence reads its generated tokens too
            stops = [p for p in seq.checkpoints if start < p < end]
            end = min(stops, default=end)
            if not seq.cache.reserve(end - start):  # admission reserved the prompt's blocks; a preemption may not
                continue
            seqs.append(seq)
            counts.append(end - start)
            budget -= end - start
        return seqs, counts

    def _after_rows(self, seq: Generation, logits: torch.Tensor, start: int) -> None:
        """After a step brought ``seq``'s rows from position ``start``: its
        next token from ``logits`` (the last row's), once its prompt is read."""
        self._checkpoint(seq, start)
        if seq.state == PREFILLING:
            if seq.cache.length < len(seq.tokens):
                return  # more prompt to read
            seq.state = DECODING
        self._emit(seq, logits)

    def _emit(self, seq: Generation, logits: torch.Tensor) -> bool:
        """Sample ``seq``'s next token from ``logits`` and append it, or end
        the sequence (max_tokens, an end-of-generation token); whether it goes on."""
        if seq.max_tokens <= len(seq.generated):
            seq.cancel("length")
            return False
        token = seq.sampler(logits, seq.tokens)
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        if token in self.end_of_generation:
            seq.cancel("stop")
            return False
        seq.tokens.append(token)
        seq.generated.append(token)
        if seq.sampler.last_logprobs is not None:
            seq.logprobs.append(seq.sampler.last_logprobs)
        self.counters["generated_tokens"] += 1
        seq.events.append(token)
        if len(seq.generated) >= seq.max_tokens:
            seq.cancel("length")
            return False
        return True

    def _checkpoint(self, seq: Generation, start: int) -> None:
        """Running state saved where a prompt chunk stopped at a checkpoint
        position, and while decoding each time the length passes a multiple
        of ``checkpoint_every`` (a verify may pass it by several tokens)."""
        cc, p = self.conversations, seq.cache.length
        if cc is None or not seq.cache.has_running_state:
            return
        # Prompt positions chosen at admission; while decoding, every ``checkpoint_every``
        # tokens (a returning conversation may part from the cached one inside the answer).
        every = cc.checkpoint_every
        if p in seq.checkpoints or (seq.state == DECODING and every and p // every > start // every):
            cc.save_checkpoint(seq.cache, seq.tokens[:p], root=p == seq.root, scope=seq.scope)

    # --- admission, preemption, residency ------------------------------------------------

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if seq.state == FINISHED:  # cancelled while waiting
                self.waiting.popleft()
                continue
            cache = self._state_for(seq)
            if cache is None:
                return  # its prompt's blocks are not free: it waits, first in line
            self.waiting.popleft()
            seq.cache = cache
            seq.state = PREFILLING if cache.length < len(seq.tokens) else DECODING
            cc = self.conversations
            if cc is not None and cache.has_running_state:
                # Running state cannot be cut back: save it on the way (every N tokens, at turn boundaries).
                seq.checkpoints = tuple(cc.checkpoint_positions(cache.length, len(seq.prompt) - 1, seq.boundaries))
            seq.admitted = next(self._admissions)
            self.running.append(seq)

    def _state_for(self, seq: Generation) -> KVCache | None:
        """A cache for ``seq``, holding the blocks its tokens need, or None
        while the pool cannot give them (it waits).

        The resident sequence (of its scope) sharing the longest prefix is
        taken over: continued where the prompt extends all of it; otherwise
        (as when a conversation returns) parked first, and the best of it,
        the parked snapshots and the checkpoints restored into it. Without a
        resident to take, a fresh cache (a restore where a snapshot fits)."""
        limit = len(seq.tokens) - 1  # at least one token to read: its logits give the next
        if seq.sibling is not None:
            waiting, cache = state_from_sibling(self, seq, limit)
            if waiting or cache is not None:  # None while waiting: it waits, first in line
                return cache
        best, shared = None, 0
        for r in self.residents:
            if r.scope == seq.scope:
                n = min(common_prefix(r.tokens, seq.tokens), limit)
                if n > shared:
                    best, shared = r, n
        cc = self.conversations
        on_host = 0 if cc is None else min(cc.longest_prefix(seq.tokens, seq.scope), limit)
        if best is not None and shared < on_host:  # a parked state goes further: restore it into a fresh cache
            best, shared = None, 0
        if best is not None and shared < len(best.tokens) and self.private is None:
            # The prompt parts from the resident: copy the shared prefix into a
            # sequence of its own where there is room, leaving the resident be
            # (two conversations alternating both stay on the device).
            cache = self.admit_copy(seq, best.cache, shared)
            if cache is not None:
                best.last_used = time.monotonic()
                return cache
        if best is not None:
            self.residents.remove(best)
            cache, held = best.cache, best.tokens
        else:
            if self.private is not None:  # one cache in turn: what holds it goes first
                while self.residents:
                    self._evict_resident()
                cache = self.private
                cache.reset()
            else:
                cache = KVCache.on_pool(self.pool, self.context_length)
                # A restore needs the blocks of what it restores (a recurrent
                # state's slot among them): residents give theirs up first.
                while on_host and not cache.reserve(on_host) and self._evict_resident():
                    pass
            held = ()
        if held and shared == len(held):
            kept = shared  # the prompt extends it: carry on
        elif cc is not None and (held or on_host):
            if held:
                cc.park(cache, held, scope=seq.scope)
            outcome = cc.restore(cache, held, seq.tokens, scope=seq.scope, live_scope=seq.scope)
            kept = outcome.position if isinstance(outcome, Restored) else 0
        else:
            kept = cache.trim(shared)
        while not self._reserve_leaving_room(cache, len(seq.tokens) - cache.length):
            if not self._evict_resident():
                if cache.length:  # keep what it holds resident for a later try
                    self.residents.append(Resident(cache, tuple(seq.tokens[:cache.length]), seq.scope))
                else:
                    cache.release()
                return None
        return self._admitted(seq, cache, kept)

    def admit_copy(self, seq: Generation, source: KVCache, shared: int) -> KVCache | None:
        """A fresh cache for ``seq`` holding a copy of ``source``'s first ``shared``
        positions and blocks for the rest of its tokens; None (nothing held)
        where the pool has no room for all of them or the copy cannot be made."""
        cache = KVCache.on_pool(self.pool, self.context_length)
        if self._room_for(cache, len(seq.tokens)) and cache.copy_prefix(source, shared):
            cache.reserve(len(seq.tokens) - shared)  # room was checked for all of them
            self.counters["prefix_copies"] += 1
            return self._admitted(seq, cache, shared)
        cache.release()
        return None

    def _admitted(self, seq: Generation, cache: KVCache, kept: int) -> KVCache:
        """Count a prefix query of ``seq`` that reuses ``kept`` tokens."""
        seq.cached_tokens = seq.cached_tokens or kept
        self.counters["prefix_queries"] += 1
        self.counters["prefix_query_tokens"] += len(seq.tokens)
        self.counters["prefix_hit_tokens"] += kept
        self.counters["prefix_hits"] += 1 if kept else 0
        return cache

    def _room_for(self, cache: KVCache, n: int) -> bool:
        """Whether the pool's free blocks hold ``n`` positions for an empty
        ``cache`` and leave a block for each running sequence (in the groups
        where sequences grow: a recurrent state is one slot for good)."""
        need = cache.blocks_needed(n)
        return all(k + (len(self.running) if g.grows else 0) <= free
                   for g, k, free in zip(self.pool.groups, need, self.pool.free_blocks()))

    def _reserve_leaving_room(self, cache: KVCache, n: int) -> bool:
        """``cache.reserve(n)`` where that leaves a block free in every group
        for each running sequence (their next growth): admitting what would
        at once be preempted again only trades one sequence's work for another's."""
        if not any(cache.blocks_needed(n)):
            return True
        return self._room_for(cache, n) and cache.reserve(n)

    def _evict_resident(self) -> bool:
        """Free the least recently used resident's blocks, parked to the host first where it can be."""
        if not self.residents:
            return False
        victim = min(self.residents, key=lambda r: r.last_used)
        self.residents.remove(victim)
        if self.conversations is not None:
            self.conversations.park(victim.cache, victim.tokens, scope=victim.scope)
        victim.cache.release()
        self.counters["resident_evictions"] += 1
        return True

    def park_residents(self) -> None:
        """Park every resident (finished) sequence to the conversation cache
        and free its blocks: what an engine does before it stops."""
        while self._evict_resident():
            pass

    def _preempt_newest(self) -> None:
        """Free blocks: a resident's, else the most recently admitted running
        sequence's: its state is parked where the conversation cache can take
        it, its blocks released, and it waits, first in line, to resume."""
        if self._evict_resident() or not self.running:
            return
        victim = max(self.running, key=lambda s: s.admitted)
        self.running.remove(victim)
        outcome = "recomputed"
        if self.conversations is not None and victim.cache.length:
            parked = self.conversations.park(victim.cache, victim.tokens[:victim.cache.length], scope=victim.scope)
            outcome = "parked" if type(parked).__name__ == "Parked" else "recomputed"
        victim.cache.release()
        victim.cache = None
        victim.state = WAITING
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        self.counters[f"preemptions_{outcome}"] += 1
        log.info("scheduler: preempted sequence %d at %d tokens (%s): no free KV block", victim.id,
                 len(victim.tokens), outcome)

    def retire(self) -> None:
        """Finished sequences leave ``running``; their state stays resident."""
        for seq in [s for s in self.running if s.state == FINISHED]:
            self.running.remove(seq)
            cache, seq.cache = seq.cache, None
            if self.speculation is not None:
                self.speculation.release(seq)
            if cache is None:
                continue
            # The cache holds every token but the last generated one.
            self.residents.append(Resident(cache, tuple(seq.tokens[:cache.length]), seq.scope))
            self.counters[f"finished_{seq.finish_reason}"] += 1
        while len(self.residents) > self.max_residents:
            self._evict_resident()

    # --- figures ----------------------------------------------------------------------------

    def slots(self) -> list[dict]:
        """Every sequence the engine holds state for (``slot_rows``)."""
        return slot_rows(self)

    def stats(self) -> dict:
        """Counters, and the queue, running and resident figures now."""
        return {**self.counters, "peak_running": self.peak_running, "running": len(self.running),
                "waiting": len(self.waiting),
                "resident": len(self.residents), "kv_usage": round(self.kv_usage(), 4),
                "free_blocks": sum(self.pool.free_blocks()), "total_blocks": self.pool.total_blocks()}

    def kv_usage(self) -> float:
        """Fraction of the pool's blocks held by running sequences (residents can be reclaimed)."""
        total = self.pool.total_blocks()
        held = sum(s.cache.held_blocks for s in self.running if s.cache is not None)
        return held / total if total else 0.0
