"""What the suffix drafter would save, before any verify exists: the model's
greedy answers on three workloads, replayed through ``SuffixDrafter`` as a
speculative decoder would call it (a draft at each step; the longest agreeing
prefix accepted, plus the target's own next token).

    python bench/draft_replay.py [--model PATH] [--max-tokens 200] [--max-draft 8]

Workloads (made here): a file rewritten whole with one rename; a chat whose
second turn asks for the first answer again, then more; free prose. Prints
per workload the tokens each verify step would yield (tokens / steps), the
drafter's acceptance and how often it drafted. Decode speed with speculation
is that figure times (one-row step time / verify step time), measured once
the verify runs (``bench/spec.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import strata_runtime  # noqa: E402
from strata_runtime.speculation import SuffixDrafter  # noqa: E402

SOURCE = Path(__file__).resolve().parents[1] / "src" / "strata_runtime" / "drafting.py"


@dataclass
class Seq:
    id: int
    tokens: list[int] = field(default_factory=list)


def workloads(engine) -> dict[str, list[dict]]:
    code = "\n".join(SOURCE.read_text().splitlines()[20:70])
    first = [{"role": "user", "content": "Explain in a few sentences what a lighthouse keeper does."}]
    answer = engine.chat(first, max_tokens=120, temperature=0).text
    return {
        "rewrite": [{"role": "user", "content": "Here is a Python file:\n\n" + code + "\n\nRename the class "
                     "_Index to _SequenceIndex everywhere and print the whole file again, unchanged otherwise."}],
        "quote": first + [{"role": "assistant", "content": answer},
                          {"role": "user", "content": "Repeat your answer word for word, then add one more sentence."}],
        "prose": [{"role": "user", "content": "Write a short story about a fox who learns to sail."}],
    }


def replay(prompt: list[int], output: list[int], drafter: SuffixDrafter) -> dict:
    """Steps a speculative decoder would take over ``output`` (greedy)."""
    tokens = prompt + output
    seq = Seq(0)
    at, steps, proposed, accepted, drafted = len(prompt), 0, 0, 0, 0
    while at < len(tokens):
        seq.tokens = tokens[:at]
        draft = drafter.propose(seq)
        actual = tokens[at:at + len(draft)]
        agree = 0
        while agree < len(actual) and draft[agree] == actual[agree]:
            agree += 1
        drafter.feedback(seq, len(draft), agree)
        proposed += len(draft)
        accepted += agree
        drafted += bool(draft)
        steps += 1
        at += agree + 1  # the accepted draft, and the target's own token after it
    drafter.release(seq)
    return dict(tokens=len(output), steps=steps, per_step=len(output) / max(steps, 1),
                acceptance=accepted / proposed if proposed else 0.0, drafted=drafted / max(steps, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--max-draft", type=int, default=8)
    args = ap.parse_args()
    engine = strata_runtime.load(args.model, progress=False, conversation_cache_mib=0)
    print(f"# {Path(engine.gguf.path).name}; greedy, up to {args.max_tokens} tokens; SuffixDrafter(max_draft="
          f"{args.max_draft})")
    print("| workload | prompt tokens | output tokens | verify steps | tokens / step | acceptance | steps drafted |")
    print("|---|---|---|---|---|---|---|")
    for name, messages in workloads(engine).items():
        prompt = engine.chat_prompt(messages)
        output = engine.generate(prompt, max_tokens=args.max_tokens, temperature=0).tokens
        r = replay(prompt, output, SuffixDrafter(max_draft=args.max_draft))
        print(f"| {name} | {len(prompt)} | {r['tokens']} | {r['steps']} | {r['per_step']:.2f} | "
              f"{r['acceptance']:.0%} | {r['drafted']:.0%} |")
    engine.close()


if __name__ == "__main__":
    main()
