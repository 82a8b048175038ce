"""The tokenizer stored in a GGUF file.

Two vocabularies, as llama.cpp reads them:

- ``llama`` (SentencePiece, as in Gemma): bigram merging by token score with
  byte fallback, implemented here because it is llama.cpp's exact algorithm
  (the GGUF carries scores, not a SentencePiece model or a merge list).
- ``gpt2`` (byte-level BPE, as in Llama 3 and Qwen): the GGUF merge list run by
  the ``tokenizers`` library, after the pre-tokenizer regex that
  ``tokenizer.ggml.pre`` names.

Both first split the text on user-defined tokens (always) and control tokens
(when ``special=True``), longest first, as llama.cpp does.
"""

from __future__ import annotations

import codecs
import heapq
from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import ModelFileError
from .gguf_file import GGUFFile

# gguf TokenType values.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# Pre-tokenizer regexes of the byte-level BPE vocabularies (llama.cpp's table,
# keyed by tokenizer.ggml.pre).
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2_SPLIT = (
    r"""(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BPE_PRE_TOKENIZERS = {
    "default": _GPT2_SPLIT,
    "gpt-2": _GPT2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}

# Turn-ending tokens that end generation besides EOS, as llama.cpp recognises them.
_END_OF_TURN_TEXTS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<turn|>")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass(frozen=True)
class Vocabulary:
    """The token table of a GGUF. Invariant: ``len(tokens) == len(types) ==
    len(scores)``, ids index all three, and ``ids`` maps each text to the
    highest id carrying it (llama.cpp's rule for duplicates)."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_space_prefix: bool
    pre: str
    merges: list[str]

    @property
    def size(self) -> int:
        return len(self.tokens)


def read_vocabulary(gguf: GGUFFile) -> Vocabulary:
    model = gguf.get("tokenizer.ggml.model")
    tokens = gguf.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise ModelFileError(f"{gguf.path} has no tokenizer (tokenizer.ggml.*); Strata needs a GGUF with its vocabulary")
    n = len(tokens)
    types = list(gguf.get("tokenizer.ggml.token_type", [NORMAL] * n))
    scores = [float(s) for s in gguf.get("tokenizer.ggml.scores", [0.0] * n)]
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    return Vocabulary(
        model=model,
        tokens=list(tokens),
        types=types,
        scores=scores,
        bos_id=None if bos is None else int(bos),
        eos_id=None if eos is None else int(eos),
        add_bos=bool(gguf.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_space_prefix=bool(gguf.get("tokenizer.ggml.add_space_prefix", model == "llama")),
        pre=str(gguf.get("tokenizer.ggml.pre", "default")),
        merges=list(gguf.get("tokenizer.ggml.merges", []) or []),
    )


class Tokenizer:
    """Text <-> token ids for one vocabulary."""

    def __init__(self, vocab: Vocabulary):
        if vocab.model not in ("llama", "gpt2"):
            raise ModelFileError(
                f"tokenizer model {vocab.model!r} is not supported; supported: 'llama' (SentencePiece), 'gpt2' (BPE)"
            )
        self.vocab = vocab
        self.ids = {text: i for i, text in enumerate(vocab.tokens)}
        by_length = sorted(range(vocab.size), key=lambda i: -len(vocab.tokens[i]))
        self._user_defined = [(vocab.tokens[i], i) for i in by_length if vocab.types[i] == USER_DEFINED]
        self._all_special = [
            (vocab.tokens[i], i) for i in by_length if vocab.types[i] in (USER_DEFINED, CONTROL, UNKNOWN)
        ]
        self._piece_bytes = self._build_piece_bytes()
        self.end_of_generation = frozenset(self._end_of_generation_ids())
        self._bpe = self._build_bpe() if vocab.model == "gpt2" else None

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "Tokenizer":
        return cls(read_vocabulary(gguf))

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    # --- encoding -------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids for ``text``; ``special=True`` also matches control tokens
        such as ``<start_of_turn>`` written in the text."""
        out: list[int] = []
        if add_bos and self.vocab.add_bos and self.vocab.bos_id is not None:
            out.append(self.vocab.bos_id)
        prev_special = True
        for piece in self._partition(text, special):
            if isinstance(piece, int):
                out.append(piece)
                prev_special = True
                continue
            if self._bpe is not None:
                out.extend(self._bpe.encode(piece, add_special_tokens=False).ids)
            else:
                if self.vocab.add_space_prefix and prev_special:
                    piece = " " + piece
                out.extend(self._spm_encode(piece.replace(" ", SPM_SPACE)))
            prev_special = False
        return out

    def _partition(self, text: str, special: bool) -> list[str | int]:
        pieces: list[str | int] = [text]
        for token_text, token_id in self._all_special if special else self._user_defined:
            if not any(isinstance(p, str) and token_text in p for p in pieces):
                continue
            split: list[str | int] = []
            for p in pieces:
                if isinstance(p, int) or token_text not in p:
                    split.append(p)
                    continue
                for i, part in enumerate(p.split(token_text)):
                    if i:
                        split.append(token_id)
                    if part:
                        split.append(part)
            pieces = split
        return pieces

    def _spm_encode(self, text: str) -> list[int]:
        """llama.cpp's SentencePiece tokenizer: repeatedly merge the adjacent
        pair whose joined text is the highest-scoring token (leftmost on ties)."""
        n = len(text)
        if n == 0:
            return []
        start = list(range(n))
        length = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []
        ids, scores = self.ids, self.vocab.scores

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
                out.extend(self._byte_token(b) for b in piece.encode("utf-8"))
            i = nxt[i]
        return out

    def _byte_token(self, byte: int) -> int:
        token = self.ids.get(f"<0x{byte:02X}>")
        if token is None:
            unk = next((i for i, t in enumerate(self.vocab.types) if t == UNKNOWN), 0)
            return unk
        return token

    def _build_bpe(self):
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        pattern = BPE_PRE_TOKENIZERS.get(self.vocab.pre)
        if pattern is None:
            raise ModelFileError(
                f"BPE pre-tokenizer {self.vocab.pre!r} is not supported; supported: "
                f"{', '.join(sorted(BPE_PRE_TOKENIZERS))}"
            )
        merges = [tuple(m.split(" ", 1)) for m in self.vocab.merges]
        # User-defined and control tokens are split off before BPE runs, so the
        # BPE model sees only plain text.
        model = models.BPE(vocab=dict(self.ids), merges=merges, ignore_merges=self.vocab.pre in ("llama-bpe", "llama3"))
        bpe = HFTokenizer(model)
        bpe.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        return bpe

    # --- decoding -------------------------------------------------------

    def _build_piece_bytes(self) -> list[bytes]:
        """The bytes each token stands for; control tokens stand for nothing."""
        v = self.vocab
        byte_level = {c: b for b, c in _byte_to_unicode().items()} if v.model == "gpt2" else None
        out: list[bytes] = []
        for text, kind in zip(v.tokens, v.types):
            if kind in (CONTROL, UNUSED):
                out.append(b"")
            elif kind == USER_DEFINED:
                out.append(text.encode("utf-8"))
            elif byte_level is None:  # SentencePiece
                out.append(bytes([int(text[3:-1], 16)]) if kind == BYTE else text.replace(SPM_SPACE, " ").encode("utf-8"))
            else:
                # Byte-level BPE spells bytes with stand-in characters; a token
                # outside that alphabet is plain text.
                plain = any(c not in byte_level for c in text)
                out.append(text.encode("utf-8") if plain else bytes(byte_level[c] for c in text))
        return out

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        if special and self.vocab.types[token] == CONTROL:
            return self.vocab.tokens[token].encode("utf-8")
        return self._piece_bytes[token]

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        data = b"".join(self.token_bytes(i, special) for i in ids)
        text = data.decode("utf-8", errors="replace")
        if self.vocab.add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def _end_of_generation_ids(self) -> list[int]:
        out = [] if self.vocab.eos_id is None else [self.vocab.eos_id]
        for text in _END_OF_TURN_TEXTS:
            token = self.ids.get(text)
            if token is not None and self.vocab.types[token] == CONTROL:
                out.append(token)
        return out


class StreamDecoder:
    """Turns tokens into text as they arrive, holding back the bytes of a UTF-8
    character split across tokens until it is complete."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False

    def push(self, token: int) -> str:
        text = self._utf8.decode(self._tokenizer.token_bytes(token))
        if not self._started and text:
            self._started = True
            if self._tokenizer.vocab.add_space_prefix and text.startswith(" "):
                text = text[1:]
        return text

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def decode_stream(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """The pieces a stream of ``ids`` yields (for tests and tools)."""
    dec = tokenizer.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    return pieces
