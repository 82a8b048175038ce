"""The tensor-core GEMV's and the attention's inline PTX conversions, run on
this CPU by a small interpreter of the instructions they use (``and``,
``or``, ``xor``, ``shl``, ``shr``, ``mov`` (a pair packed or unpacked too),
``prmt``, ``sub.f16x2``, ``fma.rn.f16x2``): the GEMV's word of code bytes as float16 1024 + each byte,
IQ4_XS's codebook lookup putting every weight where ``_weight_order`` (what
the plain Triton form and x's rows follow) says, as 1024 + value + 128; the
attention's give each byte (int8 KV) or 4-bit code's IQ4_NL level (k8v4
values, times their block's scale) as float16, in order. Without a GPU this is what checks the PTX
strings themselves; the GPU-marked tests compare the compiled kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from strata_kernels._triton_gemv_mma import _weight_order
from strata_kernels.formats import lookup_table
from strata_kernels.word_planes import WordPlanes, _codes

from helpers import random_quant_tensor
from test_gemv_words import _blocks_for

MASK = np.uint64(0xFFFFFFFF)


def _value(token: str, regs: dict) -> np.ndarray:
    token = token.strip()
    if token in regs:
        return regs[token]
    return np.uint64(int(token, 0) & 0xFFFFFFFF)


def _prmt(a, b, sel):
    """PTX prmt.b32, default mode: result byte k is byte (sel nibble k & 7)
    of b:a, or that byte's sign replicated where the nibble's bit 3 is set."""
    both = (a & MASK) | ((b & MASK) << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, sel).shape, dtype=np.uint64)
    for k in range(4):
        nibble = (sel >> np.uint64(4 * k)) & np.uint64(15)
        byte = (both >> (np.uint64(8) * (nibble & np.uint64(7)))) & np.uint64(0xFF)
        byte = np.where(nibble & np.uint64(8), np.where(byte & np.uint64(0x80), 0xFF, 0), byte).astype(np.uint64)
        out |= byte << np.uint64(8 * k)
    return out


def _halves(word: np.ndarray) -> np.ndarray:
    """A 32-bit register as its two float16 (low half first) ``[..., 2]``."""
    return np.asarray(word, dtype=np.uint64).astype(np.uint32)[..., None].view(np.float16)


def _from_halves(pair: np.ndarray) -> np.ndarray:
    return pair.astype(np.float16).view(np.uint32)[..., 0].astype(np.uint64)


def run_ptx(text: str, operands: dict[int, np.ndarray], outputs: int) -> list[np.ndarray]:
    """Run ``text`` (an ``inline_asm_elementwise`` body) on uint32 arrays:
    ``operands`` maps $N to its values; returns $0..$(outputs - 1)."""
    regs = {f"${n}": np.asarray(v, dtype=np.uint64) & MASK for n, v in operands.items()}
    for line in text.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if args.startswith("{"):  # mov.b32 {$a, $b}, r: a 32-bit register unpacked into two 16-bit ones
            pair, source = args[1:].split("}")
            low, high = [t.strip() for t in pair.split(",")]
            word = _value(source.strip(" ,"), regs)
            regs[low], regs[high] = word & np.uint64(0xFFFF), word >> np.uint64(16)
            continue
        if "{" in args:  # mov.b32 r, {$a, $b}: two 16-bit registers packed into one, $a low
            dst, pair = args.split(",", 1)
            low, high = [_value(t.strip(" {}"), regs) for t in pair.split(",")]
            regs[dst.strip()] = (low & np.uint64(0xFFFF)) | ((high & np.uint64(0xFFFF)) << np.uint64(16))
            continue
        dst, *src = [s.strip() for s in args.split(",")]
        v = [_value(s, regs) for s in src]
        name = op.split(".")[0]
        if name == "and":
            r = v[0] & v[1]
        elif name == "or":
            r = v[0] | v[1]
        elif name == "xor":
            r = v[0] ^ v[1]
        elif name == "shl":
            r = (v[0] << v[1]) & MASK
        elif name == "shr":
            assert op in ("shr.b32", "shr.u32"), op  # logical shifts only
            r = v[0] >> v[1]
        elif name == "mov":
            r = v[0] + np.zeros_like(v[0])
        elif name == "prmt":
            r = _prmt(v[0], v[1], v[2])
        elif op == "sub.f16x2":
            r = _from_halves(_halves(v[0]) - _halves(v[1]))
        elif op == "fma.rn.f16x2":  # the exact a * b + c (float64 holds it), rounded once to float16
            a, b, c = (_halves(x).astype(np.float64) for x in v)
            r = _from_halves(a * b + c)
        else:
            raise AssertionError(f"no interpreter for {op}")
        regs[dst] = np.asarray(r, dtype=np.uint64) & MASK
    return [regs[f"${n}"] for n in range(outputs)]


def _as_float16_pairs(words: np.ndarray) -> np.ndarray:
    """[..., 2] float values of uint32 words holding two float16 (low half first)."""
    return words.astype(np.uint32).view(np.float16).reshape(*words.shape, 2).astype(np.float64)


@triton.jit
def _orders_kernel(out, KIND: tl.constexpr):
    i = tl.arange(0, 16)
    tl.store(out + i, _weight_order(i, 0, KIND))
    tl.store(out + 16 + i, _weight_order(i, 1, KIND))


def _weight_orders(kind: int) -> np.ndarray:
    """``_weight_order`` for tiles 0 and 1 of ``kind`` (run by Triton: the
    interpreter here, the GPU where there is one): [2, 16]."""
    out = torch.zeros(32, dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
    _orders_kernel[(1,)](out, KIND=kind)
    return out.view(2, 16).cpu().numpy()


def test_iq4_conversion_puts_every_weight_where_the_plain_form_reads_it():
    """IQ4_XS's codebook lookup by prmt (the bank words as the kernel loads
    them): each word's eight codes as their codebook values + 128, 1024 +
    that as float16, value 2h + o of tile t at position 8h + 2w + o, where
    ``_weight_order`` says (the plain Triton form and x's rows follow it)."""
    from strata_kernels import _triton_gemv_mma as mma

    qtype = T.IQ4_XS
    planes = WordPlanes.of(random_quant_tensor(qtype, 6, _blocks_for(qtype, 512), seed=3))
    codes = _codes(planes).numpy()  # [rows, chunks, 32]
    codes = lookup_table("iq4nl_values", torch.device("cpu")).round().long().numpy()[codes] + 128
    rows, chunks = codes.shape[:2]
    words = planes.quants.numpy().view(np.uint32).reshape(rows, chunks, 4).astype(np.uint64)
    table = mma._tables(torch.device("cpu"))[1].numpy().astype(np.uint32)  # as the kernel loads its banks
    banks = {9 + i: table[mma.IQ4_BANKS_AT.value + 4 * i].astype(np.uint64) for i in range(5)}
    order = _weight_orders(5)
    for w in range(4):
        out = run_ptx(mma.IQ4_WORD.value, {8: words[:, :, w], **banks}, 8)
        for tile in (0, 1):
            got = np.stack([o.astype(np.uint16).view(np.float16) for o in out[4 * tile:4 * tile + 4]], axis=-1)
            at = [2 * w, 2 * w + 1, 2 * w + 8, 2 * w + 9]  # values 0..3: (h, o) = (0, 0), (0, 1), (1, 0), (1, 1)
            assert np.array_equal(got.astype(np.float64), 1024 + codes[:, :, order[tile, at]]), (w, tile)


def test_a_word_of_code_bytes_becomes_1024_plus_each_byte():
    """The nibble types' last step (their code bytes made by masks in plain
    Triton, which the interpreter runs): each byte of a word, byte 0 first,
    as float16 1024 + byte, every byte value in every position."""
    from strata_kernels._triton_convert import WORD_PLUS_1024

    rng = np.random.default_rng(7)
    data = np.concatenate([np.arange(256, dtype=np.uint8).repeat(4), rng.integers(0, 256, 4096, dtype=np.uint8)])
    words = data.view(np.uint32).astype(np.uint64)
    out = run_ptx(WORD_PLUS_1024.value, {4: words}, 4)
    got = np.stack([o.astype(np.uint16).view(np.float16) for o in out], axis=-1).reshape(-1)
    assert np.array_equal(got.astype(np.float64), 1024.0 + data)


def test_a_word_of_code_bytes_with_a_word_of_top_bytes_becomes_their_float16s():
    """The Q5 and Q6_K tiles' last step: byte k of the codes' word the low
    byte of float16 k, byte k of the tops' word (0x64 + the code's bits above
    its byte) the high one: 1024 + 256 x those bits + the byte, every byte
    value in every position."""
    from strata_kernels._triton_gemv_mma import WORD_TOP_PAIRS

    rng = np.random.default_rng(8)
    data = np.concatenate([np.arange(256, dtype=np.uint8).repeat(4), rng.integers(0, 256, 4096, dtype=np.uint8)])
    bits = rng.integers(0, 4, data.size, dtype=np.uint8)
    words = data.view(np.uint32).astype(np.uint64)
    tops = (bits + 0x64).astype(np.uint8).view(np.uint32).astype(np.uint64)
    out = run_ptx(WORD_TOP_PAIRS.value, {4: words, 5: tops}, 4)
    got = np.stack([o.astype(np.uint16).view(np.float16) for o in out], axis=-1).reshape(-1)
    assert np.array_equal(got.astype(np.float64), 1024.0 + 256.0 * bits + data)


def test_the_interpreter_reads_prmt_as_ptx_defines_it():
    """prmt's selectors: bytes of b:a by the low 3 bits, bit 3 the sign."""
    a, b = np.uint64(0x33221100), np.uint64(0xF7665544)
    assert _prmt(a, b, np.uint64(0x7531)) == 0xF7553311
    assert _prmt(a, b, np.uint64(0x0F00)) == 0x00FF0000  # nibble 2 picks byte 7 (0xF7) with its sign
    assert run_ptx("{ mov.b32 t, 0x64646464; prmt.b32 $0, $1, t, 0x5140; }", {1: np.uint64(0x0201)}, 1)[0] == 0x64026401


@pytest.mark.parametrize("biased", [False, True], ids=["values", "keys"])
def test_int8_words_become_their_bytes_as_float16(biased):
    """The attention's int8 KV conversions: each of a word's four signed
    bytes, byte 0 first, exactly (every byte value in every position); the
    keys' form leaves KEY_BIAS (1152) on each, which the kernel takes from
    the scores at once."""
    from strata_kernels._triton_convert import KEY_BIAS, WORD_BYTES, WORD_BYTES_BIASED

    rng = np.random.default_rng(5)
    data = np.concatenate([np.arange(256, dtype=np.uint8).repeat(4), rng.integers(0, 256, 4096, dtype=np.uint8)])
    words = data.view(np.uint32).astype(np.uint64)
    out = run_ptx((WORD_BYTES_BIASED if biased else WORD_BYTES).value, {4: words}, 4)
    got = np.stack([o.astype(np.uint16).view(np.float16) for o in out], axis=-1).reshape(-1)
    offset = KEY_BIAS.value if biased else 0
    assert np.array_equal(got.astype(np.float32), data.view(np.int8).astype(np.float32) + offset)


def test_k8v4_value_words_become_their_levels_times_the_scale_as_float16():
    """The attention's k8v4 value conversion: each of a word's eight 4-bit
    codes (code k in bits 4k..4k+3) as its IQ4_NL level times the block's
    scale over V_SHRINK (as the kernel passes it), rounded once, as that
    product in float16 is, for scales of the writers' 7 significant bits
    (reference_kv.round_scale_bits) from 2^-16 to 900, both signs: no
    overflow of the offset up to there."""
    from strata_kernels._triton_attention import V_SHRINK
    from strata_kernels._triton_convert import IQ4_BANK_WORDS, WORD_IQ4_SCALED
    from strata_kernels.reference_kv import round_scale_bits

    levels = lookup_table("iq4nl_values", torch.device("cpu")).numpy().astype(np.float16)
    rng = np.random.default_rng(6)
    words = np.concatenate([np.arange(16, dtype=np.uint64) * np.uint64(0x11111111),
                            rng.integers(0, 2**32, 4096, dtype=np.uint64)])
    drawn = np.exp2(rng.uniform(-16, np.log2(900), words.size)) * rng.choice([-1.0, 1.0], words.size)
    drawn[:2] = 900.0, -900.0
    scales = round_scale_bits(torch.from_numpy(drawn.astype(np.float16))).numpy() / np.float16(V_SHRINK.value)
    banks = {9 + i: np.uint64(word & 0xFFFFFFFF) for i, word in enumerate(IQ4_BANK_WORDS)}
    operands = {8: words, **banks, 14: scales.view(np.uint16).astype(np.uint64),
                15: (scales * np.float16(-1152)).view(np.uint16).astype(np.uint64)}
    out = run_ptx(WORD_IQ4_SCALED.value, operands, 8)
    got = np.stack([o.astype(np.uint16).view(np.float16) for o in out], axis=-1)
    codes = (words[:, None] >> (np.uint64(4) * np.arange(8, dtype=np.uint64))) & np.uint64(15)
    want = levels[codes.astype(np.int64)] * scales[:, None]  # float16 products: rounded once
    assert np.array_equal(got, want)


