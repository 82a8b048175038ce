"""The static bandwidth check of the decode kernels (no GPU needed): every
GEMV type and shape and every decode attention format the check covers,
compiled for sm_86 and sm_90, with its main loop's figures from the SASS,
R1-R3 judged, and an estimated share of copy bandwidth from the issue-and-
latency model in ``strata_kernels/bandwidth.py`` (its constants fitted to the
first H200 run; the fit's residuals printed first).

    python bench/bandwidth_check.py            # compiles what the cache lacks (minutes the first time)
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)


def main() -> int:
    from strata_kernels import bandwidth as bw

    def progress(done, total):
        print(f"\rcompiled {done}/{total}", end="", file=sys.stderr, flush=True)

    checks = bw.run(progress=progress)
    print(file=sys.stderr)
    model, rms = bw.fit(checks)
    checks = bw.with_model(checks, model)
    print(f"model: memory latency {model.latency:g} cycles, {model.sectors_per_clock:g} sectors per clock per SM, "
          f"{model.issue_per_clock:g} warp-instructions per clock per SM, {model.cycles_per_instruction:g} cycles "
          f"per instruction of one warp; fit to the H200 run: rms error "
          f"{rms:.2f} in log2 (x{2 ** rms:.2f})")
    print("parts: " + "; ".join(f"{t}: {p.name}, {p.sms} SMs, {p.clock_ghz} GHz, copy {p.copy_gbs:g} GB/s"
                                 for t, p in bw.PARTS.items()))
    print(f"{'calibration (sm_90)':<34} {'measured':>9} {'estimate':>9}")
    for c in checks:
        if c.kernel in ("gemv", "blocks") and c.target == "sm_90" and c.key in bw.CALIBRATION:
            print(f"{c.what:<34} {bw.CALIBRATION[c.key]:>9.1%} {c.estimate:>9.1%}")
    print()
    print(f"R1 bytes per load >= {bw.R1_MIN:g}; R2 instructions per KiB <= "
          + ", ".join(f"{v:g} ({t})" for t, v in bw.R2_MAX.items())
          + f"; R3 CTAs per SM >= {bw.R3_MIN_WAVES:g}")
    print(bw.format_table(checks))
    decode = bw.judged(checks)
    failing = [c for c in decode if c.failures()]
    print(f"\n{len(failing)} of {len(decode)} decode configurations fail R1-R3 ({len(checks) - len(decode)} rows of "
          "the GEMV on GGUF blocks for types the GPU path lays out as planes: shown, not judged)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
