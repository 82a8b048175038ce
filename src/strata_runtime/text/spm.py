"""SentencePiece merging as llama.cpp does it, in Python and through ``tokenizers``.

A GGUF ``llama`` vocabulary carries token scores, not a SentencePiece model
or a merge list. llama.cpp tokenizes a stretch of text by starting from its
characters and repeatedly merging the adjacent pair whose joined text is the
highest-scoring token (leftmost on ties), then spelling any leftover
character as byte tokens.

- ``merge_reference`` is that algorithm in Python: exact, and fast enough for
  short stretches (~1 us a character), but a long stretch without any
  special token in it runs at tens of thousands of characters a second.
- ``build_fast_model`` turns the vocabulary into a ``tokenizers`` BPE model
  whose merges are every split of a token into two tokens, ranked by the
  joined token's score: the same merges in the same order, run in Rust. The
  tests hold it equal to the reference on large and adversarial texts.

``safe_split_pattern`` finds where a stretch can be cut without changing its
tokens: between two characters that no token contains side by side, no merge
can ever join them, so the two sides tokenize independently. That bounds the
work between two checks of a cancel flag.
"""

from __future__ import annotations

import heapq
import re
from typing import Callable, Sequence

import numpy as np

SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space


def merge_reference(text: str, ids: dict[str, int], scores: Sequence[float],
                    byte_token: Callable[[int], int]) -> list[int]:
    """llama.cpp's SentencePiece tokenizer on one stretch (spaces already ``▁``)."""
    n = len(text)
    if n == 0:
        return []
    start = list(range(n))
    length = [1] * n
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        joined = text[start[left]:start[left] + length[left] + length[right]]
        token = ids.get(joined)
        if token is not None:
            heapq.heappush(heap, (-scores[token], left, right, len(joined)))

    for i in range(1, n):
        push(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
            continue  # stale: one side was merged since
        length[left] += length[right]
        length[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])

    out: list[int] = []
    i = 0
    while i != -1:
        piece = text[start[i]:start[i] + length[i]]
        token = ids.get(piece)
        if token is not None:
            out.append(token)
        else:
            out.extend(byte_token(b) for b in piece.encode("utf-8"))
        i = nxt[i]
    return out


def build_fast_model(tokens: Sequence[str], ids: dict[str, int], scores: Sequence[float],
                     mergeable: Sequence[bool], unknown: str | None):
    """A ``tokenizers.Tokenizer`` equal to ``merge_reference`` for this vocabulary.

    ``mergeable[i]``: token ``i`` may be formed by a merge or be half of one
    (byte tokens are not: they only spell leftover characters)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    merges: list[tuple[str, str]] = []
    # Highest score first; a token's splits in order of the left half's length.
    for token_id in np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable").tolist():
        text = tokens[token_id]
        if len(text) < 2 or not mergeable[token_id] or ids.get(text) != token_id:
            continue
        for k in range(1, len(text)):
            left, right = ids.get(text[:k]), ids.get(text[k:])
            if left is not None and right is not None and mergeable[left] and mergeable[right]:
                merges.append((text[:k], text[k:]))
    model = models.BPE(vocab=dict(ids), merges=merges, byte_fallback=True, unk_token=unknown)
    return HFTokenizer(model)


def safe_split_pattern(tokens: Sequence[str], mergeable: Sequence[bool]) -> re.Pattern:
    """Positions before a ``▁`` that no merge can reach across: the character
    before it never precedes a ``▁`` inside a token."""
    before = {t[k - 1] for t, ok in zip(tokens, mergeable) if ok and SPM_SPACE in t[1:]
              for k in range(1, len(t)) if t[k] == SPM_SPACE}
    if not before:
        return re.compile(SPM_SPACE)
    return re.compile(f"(?<![{''.join(re.escape(c) for c in sorted(before))}]){SPM_SPACE}")
