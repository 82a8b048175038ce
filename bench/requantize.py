"""Requantize a GGUF file with llama.cpp (through llama-cpp-python), for the
CPU kernels' IQ benchmarks: the default model in IQ4_XS, IQ3_S and the
other types llama.cpp writes without an importance matrix.

    python bench/requantize.py --types IQ4_XS,IQ3_S [--model PATH] [--out DIR]

Writes ``DIR/<model stem>.<type>.gguf`` (default DIR: the directory of the
model; files are never committed) and prints each file's size. llama.cpp
requantizes from the file's own (already quantized) weights, as its
``llama-quantize --allow-requantize`` does; the figures compare Strata with
llama.cpp on the same bytes, not the types' accuracy.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

# File types (llama.h's LLAMA_FTYPE_MOSTLY_*) llama.cpp writes without an importance matrix.
FTYPES = ("Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_M", "IQ3_XXS")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the GGUF to requantize (default: the default model)")
    ap.add_argument("--types", default="IQ4_XS,IQ3_S", help=f"comma-separated, of {', '.join(FTYPES)}")
    ap.add_argument("--out", default=None, help="directory for the new files (default: the model's)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("requantizing needs llama.cpp: pip install llama-cpp-python (see docs/benchmarks.md for the "
              "build flags on a CPU with AMX)", file=sys.stderr)
        return 2
    if args.model is None:
        from strata_runtime.files import default_model_path

        args.model = str(default_model_path(os.environ.get("STRATA_CACHE_DIR")))
    source = Path(args.model)
    out_dir = Path(args.out) if args.out else source.parent
    for name in args.types.split(","):
        if name not in FTYPES:
            print(f"unknown type {name!r}: choose from {', '.join(FTYPES)}", file=sys.stderr)
            return 2
        target = out_dir / f"{source.stem}.{name}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
        params.nthread = args.threads
        params.allow_requantize = True
        t0 = time.perf_counter()
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
        if rc != 0:
            print(f"{name}: llama.cpp's quantize failed (return code {rc})", file=sys.stderr)
            return 1
        print(f"{target} ({target.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
