"""The GGUF tokenizer against llama.cpp's token ids, and decoding."""

from __future__ import annotations

import pytest
from gguf_factory import write_gguf

from strata_runtime.gguf_file import GGUFFile
from strata_runtime.tokenizer import CONTROL, NORMAL, USER_DEFINED, Tokenizer, decode_stream


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
    eot = vocab["<|endoftext|>"]
    assert eot in ours.encode("a<|endoftext|>b", add_bos=False, special=True)
    assert ours.end_of_generation == {eot}
