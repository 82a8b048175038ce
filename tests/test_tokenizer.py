"""The GGUF tokenizer against llama.cpp's token ids, and decoding."""

from __future__ import annotations

import pytest
from gguf_factory import write_gguf

from strata_runtime.files.gguf_file import GGUFFile
from strata_runtime.text.tokenizer import CONTROL, NORMAL, USER_DEFINED, Tokenizer, decode_stream


@pytest.fixture(scope="module")
def tok(engine) -> Tokenizer:
    return engine.tokenizer


def test_prompts_match_llamacpp(tok, reference_llamacpp):
    for case in reference_llamacpp["greedy"]:
        assert tok.encode(case["prompt"]) == case["prompt_tokens"], case["prompt"]


def test_texts_match_llamacpp(tok, reference_llamacpp, reference_float32):
    for ref in (reference_llamacpp, reference_float32):
        for case in ref["teacher_forced"]:
            assert tok.encode(case["text"]) == case["tokens"]


def test_decode_round_trips_reference_texts(tok, reference_llamacpp):
    for case in reference_llamacpp["teacher_forced"]:
        assert tok.decode(case["tokens"]) == case["text"]
    for case in reference_llamacpp["greedy"]:
        assert tok.decode(case["generated"]) == case["text"]


@pytest.mark.parametrize("text", ["naïve café", "漢字とかな", "emoji 🦙🧪 end", "tabs\tand\n\nnewlines   spaced", "\u0600\u10FFFF"])
def test_round_trip_including_byte_fallback(tok, text):
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text


def test_byte_fallback_tokens_are_used_for_unknown_characters(tok):
    ids = tok.encode("\U0010FFFD", add_bos=False)  # a private-use character no vocabulary holds
    assert all(tok.vocab.tokens[i].startswith("<0x") for i in ids) and len(ids) == 4


