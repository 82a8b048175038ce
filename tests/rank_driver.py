"""Run by tests/test_ranks.py on every rank of a two-process split.

Rank 0 loads the engine with ``distributed=True`` and writes what it saw to
the file named by argv[1] (torch.save): greedy tokens of the reference
prompts, teacher-forced logits, a parked-and-restored conversation, and a
checkpoint whose stage-1 part fails. The other rank follows. argv[4]: the
devices, one per rank (default cpu,cpu).
"""

from __future__ import annotations

import json
import sys

import torch

import strata_runtime
from strata_runtime.split import ranks
from strata_runtime.testing import inject_fault

OPTIONS = dict(dtype="float32", progress=False, context_length=512, layer_split=[9], threads=1,
               conversation_cache_mib=64, min_free_mib=0, checkpoint_every=32)


def main(model: str, out: str, reference: str, devices: str = "cpu,cpu") -> int:
    options = dict(OPTIONS, devices=devices.split(","))
    if ranks.this_rank() != 0:
        return ranks.follow(model, **options)
    ref = json.loads(open(reference).read())
    engine = strata_runtime.load(model, distributed=True, **options)
    try:
        result = {"props": engine.props()}
        result["greedy"] = [engine.generate(c["prompt_tokens"], max_tokens=16, temperature=0).tokens
                            for c in ref["greedy"]]
        result["logits"] = [engine.logits(c["tokens"]) for c in ref["teacher_forced"]]
        prompts = [engine.tokenize(t * 6) for t in ("The printing press came to Venice in 1469. ",
                                                     "Bread needs flour, water and salt. ")]
        order = [prompts[0], prompts[1], prompts[0] + prompts[1][1:4], prompts[1] + prompts[0][1:4]]
        runs = [engine.generate(p, max_tokens=4, temperature=0) for p in order]
        result["conversation"] = {"prompts": order, "tokens": [r.tokens for r in runs],
                                  "cached": [r.cached_tokens for r in runs], "stats": engine.stats()}
        faulty = engine.tokenize("A different text about rivers and mountains, long enough to checkpoint. " * 3)
        with inject_fault("checkpoint_copy", stage=1) as fault:
            tokens = engine.generate(faulty, max_tokens=4, temperature=0).tokens
        result["fault"] = {"prompt": faulty, "tokens": tokens, "fired": fault.fired, "stats": engine.stats()}
        torch.save(result, out)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
