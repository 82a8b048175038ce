"""Turning generated tokens into text: UTF-8 reassembly and stop strings."""

from __future__ import annotations

from .tokenizer import StreamDecoder


class StopTextStream:
    """Text of a generation as it may be shown, honouring stop strings.

    Invariant: ``emitted`` never contains a stop string, and text that could
    still turn out to begin one is held back until it cannot. When a stop
    string completes, ``stopped`` is set and everything from it on is dropped.
    """

    def __init__(self, decoder: StreamDecoder, stop: tuple[str, ...]):
        self._decoder = decoder
        self._stop = stop
        # For each stop string, by character c: the lengths n (longest first) of
        # its prefixes that end in c. Held text can only end in such a prefix.
        self._prefix_ends: list[dict[str, list[int]]] = []
        for s in stop:
            ends: dict[str, list[int]] = {}
            for n in range(len(s) - 1, 0, -1):
                ends.setdefault(s[n - 1], []).append(n)
            self._prefix_ends.append(ends)
        self._held = ""
        self.emitted = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; return the text that is now safe to show."""
        return self._feed(self._decoder.push(token), final=False)

    def finish(self) -> str:
        return self._feed(self._decoder.flush(), final=True)

    def _feed(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        held = self._held + text
        cut = min((i for i in (held.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._held = held[:cut], ""
        elif final:
            out, self._held = held, ""
        else:
            keep = self._longest_stop_prefix_suffix(held)
            out, self._held = held[: len(held) - keep], held[len(held) - keep:]
        self.emitted += out
        return out

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        if not text:
            return 0
        best = 0
        for s, ends in zip(self._stop, self._prefix_ends):
            for n in ends.get(text[-1], ()):
                if n <= best:
                    break
                if n <= len(text) and text.endswith(s[:n]):
                    best = n
                    break
        return best
