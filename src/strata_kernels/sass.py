"""What a compiled kernel's main loop costs, read from its SASS.

A memory-bound kernel (a decode step's GEMV, decode attention) reaches the
memory's bandwidth only if its main loop moves enough bytes per instruction
it issues and keeps enough loads in flight. Both show in the machine code
without running it: ``nvdisasm`` (shipped with Triton) prints the cubin's
SASS, the main loop is the body of a backward branch, and each global load
says its width (``LDG.E.U8``: 1 byte a thread, ``LDG.E.128``: 16).

``loop_figures(sass)`` counts, per iteration of the loop that streams the most
bytes: warp-instructions, global loads and the bytes they bring per thread,
shuffles and barriers, and the longest chain of loads whose addresses come
from loads of the same iteration (each link a full memory round trip).
A load marked evict-last (``LDG.E.EL``: ``tl.load(..., eviction_policy=
"evict_last")``) is a *lookup* in a small table the kernels keep cached (a
grid type's codebook): counted as an instruction and a lookup, not as
streamed bytes or a round trip to memory. The kernels mark nothing else so.
A kernel without a loop (fully unrolled) is read as one iteration.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?`?\(?(\.L_x_\d+)\)?")
_REGISTER = re.compile(r"\bR(\d+)(\.64)?\b")
_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


@dataclass(frozen=True)
class LoopFigures:
    """One iteration of a kernel's main loop, per warp (``looped``: False
    when the kernel has no loop and the whole body was read)."""

    instructions: int  # warp-instructions issued per iteration
    global_loads: int  # LDG / LDGSTS instructions
    load_bytes: int  # bytes those loads bring, per thread
    narrow_loads: int  # of them, loads of fewer than 4 bytes a thread (a gather of single weights)
    narrow_bytes: int
    round_trips: int  # loads in the longest chain of address dependences
    shuffles: int
    barriers: int
    looped: bool = True
    lookups: int = 0  # evict-last loads from a cached table (not streamed, not counted above)

    @property
    def bytes_per_load(self) -> float:
        """R1: bytes streamed per global-load instruction per thread."""
        return self.load_bytes / self.global_loads if self.global_loads else 0.0

    @property
    def instructions_per_kib(self) -> float:
        """R2: warp-instructions issued per KiB the warp streams."""
        streamed = self.load_bytes * 32
        return self.instructions * 1024 / streamed if streamed else float("inf")


def disassemble(cubin: bytes) -> str:
    """The SASS of ``cubin``, through the ``nvdisasm`` Triton ships."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {run.stderr.strip()[:500]}")
    return run.stdout


def _instructions(sass: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(address, instruction) in order, and each label's address."""
    code: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _LINE.search(line)
        if m:
            address = int(m.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            code.append((address, m.group(2)))
    return code, labels


def _opcode(instruction: str) -> str:
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def _load_width(opcode: str) -> int | None:
    """Bytes per thread of a global load (``LDG``, or ``LDGSTS``: cp.async), else None."""
    parts = opcode.split(".")
    if parts[0] not in ("LDG", "LDGSTS"):
        return None
    for part in parts[1:]:
        if part in _WIDTH:
            return _WIDTH[part]
    return 4


def _registers(operands: str) -> set[int]:
    regs = set()
    for number, wide in _REGISTER.findall(operands):
        regs.add(int(number))
        if wide:
            regs.add(int(number) + 1)
    return regs


def _written(opcode: str, dst: str) -> set[int]:
    """The registers an instruction writes: its destination and, for a wide
    result named by its first register alone, the ones after it (a 64- or
    128-bit load, ``IMAD.WIDE``, ``LDSM``'s 2 or 4 matrices, an ``HMMA``'s
    float32 fragment). Missing one would leave a stale chain on it. A
    store's or ``LDGSTS``'s first operand is an address: it writes none."""
    if dst.strip().startswith("["):
        return set()
    regs = _registers(dst)
    if not regs:
        return regs
    parts = opcode.split(".")
    count = 1
    if parts[0] in ("LDG", "LDS", "LDL", "LDC", "LD", "ATOM", "ATOMS", "ATOMG"):
        count = {"64": 2, "128": 4}.get(next((p for p in parts if p in ("64", "128")), ""), 1)
    elif parts[0] == "LDSM":
        count = int(parts[-1]) if parts[-1] in ("2", "4") else 1
    elif parts[0] == "IMAD" and "WIDE" in parts:
        count = 2
    elif parts[0] in ("HMMA", "IMMA"):
        count = 2 if parts[-1] == "F16" else 4
    elif parts[0] in ("DADD", "DMUL", "DFMA"):
        count = 2
    first = min(regs)
    return regs | {first + k for k in range(count)}


def _is_lookup(opcode: str) -> bool:
    return opcode.startswith("LDG") and "EL" in opcode.split(".")


def _figures(body: list[tuple[int, str]], looped: bool) -> LoopFigures:
    loads = load_bytes = narrow_loads = narrow_bytes = shuffles = barriers = lookups = 0
    depth: dict[int, int] = {}  # register -> loads in the chain that produced it, this iteration
    deepest = 0
    for _, instruction in body:
        opcode = _opcode(instruction)
        operands = instruction.split(None, 1)[1] if " " in instruction else ""
        if operands.startswith(opcode):
            operands = operands[len(opcode):]
        dst, _, srcs = operands.partition(",")
        source_depth = max((depth.get(r, 0) for r in _registers(srcs)), default=0)
        width = _load_width(opcode)
        if width is not None and _is_lookup(opcode):
            lookups += 1  # an L1 hit: its result's chain goes on at the depth of its index
        elif width is not None:
            loads += 1
            load_bytes += width
            if width < 4:
                narrow_loads += 1
                narrow_bytes += width
            source_depth += 1
            deepest = max(deepest, source_depth)
        elif opcode.startswith("SHFL"):
            shuffles += 1
        elif opcode.startswith(("BAR", "BSYNC")):
            barriers += 1
        for r in _written(opcode, dst):
            depth[r] = source_depth
    return LoopFigures(len(body), loads, load_bytes, narrow_loads, narrow_bytes, deepest, shuffles, barriers, looped,
                       lookups)


def loop_figures(sass: str) -> LoopFigures:
    """The figures of the innermost backward branch's body that streams the
    most bytes (the smaller body on a tie), or of the whole kernel. A loop
    around a streaming loop (a pass that may run again) is not the main
    loop: its body holds the inner one's and the inner's pipelined first
    loads."""
    code, labels = _instructions(sass)
    if not code:
        raise ValueError("no SASS instructions found")
    spans = []
    for i, (address, instruction) in enumerate(code):
        branch = _BRANCH.search(instruction)
        if branch and _opcode(instruction).startswith("BRA") and labels.get(branch.group(1), address + 1) <= address:
            start = labels[branch.group(1)]
            body = [(a, ins) for a, ins in code[:i + 1] if a >= start]
            figures = _figures(body, True)
            if figures.load_bytes:  # not the trap after EXIT (a branch to itself)
                spans.append((start, address, figures))
    bodies = [f for start, end, f in spans
              if not any(start <= s and e <= end and (s, e) != (start, end) for s, e, _ in spans)]
    if not bodies:
        return _figures(code, False)
    return max(bodies, key=lambda f: (f.load_bytes, -f.instructions))
