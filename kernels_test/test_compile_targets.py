"""Every Triton kernel compiled for the GPUs users own, on this CPU-only machine.

``launch_plans.configurations()`` lists each configuration a launcher can
choose (the launchers take theirs from the same functions); each is compiled
for sm_86 and sm_90 (a sample of one per kernel and weight type for sm_80 and
sm_89, whose limits follow sm_86's) by Triton's own compiler and ``ptxas``, in
a pool of processes, with results cached by the kernels' source hash (a run
after no kernel change reads them back in seconds). A compile error, or more
shared memory than the target gives a block, fails; so do spilled registers
in a decode configuration on sm_86 or sm_90. ``python bench/kernel_report.py``
prints the whole table (registers, spills, shared memory, occupancy).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import strata_kernels
from strata_kernels import compile_targets
from strata_kernels.compile_targets import TARGETS, compile_all, format_table, occupancy, parse_ptxas
from strata_kernels.launch_plans import configurations

SPILL_FREE_TARGETS = ("sm_86", "sm_90")
# Decode configurations that spill, by kernel, weight type and target, each
# with the reason it stays.
KNOWN_DECODE_SPILLS = {
    ("_expert_gemv_kernel", "IQ2_XXS", "sm_90"):
        "8 bytes at 255 registers from ptxas 13.4 (sm_90); the dense GEMV of the same tile uses 156 and none. "
        "8 warps remove it but make ptxas spill in other types (Q3_K), so the choice waits for a GPU to time both",
    ("_expert_gemv_kernel", "IQ1_M", "sm_90"): "24 bytes (bfloat16 activations), as above",
    ("_expert_gemv_kernel", "IQ1_S", "sm_90"): "8 bytes (float32 activations), as above",
    # Decode attention over an int8 or k8v4 cache: each key group's scores are a dot of their own, scaled
    # after (the group's scale kept out of the tiles: 152 -> 128 instructions a KiB, int8 D=128 on sm_90).
    # Where the tile is widest (64 query heads a KV head; k8v4's float32 queries) ptxas spills a few values
    # that live across the loop: every load and store of local memory is before or after the main loop,
    # once per program (read from the SASS of each when it was listed: none inside). (Keys made in the
    # tensor cores' layout, the D=256 and D=128 x 64-head tiles stopped spilling; k8v4's D=128 x 32-head
    # tile spilled 4 bytes on sm_86 from the scan by positions until one query's splits were weighed
    # against a fixed reference.)
    ("_attention_kernel", "int8 D=64 decode BLOCK_M=64 BLOCK_N=64", "sm_86"):
        "32-44 bytes, outside the main loop: 64 query heads a KV head (multi-query attention's widest tile)",
    # One query weighed against a fixed reference: a loop of passes (a split read again where a weight would
    # pass float16's range) around the main loop. ptxas 13.4 keeps two small f16 tiles on sm_86 under 96
    # and 128 registers and spills one value across the passes: stored before the pass loop, loaded
    # after the main loop ends, once a pass (read from the SASS: nothing inside the main loop).
    ("_attention_kernel", "f16 D=64 decode BLOCK_M=16 BLOCK_N=32", "sm_86"):
        "16 bytes (bfloat16 queries; a 64-bit address), outside the main loop, once a pass",
    ("_attention_kernel", "f16 D=32 decode BLOCK_M=64 BLOCK_N=32", "sm_86"):
        "8 bytes (float32 queries), outside the main loop, once a pass",
}


def _known(r) -> tuple[str, str, str] | None:
    """The ``KNOWN_DECODE_SPILLS`` key that explains ``r`` (its label starts with the key's), or None."""
    for key in KNOWN_DECODE_SPILLS:
        kernel, label, target = key
        if r.kernel == kernel and r.target == target and (r.label == label or r.label.startswith(label + " ")):
            return key
    return None


def compile_test_configurations():
    """What this test compiles: every configuration of the default CUDA path
    (bfloat16 activations), and the decode configurations of
    ``dtype="float32"`` (its other configurations differ from bfloat16's in
    the activations' loads alone; ``bench/kernel_report.py --dtypes fp32``
    compiles them all). About 6 minutes on 2 cores with an empty cache."""
    seen, out = set(), []
    for config in configurations(("bf16",)) + [c for c in configurations(("fp32",)) if c.decode]:
        if config.key not in seen:
            seen.add(config.key)
            out.append(config)
    return out


# Every configuration is compiled for these; the other targets take a sample (``sampled_configurations``).
FULL_TARGETS = ("sm_86", "sm_90")


def sampled_configurations(configs):
    """One configuration per kernel and weight type (or format): what sm_80
    and sm_89 compile. Their limits follow sm_86's (sm_89: the same shared
    memory a block and registers; sm_80: more shared memory, the same
    registers), so a configuration that fits sm_86 fits them; the sample
    catches a kernel the compiler refuses for the target itself. Compiling
    all 468 for four targets took 16 of a CI run's 60 minutes."""
    seen, out = set(), []
    for config in configs:
        key = (config.kernel, config.label.split()[0])
        if key not in seen:
            seen.add(key)
            out.append(config)
    return out


@pytest.fixture(scope="module")
def results():
    """Every configuration on sm_86 and sm_90, a sample on the other targets (cached by source hash)."""
    configs = compile_test_configurations()
    full = compile_all(configs, list(FULL_TARGETS))
    return full + compile_all(sampled_configurations(configs), [t for t in TARGETS if t not in FULL_TARGETS])


@pytest.mark.slow
@pytest.mark.timeout(2400)  # its fixture compiles everything when the cache is empty: about 6 minutes on 2 cores
def test_every_kernel_compiles_for_every_target(results):
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results)} compiles ({sum(r.cached for r in results)} from the cache), "
          f"{sum(r.seconds for r in results if not r.cached):.0f} s of compiling")
    assert not failed, "did not compile or does not fit:\n" + format_table(failed)


