"""The ``strata`` command: ``generate``, ``chat``, ``serve``, ``info``.

The environment is read here and nowhere else: ``STRATA_MODEL`` (a default
for ``--model``), ``STRATA_CACHE_DIR`` (where the default model is
assembled) and ``STRATA_API_KEY`` (keys for ``serve`` when no ``--api-key``
or ``--api-key-file`` is given).
"""

from __future__ import annotations

import argparse
import dataclasses
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
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto (default): the fastest path whose accuracy holds (CPU kernels on GGUF blocks, "
                        "or Triton on a GPU); float32: the exact reference path; bfloat16: the kernels with "
                        "bfloat16 activations")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (on a GPU, matmuls read the GGUF blocks)")
    g.add_argument("--context-length", type=_positive_int, default=4096, help="tokens of KV cache (default 4096)")
    g.add_argument("--kv", default="f16", choices=["f16", "int8", "k8v4"], help="KV cache format (default f16)")
    g.add_argument("--parallel", "-np", type=_positive_int, default=None,
                   help="requests decoded together (default 4; on a CPU 2 where host memory is short); the KV "
                        "memory is reserved for this many sequences of --context-length, or as --kv-memory-mib says")
    g.add_argument("--kv-memory-mib", type=_positive_int, default=None,
                   help="KV memory reserved at load, shared by the sequences in blocks (default: --parallel "
                        "sequences of --context-length)")
    g.add_argument("--threads", "-t", type=_positive_int, default=None, help="CPU threads (default: torch's)")
    g.add_argument("--devices", default=None,
                   help="split the layers over these devices, e.g. cuda:0,cuda:1 (see strata info --devices)")
    g.add_argument("--layer-split", default=None,
                   help="first layer of each stage after the first, e.g. 9 or 6,12; or auto (the default)")
    g.add_argument("--rank-timeout", dest="rank_timeout_s", type=float, default=120.0, metavar="SECONDS",
                   help="under torchrun (one stage per rank): a rank silent this long ends the job (default 120)")
    g.add_argument("--spec", default="off", choices=["off", "suffix", "draft"],
                   help="speculative decoding: suffix drafts tokens by looking the conversation's last tokens up "
                        "in its own earlier tokens (no model memory); draft runs --draft-model a few tokens ahead; "
                        "several are checked in one forward, and the output is the same as without it (default off)")
    g.add_argument("--draft-model", default=None, metavar="PATH",
                   help="with --spec draft: a GGUF sharing the model's vocabulary (a smaller or lower-bit one)")
    g.add_argument("--spec-tokens", type=_positive_int, default=7,
                   help="draft tokens checked per step at most, 1-15 (default 7)")
    g.add_argument("--tool-call-format", default="auto", choices=["auto", "hermes", "llama3", "mistral", "generic"],
                   help="how the model writes tool calls: auto reads it from the chat template (hermes <tool_call> "
                        "blocks, llama3 JSON, mistral [TOOL_CALLS], generic: a JSON reply for templates without "
                        "tools); name one where a template's family is not recognized (default auto)")
    c = p.add_argument_group("conversation cache")
    c.add_argument("--conversation-cache-mib", type=_whole, default=1024,
                   help="host staging pool for parked conversations, reserved at start (0: none)")
    c.add_argument("--conversation-cache-slots", type=_whole, default=8, help="parked conversations kept at most")
    c.add_argument("--min-free-mib", type=_whole, default=1024, help="host memory the pool must leave free")
    c.add_argument("--conversation-cache-dir", default=None, metavar="DIR",
                   help="a disk tier: parked conversations are written through to files here (created 0700) and "
                        "come back after a restart of the server")
    c.add_argument("--conversation-cache-disk-mib", type=_whole, default=4096,
                   help="what the disk tier may hold; least recently used files go first (default 4096)")
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


