"""The notebook API: ``load()`` a model and talk to it through an ``Engine``."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from strata_kernels import KV_FORMATS, KVStore

from .chat_prompt import TurnMarker, render_and_tokenize
from .chat_template import ChatTemplate, ChatTemplateError
from .conversation_cache import ConversationCache
from .default_model import default_model_path
from .draft_model import DraftModelDrafter
from .errors import Cancelled, ContextLengthError, RequestError, RequestTypeError, StrataError
from .generation import forward_chunks
from .gguf_file import GGUFFile
from .kv_cache import KVCache
from .kv_pool import KVPool
from .compute_path import DTYPE_NAMES
from .loader import build_model, check_vocabulary, open_model
from .pipeline import Pipeline, parse_devices, parse_layer_split, plan_split
from .placement import Placement
from .memory import MiB, HostMemory
from .sampling import SamplingParams
from .scheduler import Generation, Scheduler
from .speculation import check_settings, drafter_for, spare_states
from .disk_tier import DirectoryRefused, DiskTier
from .fingerprint import model_file_identity, row_bytes, state_fingerprint
from .staging import StagingPool
from .staging_segment import StagingSegment, pin
from .text_stream import StopTextStream
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """The settings of one engine, fixed at load time."""

    dtype: str = "auto"  # auto: the fastest path whose accuracy holds; float32: the exact path (compute_path.py)
    device: str = "cpu"  # "cuda" / "cuda:N": weights stay as GGUF blocks, matmuls run in Triton
    kv: str = "f16"  # KV cache format: f16 (float32 storage on the CPU, bfloat16 with dtype=bfloat16), int8, k8v4
    context_length: int = 4096  # tokens one sequence can hold (capped by the model's)
    parallel: int | None = None  # sequences decoded together; None: 4 (on a CPU, 2 where host memory is short)
    kv_memory_mib: int | None = None  # the KV pool for them; None: `parallel` sequences of context_length
    threads: int | None = None  # torch intra-op threads; None leaves torch's default
    conversation_cache_mib: int = 1024  # host staging pool for parked conversations (0: none)
    conversation_cache_slots: int = 8  # parked conversations kept at most
    min_free_mib: int = 1024  # host memory the pool must leave free
    checkpoint_every: int = 2048  # running-state checkpoints every N prompt tokens (0: only at turn boundaries)
    strict_conversation_cache: bool = False  # refuse the pool rather than shrink it to fit
    conversation_cache_dir: str | None = None  # the disk tier: parked conversations written through to files here
    conversation_cache_disk_mib: int = 4096  # what the disk tier may hold
    devices: tuple[str, ...] | None = None  # a layer split over these devices (None: just ``device``)
    layer_split: str | tuple[int, ...] | None = None  # first layer of each later stage, or "auto"
    distributed: bool = False  # one stage per torch.distributed rank (torchrun); this process is rank 0
    rank_timeout_s: float = 120.0  # a rank silent this long is lost (split across processes)
    spec: str = "off"  # speculative decoding: "suffix" (from the sequence's own earlier tokens), "draft", or "off"
    spec_tokens: int = 7  # draft tokens per verify at most (7: one sequence's verify stays on the CPU's GEMV)
    draft_model: str | None = None  # spec="draft": a GGUF sharing the target's vocabulary
    cache_dir: str | None = None  # where the default model is assembled
    progress: bool = True  # progress bars while assembling and loading

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if not isinstance(self.context_length, int) or self.context_length < 1:
            raise ValueError(f"context_length must be a positive integer, got {self.context_length!r}")
        for name in ("parallel", "kv_memory_mib"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer (or None: sized for you), got {value!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        for name in ("conversation_cache_mib", "conversation_cache_slots", "min_free_mib", "checkpoint_every",
                     "conversation_cache_disk_mib"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        if self.conversation_cache_mib and not self.conversation_cache_slots:
            raise ValueError("conversation_cache_slots must be at least 1 while conversation_cache_mib is above 0 "
                             "(to park no conversation, set conversation_cache_mib to 0)")
        if self.conversation_cache_dir is not None and not self.conversation_cache_mib:
            raise ValueError("conversation_cache_dir needs conversation_cache_mib above 0: conversations come back "
                             "from disk through the staging pool")
        check_settings(self.spec, self.spec_tokens, self.draft_model)
        if self.kv not in KV_FORMATS:
            raise ValueError(f"kv must be one of {', '.join(KV_FORMATS)}, got {self.kv!r}")
        try:
            kind = torch.device(self.device).type
        except (RuntimeError, TypeError):
            kind = None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not isinstance(self.rank_timeout_s, (int, float)) or self.rank_timeout_s <= 0:
            raise ValueError(f"rank_timeout_s must be a positive number of seconds, got {self.rank_timeout_s!r}")
        if self.layer_split is not None and self.devices is None and not self.distributed:
            raise ValueError("layer_split needs devices (the devices the stages run on)")
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(parse_devices(self.devices)))
            split = parse_layer_split(self.layer_split)
            object.__setattr__(self, "layer_split", split if isinstance(split, str) or split is None else tuple(split))

    def sequences(self, device: str) -> int:
        """Sequences decoded together: ``parallel``, or 4 (a decode step of 4
        costs about one weight read, as one does; on a CPU the engine takes 2
        where the host's memory is short, ``Engine._reserve_scheduler``); 1 for
        a split across processes (its ranks keep one cache)."""
        if self.distributed:
            return 1
        return self.parallel or 4

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; load() accepts {', '.join(sorted(known))}")
        return cls(**options)


@dataclass(frozen=True)
class Completion:
    """One finished generation. ``tokens`` are the generated ids (an
    end-of-generation token is not included); ``finish_reason`` is ``"stop"``
    (EOS or a stop string), ``"length"`` (max_tokens or the context ran out)
    or ``"cancelled"`` (the stream was closed before it ended)."""

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    prefill_seconds: float
    decode_seconds: float

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def prefill_tokens_per_second(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes out of prefill; decode steps make the rest.
        steps = max(0, len(self.tokens) - 1)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


def load(path: str | Path | None = None, *, memory: HostMemory | None = None,
         staging: StagingSegment | None = None, disk_lock: int | None = None, **options: Any) -> "Engine":
    """Load a GGUF model (``path=None``: the embedded default model).

    Options: see ``EngineConfig`` (the default ``dtype="auto"`` is the
    fastest path whose accuracy holds; ``dtype="float32"`` the exact one).
    ``memory`` is the host telemetry the staging pool is admitted against
    (default: this host's ``/proc`` and cgroup files). ``staging``: a shared
    segment reserved by the caller (a server) to hold the staging pool, in
    place of reserving one here; what an earlier engine parked in it is
    taken back. ``disk_lock``: the lock of ``conversation_cache_dir``, held
    by the caller (a server) for every engine it starts.
    """
    config = EngineConfig.from_options(options)
    if config.distributed:  # each rank checks its own device: the others may be on other hosts
        return _load_rank0(path, config, memory, staging, disk_lock)
    for name in config.devices or (config.device,):
        check_device(name)
    if path is None:
        path = default_model_path(config.cache_dir, progress=config.progress)
    opened = open_model(path)
    gguf = opened.gguf
    if config.devices is not None:
        # Checked from metadata alone: a bad split fails before any weight is read.
        context = min(config.context_length, gguf.config.context_length)
        placement = Placement.of_stages(plan_split(gguf, list(config.devices), config.layer_split, context,
                                                   config.kv, memory=memory, dtype=config.dtype,
                                                   sequences=config.sequences(config.devices[0])))
    else:
        placement = Placement.one_device(config.device, len(opened.state_spec))
    tokenizer = Tokenizer.from_gguf(gguf)
    check_vocabulary(gguf, tokenizer.vocab.size)
    model = build_model(opened, placement, config.dtype, config.progress, f"loading {gguf.path.name}")
    runner = model if len(placement.stage_devices) == 1 else Pipeline(model)
    return Engine(gguf, runner, tokenizer, config, memory, staging, disk_lock)


def check_device(name: str) -> None:
    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        raise StrataError(f"device={name!r} was asked for but torch sees no CUDA device; use device='cpu'")


def _load_rank0(path, config: EngineConfig, memory: HostMemory | None, staging: StagingSegment | None,
                disk_lock: int | None) -> "Engine":
    """Rank 0 of a split across processes: its stage, driving the others."""
    from .ranks import RankPipeline, join_stage, ready

    stage = join_stage(path, config, memory, rank0=True)
    pipeline = RankPipeline(stage.model, stage.stages, stage.wire)
    ready(0)
    tokenizer = Tokenizer.from_gguf(stage.gguf)
    check_vocabulary(stage.gguf, tokenizer.vocab.size)
    return Engine(stage.gguf, pipeline, tokenizer, config, memory, staging, disk_lock)


class Engine:
    """One model, its KV pool and the scheduler that runs sequences on it.

    Invariant: every generation (``generate``, ``stream``, ``chat``,
    ``generate_many``) is a sequence of ``scheduler``, which holds the KV
    state of the running sequences and of up to ``parallel`` finished ones
    (resident, least recently used first to be parked to the conversation
    cache); a new prompt of the same scope that starts with what one of them
    holds reuses that prefix and prefills only the rest. Requests of
    different scopes never share cached state (one scope per API key or
    ``cache_salt`` in a server), so how long a prompt takes to start says
    nothing about another scope's.
    """

    def __init__(self, gguf: GGUFFile, model, tokenizer: Tokenizer, config: EngineConfig,
                 memory: HostMemory | None = None, staging: StagingSegment | None = None,
                 disk_lock: int | None = None):
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.gguf = gguf
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.context_length = min(config.context_length, gguf.config.context_length)
        self.chat_template = ChatTemplate.for_model(
            gguf.get("tokenizer.chat_template"),
            gguf.architecture,
            _token_text(tokenizer, tokenizer.bos_id),
            _token_text(tokenizer, tokenizer.eos_id),
        )
        self._turns = TurnMarker.of(self.chat_template, tokenizer)
        self.conversations = self._reserve_conversation_cache(config, memory, staging)
        self.scheduler = self._reserve_scheduler(config, memory)
        self.recovered: dict[str, Any] | None = None  # what was taken back from a shared staging pool
        # Only state that outlives this engine needs a fingerprint (it reads the model file's header and samples).
        if self.conversations is not None and (staging is not None or config.conversation_cache_dir is not None):
            self.conversations.fingerprint = self.state_fingerprint()
            if staging is not None:
                self.recovered = self.conversations.recover(self.conversations.fingerprint,
                                                            row_bytes(self.scheduler.pool))
            if config.conversation_cache_dir is not None:
                self._open_disk_tier(config, disk_lock)
        self.last_completion: Completion | None = None
        self.loaded_at = time.time()

    def _open_disk_tier(self, config: EngineConfig, disk_lock: int | None) -> None:
        """The disk tier is an optimization: a directory it cannot use (another
        user's, a symlink, locked by another server) leaves the engine
        without one, saying why (``stats()["disk_refused"]``)."""
        try:
            disk = DiskTier(config.conversation_cache_dir, config.conversation_cache_disk_mib * MiB,
                            self.conversations.fingerprint, lock_fd=disk_lock)
        except DirectoryRefused as e:
            self.conversations.disk_refusal = str(e)
            log.warning("conversation cache: running without a disk tier: %s", e)
            return
        self.conversations.use_disk(disk)

    def persist(self, timeout: float = 30.0) -> bool:
        """Before the engine goes away on purpose: park the conversations
        still resident on the device and wait (up to ``timeout``) for the
        disk tier to write what it has queued; whether everything was written."""
        if self.conversations is None:
            return True
        self.scheduler.park_residents()
        return self.conversations.disk is None or self.conversations.disk.flush(timeout)

    def close(self) -> None:
        """Stop what the engine runs outside this process (the other ranks of
        a split across processes) and its disk tier's writer, letting go of
        the directory (its queued writes are finished first, up to 30 s). The
        engine is unusable afterwards."""
        if self.conversations is not None and self.conversations.disk is not None:
            self.conversations.disk.close()
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    # --- text <-> tokens --------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def _reserve_conversation_cache(self, config: EngineConfig, memory: HostMemory | None,
                                    staging: StagingSegment | None) -> ConversationCache | None:
        """The staging pool is reserved here, once (or was, by the server, as
        ``staging``); nothing later asks the host for more."""
        self.pool_decision = None
        if staging is not None:
            buffer = staging.map()
            pool = StagingPool.over(buffer, staging.page_bytes,
                                    pinned=self.model.device.type == "cuda" and not staging.refused and pin(buffer))
            self.pool_decision = staging.decision
            return ConversationCache(pool, config.conversation_cache_slots, config.checkpoint_every, durable=True,
                                     pool_refusal=staging.decision.removeprefix("staging pool: "))
        if config.conversation_cache_mib == 0:
            return None
        pool, decision = StagingPool.reserve(
            config.conversation_cache_mib * MiB,
            min_free_bytes=config.min_free_mib * MiB,
            memory=memory or HostMemory(),
            strict=config.strict_conversation_cache,
            pin=self.model.device.type == "cuda",
        )
        self.pool_decision = decision.message
        # A refused pool still gets a cache: each park and checkpoint is then
        # skipped, logged and counted with the refusal's reason.
        return ConversationCache(pool, config.conversation_cache_slots, config.checkpoint_every,
                                 pool_refusal=decision.message.removeprefix("staging pool: "))

    def state_fingerprint(self) -> str:
        """What this engine's parked state means (``fingerprint``): entries of
        another fingerprint are never taken back."""
        identity = model_file_identity(self.gguf.path, int(self.gguf.reader.data_offset))
        return state_fingerprint(identity, self.gguf.architecture, self.config.kv, self.model.compute_path.name,
                                 self.scheduler.pool, [str(d) for d in self.model.placement.stage_devices])

    def _reserve_scheduler(self, config: EngineConfig, memory: HostMemory | None) -> Scheduler:
        """The KV pool for sequences decoded together, reserved here, once:
        ``kv_memory_mib``, or ``parallel`` sequences of the context length.
        A split across processes runs one sequence at a time: each rank keeps
        its part of one cache (``ranks``), so its pool holds one sequence."""
        parallel = config.sequences(str(self.model.device))
        spec = self.model.state_spec()
        per_sequence = KVPool.for_sequences(config.kv, spec, self.model.placement, 1, self.context_length,
                                            self.model.compute_path.kv_float, allocate=False).nbytes
        if config.parallel is None and self.model.device.type == "cpu" and not config.distributed:
            # Sized from memory: at most a quarter of the host's headroom for KV, and never fewer than 2.
            headroom = (memory or HostMemory()).headroom()
            while parallel > 2 and headroom.known and parallel * per_sequence > headroom.bytes // 4:
                parallel -= 1
        sequences = parallel if config.kv_memory_mib is None else config.kv_memory_mib * MiB / per_sequence
        if config.distributed:
            cache = self.new_cache(self.context_length)  # the ranks' twin of this cache is the one they step
            return Scheduler(self.model, cache.pool, self.context_length, self.tokenizer.end_of_generation,
                             max_running=1, conversations=self.conversations, max_residents=1, private=cache,
                             **self._speculation(config, 1, private=True))
        pool = KVPool.for_sequences(config.kv, spec, self.model.placement, sequences, self.context_length,
                                    self.model.compute_path.kv_float,
                                    spare_states=spare_states(config.spec, spec, parallel))
        return Scheduler(self.model, pool, self.context_length, self.tokenizer.end_of_generation,
                         max_running=parallel, conversations=self.conversations, max_residents=parallel,
                         **self._speculation(config, parallel))

    def _speculation(self, config: EngineConfig, sequences: int, private: bool = False) -> dict[str, Any]:
        """The scheduler's drafter where this model can speculate (else why
        not, in ``spec_refusal``); a draft model's KV for ``sequences`` is reserved here."""
        def load_draft_model():
            return DraftModelDrafter.load(config.draft_model, self.tokenizer, str(self.model.device), config.dtype,
                                          config.kv, sequences, self.context_length, config.spec_tokens,
                                          config.progress)

        drafter, self.spec_refusal = drafter_for(config.spec, config.spec_tokens, self.model.state_spec(),
                                                 load_draft_model if config.draft_model else None, private)
        return {} if drafter is None else {"drafter": drafter, "spec_tokens": config.spec_tokens}

    def stats(self) -> dict[str, Any]:
        """Counters of the conversation cache (empty without one) and the
        staging pool's admission decision; the scheduler's are ``scheduler.stats()``."""
        if self.conversations is None:
            return {}
        return {**self.conversations.stats(), "pool_decision": self.pool_decision}

    # --- model ------------------------------------------------------------

    def new_cache(self, max_tokens: int) -> KVCache:
        """An empty cache of this engine's format for ``max_tokens`` positions."""
        return self.model.new_cache(max_tokens, self.config.kv)

    def logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits ``[len(tokens), vocab]`` (float32) from an empty
        state: row ``i`` predicts token ``i + 1``. It runs on a cache of its
        own: no sequence of the scheduler is touched."""
        tokens = self._check_tokens(tokens)
        cache = self.new_cache(len(tokens))
        with torch.inference_mode():
            return forward_chunks(self.model, cache, tokens, last_only=False).float().cpu()

    def generate(self, prompt: str | Sequence[int], *, abort: Callable[[], bool] | None = None,
                 cache_scope: str = "", **sampling: Any) -> Completion:
        """Continue ``prompt`` (text, or token ids) with the sampling options of
        ``SamplingParams``. ``abort`` is asked between chunks of tokenizing and
        prefilling (``Cancelled`` when it says yes); ``cache_scope`` keeps this
        request's cached prefixes apart from other scopes'."""
        run = self._start(prompt, sampling, abort=abort, cache_scope=cache_scope)
        for _ in run:
            pass
        return run.completion

    def generate_many(self, prompts: Sequence[str | Sequence[int]], *, cache_scope: str = "",
                      **sampling: Any) -> list[Completion]:
        """Continue every prompt of ``prompts`` (text, or token ids), decoding
        them together (up to ``parallel`` at a time, the rest waiting their
        turn), with the sampling options of ``SamplingParams`` (a seed gives
        each prompt the tokens it would get alone). Completions in the prompts' order."""
        runs = [self._start(prompt, dict(sampling), cache_scope=cache_scope) for prompt in prompts]
        return [run.completion for run in run_together(self.scheduler, runs)]

    def stream(self, prompt: str | Sequence[int], *, abort: Callable[[], bool] | None = None,
               cache_scope: str = "", **sampling: Any) -> Iterator[str]:
        """Text pieces as they are decoded (same arguments as ``generate``).
        Arguments are checked here, before the first piece is asked for."""
        return iter(self._start(prompt, sampling, abort=abort, cache_scope=cache_scope))

    def chat(self, messages: Sequence[dict[str, Any]], *, stream: bool = False,
             abort: Callable[[], bool] | None = None, cache_scope: str = "", **sampling: Any):
        """Generate the assistant's reply to ``messages`` through the model's chat template."""
        run = self._chat_run(messages, sampling, abort, cache_scope)
        if stream:
            return iter(run)
        for _ in run:
            pass
        return run.completion

    def _chat_run(self, messages: Sequence[dict[str, Any]], sampling: dict[str, Any],
                  abort: Callable[[], bool] | None, cache_scope: str) -> "Run":
        prompt = self.chat_prompt(messages, abort=abort)
        # Turn boundaries are where a returning conversation diverges: checkpoint there.
        boundaries = [] if self.conversations is None or self._turns is None else self._turns.boundaries(prompt)
        root = boundaries[0] if boundaries and messages[0]["role"] == "system" else None
        return self._start(prompt, sampling, boundaries, root=root, abort=abort, cache_scope=cache_scope)

    def submit(self, prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict[str, Any]] | None = None,
               abort: Callable[[], bool] | None = None, cache_scope: str = "", **sampling: Any) -> "Run":
        """Queue one generation (a ``prompt``, or chat ``messages``) and return
        its ``Run`` without stepping: whoever drives ``scheduler.step()`` (a
        server's loop) takes its text with ``run.pump()`` until
        ``run.completion`` is set. ``QueueFull`` where the waiting queue is at
        its bound. Arguments are checked here, as ``generate``/``chat`` check them."""
        if (prompt is None) == (messages is None):
            raise RequestTypeError("give a prompt or messages, not both")
        run = (self._chat_run(messages, dict(sampling), abort, cache_scope) if messages is not None
               else self._start(prompt, dict(sampling), abort=abort, cache_scope=cache_scope))
        run.submit(bounded=True)
        return run

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
                    abort: Callable[[], bool] | None = None) -> list[int]:
        """The prompt tokens of ``messages``: control tokens come from the
        template only; a control token's text inside a message stays text."""
        if self.chat_template is None:
            raise ChatTemplateError(
                f"{self.gguf.path} has no chat template (tokenizer.chat_template); use generate() with a plain prompt"
            )
        return render_and_tokenize(self.chat_template, self.tokenizer, messages, add_generation_prompt,
                                   self._check_chars, abort)

    def _stages(self) -> list[dict[str, Any]]:
        """A split's stages (none on one device): each one's device and first and last layer."""
        placement = self.model.placement
        if len(placement.stage_devices) == 1:
            return []
        return [{"device": str(device), "layers": [layers.start, layers.stop - 1]}
                for device, layers in zip(placement.stage_devices, placement.stage_layers())]

    def props(self) -> dict[str, Any]:
        c = self.gguf.config
        return {
            "model": c.name,
            "path": str(self.gguf.path),
            "architecture": c.architecture,
            "context_length": self.context_length,
            "max_prompt_chars": self.max_prompt_chars(),
            "model_context_length": c.context_length,
            "vocab_size": self.tokenizer.vocab.size,
            "experts": (None if (e := c.experts()) is None else {"count": e.count, "per_token": e.per_token}),
            "dtype": self.model.compute_path.name,
            "compute_path": self._compute_path_state(),
            "device": str(self.model.device),
            "stages": self._stages(),
            "backend": [b.describe() for b in self.model.backends if b.kernels != "meta"],
            "kv": self.config.kv,
            "kv_storage": self._kv_storage(),
            "kv_bytes_per_token": self.scheduler.pool.bytes_per_token(),
            "recurrent_bytes_per_sequence": self.scheduler.pool.recurrent_bytes(),
            "kv_bytes": self.scheduler.pool.nbytes,
            "parallel": self.scheduler.max_running,
            "speculative": self._speculative_state(),
            "kv_blocks": self.scheduler.pool.total_blocks(),
            "threads": torch.get_num_threads(),
            "cpu_kernels": self._cpu_kernels_state(),
            "chat_template": None if self.chat_template is None else self.chat_template.origin,
            "settings": dataclasses.asdict(self.config),
        }

    # --- internals --------------------------------------------------------

    def _speculative_state(self) -> dict[str, Any]:
        """What ``spec`` resolved to: the drafter and draft length, or off and why."""
        on = self.scheduler.speculation is not None
        state = {"requested": self.config.spec, "mode": self.config.spec if on else "off",
                 "tokens": self.config.spec_tokens if on else 0, "refusal": self.spec_refusal}
        describe = getattr(self.scheduler.speculation.drafter, "describe", None) if on else None
        return state | (describe() if describe else {})

    def _kv_storage(self) -> str:
        """The dtype the attention layers' KV is stored in (recurrent state is float32)."""
        store = next((s for s in self.scheduler.pool.stores if isinstance(s, KVStore)), None)
        return "none" if store is None else str(store.k.dtype).removeprefix("torch.")

    def _compute_path_state(self) -> dict[str, str]:
        """What ``dtype`` resolved to here, and why (``compute_path``)."""
        path = self.model.compute_path
        return {"requested": path.requested, "activations": path.name,
                "prefill_matmuls": str(path.prefill_matmuls).removeprefix("torch."), "reason": path.reason}

    def _cpu_kernels_state(self) -> str:
        """Which build of the CPU kernels reads the GGUF blocks ("avx2 (this
        CPU runs avx512, avx2, generic): ..."), why they did not build, or
        "unused" (the exact path, or a GPU)."""
        if not any(b.kernels == "cpu" for b in self.model.backends) and (
                not self.model.compute_path.fast or self.model.device.type != "cpu"):
            return "unused"
        from strata_kernels import cpu_kernels

        return cpu_kernels.describe()

    def max_prompt_chars(self) -> int:
        """Text longer than this cannot fit the context, whatever it says."""
        return self.tokenizer.max_chars(self.context_length)

    def _check_chars(self, characters: int) -> None:
        """Refuse text that cannot fit before spending any time tokenizing it."""
        if characters > self.max_prompt_chars():
            raise ContextLengthError(None, self.context_length, characters=characters,
                                     max_characters=self.max_prompt_chars())

    def _check_tokens(self, tokens: Sequence[int]) -> list[int]:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise RequestError("the prompt is empty; give at least one token")
        vocab = self.tokenizer.vocab.size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of range; the vocabulary has {vocab} tokens")
        return tokens

    def _start(self, prompt: str | Sequence[int], sampling: dict[str, Any],
               boundaries: Sequence[int] = (), root: int | None = None, *,
               abort: Callable[[], bool] | None = None, cache_scope: str = "") -> "Run":
        try:
            params = SamplingParams(**sampling)
        except TypeError as e:
            raise RequestTypeError(f"{e}; sampling options are {', '.join(f.name for f in dataclasses.fields(SamplingParams))}") from None
        if not isinstance(cache_scope, str):
            raise RequestTypeError(f"cache_scope must be a string, got {type(cache_scope).__name__}")
        if isinstance(prompt, str):
            self._check_chars(len(prompt))
            ids = self.tokenizer.encode(prompt, abort=abort)
        else:
            if len(prompt) >= self.context_length:
                raise ContextLengthError(len(prompt), self.context_length)
            ids = list(prompt)
        ids = self._check_tokens(ids)
        if len(ids) >= self.context_length:
            raise ContextLengthError(len(ids), self.context_length)
        return Run(self, ids, params, boundaries, root, abort, cache_scope)


