"""The tokenizer stored in a GGUF file.

Two vocabularies, as llama.cpp reads them:

- ``llama`` (SentencePiece, as in Gemma): bigram merging by token score with
  byte fallback, llama.cpp's exact algorithm (``spm.py``: the GGUF carries
  scores, not a SentencePiece model or a merge list).
- ``gpt2`` (byte-level BPE, as in Llama 3 and Qwen): the GGUF merge list run by
  the ``tokenizers`` library, after the pre-tokenizer regex that
  ``tokenizer.ggml.pre`` names.

Both first split the text on user-defined tokens (always) and control tokens
(when ``special=True``), longest first, as llama.cpp does (``special_tokens.py``).
"""

from __future__ import annotations

import codecs
import logging
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ..errors import Cancelled, ModelFileError, StrataError
from ..files import GGUFFile
from .special_tokens import SpecialTokenSplitter
from .spm import SPM_SPACE, build_fast_model, merge_reference, safe_split_pattern

log = logging.getLogger(__name__)

# gguf TokenType values.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

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
# Each a sequence of patterns, applied in turn to the pieces the previous made.
BPE_PRE_TOKENIZERS = {
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),  # digits one by one first
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
    if not isinstance(model, str) or not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelFileError(f"{gguf.path}: tokenizer.ggml.model must be text and tokenizer.ggml.tokens a list of "
                             "texts; the file is malformed: convert it again")
    n = len(tokens)
    types = _per_token(gguf, "tokenizer.ggml.token_type", [NORMAL] * n, n, int)
    scores = _per_token(gguf, "tokenizer.ggml.scores", [0.0] * n, n, float)
    return Vocabulary(
        model=model,
        tokens=list(tokens),
        types=types,
        scores=scores,
        bos_id=_token_id(gguf, "tokenizer.ggml.bos_token_id", n),
        eos_id=_token_id(gguf, "tokenizer.ggml.eos_token_id", n),
        add_bos=bool(gguf.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_space_prefix=bool(gguf.get("tokenizer.ggml.add_space_prefix", model == "llama")),
        pre=str(gguf.get("tokenizer.ggml.pre", "default")),
        merges=list(gguf.get("tokenizer.ggml.merges", []) or []),
    )


def _per_token(gguf: GGUFFile, key: str, default: list, n: int, kind: type) -> list:
    """A list with one number per token (``ModelFileError`` naming ``key`` otherwise)."""
    values = gguf.get(key, default)
    if not isinstance(values, list) or len(values) != n or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ModelFileError(f"{gguf.path}: metadata key {key} must list one number for each of the {n} tokens; "
                             "the file is malformed: convert it again")
    return [kind(v) for v in values]


def _token_id(gguf: GGUFFile, key: str, n: int) -> int | None:
    value = gguf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise ModelFileError(f"{gguf.path}: metadata key {key} is {value!r}; a token id in [0, {n}) belongs there. "
                             "The file is malformed: convert it again")
    return value


class Tokenizer:
    """Text <-> token ids for one vocabulary.

    Encoding splits the text at special tokens (``special_tokens``), then
    tokenizes each plain stretch: SentencePiece stretches by llama.cpp's
    merge (``spm``: in Python, or through ``tokenizers`` once that model is
    built, on the first stretch of ``FAST_FROM_CHARS`` characters or by
    ``prepare()``; both exact), BPE stretches by ``tokenizers``. Long
    stretches go in chunks of about ``CHUNK_CHARS``, cut where no token can
    span the cut, with a check of ``abort`` between chunks."""

    FAST_FROM_CHARS = 2048
    CHUNK_CHARS = 16384

    def __init__(self, vocab: Vocabulary):
        if vocab.model not in ("llama", "gpt2"):
            raise ModelFileError(
                f"tokenizer model {vocab.model!r} is not supported; supported: 'llama' (SentencePiece), 'gpt2' (BPE)"
            )
        self.vocab = vocab
        self.ids = {text: i for i, text in enumerate(vocab.tokens)}
        types = vocab.types
        self._user_defined = SpecialTokenSplitter(
            [(t, i) for i, t in enumerate(vocab.tokens) if types[i] == USER_DEFINED])
        self._special = SpecialTokenSplitter(
            [(t, i) for i, t in enumerate(vocab.tokens) if types[i] in (USER_DEFINED, CONTROL, UNKNOWN)])
        self.max_token_chars = max((len(t) for t in vocab.tokens), default=1)
        self._piece_bytes = self._build_piece_bytes()
        self.end_of_generation = frozenset(self._end_of_generation_ids())
        self._unknown_id = next((i for i, t in enumerate(types) if t == UNKNOWN), 0)
        if vocab.model == "gpt2":
            self._bpe = self._build_bpe()
            # The pre-tokenizer regexes never match across a newline followed by a non-space.
            self._safe_split = re.compile(r"(?<=\n)(?=\S)")
        else:
            self._bpe = None
            self._mergeable = [t != BYTE for t in types]
            self._safe_split = safe_split_pattern(vocab.tokens, self._mergeable)
        self._fast_spm = None  # built on the first long stretch (seconds for a large vocabulary)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "Tokenizer":
        return cls(read_vocabulary(gguf))

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    def split_special(self, text: str) -> list[str | int]:
        """``text`` split at every special token written in it (as ``encode(special=True)`` splits it)."""
        return self._special.split(text)

    @property
    def special_chars(self) -> set[str]:
        """Every character of every special token's text."""
        return set().union(*self._special.order)

    def max_chars(self, tokens: int) -> int:
        """The most characters that ``tokens`` tokens can spell: longer text can never fit."""
        return tokens * self.max_token_chars

    # --- encoding -------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True, special: bool = False, *,
               unescape: Callable[[str], str] | None = None, abort: Callable[[], bool] | None = None) -> list[int]:
        """Token ids for ``text``; ``special=True`` also matches control tokens
        such as ``<start_of_turn>`` written in the text.

        ``unescape`` turns each plain stretch back into the text it stands for
        (``ControlTextGuard.restore``), which is then tokenized as plain text.
        ``abort`` is asked between chunks of a long text; when it says yes,
        ``Cancelled`` is raised."""
        check_text(text)
        out: list[int] = []
        if add_bos and self.vocab.add_bos and self.vocab.bos_id is not None:
            out.append(self.vocab.bos_id)
        splitter = self._special if special else self._user_defined
        prev_special = True
        for piece in splitter.split(text):
            if isinstance(piece, int):
                out.append(piece)
                prev_special = True
                continue
            restored = piece if unescape is None else unescape(piece)
            parts = [restored] if restored is piece else self._user_defined.split(restored)
            for part in parts:
                if isinstance(part, int):
                    out.append(part)
                    prev_special = True
                else:
                    self._encode_plain(part, prev_special, out, abort)
                    prev_special = False
        return out

    def _encode_plain(self, text: str, after_special: bool, out: list[int], abort) -> None:
        if self._bpe is None:
            if self.vocab.add_space_prefix and after_special:
                text = " " + text
            text = text.replace(" ", SPM_SPACE)
        for chunk in self._chunks(text):
            if abort is not None and abort():
                raise Cancelled("tokenization was cancelled")
            if self._bpe is not None:
                out.extend(self._bpe.encode(chunk, add_special_tokens=False).ids)
            elif self._fast_spm is None and len(chunk) < self.FAST_FROM_CHARS:
                out.extend(merge_reference(chunk, self.ids, self.vocab.scores, self._byte_token))
            else:
                out.extend(self._fast_spm_model().encode(chunk, add_special_tokens=False).ids)

    def _chunks(self, text: str) -> list[str]:
        """``text`` cut at safe places into chunks of about ``CHUNK_CHARS``."""
        if len(text) <= self.CHUNK_CHARS:
            return [text]
        chunks, start = [], 0
        while len(text) - start > self.CHUNK_CHARS:
            cut = self._safe_split.search(text, start + self.CHUNK_CHARS)
            if cut is None:
                break
            chunks.append(text[start:cut.start()])
            start = cut.start()
        chunks.append(text[start:])
        return chunks

    def _fast_spm_model(self):
        if self._fast_spm is None:
            t0 = time.perf_counter()
            unknown = self.vocab.tokens[self._unknown_id] if self.vocab.types[self._unknown_id] == UNKNOWN else None
            self._fast_spm = build_fast_model(self.vocab.tokens, self.ids, self.vocab.scores, self._mergeable, unknown)
            log.info("built the fast SentencePiece tokenizer in %.1f s", time.perf_counter() - t0)
        return self._fast_spm

    def prepare(self) -> None:
        """Build what the first long prompt would otherwise wait for (a server calls this at start)."""
        if self._bpe is None:
            self._fast_spm_model()

    def _byte_token(self, byte: int) -> int:
        token = self.ids.get(f"<0x{byte:02X}>")
        return self._unknown_id if token is None else token

    def _build_bpe(self):
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        patterns = BPE_PRE_TOKENIZERS.get(self.vocab.pre)
        if patterns is None:
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
            *(pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in patterns),
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

    def stream_decoder(self, special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, special)

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

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self._tokenizer = tokenizer
        self._special = special  # control tokens spelled out (where a reply's markers are read)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._started = False

    def push(self, token: int) -> str:
        text = self._utf8.decode(self._tokenizer.token_bytes(token, self._special))
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


def check_text(text: str) -> None:
    """Text that can be tokenized: a ``str`` of Unicode characters (no lone surrogate)."""
    if not isinstance(text, str):
        raise StrataError(f"expected text (str), got {type(text).__name__}")
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise StrataError(f"the text has a lone surrogate ({text[e.start]!r}) at character {e.start}; "
                          f"text must be valid Unicode (a surrogate pair joined into one character)") from None
