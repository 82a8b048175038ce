"""Compile the Triton kernels for NVIDIA GPUs on a machine without one.

Triton compiles for a target it is told of (``GPUTarget("cuda", 86, 32)``)
without a device: Python to PTX to a cubin through the ``ptxas`` it ships.
``compile_all`` compiles each of ``launch_plans.configurations()`` for each
target in ``TARGETS``, in a pool of processes, and reads ``ptxas -v`` (which
Triton runs with ``-v`` and, asked, prints) for registers, spilled bytes and
static shared memory; Triton's metadata gives the dynamic shared memory. The
occupancy follows from those and the target's limits.

Each result is kept in a cache keyed by the kernels' source, Triton's version,
the configuration and the target (``STRATA_COMPILE_CACHE``, default
``~/.cache/strata/triton-compile``), so a run compiles only what changed.

``bench/kernel_report.py`` prints the table. The Triton interpreter must be
off in the compiling processes; this module switches it off in its workers.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import dataclasses
import hashlib
import io
import json
import multiprocessing
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .launch_plans import KernelConfig

# launch_plans (which imports triton) loads where used: a worker must not
# import triton before its setup has switched the interpreter off.


@dataclass(frozen=True)
class Target:
    """A GPU architecture's per-block and per-SM limits (CUDA programming
    guide, compute capabilities table); shared memory in bytes, the per-block
    figure being the opt-in maximum a kernel may request."""

    name: str
    capability: int
    shared_per_block: int
    shared_per_sm: int
    threads_per_sm: int
    blocks_per_sm: int
    registers_per_sm: int = 65536
    shared_reserved_per_block: int = 1024  # the driver's, per resident block
    sms: int = 0  # streaming multiprocessors of the largest common part (the bandwidth check's R3)


TARGETS = {
    "sm_80": Target("sm_80", 80, 166912, 167936, 2048, 32, sms=108),  # A100
    "sm_86": Target("sm_86", 86, 101376, 102400, 1536, 16, sms=84),  # RTX 30xx, A10, A40
    "sm_89": Target("sm_89", 89, 101376, 102400, 1536, 24, sms=142),  # RTX 40xx, L4, L40S
    "sm_90": Target("sm_90", 90, 232448, 233472, 2048, 32, sms=132),  # H100, H200
}


# The targets whose decode loops are read from the SASS (the bandwidth check's).
LOOP_TARGETS = ("sm_86", "sm_90")


@dataclass
class CompileResult:
    """One configuration on one target. ``ok`` is False with ``error`` set
    when it did not compile or needs more shared memory than the target has."""

    label: str
    kernel: str
    target: str
    decode: bool
    num_warps: int
    ok: bool = False
    error: str = ""
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    shared: int = 0  # dynamic + static, bytes
    occupancy: float = 0.0  # resident warps / the SM's maximum
    loop: dict | None = None  # a decode configuration's main loop (``sass.LoopFigures`` as a dict)
    seconds: float = 0.0
    cached: bool = False

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


def occupancy(target: Target, registers: int, shared: int, num_warps: int) -> float:
    """Resident warps per SM over the maximum, from the three limits a block
    is held to: registers (allocated per warp in 256s, per thread in 8s),
    shared memory (plus the driver's reserve per block) and threads."""
    threads = 32 * num_warps
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = target.registers_per_sm // (regs_per_warp * num_warps)
    by_shared = target.shared_per_sm // (shared + target.shared_reserved_per_block)
    by_threads = target.threads_per_sm // threads
    blocks = min(by_regs, by_shared, by_threads, target.blocks_per_sm)
    return blocks * num_warps / (target.threads_per_sm // 32)


_USED = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict:
    """Registers, spilled bytes, stack frame and static shared memory from
    ``ptxas -v`` output (one kernel)."""
    used = _USED.search(log)
    if used is None:
        raise ValueError(f"no register count in the ptxas output:\n{log}")
    spills = _SPILLS.search(log)
    smem = _SMEM.search(log)
    stack, stores, loads = (int(g) for g in spills.groups()) if spills else (0, 0, 0)
    return dict(registers=int(used.group(1)), spill_stores=stores, spill_loads=loads, stack=stack,
                static_shared=int(smem.group(1)) if smem else 0)


# The interpreter replaces every @triton.jit function when triton is
# imported: it must be off in a worker. Compile every time (Triton's own cache
# would skip ptxas, whose log is the point) and have ptxas's report printed.
_COMPILER_ENV = {"TRITON_INTERPRET": None, "TRITON_ALWAYS_COMPILE": "1", "TRITON_DUMP_PTXAS_LOG": "1",
                 "TRITON_DEFAULT_FP_FUSION": "1"}  # the last: Triton 3.9's default, said aloud


def _worker_setup() -> None:
    for name, value in _COMPILER_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def _compiler_environment():
    """The workers' environment in this process while they start (a spawned
    process copies it), the caller's restored after."""
    saved = {name: os.environ.get(name) for name in _COMPILER_ENV}
    _worker_setup()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def compile_one(config: KernelConfig, target_name: str) -> CompileResult:
    """Compile ``config`` for ``target_name`` in this process (a worker)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = TARGETS[target_name]
    result = CompileResult(config.label, config.kernel, target_name, config.decode, config.num_warps)
    fn = getattr(importlib.import_module(f"strata_kernels.{config.module}"), config.kernel)
    t0 = time.perf_counter()
    log = io.StringIO()
    try:
        # As the JIT specializes a launch on torch tensors: every pointer is
        # 16-byte aligned (what lets loads be vectorized); integers unmarked.
        aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
                   for name, kind in config.signature.items() if kind.startswith("*") or name in config.divisible}
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn, dict(config.signature), dict(config.constexprs), aligned),
                                      target=GPUTarget("cuda", target.capability, 32),
                                      options={"num_warps": config.num_warps,
                                               **({"num_stages": config.num_stages} if config.num_stages else {})})
        usage = parse_ptxas(log.getvalue())
    except Exception as exc:  # a compile error is this configuration's result, not the run's end
        result.error = f"{type(exc).__name__}: {exc}"[:2000]
        result.seconds = time.perf_counter() - t0
        return result
    result.seconds = time.perf_counter() - t0
    result.registers = usage["registers"]
    result.spill_stores, result.spill_loads, result.stack = usage["spill_stores"], usage["spill_loads"], usage["stack"]
    result.shared = compiled.metadata.shared + usage["static_shared"]
    if result.shared > target.shared_per_block:
        result.error = (f"needs {result.shared} bytes of shared memory; {target_name} gives a block at most "
                        f"{target.shared_per_block}")
        return result
    result.occupancy = occupancy(target, result.registers, result.shared, config.num_warps)
    if config.decode and target_name in LOOP_TARGETS:  # what the memory-bound loops cost (bandwidth.py judges it)
        from .sass import disassemble, loop_figures

        result.loop = dataclasses.asdict(loop_figures(disassemble(compiled.asm["cubin"])))
    result.ok = True
    return result


_RESULT_VERSION = b"results-2"  # what a result holds: 2 added the decode loops' SASS figures


def _source_hash() -> str:
    """The kernels' source and the Triton that compiles them."""
    from importlib.metadata import version

    h = hashlib.sha256(version("triton").encode() + _RESULT_VERSION)
    here = Path(__file__).parent
    for path in sorted(here.glob("_triton_*.py")) + [here / "sass.py"]:
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("STRATA_COMPILE_CACHE") or Path.home() / ".cache" / "strata" / "triton-compile")


def _cache_path(source: str, config: KernelConfig, target: str) -> Path:
    # A decode configuration's result also holds its loop's figures: a key of its own.
    key = hashlib.sha256(json.dumps([source, repr(config.key), config.decode, target]).encode()).hexdigest()
    return cache_dir() / key[:2] / f"{key}.json"


def compile_all(configs: list[KernelConfig], targets: list[str], workers: int | None = None,
                progress=None) -> list[CompileResult]:
    """Every configuration for every target, cached results first, the rest
    compiled in ``workers`` processes (default: one per CPU). ``progress``:
    called with (done, total) as results arrive."""
    source = _source_hash()
    jobs = [(c, t) for c in configs for t in targets]
    results: list[CompileResult | None] = [None] * len(jobs)
    missing = []
    for i, (config, target) in enumerate(jobs):
        path = _cache_path(source, config, target)
        if path.exists():
            try:
                # The label and role are the configuration's now, not the run's that compiled it.
                results[i] = CompileResult(**{**json.loads(path.read_text()), "cached": True, "label": config.label,
                                              "decode": config.decode})
                continue
            except (ValueError, TypeError):
                pass  # unreadable: compile again
        missing.append(i)
    done = len(jobs) - len(missing)
    if progress:
        progress(done, len(jobs))
    if missing:
        context = multiprocessing.get_context("spawn")
        with _compiler_environment(), futures.ProcessPoolExecutor(
                max_workers=workers or os.cpu_count() or 1, mp_context=context, initializer=_worker_setup) as pool:
            pending = {pool.submit(compile_one, *jobs[i]): i for i in missing}
            for future in futures.as_completed(pending):
                i = pending[future]
                results[i] = result = future.result()
                path = _cache_path(source, *jobs[i])
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(dataclasses.asdict(result)))
                tmp.replace(path)
                done += 1
                if progress:
                    progress(done, len(jobs))
    return results


def format_table(results: list[CompileResult]) -> str:
    """One line per configuration and target."""
    lines = [f"{'kernel':<26} {'configuration':<44} {'target':<6} {'ok':<4} {'regs':>4} {'spill B':>7} "
             f"{'smem B':>7} {'occ':>5}"]
    for r in results:
        status = "ok" if r.ok else "FAIL"
        lines.append(f"{r.kernel:<26} {r.label + (' *' if r.decode else ''):<44} {r.target:<6} {status:<4} "
                     f"{r.registers:>4} {r.spills:>7} {r.shared:>7} {r.occupancy:>5.0%}")
        if r.error:
            lines.append(f"    {r.error.splitlines()[0][:200]}")
    return "\n".join(lines)