def test_stream_never_splits_a_character(tok):
    text = "a 🦙 and \U0010FFFD then done"
    ids = tok.encode(text, add_bos=False)
    pieces = decode_stream(tok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # The 4-byte character arrived as byte tokens: some pushes emitted nothing.
    assert "" in pieces[:-1]


def test_user_defined_tokens_always_match(tok):
    ids = tok.encode("a   b", add_bos=False)
    three_spaces = tok.ids["   "]
    assert tok.vocab.types[three_spaces] == USER_DEFINED
    assert three_spaces in ids


def test_control_tokens_only_with_special(tok):
    text = "<start_of_turn>user"
    plain = tok.encode(text, add_bos=False)
    special = tok.encode(text, add_bos=False, special=True)
    sot = tok.ids["<start_of_turn>"]
    assert tok.vocab.types[sot] == CONTROL
    assert special[0] == sot and sot not in plain
    assert tok.decode(special) == "user"  # control tokens render as nothing
    assert tok.decode(special, special=True) == text


def test_bos_and_end_of_generation(tok):
    assert tok.encode("hi")[0] == tok.bos_id == 2
    assert tok.encode("hi", add_bos=False)[0] != 2
    assert {1, tok.ids["<end_of_turn>"]} <= tok.end_of_generation


def test_gpt2_bpe_matches_the_tokenizers_it_came_from(tmp_path):
    """A byte-level BPE trained here, stored in a GGUF, read back: same ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    corpus = [
        "The quick brown fox jumps over the lazy dog. It's 2026 and we'll tokenize 12345 numbers!",
        "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(3))",
        "naïve café, déjà vu; über straße — “quotes” and emoji 🦙.",
    ] * 20
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]))
    vocab = hf.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [CONTROL if t == "<|endoftext|>" else NORMAL for t in tokens]
    import json

    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(hf.to_str())["model"]["merges"]]
    path = write_gguf(tmp_path / "bpe.gguf", tokenizer={
        "model": "gpt2", "pre": "gpt-2", "tokens": tokens, "types": types, "merges": merges, "eos": vocab["<|endoftext|>"],
    })
    ours = Tokenizer.from_gguf(GGUFFile.open(path))
    for text in corpus[:3] + ["  leading spaces and trailing  ", "fox's dog'll 99999"]:
        expected = hf.encode(text).ids
        assert ours.encode(text, add_bos=False) == expected, text
        assert ours.decode(expected) == text
    long = "\n".join(corpus[:3]) * 20
    ours.CHUNK_CHARS = 64  # cut after newlines: still the same ids
    assert len(ours._chunks(long)) > 10 and ours.encode(long, add_bos=False) == hf.encode(long).ids
    eot = vocab["<|endoftext|>"]
    assert eot in ours.encode("a<|endoftext|>b", add_bos=False, special=True)
    assert ours.end_of_generation == {eot}


# --- exactness of the fast paths, and long prompts ----------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from strata_runtime import Cancelled, StrataError  # noqa: E402
from strata_runtime.text.special_tokens import SpecialTokenSplitter  # noqa: E402
from strata_runtime.text.spm import SPM_SPACE, merge_reference  # noqa: E402


def _split_like_llamacpp(text: str, specials: list[tuple[str, int]]) -> list:
    """llama.cpp's loop as written there: longest token first, each split out of
    every fragment not yet claimed (the oracle for SpecialTokenSplitter)."""
    pieces: list = [text] if text else []
    for token_text, token_id in sorted(specials, key=lambda s: (-len(s[0]), s[1])):
        split: list = []
        for p in pieces:
            if isinstance(p, int):
                split.append(p)
                continue
            for i, part in enumerate(p.split(token_text)):
                if i:
                    split.append(token_id)
                if part:
                    split.append(part)
        pieces = split
    return pieces


SMALL = st.text(alphabet="abc<>", min_size=1, max_size=5)


@settings(max_examples=400, deadline=None)
@given(specials=st.lists(SMALL, min_size=1, max_size=8, unique=True), text=st.text(alphabet="abc<> ", max_size=60))
def test_special_token_splitting_follows_llamacpp_order(specials, text):
    """Overlapping specials ('ab' before 'bcd' in 'abcd'): the longer one wins, as in llama.cpp."""
    pairs = [(t, 100 + i) for i, t in enumerate(specials)]
    assert SpecialTokenSplitter(pairs).split(text) == _split_like_llamacpp(text, pairs)


def test_special_token_splitting_prefers_the_longer_token_that_starts_later():
    pairs = [("ab", 1), ("bcde", 2)]
    assert SpecialTokenSplitter(pairs).split("xabcdey") == ["xa", 2, "y"]


# Texts that make merges compete: periodic runs, repeated punctuation, mixed scripts.
MERGE_TEXT = st.one_of(
    st.text(alphabet="ab ", max_size=80),
    st.text(alphabet="=-_ \t#*", max_size=80),
    st.text(alphabet="aeiou ntrsl.,", max_size=120),
    st.text(alphabet="的是不了人我 ", max_size=40),
    st.text(max_size=60),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=MERGE_TEXT)
def test_fast_sentencepiece_model_equals_the_reference_merge(tok, text):
    """The ``tokenizers`` model built from the GGUF's scores gives llama.cpp's merge, id for id."""
    text = text.replace(" ", SPM_SPACE)
    fast = tok._fast_spm_model().encode(text, add_special_tokens=False).ids
    assert fast == merge_reference(text, tok.ids, tok.vocab.scores, tok._byte_token)


def test_fast_sentencepiece_model_on_source_code(tok):
    import inspect

    import strata_runtime.engine as module

    for line in inspect.getsource(module).splitlines():
        text = line.replace(" ", SPM_SPACE)
        fast = tok._fast_spm_model().encode(text, add_special_tokens=False).ids
        assert fast == merge_reference(text, tok.ids, tok.vocab.scores, tok._byte_token), line


def test_long_text_in_chunks_equals_one_piece(tok, reference_llamacpp, monkeypatch):
    """A long stretch is cut where no token can span the cut: the ids do not change."""
    text = " ".join(case["text"] for case in reference_llamacpp["teacher_forced"]).replace("\n", " ")
    monkeypatch.setattr(tok, "CHUNK_CHARS", 10**9)
    whole = tok.encode(text)
    monkeypatch.setattr(tok, "CHUNK_CHARS", 200)
    assert len(tok._chunks(text.replace(" ", SPM_SPACE))) > 10
    assert tok.encode(text) == whole


def test_a_cancelled_tokenization_stops_between_chunks(tok):
    asked = []

    def abort() -> bool:
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(Cancelled):
        tok.encode("word " * 50_000, abort=abort)
    assert len(asked) == 3


def test_lone_surrogates_are_refused_with_their_position(tok):
    with pytest.raises(StrataError, match=r"lone surrogate .* at character 2"):
        tok.encode("ab\ud800c")
    assert tok.encode("ok \U0001F999") == tok.encode("ok \ud83e\udd99".encode("utf-16", "surrogatepass").decode("utf-16"))


def test_max_chars_bounds_any_text_that_fits(tok):
    """No token spells more than max_token_chars characters, so longer text cannot fit."""
    assert tok.max_token_chars == max(len(t) for t in tok.vocab.tokens)
    run = " " * tok.max_token_chars * 4
    assert len(tok.encode(run, add_bos=False)) >= len(run) / tok.max_token_chars
