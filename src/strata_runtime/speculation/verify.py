"""Speculative decoding inside the scheduler's step.

A decoding sequence with a draft (``drafting``: guesses at its next tokens)
brings its last token and the draft to the step as one short run of rows (a
verify), instead of its last token alone; the step's forward gives logits
at every one of those rows. Row ``i`` predicts the token after draft token
``i``, so sampling row 0, then row 1 while the sampled token equals the
draft, and so on, yields what plain decoding would have yielded one step at
a time, up to ``1 + len(draft)`` tokens for one forward. With a draft that
is one token per position (a point mass, as every drafter here gives), this
is exactly the rejection rule of speculative sampling: the output is
distributed as the target's, and a seeded sampler (one random draw per
token) gives the same tokens as without speculation.

Afterwards the sequence is cut back to what was accepted: full-attention
layers by length; sliding rings are sized so the rejected positions only
overwrote slots outside every live window (``state.spec.DRAFT_MARGIN``).
Recurrent state holds one position and cannot be cut back: in a step that
carries a verify, every sequence's recurrent state is written to spare
slots reserved at load (``KVCache.shadow``: a verify's rows one slot each,
the state after every draft position), and afterwards the slot of the
accepted position becomes the sequence's (``KVCache.adopt``), no copy made.

A verify is an optimization: where it cannot get its rows (the step's row
budget, the KV pool's blocks, an out-of-memory at the ``verify`` fault point
or in the verify's forward) the sequence decodes one token that step, the
skip is counted by reason and logged once per reason, and nothing is lost.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Sequence

import torch

from strata_kernels.launch import CPU_GEMV_MAX_M

from ..faults import describe, is_out_of_memory
from ..state import DRAFT_MARGIN, LayerState, RecurrentState
from ..testing import armed, fault_point
from .drafting import SuffixDrafter

log = logging.getLogger(__name__)

SPEC_MODES = ("off", "suffix", "draft")
# Why a verify was skipped (counted as ``spec_skipped_<reason>``).
SKIP_REASONS = ("budget", "kv_blocks", "out_of_memory")
MAX_DRAFT = DRAFT_MARGIN - 1


def check_settings(mode: str, tokens: int, draft_model) -> None:
    """Refuse a ``--spec`` / ``--spec-tokens`` / ``--draft-model`` combination that cannot work."""
    if mode not in SPEC_MODES:
        raise ValueError(f"spec must be one of {', '.join(SPEC_MODES)}, got {mode!r}")
    if not isinstance(tokens, int) or not 1 <= tokens <= MAX_DRAFT:
        raise ValueError(f"spec_tokens must be a whole number in 1..{MAX_DRAFT}, got {tokens!r}")
    if mode == "draft" and not draft_model:
        raise ValueError("spec='draft' needs draft_model: the path of a GGUF that shares the target's vocabulary")
    if draft_model and mode != "draft":
        raise ValueError(f"draft_model is used with spec='draft' only (spec is {mode!r})")


def make_drafter(mode: str, tokens: int, load_draft_model: Callable[[], object] | None = None):
    """The drafter of ``--spec MODE`` (None for "off"); "draft" calls
    ``load_draft_model`` (``draft_model.DraftModelDrafter.load`` with the engine's settings)."""
    check_settings(mode, tokens, load_draft_model)
    if mode == "off":
        return None
    return SuffixDrafter(max_draft=tokens) if mode == "suffix" else load_draft_model()


def drafter_for(mode: str, tokens: int, spec: Sequence[LayerState], load_draft_model=None,
                private: bool = False):
    """``(drafter, refusal)``: the drafter of ``mode`` for a model whose
    state is ``spec``, or None and why it cannot speculate (None: "off").
    ``private``: one cache stepped in turn (a split across processes), whose
    pool has no spare recurrent slots."""
    if mode == "off":
        return None, None
    if private and any(isinstance(layer, RecurrentState) for layer in spec):
        refusal = "a split across processes keeps no spare recurrent slots for the verifies' states"
        log.warning("speculative decoding is off: %s", refusal)
        return None, refusal
    return make_drafter(mode, tokens, load_draft_model), None


def spare_states(mode: str, spec: Sequence[LayerState], parallel: int) -> int:
    """Recurrent slots a pool keeps beyond its sequences' for speculative
    steps: one per decode row a step carries, one per prompt chunk beside them."""
    if mode == "off" or not any(isinstance(layer, RecurrentState) for layer in spec):
        return 0
    return CPU_GEMV_MAX_M + parallel


class Speculation:
    """The drafts of one scheduler's sequences and what their verifies accepted.

    Invariant: a sequence's ``draft`` is non-empty only between the plan of
    a step that verifies it and that step's acceptance; while it is, the
    sequence holds blocks for its last token and every draft token.
    ``counters`` is the scheduler's (``spec_*`` keys).
    """

    def __init__(self, drafter, max_tokens: int, counters: Counter, step_rows: int = CPU_GEMV_MAX_M):
        """``max_tokens``: draft tokens per verify at most; ``step_rows``:
        decode rows (plain and verify) a step carries at most where drafts
        are added: a step of up to ``CPU_GEMV_MAX_M`` rows reads each weight
        once in the GEMV, more take the prefill GEMM (on 2 cores, 4 sequences
        with drafts of 7 made decoding 0.7-0.9x as fast as without them)."""
        self.drafter = drafter
        self.max_tokens = max_tokens
        self.step_rows = step_rows
        self.counters = counters
        self._logged: set[str] = set()
        # Every counter listed from the start: a dashboard sees each reason and position at 0.
        for key in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens",
                    *(f"spec_skipped_{r}" for r in SKIP_REASONS), *(f"spec_accepted_at_{i}" for i in range(max_tokens))):
            counters[key] += 0

    def plan(self, decoding: Sequence, budget: int) -> int:
        """Set ``draft`` on each of ``decoding`` that gets a verify this step
        (blocks reserved for it); return the rows the drafts took beyond one
        per sequence. Draft rows are at most ``budget`` and keep the step's
        decode rows within ``step_rows``, shared out one row per sequence in
        turn (a draft's first tokens are the likeliest to be accepted)."""
        drafts = []
        spare = min(budget, self.step_rows - len(decoding))
        for seq in decoding:
            seq.draft = []
            # The last emitted token is the verify's own: a draft never runs past max_tokens or the context.
            room = min(self.max_tokens, seq.max_tokens - len(seq.generated) - 1,
                       seq.cache.max_tokens - seq.cache.length - 1)
            if room < 1 or spare < 1:
                continue
            if getattr(self.drafter, "costly", False):  # a draft model: no tokens past the sequence's share
                draft = self._propose(seq, min(room, -(-spare // len(decoding))))
            else:
                draft = self._propose(seq)
            if draft[:room]:
                drafts.append((seq, draft[:room]))
        shares = [0] * len(drafts)
        while spare > 0 and any(n < len(d) for n, (_, d) in zip(shares, drafts)):
            for i, (_, draft) in enumerate(drafts):
                if spare > 0 and shares[i] < len(draft):
                    shares[i] += 1
                    spare -= 1
        used = 0
        for (seq, draft), share in zip(drafts, shares):
            if share == 0:
                self.skip("budget", f"a step carries at most {self.step_rows} decode rows and "
                                    f"{len(decoding)} sequences are decoding")
                continue
            draft = draft[:share]
            try:
                if armed("verify"):
                    fault_point("verify", subject=seq.tokens)
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                self.skip("out_of_memory", describe(e))
                continue
            if not seq.cache.reserve(1 + len(draft)):  # never preempts: a verify is an optimization
                self.skip("kv_blocks", "the KV pool has no free block for the draft's positions")
                continue
            seq.draft = draft
            used += len(draft)
        return used

    def _propose(self, seq, limit: int | None = None) -> list[int]:
        """The drafter's draft, or none where drafting runs out of memory (counted)."""
        try:
            return self.drafter.propose(seq) if limit is None else self.drafter.propose(seq, limit)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            self.skip("out_of_memory", f"drafting: {describe(e)}")
            return []

    def skip(self, reason: str, why: str) -> None:
        self.counters[f"spec_skipped_{reason}"] += 1
        if reason not in self._logged:  # once per reason: a full pool would say it every step
            self._logged.add(reason)
            log.warning("speculation: a verify was skipped (%s: %s); the sequence decodes one token "
                        "(counted as spec_skipped_%s, logged once)", reason, why, reason)

    def shadow(self, seqs: Sequence) -> None:
        """For a step carrying verifies over a model with recurrent layers:
        spare slots for every sequence's recurrent state (a slot per row of
        a decode or verify, one for a prompt chunk), or, where the pool has
        too few free, no verify this step (its drafts dropped, counted)."""
        drafting = [s for s in seqs if s.draft]
        if not drafting or not seqs[0].cache.recurrent_layers:
            return
        cache = seqs[0].cache
        group = cache.pool.layer_group[cache.recurrent_layers[0]]
        need = [1 + len(s.draft) for s in seqs]
        if sum(need) > len(cache.pool.groups[group].free):
            for seq in drafting:
                seq.draft = []
                self.skip("kv_blocks", "too few spare recurrent slots for the verifies' states")
            return
        for seq, n in zip(seqs, need):
            seq.cache.shadow = cache.pool.allocate(group, n)

    def drop(self, seqs: Sequence, error: BaseException) -> bool:
        """After a step carrying verifies failed with ``error``: whether it was
        out of memory (then every draft is dropped, counted, and the step can
        run again without them: nothing it wrote is read before it is
        written again, and recurrent state went to spare slots, given back here)."""
        if not any(s.draft for s in seqs) or not is_out_of_memory(error):
            return False
        for seq in seqs:
            seq.cache.drop_shadow()
            if seq.draft:
                seq.draft = []
                self.skip("out_of_memory", describe(error))
        return True

    def accept(self, seq, logits: torch.Tensor, emit: Callable[[object, torch.Tensor], bool]) -> None:
        """Sample ``seq``'s verify rows ``logits`` ``[1 + k, vocab]`` in order
        through ``emit`` (the scheduler's one-token step: False once the
        sequence has ended) while the sampled token equals the draft; then
        cut the cache back to the positions that agree with its tokens."""
        draft, seq.draft = seq.draft, []
        written = seq.cache.length  # the verify wrote the last token and the whole draft
        base = written - len(draft)  # positions up to base - 1 hold tokens; then the draft
        accepted = 0
        for i in range(len(draft) + 1):
            if not emit(seq, logits[i]):
                break
            if i == len(draft) or seq.tokens[-1] != draft[i]:
                break
            accepted += 1
        keep = base
        while keep < written and keep < len(seq.tokens) and seq.tokens[keep] == draft[keep - base]:
            keep += 1
        if seq.cache.shadow is not None:
            seq.cache.adopt(keep - base, keep)  # the state after the last kept row
        elif seq.cache.trim(keep) != keep:
            raise RuntimeError(f"a verify's cache could not be cut back to {keep} positions")
        self.drafter.feedback(seq, len(draft), accepted)
        self.counters["spec_drafts"] += 1
        self.counters["spec_draft_tokens"] += len(draft)
        self.counters["spec_accepted_tokens"] += accepted
        for i in range(accepted):
            self.counters[f"spec_accepted_at_{i}"] += 1

    def release(self, seq) -> None:
        self.drafter.release(seq)
