"""Whether a decode step's kernels can reach the memory's bandwidth, judged
from their compiled code on a machine without a GPU.

A decode step streams every weight and the KV once; its kernels are fast
only if their main loops move many bytes per instruction and keep enough
loads in flight. For each kernel at the shapes users run, compiled for each
``TARGETS`` entry (``compile_targets``), from the SASS of its main loop
(``sass.LoopFigures``):

- R1: bytes streamed per global-load instruction per thread, at least
  ``R1_MIN`` (16-byte loads of whole words, not a byte per weight);
- R2: warp-instructions issued per KiB streamed, at most ``R2_MAX`` (issue
  time must stay below the memory's time): for a GEMV, the bytes of weights
  (codes and scales) a warp's iteration covers; for attention, the bytes its
  loads bring (the KV);
- R3: CTAs at the smallest shape, at least ``R3_MIN_WAVES`` times the SMs
  (loads in flight on every SM);
- R4 (reported): loads in the longest chain of address dependences within
  one iteration, each a memory round trip;
- lookups (reported): loads from a cached table (a grid type's codebook;
  ``sass``), counted in R2's instructions, not in R1's bytes.

``estimate`` turns the figures into a share of copy bandwidth through a
stated model (``Model``): per SM, the resident warps each run one iteration
in the longest of their issue time, one lone warp's latency (round trips
times the memory latency plus its instructions) and the load unit's time
(a load narrower than 4 bytes a thread is a gather of 32 sectors; a wider
one moves 32 x width bytes in 32-byte sectors). The latency and the load
unit's rate are fitted to the first H200 run of the kernels before this
check (``CALIBRATION``); ``bench/bandwidth_check.py`` prints the table, the
fit's residuals and the failures.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from gguf import GGMLQuantizationType as T

from .launch import split_k
from .sass import LoopFigures

R1_MIN = 4.0
R2_MAX = {"sm_90": 128.0, "sm_86": 256.0}
R3_MIN_WAVES = 2.0
CHECK_TARGETS = ("sm_86", "sm_90")  # compile_targets.LOOP_TARGETS reads their loops

GEMV_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS", "IQ3_S", "IQ2_XXS")
GEMV_SHAPES = ((4096, 14336), (14336, 4096))  # N x K: an 8B model's MLP down and up/gate projections
GEMV_ROWS = (1, 8)
WORD_GEMV_TYPES = GEMV_TYPES  # every type the check covers has a GPU word layout (word_planes)
ATTENTION_FORMATS = ("f16", "int8", "k8v4")
ATTENTION_HEAD_DIMS = (128, 256)
# The smallest attention a decode step runs here: one sequence, 8 KV heads of
# 4 query heads each, 4K positions (a conversation's start).
ATTENTION_SHAPE = dict(batch=1, kv_heads=8, group=4, context=4096)


@dataclass(frozen=True)
class Part:
    """The GPU a target stands for in the estimate: SMs, clock and copy bandwidth."""

    name: str
    sms: int
    clock_ghz: float
    copy_gbs: float
    max_warps: int


PARTS = {
    "sm_90": Part("H200", 132, 1.98, 4128.3, 64),  # copy bandwidth measured (bench/results/gpu-2026-12-04)
    "sm_86": Part("RTX 3090", 82, 1.695, 830.0, 48),  # ~89% of the 936 GB/s spec, as H200's copy is of its 4.8 TB/s
}


@dataclass(frozen=True)
class Model:
    """The issue-and-latency model's constants (cycles)."""

    latency: float = 1000.0  # one memory round trip under load
    sectors_per_clock: float = 1.0  # the load unit's 32-byte sectors per clock per SM
    issue_per_clock: float = 4.0  # warp-instructions per clock per SM (four schedulers at best)
    cycles_per_instruction: float = 1.0  # one warp's own instructions, back to back


