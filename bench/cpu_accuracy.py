"""The CPU default path's accuracy against the exact path, per model file:
top-1 agreement and mean KL(exact || default) over the Gemma reference
texts (``tests/data``), fed as one prompt and one token a step (the decode
GEMV), as ``tests/test_fast_path.py`` measures them for the default files.
For the same model in other GGUF types (``bench/requantize.py`` writes
them): a type read by the kernels should cost no more accuracy than the
Q4_K_M file's path does.

The reference texts are 512 positions: one position is 0.2 points of
top-1. ``--corpus N`` adds N positions of Python's own reference text
(``pydoc_data.topics``, 512-token prompts) for the prompt path, and the
file's own sensitivity there: the exact path against itself with its token
embeddings nudged by a relative 2**-9 (one bfloat16 rounding; ``quality.nudged``).
A lower-bit file has flatter, closer-run predictions, so the same rounding
flips more of them; the sensitivity column shows how much.

    python bench/cpu_accuracy.py FILE [FILE ...] [--decode-tokens 128] [--corpus 8192]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import strata_runtime
from strata_runtime.models import decode_logits_of
from strata_runtime.quality import Agreement, agreement, logits_of, nudged

REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "gemma-3-270m-q4_k_m.float32.json"
CHUNK = 512
BFLOAT16_ROUNDING = 2.0 ** -9


def pooled(parts: list[Agreement]) -> Agreement:
    positions = sum(p.positions for p in parts)
    return Agreement(sum(p.top1 * p.positions for p in parts) / positions,
                     sum(p.kl * p.positions for p in parts) / positions, positions)


def corpus_chunks(engine, positions: int) -> list[list[int]]:
    from pydoc_data.topics import topics  # the standard library's own documentation: fixed per Python version

    ids = engine.tokenizer.encode("\n\n".join(topics[key] for key in sorted(topics)))
    return [ids[i:i + CHUNK] for i in range(0, min(positions, len(ids)), CHUNK)]


def corpus_figures(exact, fast, positions: int) -> tuple[Agreement, Agreement]:
    """The default path against the exact one, and the exact path nudged
    against itself, chunk by chunk (a chunk's logits are 0.5 GiB at Gemma's vocabulary)."""
    default, sensitivity = [], []
    for chunk in corpus_chunks(exact, positions):
        reference = logits_of(exact, [chunk])
        default.append(agreement(reference, logits_of(fast, [chunk])))
        with nudged(exact, seed=0, relative=BFLOAT16_ROUNDING):
            sensitivity.append(agreement(reference, logits_of(exact, [chunk])))
    return pooled(default), pooled(sensitivity)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--corpus", type=int, default=0, help="positions of pydoc text for the prompt path (0: none)")
    args = ap.parse_args()
    texts = [case["tokens"] for case in json.loads(REFERENCE.read_text())["teacher_forced"]]
    print(f"# default path (dtype=auto) vs the exact path (float32) of the same file, {len(texts)} Gemma texts; "
          f"decode: the first {args.decode_tokens} tokens of each, one a step"
          + (f"; corpus: {args.corpus} positions of pydoc text as {CHUNK}-token prompts" if args.corpus else ""))
    corpus_header = f" {'corpus top-1':>12} {'KL':>8} {'nudged exact':>12} {'KL':>8}" if args.corpus else ""
    print(f"{'file':<44} {'prompt top-1':>12} {'KL':>8} {'decode top-1':>13} {'KL':>8}{corpus_header}  weights")
    for file in args.files:
        options = {"progress": False, "conversation_cache_mib": 0, "context_length": 2048}
        exact = strata_runtime.load(file, dtype="float32", **options)
        fast = strata_runtime.load(file, dtype="auto", **options)
        reference = logits_of(exact, texts)
        prompt = agreement(reference, logits_of(fast, texts))
        short = [t[:args.decode_tokens] for t in texts]
        decode = agreement(logits_of(exact, short), decode_logits_of(fast, short))
        corpus = ""
        if args.corpus:
            default, sensitivity = corpus_figures(exact, fast, args.corpus)
            corpus = f" {default.top1:>12.2%} {default.kl:>8.4f} {sensitivity.top1:>12.2%} {sensitivity.kl:>8.4f}"
        weights = ", ".join(f"{k}: {v}" for k, v in fast.props()["compute_path"]["weights"].items())
        print(f"{Path(file).name:<44} {prompt.top1:>12.1%} {prompt.kl:>8.4f} {decode.top1:>13.1%} {decode.kl:>8.4f}"
              f"{corpus}  {weights}", flush=True)
        del exact, fast, reference


if __name__ == "__main__":
    main()
