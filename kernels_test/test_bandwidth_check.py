"""The static bandwidth check of the decode kernels (``strata_kernels/bandwidth.py``),
on this CPU-only machine: every GEMV type and shape and every decode attention
format it covers, compiled for sm_86 and sm_90 (cached with the compile test's
results), judged from its main loop's SASS (the GEMV on GGUF blocks only for
the types without a word layout: for the others the GPU path runs the word
GEMV and the tensor-core one). A rule broken that the list below
does not expect fails; so does a listed failure that no longer happens (take
it off the list: the GPU-kernel issue empties it). ``python
bench/bandwidth_check.py`` prints the table with the estimated share of copy
bandwidth. The SASS reading itself is checked on a hand-written loop."""

from __future__ import annotations

import pytest

from strata_kernels import bandwidth
from strata_kernels.sass import loop_figures

# (kernel, what, target) -> the rules it breaks today (R1 bytes per load, R2 instructions per KiB, R3 CTAs per SM).
EXPECTED_FAILURES = {
    # The grid types (IQ3_S, IQ2_XXS): a codebook lookup and sign bytes per 4 weights (_triton_gemv_grid).
    ("gemv-words", "IQ3_S 4096x14336 M=1", "sm_86"): "R2",
    ("gemv-words", "IQ3_S 4096x14336 M=1", "sm_90"): "R2",
    ("gemv-words", "IQ3_S 4096x14336 M=8", "sm_86"): "R2",
    ("gemv-words", "IQ3_S 4096x14336 M=8", "sm_90"): "R2",
    ("gemv-words", "IQ3_S 14336x4096 M=1", "sm_86"): "R2",
    ("gemv-words", "IQ3_S 14336x4096 M=1", "sm_90"): "R2",
    ("gemv-words", "IQ3_S 14336x4096 M=8", "sm_86"): "R2",
    ("gemv-words", "IQ3_S 14336x4096 M=8", "sm_90"): "R2",
    ("gemv-words", "IQ2_XXS 4096x14336 M=1", "sm_86"): "R2",
    ("gemv-words", "IQ2_XXS 4096x14336 M=1", "sm_90"): "R2",
    ("gemv-words", "IQ2_XXS 4096x14336 M=8", "sm_86"): "R2",
    ("gemv-words", "IQ2_XXS 4096x14336 M=8", "sm_90"): "R2",
    ("gemv-words", "IQ2_XXS 14336x4096 M=1", "sm_86"): "R2",
    ("gemv-words", "IQ2_XXS 14336x4096 M=1", "sm_90"): "R2",
    ("gemv-words", "IQ2_XXS 14336x4096 M=8", "sm_86"): "R2",
    ("gemv-words", "IQ2_XXS 14336x4096 M=8", "sm_90"): "R2",
    # IQ4_XS a codebook lookup (prmt) per 8 weights: at 8 rows on the tensor cores (181), at one row (146).
    ("gemv-mma", "IQ4_XS 4096x14336 M=8", "sm_90"): "R2",
    ("gemv-mma", "IQ4_XS 14336x4096 M=8", "sm_90"): "R2",
    ("gemv-words", "IQ4_XS 4096x14336 M=1", "sm_90"): "R2",
    ("gemv-words", "IQ4_XS 14336x4096 M=1", "sm_90"): "R2",
}

_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LDG.E.U8 R8, desc[UR4][R10.64] ;
        /*0040*/                   IMAD.WIDE R12, R8, 0x4, R14 ;
        /*0050*/                   LDG.E R9, desc[UR4][R12.64] ;
        /*0060*/                   SHFL.BFLY PT, R16, R4, 0x1, 0x1f ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;
        /*0090*/              @P0 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