@dataclass(frozen=True)
class Check:
    """One kernel at one shape on one target."""

    kernel: str  # "gemv" (on GGUF blocks), "blocks" (the same, not judged), "gemv-words", "gemv-mma", "attention"
    what: str  # the type and shape, or the KV format and head dim
    key: tuple  # the GEMV's (type, N, K, M), or the attention's (format, head dim)
    target: str
    loop: LoopFigures
    ctas: int  # programs at the smallest production shape
    streamed: float  # bytes a warp's iteration streams (R2's denominator)
    num_warps: int
    occupancy: float  # resident warps over the SM's maximum (registers, shared memory, threads)
    estimate: float  # share of copy bandwidth, by the model

    @property
    def instructions_per_kib(self) -> float:
        """R2."""
        return self.loop.instructions * 1024 / self.streamed if self.streamed else float("inf")

    @property
    def waves(self) -> float:
        return self.ctas / PARTS[self.target].sms

    def failures(self) -> list[str]:
        out = []
        if self.loop.bytes_per_load < R1_MIN:
            out.append("R1")
        if self.instructions_per_kib > R2_MAX[self.target]:
            out.append("R2")
        if self.waves < R3_MIN_WAVES:
            out.append("R3")
        return out


LOOKUP_SECTORS = 8.0  # a lookup: a gather of up to 32 sectors, served by L1 at 4 a clock against memory's 1


def load_sectors(loop: LoopFigures) -> float:
    """32-byte sectors the loop's loads touch per warp and iteration: a load
    narrower than 4 bytes a thread is a gather (32 sectors), a wider one
    moves 32 x its width in whole sectors; a lookup (``sass``) costs the
    load unit ``LOOKUP_SECTORS``."""
    return (loop.narrow_loads * 32 + (loop.load_bytes - loop.narrow_bytes) * 32 / 32
            + loop.lookups * LOOKUP_SECTORS)


def estimate(loop: LoopFigures, ctas: int, num_warps: int, occupancy: float, part: Part,
             model: Model = Model(), streamed: float | None = None) -> float:
    """The share of ``part``'s copy bandwidth the kernel would stream at, by
    ``model``, counting ``streamed`` bytes per warp and iteration from memory
    (default: all its loads bring)."""
    if not loop.load_bytes:
        return 0.0
    resident_ctas = max(1, math.ceil(ctas / part.sms))
    warps = min(max(1.0, occupancy * part.max_warps), resident_ctas * num_warps)
    issue = warps * loop.instructions / model.issue_per_clock
    latency = loop.round_trips * model.latency + loop.instructions * model.cycles_per_instruction
    lsu = warps * load_sectors(loop) / model.sectors_per_clock
    cycles = max(issue, latency, lsu)
    bytes_per_sm_clock = warps * (loop.load_bytes * 32 if streamed is None else streamed) / cycles
    active = min(1.0, ctas / part.sms)  # SMs with work at all
    gbs = bytes_per_sm_clock * part.sms * active * part.clock_ghz
    return min(1.0, gbs / part.copy_gbs)


def gemv_ctas(block_n: int, n: int, splits: int = 1) -> int:
    return math.ceil(n / block_n) * splits


def attention_ctas(block_m: int, splits: int) -> int:
    s = ATTENTION_SHAPE
    return math.ceil(s["group"] / block_m) * s["kv_heads"] * s["batch"] * splits


def gemv_rows(types=GEMV_TYPES) -> list[tuple[str, int, int, int, int]]:
    """(type name, qtype, M, N, K) the check covers."""
    return [(name, int(T[name]), m, n, k) for name in types for (n, k) in GEMV_SHAPES for m in GEMV_ROWS]


def judged(checks: list[Check]) -> list[Check]:
    """The decode configurations R1-R3 hold to (not the "blocks" rows: see ``rows``)."""
    return [c for c in checks if c.kernel != "blocks"]