@pytest.mark.slow
def test_decode_configurations_do_not_spill(results):
    """A decode step is bound by memory bandwidth: a kernel that spills
    registers to local memory adds traffic to every step."""
    spilled = [r for r in results if r.decode and r.target in SPILL_FREE_TARGETS and r.spills]
    unexplained = [r for r in spilled if _known(r) not in KNOWN_DECODE_SPILLS]
    assert not unexplained, "decode configurations spilling registers:\n" + format_table(unexplained)
    # A known spill that is gone comes off the list (so the list stays true).
    gone = set(KNOWN_DECODE_SPILLS) - {_known(r) for r in spilled}
    assert not gone, f"no longer spilling, remove from KNOWN_DECODE_SPILLS: {sorted(gone)}"


def test_every_triton_kernel_has_launch_configurations():
    """A kernel added without its configurations here would never be compiled
    ahead of time: every ``@triton.jit`` function launched with a grid (its
    name ends in ``_kernel``) in the ``_triton_*`` modules is planned."""
    planned = {(c.module, c.kernel) for c in configurations()}
    found = set()
    for info in pkgutil.iter_modules(strata_kernels.__path__):
        if info.name.startswith("_triton_"):
            module = importlib.import_module(f"strata_kernels.{info.name}")
            found |= {(info.name, name) for name, obj in vars(module).items()
                      if name.endswith("_kernel") and hasattr(obj, "arg_names")}
    assert found and found <= planned, f"kernels without launch configurations: {sorted(found - planned)}"