class Run:
    """One generation as a sequence (``seq``) of the engine's scheduler:
    iterate for text pieces (each iteration steps the scheduler, every
    sequence in it advancing together), or, where something else steps it,
    ``pump()`` for the text so far; ``completion`` once it has ended."""

    def __init__(self, engine: Engine, prompt: list[int], params: SamplingParams,
                 boundaries: Sequence[int] = (), root: int | None = None,
                 abort: Callable[[], bool] | None = None, scope: str = ""):
        self.engine = engine
        self.prompt = prompt
        self.params = params
        self.boundaries = boundaries
        self.root = root
        self.abort = abort
        self.scope = scope
        self.completion: Completion | None = None
        self.seq: Generation | None = None
        self.text = StopTextStream(engine.tokenizer.stream_decoder(), params.stop)
        self.started = 0.0

    def submit(self, bounded: bool = False) -> Generation:
        """Queue this generation (``bounded``: subject to the waiting queue's bound)."""
        self.started = time.perf_counter()
        self.seq = self.engine.scheduler.submit(self.prompt, self.params, self.scope, self.boundaries, self.root,
                                                bounded=bounded)
        return self.seq

    def pump(self) -> str:
        """The text of the tokens generated since the last call; at the end,
        the held-back tail too, and ``completion`` is set."""
        seq, text = self.seq, self.text
        out = []
        taken = seq.take()
        for i, token in enumerate(taken):
            out.append(text.push(token))
            if text.stopped:
                seq.stop(unused=len(taken) - 1 - i)
                break
        if seq.done and self.completion is None:
            out.append(text.finish())
            self._complete()
        return "".join(out)

    def _complete(self) -> None:
        seq, end = self.seq, time.perf_counter()
        first = seq.first_token_at or end
        self.completion = Completion(text=self.text.emitted, tokens=list(seq.generated),
                                     finish_reason=seq.finish_reason or "length", prompt_tokens=len(self.prompt),
                                     cached_tokens=seq.cached_tokens, prefill_seconds=max(0.0, first - self.started),
                                     decode_seconds=max(0.0, end - first))
        self.engine.last_completion = self.completion

    def __iter__(self) -> Iterator[str]:
        scheduler = self.engine.scheduler
        seq = self.submit()
        try:
            while True:
                piece = self.pump()
                if piece:
                    yield piece
                if seq.done:
                    return
                if self.abort is not None and self.abort():
                    raise Cancelled(seq.progress())
                scheduler.step()
        finally:
            if not seq.done:  # closed early, cancelled, or an error: the sequence ends here
                seq.cancel("cancelled")
                scheduler.retire()
            if self.completion is None:
                self.text.finish()
                self._complete()


def run_together(scheduler: Scheduler, runs: Sequence[Run]) -> list[Run]:
    """Step ``scheduler`` until every run's generation has ended."""
    for run in runs:
        run.submit()
    while True:
        for run in runs:
            run.pump()
        if all(run.completion is not None for run in runs):
            return list(runs)
        scheduler.step()


def _token_text(tokenizer: Tokenizer, token: int | None) -> str:
    return "" if token is None else tokenizer.vocab.tokens[token]