def format_table(checks: list[Check]) -> str:
    lines = [f"{'kernel':<10} {'what':<34} {'target':<6} {'B/load':>6} {'ins/KiB':>8} {'CTAs/SM':>7} "
             f"{'trips':>5} {'shfl':>4} {'bar':>3} {'look':>4} {'est':>6}  fails"]
    for c in checks:
        lines.append(f"{c.kernel:<10} {c.what:<34} {c.target:<6} {c.loop.bytes_per_load:>6.2f} "
                     f"{c.instructions_per_kib:>8.0f} {c.waves:>7.2f} {c.loop.round_trips:>5} "
                     f"{c.loop.shuffles:>4} {c.loop.barriers:>3} {c.loop.lookups:>4} {c.estimate:>6.1%}  "
                     f"{'(not judged)' if c.kernel == 'blocks' else ' '.join(c.failures()) or '-'}")
    return "\n".join(lines)


# The first H200 run (bench/results/gpu-2026-12-04/kernels.txt, bf16 activations): the GEMV's measured share
# of copy bandwidth, (type, N, K, M) -> share. The model's constants are fitted to these (the GEMV's tiles
# changed since, in how the shared tile bodies are written, not in what they load).
CALIBRATION = {
    ("Q4_K", 4096, 14336, 1): 0.026, ("Q4_K", 14336, 4096, 1): 0.032,
    ("Q4_K", 4096, 14336, 8): 0.011, ("Q4_K", 14336, 4096, 8): 0.010,
    ("Q8_0", 4096, 14336, 1): 0.056, ("Q8_0", 14336, 4096, 1): 0.068,
    ("Q8_0", 4096, 14336, 8): 0.024, ("Q8_0", 14336, 4096, 8): 0.025,
    ("IQ4_XS", 4096, 14336, 1): 0.027, ("IQ4_XS", 14336, 4096, 1): 0.027,
    ("IQ3_S", 4096, 14336, 1): 0.018, ("IQ3_S", 14336, 4096, 1): 0.020,
    ("Q6_K", 4096, 14336, 1): 0.034, ("Q6_K", 14336, 4096, 1): 0.039,
}


@dataclass(frozen=True)
class Row:
    """One kernel configuration at one shape, before compiling."""

    kernel: str
    what: str
    key: tuple  # the GEMV's (type, N, K, M), or the attention's (format, head dim)
    config: object  # launch_plans.KernelConfig
    ctas: int
    streamed: float | None  # weight bytes a warp's iteration covers (None: what its loads bring)


