"""CPU kernels: the GEMV that reads GGUF blocks directly by integer dot
products (``csrc/qdot_cpu.cpp``), dequantization of slabs of blocks for a
prompt's GEMM (``csrc/dequant_cpu.cpp``) and the small operations of a
decode step (``csrc/decode_cpu.cpp``).

One build per ISA variant, chosen at run time from what this CPU has
(``/proc/cpuinfo``), not from the machine that built it, so that an
installation or a cache moved between machines stays correct:

- ``avx512vnni``: AVX-512 F/BW/DQ/VL with VNNI (Cascade Lake, Ice Lake, Zen 4
  and later): the GEMV's 16-bit products accumulate in one instruction;
- ``avx512``: AVX-512 F/BW/DQ/VL (Skylake-X);
- ``avx2``: AVX2, FMA and F16C (Haswell on, every Zen);
- ``generic``: the compiler's default target, plain C++.

Each variant compiles on first use with the machine's compiler through
``torch.utils.cpp_extension`` (about a minute on 2 cores, with a progress
line), once per machine: torch caches it under ``TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), the variant in its name.
``STRATA_CPU_ISA=avx2`` (or ``generic``) picks a lower variant than the CPU
could run; ``ATEN_CPU_CAPABILITY=avx2`` (torch's own switch) caps it too,
so one setting shows what an AVX2-only machine sees. Importing this module
builds nothing; ``available()`` says whether the build worked, and why not
when it did not, and callers fall back to the torch path then.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

from .cpu_tables import header_text
from .launch import CPU_GEMV_MAX_M, CPU_SLAB_ROWS
from .quant_tensor import QuantTensor

log = logging.getLogger(__name__)

# The types csrc/gguf_types.h decodes (the block formats of llama.cpp's quantized files; not the ternary
# TQ1_0/TQ2_0 or MXFP4).
CPU_KERNEL_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
                              T.IQ4_NL, T.IQ4_XS, T.IQ3_S, T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S,
                              T.IQ1_M})

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("qdot_cpu.cpp", "dequant_cpu.cpp", "decode_cpu.cpp", "decode_block_cpu.cpp",
                                                 "recurrent_cpu.cpp", "bindings.cpp")]

# Variant -> (compiler flags, /proc/cpuinfo flags it needs), best first.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c"})
ISA_VARIANTS: dict[str, tuple[list[str], frozenset[str]]] = {
    "avx512vnni": (["-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"], _AVX512 | {"avx512_vnni"}),
    "avx512": (["-march=x86-64-v4", "-mtune=generic"], _AVX512),
    "avx2": (["-march=haswell", "-mtune=generic"], frozenset({"avx2", "fma", "f16c"})),
    "generic": ([], frozenset()),
}
# torch's ATEN_CPU_CAPABILITY values -> the best variant they allow.
_ATEN_CAP = {"default": "generic", "avx2": "avx2", "avx512": "avx512vnni"}

_lock = threading.Lock()
_modules: dict[str, object] = {}
_errors: dict[str, str] = {}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_isas() -> list[str]:
    """The variants this CPU can run, best first (``generic`` always)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["generic"]
    flags = cpu_flags()
    return [name for name, (_, needs) in ISA_VARIANTS.items() if needs <= flags]


@functools.lru_cache(maxsize=1)
def isa() -> str:
    """The variant this process runs: the best the CPU has, lowered by
    ``STRATA_CPU_ISA`` or ``ATEN_CPU_CAPABILITY`` when set (read once per
    process, as torch reads its own). Asking for a variant the CPU cannot
    run is an error that names the ones it can."""
    can = supported_isas()
    order = list(ISA_VARIANTS)
    chosen = can[0]
    cap = _ATEN_CAP.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower())
    if cap is not None and order.index(cap) > order.index(chosen):
        chosen = cap
    asked = os.environ.get("STRATA_CPU_ISA")
    if asked:
        if asked not in ISA_VARIANTS:
            raise ValueError(f"STRATA_CPU_ISA={asked!r}: choose one of {', '.join(ISA_VARIANTS)}")
        if asked not in can:
            raise ValueError(f"STRATA_CPU_ISA={asked!r}: this CPU runs {', '.join(can)}")
        chosen = asked
    return chosen


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below the bf16 dot product.
_ONEDNN_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


