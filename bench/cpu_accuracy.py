"""The CPU default path's accuracy against the exact path, per model file:
top-1 agreement and mean KL(exact || default) over the Gemma reference
texts (``tests/data``), fed as one prompt and one token a step (the decode
GEMV), as ``tests/test_fast_path.py`` measures them for the default files.
For the same model in other GGUF types (``bench/requantize.py`` writes
them): a type read by the kernels should cost no more accuracy than the
Q4_K_M file's path does.

    python bench/cpu_accuracy.py FILE [FILE ...] [--decode-tokens 128]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import strata_runtime
from strata_runtime.models import decode_logits_of
from strata_runtime.quality import agreement, logits_of

REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "gemma-3-270m-q4_k_m.float32.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--decode-tokens", type=int, default=128)
    args = ap.parse_args()
    texts = [case["tokens"] for case in json.loads(REFERENCE.read_text())["teacher_forced"]]
    print(f"# default path (dtype=auto) vs the exact path (float32) of the same file, {len(texts)} Gemma texts; "
          f"decode: the first {args.decode_tokens} tokens of each, one a step")
    print(f"{'file':<44} {'prompt top-1':>12} {'KL':>8} {'decode top-1':>13} {'KL':>8}  weights")
    for file in args.files:
        options = {"progress": False, "conversation_cache_mib": 0, "context_length": 2048}
        exact = strata_runtime.load(file, dtype="float32", **options)
        fast = strata_runtime.load(file, dtype="auto", **options)
        reference = logits_of(exact, texts)
        prompt = agreement(reference, logits_of(fast, texts))
        short = [t[:args.decode_tokens] for t in texts]
        decode = agreement(logits_of(exact, short), decode_logits_of(fast, short))
        weights = ", ".join(f"{k}: {v}" for k, v in fast.props()["compute_path"]["weights"].items())
        print(f"{Path(file).name:<44} {prompt.top1:>12.1%} {prompt.kl:>8.4f} {decode.top1:>13.1%} {decode.kl:>8.4f}  "
              f"{weights}")
        del exact, fast


if __name__ == "__main__":
    main()
