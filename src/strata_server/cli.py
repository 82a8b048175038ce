"""The ``strata`` command: ``generate``, ``chat``, ``info``.

The environment is read here and nowhere else: ``STRATA_MODEL`` (a default
for ``--model``) and ``STRATA_CACHE_DIR`` (where the default model is
assembled).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Sequence

GiB = 1 << 30
MiB = 1 << 20


def _int_at_least(minimum: int):
    """An argparse type: a whole number no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_whole = _int_at_least(0)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", default=os.environ.get("STRATA_MODEL"),
                   help="path of a .gguf file (default: the embedded Gemma 3 270M)")
    g.add_argument("--dtype", default="float32", choices=["float32"], help="compute path (float32: exact)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (on a GPU, matmuls read the GGUF blocks)")
    g.add_argument("--context-length", type=_positive_int, default=4096, help="tokens of KV cache (default 4096)")
    g.add_argument("--kv", default="f16", choices=["f16", "int8", "k8v4"], help="KV cache format (default f16)")
    g.add_argument("--threads", "-t", type=_positive_int, default=None, help="CPU threads (default: torch's)")
    c = p.add_argument_group("conversation cache")
    c.add_argument("--conversation-cache-mib", type=_whole, default=1024,
                   help="host staging pool for parked conversations, reserved at start (0: none)")
    c.add_argument("--conversation-cache-slots", type=_whole, default=8, help="parked conversations kept at most")
    c.add_argument("--min-free-mib", type=_whole, default=1024, help="host memory the pool must leave free")
    c.add_argument("--checkpoint-every", type=_whole, default=2048,
                   help="running-state checkpoints every N prompt tokens (0: turn boundaries only)")


def _add_sampling_options(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=int, default=max_tokens)
    g.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="makes sampled output reproducible")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
        "stop": tuple(args.stop),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Run quantized GGUF language models.")
    parser.add_argument("--verbose", "-v", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="continue a prompt, streaming text to stdout")
    gen.add_argument("prompt", help="the text to continue")
    _add_model_options(gen)
    _add_sampling_options(gen, max_tokens=128)
    gen.add_argument("--stats", action="store_true", help="print token counts and speeds to stderr")

    chat = sub.add_parser("chat", help="an interactive conversation through the model's chat template")
    chat.add_argument("--system", default=None, help="a system message")
    _add_model_options(chat)
    _add_sampling_options(chat, max_tokens=512)

    info = sub.add_parser("info", help="describe a GGUF model file")
    info.add_argument("model", nargs="?", default=os.environ.get("STRATA_MODEL"),
                      help="path of a .gguf file (default: the embedded model)")
    info.add_argument("--context", type=_positive_int, default=None,
                      help="context length to cost in KV memory (default: the model's)")
    return parser


def _load(args: argparse.Namespace):
    from strata_runtime import load

    return load(
        args.model,
        dtype=args.dtype,
        device=args.device,
        kv=args.kv,
        context_length=args.context_length,
        threads=args.threads,
        conversation_cache_mib=args.conversation_cache_mib,
        conversation_cache_slots=args.conversation_cache_slots,
        min_free_mib=args.min_free_mib,
        checkpoint_every=args.checkpoint_every,
        cache_dir=os.environ.get("STRATA_CACHE_DIR"),
    )


def _check_sampling(args: argparse.Namespace) -> None:
    """Reject bad sampling options before spending seconds on loading."""
    from strata_runtime import SamplingParams

    SamplingParams(**_sampling(args))


def cmd_generate(args: argparse.Namespace) -> int:
    _check_sampling(args)
    engine = _load(args)
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    for piece in engine.stream(args.prompt, **_sampling(args)):
        out.write(piece)
        out.flush()
    out.write("\n")
    if args.stats:
        c = engine.last_completion
        print(
            f"prompt {c.prompt_tokens} tokens ({c.prefill_tokens_per_second:.1f} tok/s), "
            f"generated {c.completion_tokens} tokens ({c.decode_tokens_per_second:.1f} tok/s), "
            f"finish: {c.finish_reason}",
            file=sys.stderr,
        )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from strata_runtime import StrataError

    _check_sampling(args)
    engine = _load(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for piece in engine.chat(messages, stream=True, **_sampling(args)):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except StrataError as e:
            messages.pop()
            print(f"strata: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_info(args: argparse.Namespace) -> int:
    from strata_runtime.default_model import default_model_path
    from strata_runtime.gguf_file import GGUFFile, bits_per_weight, describe_types
    from strata_runtime.kv_cache import format_bytes_per_token

    path = args.model or default_model_path(os.environ.get("STRATA_CACHE_DIR"))
    gguf = GGUFFile.open(path)
    c = gguf.config
    context = args.context or c.context_length
    size = gguf.path.stat().st_size
    print(f"file:            {gguf.path} ({size / MiB:.1f} MiB, {bits_per_weight(gguf):.2f} bits per weight)")
    print(f"model:           {c.name}")
    print(f"architecture:    {c.architecture}")
    print(f"context length:  {c.context_length}")
    print(f"layers:          {c.block_count}")
    print(f"embedding:       {c.embedding_length}, feed-forward {c.feed_forward_length}")
    print(f"attention heads: {c.head_count} query, {c.head_count_kv} key/value, "
          f"head dim {c.key_length}/{c.value_length}")
    if c.sliding_window:
        print(f"sliding window:  {c.sliding_window}")
    print("tensors:")
    for name, (count, nbytes) in sorted(describe_types(gguf).items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:<8} {count:>4} tensors {nbytes / MiB:>9.1f} MiB")
    print(f"KV cache for a context of {context} tokens (all layers, scales included):")
    f16 = format_bytes_per_token("f16", c.block_count, c.head_count_kv, c.key_length)
    for fmt in ("f16", "int8", "k8v4"):
        per_token = format_bytes_per_token(fmt, c.block_count, c.head_count_kv, c.key_length)
        print(f"  {fmt:<5} {per_token:>7} bytes per token ({per_token / f16:.3f}x f16), "
              f"{per_token * context / MiB:.1f} MiB")
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="strata: %(levelname)s %(name)s: %(message)s")
    from strata_runtime import StrataError

    try:
        return COMMANDS[args.command](args)
    except (StrataError, ValueError, TypeError) as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