def _add_server_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=_positive_int, default=8080)
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="require 'Authorization: Bearer KEY' on every route but /health, for any key in PATH (one "
                        "a line; # comments). Each key is its own cache scope. Prefer this or STRATA_API_KEY: "
                        "--api-key is visible to every user of this machine in the process list")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY[,KEY...]",
                   help="as --api-key-file, keys given here (repeatable; env STRATA_API_KEY, comma-separated)")
    g.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="a Host name to answer besides localhost and the bound address (repeatable; '*': any). "
                        "Default: those only, or any name when binding 0.0.0.0 or ::")
    g.add_argument("--max-connections", type=_positive_int, default=64,
                   help="open connections past this get 503 at once (default 64)")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request body still arriving after this gets 408 (default 30)")
    g.add_argument("--max-queue", type=_whole, default=16,
                   help="requests that may wait behind the one being served; more get 503 (default 16)")
    g.add_argument("--max-body-mib", type=_positive_int, default=8, help="request body limit (default 8 MiB)")
    g.add_argument("--max-restarts", type=_positive_int, default=5,
                   help="engine crashes within --restart-window that make the server exit non-zero (default 5)")
    g.add_argument("--restart-window", type=float, default=600.0, metavar="SECONDS", help="default 600")
    g.add_argument("--restart-backoff", type=float, default=1.0, metavar="SECONDS",
                   help="delay before the first restart, doubling per crash in the window, capped at 30 s")
    g.add_argument("--hang-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="an engine silent this long is killed and restarted (default 30)")
    g.add_argument("--start-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="an engine not ready this long after it started (loading the model, reading the "
                        "conversation cache) is killed and counted as a crash (default 600)")
    g.add_argument("--stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="an engine whose step (or tokenizing) runs longer than this, plus as long again per 256 "
                        "tokens it handles and four times the slowest pace seen, is stuck: it is killed and restarted "
                        "(default 60)")
    g.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, requests in flight get this long to finish before the server exits (default 30)")
    g.add_argument("--inject-fault", action="append", default=[], metavar="POINT[:RATE[:KIND]][@TEXT]", type=_fault,
                   help="chaos testing: make the engine fail at POINT (park_copy, restore_copy, checkpoint_copy, "
                        "recurrent_copy, staging_lease, disk_index, disk_write, disk_read, verify, verify_copy, "
                        "verify_forward, forward, layer) on every call or on a seeded random RATE of "
                        "them, as KIND says (oom: out-of-memory, the default; device_error; hang; kill; slow); @TEXT: "
                        "only a forward whose prompts contain TEXT; repeatable")


# The argparse destinations that are SamplingParams fields and load() options.
SAMPLING_OPTIONS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "stop")
ENGINE_OPTIONS = ("dtype", "device", "kv", "context_length", "threads", "parallel", "kv_memory_mib",
                  "conversation_cache_mib", "conversation_cache_slots", "min_free_mib", "checkpoint_every", "devices",
                  "conversation_cache_dir", "conversation_cache_disk_mib",
                  "layer_split", "rank_timeout_s", "spec", "spec_tokens", "draft_model", "tool_call_format")


def _fault(text: str) -> str:
    """``POINT[:RATE[:KIND]][@TEXT]``, checked here (the engine process arms it)."""
    from strata_runtime.testing import KINDS, POINTS

    head, at, marker = text.partition("@")
    point, _, rest = head.partition(":")
    rate, _, kind = rest.partition(":")
    if point not in POINTS:
        raise argparse.ArgumentTypeError(f"unknown fault point {point!r}; points: {', '.join(POINTS)}")
    if kind and kind not in KINDS:
        raise argparse.ArgumentTypeError(f"unknown fault kind {kind!r}; kinds: {', '.join(KINDS)}")
    if at and (point != "forward" or not marker):
        raise argparse.ArgumentTypeError("@TEXT needs the forward point and a non-empty TEXT")
    try:
        ok = not rate or 0.0 < float(rate) <= 1.0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"the rate after {point}: must be a number in (0, 1], got {rate!r}")
    return text


def _pick(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    return {name: getattr(args, name) for name in names}


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return _pick(args, SAMPLING_OPTIONS)


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

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with a supervised engine process")
    _add_model_options(serve)
    _add_server_options(serve)

    info = sub.add_parser("info", help="describe a GGUF model file")
    info.add_argument("model", nargs="?", default=os.environ.get("STRATA_MODEL"),
                      help="path of a .gguf file (default: the embedded model)")
    info.add_argument("--context", type=_positive_int, default=None,
                      help="context length to cost in KV memory (default: the model's)")
    info.add_argument("--devices", default=None, help="plan a layer split over these devices (e.g. cuda:0,cuda:1)")
    info.add_argument("--layer-split", default=None,
                      help="first layer of each stage after the first (e.g. 9), or auto (default with --devices)")
    info.add_argument("--kv", default="f16", choices=["f16", "int8", "k8v4"], help="KV format of the planned split")
    info.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                      help="the path whose KV storage to count: f16 KV is stored in the activations' dtype on "
                           "a CPU (float32 or bfloat16; auto picks per CPU), float16 on a GPU (default auto)")
    info.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    return parser


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    from strata_runtime.split import launched_with_ranks

    options = _pick(args, ENGINE_OPTIONS)
    if launched_with_ranks():
        options["distributed"] = True  # torchrun started us: one stage per rank
    return options