.L_x_2:
        /*00b0*/                   BRA `(.L_x_2);
"""


def test_the_sass_reader_counts_one_iteration_of_the_loop():
    f = loop_figures(_SASS)
    assert f.looped and f.instructions == 8  # 0x20..0x90
    assert (f.global_loads, f.load_bytes, f.narrow_loads, f.narrow_bytes) == (3, 21, 1, 1)
    assert f.round_trips == 2  # the 4-byte load's address comes from the byte load
    assert (f.shuffles, f.barriers) == (1, 1)
    assert f.bytes_per_load == 7.0
    assert f.instructions_per_kib == pytest.approx(8 * 1024 / (21 * 32))


def test_a_lookup_counts_as_an_instruction_not_as_streamed_bytes():
    """An evict-last load (a grid type's codebook, kept in L1) is a lookup:
    in the loop's instructions, not in R1's loads and bytes; a lookup's
    result starts no new memory round trip."""
    f = loop_figures(_SASS.replace("LDG.E R9", "LDG.E.EL R9"))
    assert f.instructions == 8 and f.lookups == 1
    assert (f.global_loads, f.load_bytes) == (2, 17)
    assert f.round_trips == 1
    loop = loop_figures(_SASS)
    assert bandwidth.load_sectors(f) == bandwidth.load_sectors(loop) - 4 + bandwidth.LOOKUP_SECTORS


def test_a_register_rewritten_by_a_wide_result_ends_its_chain():
    """A 64-bit address made by IMAD.WIDE (written as its first register)
    replaces both halves: a load from it starts a new round trip even where
    the high half last held a loaded value; a cp.async's shared address is
    read, not written."""
    body = _SASS.replace(
        "        /*0040*/                   IMAD.WIDE R12, R8, 0x4, R14 ;\n",
        "        /*0040*/                   IMAD.WIDE R12, R17, 0x4, R14 ;\n")
    f = loop_figures(body.replace("LDG.E.U8 R8, desc[UR4][R10.64]", "LDG.E.U8 R13, desc[UR4][R10.64]"))
    assert f.round_trips == 1  # R13 (a byte load's result) is overwritten by the wide IMAD before the 4-byte load
    f = loop_figures(body.replace("LDG.E.U8 R8, desc[UR4][R10.64]", "LDGSTS.E.BYPASS.128 [R12+0x10], desc[UR4][R10.64]"))
    assert f.round_trips == 1


def test_a_loop_around_the_main_loop_is_not_the_main_loop():
    """A pass that may run again (the attention's split read once more
    against its largest score) wraps the main loop; its body holds the
    inner loop and the inner loop's pipelined first loads, so it streams
    more bytes a branch, but the inner loop is the one that runs: its
    figures are read."""
    nested = _SASS.replace(
        "        /*0010*/                   S2R R0, SR_TID.X ;\n",
        "        /*0010*/                   S2R R0, SR_TID.X ;\n.L_x_0:\n"
        "        /*0018*/                   LDG.E.128 R20, desc[UR4][R2.64] ;\n").replace(
        "        /*00a0*/                   EXIT ;\n",
        "        /*0098*/                   ISETP.NE.AND P1, PT, R21, RZ, PT ;\n"
        "        /*009c*/              @P1 BRA `(.L_x_0) ;\n"
        "        /*00a0*/                   EXIT ;\n")
    f = loop_figures(nested)
    assert f.looped and f.instructions == 8 and f.load_bytes == 21  # 0x20..0x90, as without the outer loop


def test_a_kernel_without_a_loop_is_read_whole():
    f = loop_figures(_SASS.replace("@P0 BRA `(.L_x_1)", "NOP"))
    assert not f.looped and f.instructions == 12  # every instruction, the trap after EXIT too


def test_the_model_bounds_a_kernel_by_its_slowest_part():
    loop = loop_figures(_SASS)
    part = bandwidth.PARTS["sm_90"]
    few = bandwidth.estimate(loop, 10, 4, 1.0, part)
    many = bandwidth.estimate(loop, 10 * part.sms, 4, 1.0, part)
    assert 0 < few < many <= 1.0  # SMs without work stream nothing


@pytest.fixture(scope="module")
def checks():
    return bandwidth.run()


def test_decode_kernels_break_no_rule_the_list_does_not_expect(checks):
    unexpected, fixed = [], []
    for c in bandwidth.judged(checks):
        broken = set(c.failures())
        expected = set(EXPECTED_FAILURES.get((c.kernel, c.what, c.target), "").split())
        if broken - expected:
            unexpected.append(f"{c.kernel} {c.what} {c.target}: breaks {' '.join(sorted(broken - expected))}")
        if expected - broken:
            fixed.append(f"{c.kernel} {c.what} {c.target}: now passes {' '.join(sorted(expected - broken))}")
    assert not unexpected, "\n".join(unexpected) + "\n\n" + bandwidth.format_table(checks)
    assert not fixed, "take these off EXPECTED_FAILURES:\n" + "\n".join(fixed)