def rows() -> list[Row]:
    """Every kernel and shape the check covers (bf16 activations, as a GPU runs them)."""
    from .formats import block_format
    from .launch_plans import MMA_KINDS, attention_config, gemv_config, gemv_mma_config, gemv_words_config
    from .word_planes import WORD_TYPES, bytes_per_weight

    out = []
    for name, qtype, m, n, k in gemv_rows():
        config = gemv_config(qtype, m, n, k, "bf16")
        c, fmt = config.constexprs, block_format(T(qtype))
        weights = c["BLOCK_N"] * c["BLOCK_K"] * fmt.type_size / fmt.block_size
        # The GEMV on GGUF blocks is a decode step's for the types without a word layout; for the others
        # the runtime lays the weights out as planes and it runs only where qmatmul is called on blocks:
        # kept in the table (and the model's calibration) as "blocks", not judged.
        kernel = "blocks" if name in WORD_GEMV_TYPES else "gemv"
        out.append(Row(kernel, f"{name} {n}x{k} M={m}", (name, n, k, m), config,
                       gemv_ctas(c["BLOCK_N"], n), weights / config.num_warps))
    for name, qtype, m, n, k in gemv_rows(WORD_GEMV_TYPES):
        if m > 1 and T(qtype) in MMA_KINDS:  # these rows run the tensor-core GEMV
            config = gemv_mma_config(qtype)
            c = config.constexprs
            splits = split_k(math.ceil(n / c["BLOCK_N"]), k // 32, c["BLOCK_B"], PARTS["sm_90"].sms)
            weights = c["BLOCK_N"] * c["BLOCK_B"] * 32
            out.append(Row("gemv-mma", f"{name} {n}x{k} M={m}", (name, n, k, m), config,
                           gemv_ctas(c["BLOCK_N"], n, splits), weights * bytes_per_weight(T(qtype)) / config.num_warps))
            continue
        config = gemv_words_config(qtype, m)
        c = config.constexprs
        kind = WORD_TYPES[T(qtype)]
        per_chunk = 32 if kind.grid else 4 * 32 // kind.bits  # weights a chunk (a grid type's: 32; 4 code words)
        chunks = k // per_chunk
        splits = split_k(math.ceil(n / c["BLOCK_N"]), chunks, c["BLOCK_C"], PARTS["sm_90"].sms)
        weights = c["BLOCK_N"] * c["BLOCK_C"] * per_chunk
        out.append(Row("gemv-words", f"{name} {n}x{k} M={m}", (name, n, k, m), config,
                       gemv_ctas(c["BLOCK_N"], n, splits), weights * bytes_per_weight(T(qtype)) / config.num_warps))
    s = ATTENTION_SHAPE
    for fmt in ATTENTION_FORMATS:
        for d in ATTENTION_HEAD_DIMS:
            # the splits for the H200 (sm_86's 82 SMs take fewer; both compile the same kernel)
            config, splits = attention_config(fmt, d, 1, s["group"], s["context"], "bf16",
                                              s["batch"] * s["kv_heads"], PARTS["sm_90"].sms)
            out.append(Row("attention", f"{fmt} D={d} {s['context'] // 1024}K", (fmt, d), config,
                           attention_ctas(config.constexprs["BLOCK_M"], splits), None))
    return out


def run(model: Model = Model(), targets=CHECK_TARGETS, progress=None) -> list[Check]:
    """Every row compiled for ``targets`` (cached by ``compile_targets``) and judged."""
    from .compile_targets import compile_all

    todo = rows()
    results = compile_all([r.config for r in todo], list(targets), progress=progress)
    checks = []
    for i, row in enumerate(todo):
        for j, target in enumerate(targets):
            result = results[i * len(targets) + j]
            if not result.ok or result.loop is None:
                raise RuntimeError(f"{row.kernel} {row.what} on {target} did not compile: {result.error}")
            loop = LoopFigures(**result.loop)
            streamed = row.streamed if row.streamed is not None else loop.load_bytes * 32
            share = estimate(loop, row.ctas, row.config.num_warps, result.occupancy, PARTS[target], model, streamed)
            checks.append(Check(row.kernel, row.what, row.key, target, loop, row.ctas, streamed,
                                row.config.num_warps, result.occupancy, share))
    return checks


def fit(checks: list[Check]) -> tuple[Model, float]:
    """The model's latency and load-unit rate that best match ``CALIBRATION``
    on sm_90 (least squares of log shares, over a grid), and the fit's rms error in log2."""
    measured = {c.key: c for c in checks if c.kernel in ("gemv", "blocks") and c.target == "sm_90"
                and c.key in CALIBRATION}
    best = None
    grid = itertools.product((400, 600, 800, 1000, 1500, 2000), (0.25, 0.5, 1.0, 2.0, 4.0), (0.25, 0.5, 1.0, 2.0, 4.0),
                             (1.0, 2.0, 4.0, 8.0))
    for latency, rate, issue, cpi in grid:
        model = Model(latency, rate, issue, cpi)
        err = 0.0
        for key, c in measured.items():
            est = estimate(c.loop, c.ctas, c.num_warps, c.occupancy, PARTS["sm_90"], model, c.streamed)
            err += math.log2(max(est, 1e-6) / CALIBRATION[key]) ** 2
        if best is None or err < best[1] - 1e-9:
            best = (model, err)
    model, err = best
    return model, math.sqrt(err / max(1, len(measured)))


def with_model(checks: list[Check], model: Model) -> list[Check]:
    """``checks`` with their estimates by ``model``."""
    return [dataclasses.replace(c, estimate=estimate(c.loop, c.ctas, c.num_warps, c.occupancy, PARTS[c.target],
                                                    model, c.streamed)) for c in checks]