def _follow(args: argparse.Namespace) -> int:
    """Ranks other than 0 of a torchrun job: run this rank's layers until rank 0 stops."""
    from strata_runtime.split import follow

    return follow(args.model, cache_dir=os.environ.get("STRATA_CACHE_DIR"), **_engine_options(args))


def _load(args: argparse.Namespace):
    from strata_runtime import load

    return load(args.model, cache_dir=os.environ.get("STRATA_CACHE_DIR"), **_engine_options(args))


def _check_sampling(args: argparse.Namespace) -> None:
    """Reject bad sampling options before spending seconds on loading."""
    from strata_runtime import SamplingParams

    SamplingParams(**_sampling(args))


def cmd_generate(args: argparse.Namespace) -> int:
    _check_sampling(args)
    engine = _load(args)
    try:
        out = sys.stdout
        out.write(args.prompt)
        out.flush()
        for piece in engine.stream(args.prompt, **_sampling(args)):
            out.write(piece)
            out.flush()
        out.write("\n")
    finally:
        engine.close()
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
    _check_sampling(args)
    engine = _load(args)
    try:
        return _chat_loop(engine, args)
    finally:
        engine.close()


def _chat_loop(engine, args: argparse.Namespace) -> int:
    from strata_runtime import StrataError

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


def cmd_serve(args: argparse.Namespace) -> int:
    from strata_runtime import EngineConfig
    from strata_runtime.files import check_gguf_path, default_model_path

    from .app import run
    from .config import ServerConfig

    options = _engine_options(args)
    EngineConfig(**options)  # bad options fail here, not in a crash-looping engine
    model = check_gguf_path(args.model) if args.model else default_model_path(os.environ.get("STRATA_CACHE_DIR"))
    config = ServerConfig(
        model=str(model), engine_options=options, host=args.host, port=args.port, api_keys=_api_keys(args),
        allowed_hosts=tuple(args.allowed_host) if args.allowed_host else None,
        max_connections=args.max_connections, body_timeout_s=args.body_timeout,
        max_queue=args.max_queue, max_body_bytes=args.max_body_mib * MiB, max_restarts=args.max_restarts,
        restart_window_s=args.restart_window, restart_backoff_s=args.restart_backoff,
        hang_timeout_s=args.hang_timeout, start_timeout_s=args.start_timeout, stall_timeout_s=args.stall_timeout, shutdown_grace_s=args.shutdown_grace,
        log_level="info" if args.verbose else "warning",
        faults=tuple(args.inject_fault),
    )
    if options.get("distributed"):
        # A restarted engine process cannot rejoin the job's ranks: its first crash ends the server.
        config = dataclasses.replace(config, max_restarts=1)
    logging.getLogger("strata_server").setLevel(logging.INFO)  # restarts and engine lines always show
    return run(config)


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Keys from --api-key-file and --api-key, else from STRATA_API_KEY; none: an open server."""
    keys: list[str] = []
    if args.api_key_file:
        try:
            lines = open(args.api_key_file, encoding="utf-8").read().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read --api-key-file {args.api_key_file}: {e.strerror}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key (one a line)")
        if os.stat(args.api_key_file).st_mode & 0o077:
            logging.getLogger("strata_server").warning(
                "%s can be read by other users; chmod 600 it", args.api_key_file)
    given = args.api_key if args.api_key else ([] if keys else [os.environ.get("STRATA_API_KEY") or ""])
    listed = [k.strip() for text in given for k in text.split(",") if k.strip()]
    if args.api_key and not listed:
        raise ValueError("--api-key was given but is empty (an unset variable?); the server would be open to all")
    return tuple(dict.fromkeys(keys + listed))


def cmd_info(args: argparse.Namespace) -> int:
    from strata_runtime.files import GGUFFile, bits_per_weight, default_model_path, describe_types, resolve
    from strata_runtime.models import open_model
    from strata_runtime.state import (
        RecurrentState,
        f16_storage_bytes,
        f16_storage_dtype,
        kv_bytes,
        kv_bytes_per_token,
        recurrent_bytes,
    )

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
    if (experts := c.experts()) is not None:
        print(f"experts:         {experts.count} per layer, {experts.per_token} per token, "
              f"feed-forward {experts.width} each")
    path = resolve(args.dtype, args.device)
    print(f"tensors (how --dtype {args.dtype} on {args.device} reads each type):")
    reads = _type_paths(gguf, path, args.device)
    for name, (count, nbytes) in sorted(describe_types(gguf).items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:<8} {count:>4} tensors {nbytes / MiB:>9.1f} MiB  {reads[name]}")
    kv_float = path.kv_float
    storage = f16_storage_dtype(args.device, kv_float)
    float_bytes = f16_storage_bytes(args.device, kv_float)
    print(f"KV cache for a context of {context} tokens (all layers, scales included; f16 stored as "
          f"{str(storage).removeprefix('torch.')} with --dtype {args.dtype} on {args.device}):")
    spec = open_model(gguf).state_spec  # what each layer keeps, as the model declares it
    rings = any(layer.window is not None for layer in spec)
    f16 = kv_bytes_per_token(spec, "f16", float_bytes)
    for fmt in ("f16", "int8", "k8v4"):
        per_token = kv_bytes_per_token(spec, fmt, float_bytes)
        stored = f"; stored: {kv_bytes(spec, context, fmt, float_bytes) / MiB:.1f} MiB (sliding layers keep a ring)"
        print(f"  {fmt:<5} {per_token:>7} bytes per token ({per_token / f16:.3f}x f16), "
              f"{per_token * context / MiB:.1f} MiB{stored if rings else ''}")
    recurrent = [layer for layer in spec if isinstance(layer, RecurrentState)]
    if recurrent:
        print(f"recurrent state: {recurrent_bytes(spec) / 1024:.1f} KiB per sequence ({len(recurrent)} recurrent "
              f"layers: convolution window and delta-rule state, float32, whatever the context)")
    if args.devices or args.layer_split:
        _print_split(gguf, args, context)
    return 0


def _type_paths(gguf, path, device: str) -> dict[str, str]:
    """Per tensor type of ``gguf``: what the compute ``path`` on ``device`` reads it as (a type the kernels
    cannot read is dequantized at load: the dense copy's size is named)."""
    import math

    import torch
    from strata_kernels.cpu_kernels import CPU_KERNEL_TYPES
    from strata_kernels.formats import FLOAT_TYPES

    dense: dict[str, int] = {}
    out: dict[str, str] = {}
    for info in gguf.tensor_infos():
        name = info.qtype.name
        if info.qtype in FLOAT_TYPES:
            out[name] = "dense (a float type)"
        elif torch.device(device).type != "cpu":
            out[name] = "GGUF blocks (Triton kernels)"
        elif path.fast and info.qtype in CPU_KERNEL_TYPES:
            out[name] = "GGUF blocks (CPU kernels)"
        else:
            dense[name] = dense.get(name, 0) + math.prod(info.shape) * path.activations.itemsize
    for name, nbytes in dense.items():
        out[name] = f"dense {path.name} copy made at load ({nbytes / MiB:.1f} MiB)"
    return out


def _print_split(gguf, args: argparse.Namespace, context: int) -> None:
    from strata_runtime.split import plan_split

    stages = plan_split(gguf, args.devices or args.device, args.layer_split, context, args.kv, dtype=args.dtype)
    # A mixture-of-experts model's expert tensors (counted in each stage's weights).
    expert_bytes = [0] * gguf.config.block_count
    for t in gguf.tensor_infos():
        if t.name.startswith("blk.") and "_exps." in t.name:
            expert_bytes[int(t.name.split(".")[1])] += t.nbytes
    print(f"planned split over {len(stages)} stage(s), KV in {args.kv} at a context of {context}:")
    for i, s in enumerate(stages):
        extra = [w for w, on in (("embeddings", i == 0), ("output head", i == len(stages) - 1)) if on]
        experts = sum(expert_bytes[j] for j in s.layers)
        print(f"  stage {i} {s.device:<8} layers {s.layers.start:>3}-{s.layers.stop - 1:<3} "
              f"weights {s.weight_bytes / MiB:>8.1f} MiB  KV {s.kv_bytes / MiB:>8.1f} MiB"
              + (f"  (experts {experts / MiB:.1f} MiB of the weights)" if experts else "")
              + (f"  (+ {', '.join(extra)})" if extra else ""))


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "info": cmd_info}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="strata: %(levelname)s %(name)s: %(message)s")
    from strata_runtime import StrataError
    from strata_runtime.split import launched_with_ranks, this_rank

    try:
        if args.command in ("generate", "chat", "serve") and launched_with_ranks() and this_rank() != 0:
            return _follow(args)
        return COMMANDS[args.command](args)
    except (StrataError, ValueError, TypeError) as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
