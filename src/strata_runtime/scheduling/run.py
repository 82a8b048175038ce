"""One generation driven through the scheduler and turned into text:
``Run`` (iterate it for text pieces, or ``pump`` it where something else
steps the scheduler) and the ``Completion`` it ends with."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from ..errors import Cancelled
from ..text import AssistantReply, ReplyStream, StopTextStream
from .constraint import Constraint
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Generation


@dataclass(frozen=True)
class Completion:
    """One finished generation. ``tokens`` are the generated ids (an
    end-of-generation token is not included); ``finish_reason`` is ``"stop"``
    (EOS or a stop string), ``"tool_calls"`` (a chat reply that ended in tool
    calls), ``"length"`` (max_tokens or the context ran out: never tool calls,
    whatever the text held) or ``"cancelled"`` (the stream was closed before it ended)."""

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    prefill_seconds: float
    decode_seconds: float
    reply: AssistantReply | None = None  # a chat's reply read back: content, reasoning, tool calls
    # Per token of ``tokens`` where the sampling asked (``logprobs``): (logprob, [(alternative, logprob), ...]).
    logprobs: list | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def prefill_tokens_per_second(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes out of prefill; decode steps make the rest.
        steps = max(0, len(self.tokens) - 1)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


class Run:
    """One generation as a sequence (``seq``) of the engine's scheduler:
    iterate for text pieces (each iteration steps the scheduler, every
    sequence in it advancing together), or, where something else steps it,
    ``pump()`` for the text so far; ``completion`` once it has ended."""

    def __init__(self, scheduler: Scheduler, text: StopTextStream, prompt: list[int], params: SamplingParams,
                 boundaries: Sequence[int] = (), root: int | None = None,
                 abort: Callable[[], bool] | None = None, scope: str = "",
                 on_complete: Callable[[Completion], None] | None = None, constraint: Constraint | None = None):
        self.scheduler = scheduler
        self.constraint = constraint
        self.prompt = prompt
        self.params = params
        self.boundaries = boundaries
        self.root = root
        self.abort = abort
        self.scope = scope
        self.on_complete = on_complete
        self.completion: Completion | None = None
        self.seq: Generation | None = None
        self.text = text
        self.started = 0.0
        # A chat's (set by the engine; None for a plain prompt): (generated tokens, text) -> AssistantReply,
        # and its reading as it goes: the text with control tokens spelled (cut at the same stop strings) fed
        # to a ReplyStream, whose deltas wait in ``_deltas`` for ``take_deltas``.
        self.read_reply: Callable[[list[int], str], AssistantReply] | None = None
        self.reply_stream: ReplyStream | None = None
        self._logprobs_taken = 0  # entries of seq.logprobs handed out by take_logprobs
        self.special_text: StopTextStream | None = None
        self._deltas: list[dict] = []

    def submit(self, bounded: bool = False, sibling: Generation | None = None) -> Generation:
        """Queue this generation (``bounded``: subject to the waiting queue's bound;
        ``sibling``: a sequence of the same prompt to copy the prompt's state from)."""
        self.started = time.perf_counter()
        self.seq = self.scheduler.submit(self.prompt, self.params, self.scope, self.boundaries, self.root,
                                         bounded=bounded, constraint=self.constraint, sibling=sibling)
        return self.seq

    def pump(self) -> str:
        """The text of the tokens generated since the last call; at the end,
        the held-back tail too, and ``completion`` is set."""
        seq, text = self.seq, self.text
        out = []
        taken = seq.take()
        for i, token in enumerate(taken):
            out.append(text.push(token))
            if self.reply_stream is not None:
                self._deltas += self.reply_stream.feed(self.special_text.push(token))
            if text.stopped:
                seq.stop(unused=len(taken) - 1 - i)
                break
        if seq.done and self.completion is None:
            out.append(text.finish())
            if self.reply_stream is not None:
                self._deltas += self.reply_stream.feed(self.special_text.finish())
                self._deltas += self.reply_stream.finish()
            self._complete()
        return "".join(out)

    def take_logprobs(self) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """(token, logprob, alternatives) of the tokens generated since the last call, where asked for."""
        seq = self.seq
        upto = min(len(seq.logprobs), len(seq.generated))
        out = [(seq.generated[i], *seq.logprobs[i]) for i in range(self._logprobs_taken, upto)]
        self._logprobs_taken = max(self._logprobs_taken, upto)
        return out

    def take_deltas(self) -> list[dict]:
        """The reply's deltas since the last call (a chat's; see ``text.reply_stream``)."""
        out, self._deltas = self._deltas, []
        return out

    def _complete(self) -> None:
        seq, end = self.seq, time.perf_counter()
        first = seq.first_token_at or end
        finish, reply = seq.finish_reason or "length", None
        if self.read_reply is not None:
            reply = self.read_reply(list(seq.generated), self.text.emitted)
            if finish == "stop" and reply.tool_calls:
                finish = "tool_calls"
            elif reply.tool_calls:  # cut off (length, cancelled): what it held is text, not calls to make
                reply = AssistantReply(self.text.emitted, None)
        self.completion = Completion(text=self.text.emitted, tokens=list(seq.generated),
                                     finish_reason=finish, prompt_tokens=len(self.prompt),
                                     cached_tokens=seq.cached_tokens, prefill_seconds=max(0.0, first - self.started),
                                     decode_seconds=max(0.0, end - first), reply=reply,
                                     logprobs=list(seq.logprobs) if self.params.logprobs is not None else None)
        if self.on_complete is not None:
            self.on_complete(self.completion)

    def __iter__(self) -> Iterator[str]:
        scheduler = self.scheduler
        seq = self.submit()
        try:
            while True:
                piece = self.pump()
                if piece:
                    yield piece
                if seq.done:
                    return
                if self.abort is not None and self.abort():
                    raise Cancelled(seq.progress())
                scheduler.step()
        finally:
            if not seq.done:  # closed early, cancelled, or an error: the sequence ends here
                seq.cancel("cancelled")
                scheduler.retire()
            if self.completion is None:
                self.text.finish()
                self._complete()


def run_together(scheduler: Scheduler, runs: Sequence[Run], siblings: bool = False) -> list[Run]:
    """Step ``scheduler`` until every run's generation has ended (``siblings``:
    runs of one prompt, the later ones copying the first's prompt state)."""
    for i, run in enumerate(runs):
        run.submit(sibling=runs[0].seq if siblings and i else None)
    while True:
        for run in runs:
            run.pump()
        if all(run.completion is not None for run in runs):
            return list(runs)
        scheduler.step()
