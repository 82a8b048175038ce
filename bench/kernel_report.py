"""Registers, spills, shared memory and occupancy of every Triton kernel, per
configuration and GPU target, compiled here without a GPU.

    python bench/kernel_report.py                       # every configuration, sm_80/86/89/90
    python bench/kernel_report.py --decode-only --targets sm_86,sm_90
    python bench/kernel_report.py --csv bench/results/kernel-report.csv

The configurations are ``strata_kernels.launch_plans.configurations()``: what
each launcher can choose. A ``*`` marks a decode configuration (one token per
sequence: memory-bound, where a spill is a defect). Results are cached by the
kernels' source (``STRATA_COMPILE_CACHE``), so a second run reads them back.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from strata_kernels.compile_targets import TARGETS, compile_all, format_table  # noqa: E402


def summary(results) -> str:
    """Per kernel and target: configurations, failures, the most registers,
    decode configurations that spill, the least occupancy."""
    groups = defaultdict(list)
    for r in results:
        groups[(r.kernel, r.target)].append(r)
    lines = [f"{'kernel':<26} {'target':<6} {'configs':>7} {'failed':>6} {'max regs':>8} {'decode spills':>13} "
             f"{'any spills':>10} {'min occ':>7}"]
    for (kernel, target), rs in sorted(groups.items()):
        ok = [r for r in rs if r.ok]
        lines.append(f"{kernel:<26} {target:<6} {len(rs):>7} {len(rs) - len(ok):>6} "
                     f"{max((r.registers for r in ok), default=0):>8} "
                     f"{sum(1 for r in ok if r.decode and r.spills):>13} {sum(1 for r in ok if r.spills):>10} "
                     f"{min((r.occupancy for r in ok), default=0):>7.0%}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    parser.add_argument("--dtypes", default="bf16,fp32", help="activation dtypes: bf16 (dtype=auto), fp32")
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--workers", type=int, default=None, help="compiling processes (default: one per CPU)")
    parser.add_argument("--csv", default="", help="write every result to this CSV file")
    parser.add_argument("--summary-only", action="store_true", help="print the per-kernel summary alone")
    args = parser.parse_args()

    from strata_kernels.launch_plans import configurations

    configs = configurations(tuple(args.dtypes.split(",")))
    if args.kernels:
        configs = [c for c in configs if c.kernel in args.kernels.split(",")]
    if args.decode_only:
        configs = [c for c in configs if c.decode]
    targets = args.targets.split(",")
    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"\rcompiled {done}/{total} ({time.perf_counter() - t0:.0f} s)", end="", file=sys.stderr, flush=True)

    results = compile_all(configs, targets, args.workers, progress)
    print(file=sys.stderr)
    import triton

    print(f"Triton {triton.__version__}; {len(configs)} configurations x {len(targets)} targets; "
          f"{sum(r.cached for r in results)} from the cache; "
          f"{sum(r.seconds for r in results if not r.cached):.0f} s of compiling in {time.perf_counter() - t0:.0f} s")
    print("(* = decode configuration; spill B = spill stores + loads, bytes; smem B = dynamic + static shared "
          "memory, bytes; occ = resident warps / the SM's maximum)\n")
    if not args.summary_only:
        print(format_table(results))
        print()
    print(summary(results))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            fields = [f.name for f in dataclasses.fields(results[0])] if results else []
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            for r in results:
                writer.writerow(dataclasses.asdict(r))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
