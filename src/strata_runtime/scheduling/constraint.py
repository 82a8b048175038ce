"""One sequence's grammar in its sampler: which tokens may come next.

A ``Constraint`` wraps one ``llguidance.LLMatcher``. The sampler asks it for
the allowed tokens before penalties and top-k/top-p (so every filter sees
only what the grammar allows) and tells it each token it chose. Batching,
preemption and speculative verifies need nothing of it: the constraint
lives on the sequence's sampler, which sees one token at a time in order
(a verify's rows are sampled one after another, as plain decoding would),
and a stop string that drops tokens rolls them back.

The next token's mask is computed on a worker thread as soon as a token is
chosen, so it is ready while the model's forward runs (llguidance releases
the GIL while it computes). A greedy choice the grammar allows is taken
without masking the logits.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _mask_thread() -> ThreadPoolExecutor:
    """One thread for every sequence's masks (made on first use: importing has no side effects)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-grammar-mask")
        return _executor


class ConstraintViolation(RuntimeError):
    """A token the grammar does not allow reached the matcher (a bug in the caller, never the request's)."""


class Constraint:
    """The grammar state of one sequence.

    Invariant: the matcher has consumed exactly the tokens this sequence's
    sampler returned since the constraint was made, less those rolled back;
    ``_next`` (when set) is the bitmask of the tokens allowed after them,
    being computed or computed, and is dropped whenever the matcher moves.
    """

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._next: Future | None = None
        self._prefetch()

    @property
    def finished(self) -> bool:
        """The grammar is complete: only an end-of-generation token may follow."""
        return self.matcher.is_stopped()

    def _compute(self) -> torch.Tensor:
        bits = torch.empty(self._words, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), self._words * 4)
        return bits

    def _prefetch(self) -> None:
        self._next = _mask_thread().submit(self._compute)

    def bitmask(self) -> torch.Tensor:
        """``[ceil(vocab / 32)]`` int32: bit ``t % 32`` of word ``t // 32`` set where token ``t`` may come next."""
        if self._next is None:
            self._prefetch()
        return self._next.result()

    def allows(self, token: int) -> bool:
        if not 0 <= token < self.vocab_size:
            return False
        return bool((int(self.bitmask()[token >> 5]) >> (token & 31)) & 1)

    def allowed_among(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (int64 ids in the vocabulary) -> bool, True where the grammar allows that token next:
        a gather of ``len(tokens)`` bits, where ``restrict`` unpacks the whole vocabulary's."""
        bits = self.bitmask()
        return ((bits[tokens >> 5] >> (tokens & 31).to(torch.int32)) & 1).bool()

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[n]`` (n at least the vocabulary: rows past it are padding) with every token the
        grammar does not allow at -inf (a new tensor on ``logits``' device)."""
        bits = self.bitmask().to(logits.device)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bits.unsqueeze(1) >> shifts) & 1).bool().reshape(-1)[:self.vocab_size]
        out = torch.full_like(logits, float("-inf"))
        n = min(self.vocab_size, logits.shape[0])
        out[:n] = torch.where(allowed[:n], logits[:n], out[:n])
        return out

    def advance(self, token: int) -> None:
        """The sampler chose ``token``."""
        self._settle()
        if not self.matcher.consume_token(token):
            raise ConstraintViolation(f"token {token} is not allowed here by the sequence's grammar "
                                      f"({self.matcher.get_error() or 'no error recorded'})")
        self._prefetch()

    def rollback(self, tokens: int) -> None:
        """Forget the last ``tokens`` chosen (a stop string cut them off)."""
        if tokens <= 0:
            return
        self._settle()
        if not self.matcher.rollback(tokens):
            raise ConstraintViolation(f"the grammar cannot roll back {tokens} tokens: {self.matcher.get_error()}")
        self._prefetch()

    def _settle(self) -> None:
        """Wait for a mask in flight: the matcher is not to be touched by two threads at once."""
        if self._next is not None:
            self._next.result()
            self._next = None