def test_ptxas_report_is_read():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_gemv_kernel' for 'sm_80'
ptxas info    : Function properties for _gemv_kernel
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 440 bytes cmem[0]
"""
    assert parse_ptxas(log) == dict(registers=255, spill_stores=12, spill_loads=16, stack=8, static_shared=1024)
    assert parse_ptxas("ptxas info    : Used 40 registers, used 1 barriers, 440 bytes cmem[0]")["spill_stores"] == 0
    with pytest.raises(ValueError, match="no register count"):
        parse_ptxas("ptxas fatal   : Unsupported .version 9.4")


@pytest.mark.parametrize("target,registers,shared,warps,expected", [
    ("sm_90", 32, 0, 4, 1.0),  # 16 blocks of 4 warps: every warp slot
    ("sm_90", 128, 0, 4, 0.25),  # 64K registers / (128 x 128 threads) = 4 blocks
    ("sm_90", 33, 0, 4, 0.75),  # 33 registers are allocated as 40: 12 blocks, not 15
    ("sm_86", 40, 0, 4, 1.0),  # 12 blocks by threads (1536), by registers 12
    ("sm_86", 64, 48 * 1024, 4, 0.167),  # shared memory: 2 blocks of 49 KiB (with the 1 KiB reserve)
    ("sm_80", 255, 0, 4, 0.125),  # 255 registers round to 256 per thread: 2 blocks
])
def test_occupancy_follows_the_tightest_limit(target, registers, shared, warps, expected):
    assert occupancy(TARGETS[target], registers, shared, warps) == pytest.approx(expected, abs=0.001)


def test_a_compile_error_is_a_result_not_a_crash(tmp_path, monkeypatch):
    """A configuration that does not compile is reported with its error, and
    the other configurations still compile (the run is not cut short)."""
    from dataclasses import replace

    monkeypatch.setenv("STRATA_COMPILE_CACHE", str(tmp_path))
    good = next(c for c in configurations(("bf16",)) if c.kernel == "_conv_step_kernel")
    bad = replace(good, label="BLOCK_C not a power of two", constexprs={**good.constexprs, "BLOCK_C": 100})
    first, second = compile_all([bad, good], ["sm_90"], workers=1)
    assert not first.ok and "power of 2" in first.error.lower().replace("two", "2"), first.error
    assert second.ok and second.registers > 0
    again = compile_all([bad, good], ["sm_90"], workers=1)
    assert all(r.cached for r in again) and [r.ok for r in again] == [False, True]
    assert compile_targets.cache_dir() == tmp_path


def test_the_launchers_launch_only_planned_configurations(monkeypatch):
    """What the plan lists is what the launchers launch: every kernel launch
    of qmatmul (each GEMV row tile, each GEMM tile), experts, attention (a
    decode step and a prefill chunk per KV format), quantize-on-write and the
    recurrent ops, under the interpreter, is recorded with its constants and
    warps, and each is one of ``configurations()`` (activations aside)."""
    import torch
    from gguf import GGMLQuantizationType as T
    from helpers import random_quant_tensor
    from triton.runtime.interpreter import InterpretedFunction

    from strata_kernels import ExpertGroups, KVStore, QuantTensor, attention, expert_matmul, kv_write, qmatmul
    from strata_kernels.recurrent import causal_conv_step, delta_rule_prefill, delta_rule_step

    launched = set()
    original = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        # (USE_ASM: the interpreter runs a configuration's plain form; a GPU its inline PTX.)
        constants = {k: True if k == "USE_ASM" else v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        launched.add((self.fn.__name__, tuple(sorted(constants.items())), kwargs.get("num_warps", 4)))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    g = torch.Generator().manual_seed(0)
    for qtype in (T.Q4_K, T.Q8_0):
        qt = random_quant_tensor(qtype, 24, 512 // (256 if qtype != T.Q8_0 else 32), seed=1)
        for m in (1, 2, 3, 5, 9, 20, 40):
            qmatmul(torch.randn(m, qt.cols, generator=g), qt, backend="triton")
    flat = random_quant_tensor(T.Q4_K, 4 * 16, 1, seed=2)
    experts = QuantTensor(flat.data, T.Q4_K, (4, 16, 256))
    ids = torch.tensor([[0, 1]] * 12 + [[2, 3]])
    groups = ExpertGroups.of(ids, 4)
    expert_matmul(torch.randn(len(groups.rows), 256, generator=g), experts, groups, "triton")
    for fmt, d, group in (("f16", 64, 1), ("int8", 128, 20), ("k8v4", 256, 8)):
        store = KVStore.allocate(fmt, 64, 2, d)
        kv_write(store, torch.arange(40), torch.randn(40, 2, d, generator=g), torch.randn(40, 2, d, generator=g),
                 backend="triton")
        for t in (1, 7):  # a decode step, a prefill chunk
            attention(torch.randn(t, 2 * group, d, generator=g), store, 40 - t, None, d**-0.5, "triton")
    state = torch.zeros(2, 4, 64, 32)
    q = torch.randn(2, 2, 64, generator=g)
    delta_rule_step(q, q, torch.randn(2, 4, 32, generator=g), -torch.rand(2, 4), torch.rand(2, 4), state,
                    torch.arange(2), "triton")
    delta_rule_prefill(q, q, torch.randn(2, 4, 32, generator=g), -torch.rand(2, 4), torch.rand(2, 4), state[0],
                       "triton")
    causal_conv_step(torch.randn(2, 48, generator=g), torch.randn(48, 4, generator=g), torch.zeros(2, 3, 48),
                     torch.arange(2), "triton")

    planned = {(c.kernel, tuple(sorted(c.constexprs.items())), c.num_warps) for c in configurations()}
    kernels = {name for name, _, _ in launched}
    assert {"_gemv_kernel", "_gemm_kernel", "_expert_gemv_kernel", "_expert_gemm_kernel", "_attention_kernel",
            "_quantize_kernel", "_delta_rule_step_kernel", "_delta_rule_chunk_kernel", "_conv_step_kernel"} <= kernels
    assert launched <= planned, f"launched but not planned: {sorted(launched - planned)}"