@functools.lru_cache(maxsize=1)
def bf16_matmul() -> bool:
    """Whether torch's bfloat16 GEMM runs on bf16 hardware here (the AVX-512
    bf16 dot product or AMX: about 2.5x its float32 GEMM on 2 Zen 4 cores),
    not emulated: the CPU has it, and neither this process's kernel variant
    (``isa()``, lowered by ``ATEN_CPU_CAPABILITY``) nor ``ONEDNN_MAX_CPU_ISA``
    keeps torch below it."""
    has = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in _ONEDNN_WITHOUT_BF16
    return has and isa().startswith("avx512") and not capped


def _build(variant: str):
    from torch.utils.cpp_extension import _get_build_directory, load

    flags, _ = ISA_VARIANTS[variant]
    name = f"strata_cpu_kernels_{variant}"
    build_directory = Path(_get_build_directory(name, verbose=False))
    # -ffp-contract=off: dequantize must round exactly as gguf-py does (no
    # fused multiply-adds unless the source asks for one).
    with _build_lock(build_directory), \
            _progress_line(f"building the CPU kernels ({variant}; once per machine, about a minute)"):
        _write_if_changed(build_directory / "iq_tables.h", header_text())  # the IQ grids, from gguf.quants
        return load(name=name, sources=[str(p) for p in _SOURCES], build_directory=str(build_directory),
                    extra_include_paths=[str(_CSRC), str(build_directory)],
                    extra_cflags=["-O3", *flags, "-ffp-contract=off", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)


def _write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` unless it holds it already (a new mtime would rebuild the kernels)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


@contextlib.contextmanager
def _build_lock(build_directory: Path):
    """Hold an advisory lock (``flock``) on the build for the ``load`` inside.

    torch's own lock is a file that a killed build leaves behind, and every
    later ``load`` of that extension then waits for it forever, cached build
    or not. The kernel drops a ``flock`` when its holder dies, so whoever holds
    this one knows that no Strata process is building the extension, and a
    torch lock file still there is stale: it is removed, with a warning."""
    holder = build_directory.parent / f"{build_directory.name}.build-lock"
    with open(holder, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process building %s", build_directory.name)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_directory / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that was interrupted (it would block every load)",
                            stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class _progress_line:
    """A tqdm line with the elapsed time, shown only if the work inside takes
    more than a second (a cached build loads in a fraction of one)."""

    def __init__(self, desc: str):
        self.desc = desc
        self.done = threading.Event()

    def _tick(self) -> None:
        if self.done.wait(1.0):
            return
        from tqdm.auto import tqdm

        with tqdm(desc=self.desc, bar_format="{desc}: {elapsed}") as bar:
            while not self.done.wait(1.0):
                bar.refresh()

    def __enter__(self):
        self.thread = threading.Thread(target=self._tick, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def kernels_for(variant: str):
    """The compiled module of ``variant``, building it on first call; None if
    it cannot be built here (the reason is logged once and kept)."""
    if variant in _modules or variant in _errors:
        return _modules.get(variant)
    with _lock:
        if variant not in _modules and variant not in _errors:
            t0 = time.perf_counter()
            try:
                _modules[variant] = _build(variant)
            except Exception as exc:  # a missing compiler, ninja, or headers
                _errors[variant] = f"{type(exc).__name__}: {exc}".strip()
                log.warning("CPU GGUF kernels (%s) could not be built, using the torch path instead: %s",
                            variant, _errors[variant])
            else:
                log.debug("CPU kernels (%s) ready in %.1f s", variant, time.perf_counter() - t0)
    return _modules.get(variant)


def kernels():
    """The compiled module for this machine's variant (``isa()``), or None."""
    return kernels_for(isa())


def built():
    """``kernels()``, or a RuntimeError that says why they did not build and
    what to do (the functions below call through this)."""
    module = kernels()
    if module is None:
        raise RuntimeError(f"the CPU kernels could not be built here ({build_error()}); "
                           "install a C++ compiler and ninja, or use backend='torch'")
    return module


def available() -> bool:
    return kernels() is not None


def build_error() -> str | None:
    kernels()
    return _errors.get(isa())


def describe() -> str:
    """What the kernels run on this machine, for ``props()`` and benchmarks
    ("avx2 (this CPU runs avx512, avx2, generic): avx2 lanes"), or why they
    did not build."""
    built = kernels()
    if built is None:
        return f"not built: {build_error()}"
    return f"{isa()} (this CPU runs {', '.join(supported_isas())}): {built.simd} lanes"


def supports(qt: QuantTensor) -> bool:
    """Whether ``qt`` can be read by these kernels (not whether they built)."""
    return qt.device.type == "cpu" and qt.qtype in CPU_KERNEL_TYPES and len(qt.shape) == 2


def check_supported(qt: QuantTensor) -> None:
    if qt.qtype not in CPU_KERNEL_TYPES:
        names = ", ".join(sorted(t.name for t in CPU_KERNEL_TYPES))
        raise NotImplementedError(f"the CPU kernels read {names}, not {qt.qtype.name}; use backend='torch'")


def gemv(x: torch.Tensor, qt: QuantTensor) -> torch.Tensor:
    """``x @ W.T`` for float32 or bfloat16 ``x`` ``[M, K]``, ``M <= 8``,
    reading each block of ``qt`` once; ``[M, N]`` in x's dtype. By integer
    dot products (``csrc/qdot_cpu.cpp``): x quantized once to 16-bit codes
    with one scale per 32 columns (each value within 2^-16 of its group's
    largest, finer than bfloat16's rounding), products summed in int32 per
    32 weights, then scaled and accumulated in float32."""
    return built().gemv(x, [qt.data], [int(qt.qtype)], qt.cols)[0]


def gemv_many(x: torch.Tensor, weights: list[QuantTensor]) -> list[torch.Tensor]:
    """``[x @ W.T for W in weights]`` in one call and one parallel region
    (the q/k/v or gate/up projections of a decode step), same contract as
    ``gemv``; the weights may be of different types."""
    return gemv_blocks(x, *gemv_arguments(weights))


def gemv_arguments(weights: list[QuantTensor]) -> tuple[list[torch.Tensor], list[int]]:
    """What ``gemv_blocks`` takes for ``weights``: made once per layer, not per step."""
    for w in weights:
        check_supported(w)
    return [w.data for w in weights], [int(w.qtype) for w in weights]


def gemv_blocks(x: torch.Tensor, blocks: list[torch.Tensor], qtypes: list[int]) -> list[torch.Tensor]:
    """``gemv_many`` on ``gemv_arguments``' lists (x float32 or bfloat16, at
    most ``CPU_GEMV_MAX_M`` rows): the kernel call and nothing else."""
    return built().gemv(x, blocks, qtypes, x.shape[-1])


def gemv_experts(x: torch.Tensor, experts: QuantTensor, runs: list[tuple[int, int, int]]) -> torch.Tensor:
    """A mixture-of-experts step's GEMVs in one call and one parallel region:
    for each ``(expert, start, count)`` of ``runs`` (``count`` at most
    ``CPU_GEMV_MAX_M``), rows ``start..start+count-1`` of ``x`` ``[P, K]``
    (float32 or bfloat16) times that expert's matrix of ``experts``
    ``[E, N, K]``. Float32 ``[P, N]``; rows no run covers are left unwritten.
    Each expert's blocks are read once for its rows, as ``gemv`` reads a weight."""
    check_supported(experts)
    e, s, c = zip(*runs) if runs else ((), (), ())
    return built().gemv_experts(x, experts.data, int(experts.qtype), experts.shape[1], list(e), list(s), list(c))


def dequantize_into(qt: QuantTensor, out: torch.Tensor) -> torch.Tensor:
    """Write the dense 2-D ``qt`` into ``out`` (float32 or bfloat16, ``[N, K]``).
    float32 values equal ``gguf.quants.dequantize`` bit for bit."""
    built().dequantize(qt.data, int(qt.qtype), qt.cols, out)
    return out


def dequantize_cpu(qt: QuantTensor, dtype: torch.dtype) -> torch.Tensor:
    check_supported(qt)
    kernel_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    out = torch.empty((qt.rows, qt.cols), dtype=kernel_dtype)
    return dequantize_into(qt, out).to(dtype).reshape(qt.shape)


def qmatmul_cpu(x: torch.Tensor, qt: QuantTensor, gemm_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` in ``x``'s dtype: the GEMV for up to ``CPU_GEMV_MAX_M`` rows,
    else torch's GEMM over slabs of weight rows dequantized in ``gemm_dtype``
    (default x's dtype; float32 for float16 x), so no dense copy of the whole
    weight is made."""
    check_supported(qt)
    if x.shape[0] <= CPU_GEMV_MAX_M:
        if x.dtype in (torch.float32, torch.bfloat16):
            return gemv(x, qt)
        return gemv(x.float(), qt).to(x.dtype)
    if gemm_dtype is None:
        gemm_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    work = x.to(gemm_dtype)
    out = torch.empty((x.shape[0], qt.rows), dtype=gemm_dtype)
    slab = torch.empty((min(CPU_SLAB_ROWS, qt.rows), qt.cols), dtype=gemm_dtype)
    for r0 in range(0, qt.rows, CPU_SLAB_ROWS):
        part = qt.row_slice(r0, min(qt.rows, r0 + CPU_SLAB_ROWS))
        w = dequantize_into(part, slab[:part.rows])
        torch.matmul(work, w.T, out=out[:, r0:r0 + part.rows])
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last dim of float32
    or bfloat16 ``x`` (weight float32), in one call; then, with ``rope``
    (float32 cos/sin ``[T, 1, D]`` for ``x`` ``[T, H, D]``), the NEOX rotary
    embedding; then, with ``residual``, ``residual + result``. Float32 inside,
    rounded once to x's dtype."""
    cos, sin = rope if rope is not None else (None, None)
    return built().rms_norm(x.contiguous(), weight, eps, residual, cos, sin)


def attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     window: int | None, scale: float, tables, new_k: torch.Tensor | None = None,
                     new_v: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence: ``q`` ``[B, H, D]`` float32 at ``positions``
    (int64 ``[B]``) over keys and values ``[slots, Hkv, D]`` (both float32 or
    both bfloat16) read through the sequences' block tables (a
    ``paging.BlockTables`` of ``B`` rows), every position from
    ``max(0, position - window + 1)`` (0 without a window) on; ``[B, H, D]``
    float32. With ``new_k`` and ``new_v`` (``[B, Hkv, D]``), each query's own
    key and value are written into its slot first. Each K and V row is read
    once; D a multiple of 16."""
    return built().attention_decode(q.contiguous(), k, v, positions, window, scale, tables.tables, tables.lengths,
                                    tables.block_size, new_k, new_v)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The NEOX rotary embedding of ``x`` ``[T, H, D]`` (float32 or bfloat16)
    by float32 cos/sin ``[T, 1, D]``, in one call, float32 inside, rounded
    once to x's dtype (``rms_norm``'s rotation without the norm)."""
    return built().rms_norm(x.contiguous(), None, 0.0, None, cos, sin)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (float32 or bfloat16, one shape
    and dtype) in one call, float32 inside, rounded once."""
    return built().gated_mul(gate, up, 0)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``recurrent.delta_rule_step`` in one call (float32 throughout): each
    sequence's ``[Dk, Dv]`` state per value head read twice (the second time
    from cache) and written once, in place in its slot of ``state``."""
    return built().delta_rule_step(q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                                   g.float().contiguous(), beta.float().contiguous(), state, slots.contiguous())


def delta_rule_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> torch.Tensor:
    """``recurrent.delta_rule_recurrent`` in one call: one sequence's tokens in
    order, each head's ``[Dk, Dv]`` state (``state`` ``[Hv, Dk, Dv]``,
    contiguous, updated in place) kept in cache for all of them."""
    return built().delta_rule_scan(q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                                   g.float().contiguous(), beta.float().contiguous(), state)


def conv_step(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``recurrent.causal_conv_step`` in one call (float32): each sequence's
    window in its slot of ``conv`` shifted in place."""
    return built().conv_step(x.float().contiguous(), weight, conv, slots.contiguous())


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (float32 or bfloat16, one shape and dtype) in one
    call, float32 inside, rounded once."""
    return built().gated_mul(gate, up, 1)
