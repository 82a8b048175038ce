"""The notebook API: ``load()`` a model and talk to it through an ``Engine``.

``load`` reads top-down: the file (``files``) and what its metadata
describes (``models.open_model``: a file Strata cannot run fails before
anything is read), its text side (``text``), the model's weights
(``models``); then the engine reserves the conversation cache
(``conversations``), the KV pool (``state``) and the scheduler over it
(``scheduling``, with ``speculation``). A layer split (``split``) is
imported only where one is asked for.
"""

from __future__ import annotations

import dataclasses
import time
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from strata_kernels import KVStore

from .config import EngineConfig
from .conversations import CacheSettings, HostMemory, StagingSegment, open_disk_tier, reserve_conversations
from .errors import ContextLengthError, RequestError, RequestTypeError
from .files import GGUFFile, Placement, check_device, default_model_path, model_file_identity
from .models import build_model, check_vocabulary, forward_chunks, open_model, weight_paths
from .scheduling import Completion, Constraint, Run, SamplingParams, reserve_scheduler, run_together
from .state import KVCache, row_bytes, state_fingerprint
from .text import (
    AssistantReply,
    ChatTemplate,
    ChatTemplateError,
    GrammarCompiler,
    ReplyStream,
    StopTextStream,
    Tokenizer,
    ToolCalling,
    ToolChoice,
    TurnMarker,
    chat_template_of,
    detect_format,
    normalize_messages,
    normalize_tools,
    render_and_tokenize,
    split_reasoning,
)


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
    gguf = GGUFFile.open(path if path is not None else default_model_path(config.cache_dir, progress=config.progress))
    opened = open_model(gguf)  # the metadata as the architecture reads it: a file Strata cannot run fails first
    tokenizer = Tokenizer.from_gguf(gguf)
    chat_template = chat_template_of(gguf, tokenizer)
    check_vocabulary(gguf, tokenizer.vocab.size)
    placement = _placement(opened, config, memory)
    model = build_model(opened, placement, config.dtype, config.progress, f"loading {gguf.path.name}")
    if len(placement.stage_devices) > 1:
        from .split import Pipeline

        model = Pipeline(model)
    return Engine(gguf, model, tokenizer, chat_template, config, memory, staging, disk_lock)


def _placement(opened, config: EngineConfig, memory: HostMemory | None) -> Placement:
    """Where each layer runs: one device, or a split planned from the
    metadata alone (a bad split fails before any weight is read)."""
    if config.devices is None:
        return Placement.one_device(config.device, len(opened.state_spec))
    from .split import plan_split

    gguf = opened.gguf
    context = min(config.context_length, gguf.config.context_length)
    return Placement.of_stages(plan_split(gguf, list(config.devices), config.layer_split, context, config.kv,
                                          memory=memory, dtype=config.dtype,
                                          sequences=config.sequences(config.devices[0])))


def _load_rank0(path, config: EngineConfig, memory: HostMemory | None, staging: StagingSegment | None,
                disk_lock: int | None) -> "Engine":
    """Rank 0 of a split across processes: its stage, driving the others."""
    from .split import RankPipeline, join_stage, ready

    stage = join_stage(path, config, memory, rank0=True)
    pipeline = RankPipeline(stage.model, stage.stages, stage.wire)
    ready(0)
    tokenizer = Tokenizer.from_gguf(stage.gguf)
    check_vocabulary(stage.gguf, tokenizer.vocab.size)
    return Engine(stage.gguf, pipeline, tokenizer, chat_template_of(stage.gguf, tokenizer), config, memory,
                  staging, disk_lock)


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

    def __init__(self, gguf: GGUFFile, model, tokenizer: Tokenizer, chat_template: ChatTemplate | None,
                 config: EngineConfig, memory: HostMemory | None = None, staging: StagingSegment | None = None,
                 disk_lock: int | None = None):
        """Reserves, once and in this order: the conversation cache's staging
        pool, the KV pool and the scheduler over it, then (for state that
        outlives this engine) the fingerprint, what a shared staging pool
        holds, and the disk tier."""
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.gguf = gguf
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.context_length = min(config.context_length, gguf.config.context_length)
        self.chat_template = chat_template
        on_cuda = model.device.type == "cuda"  # the staging pool is pinned for a GPU's copies
        self.conversations, self.pool_decision = reserve_conversations(CacheSettings.of(config), on_cuda, memory,
                                                                       staging)
        self.scheduler, self.spec_refusal = reserve_scheduler(model, config, self.context_length, tokenizer,
                                                              self.conversations, memory)
        self.recovered: dict[str, Any] | None = None  # what was taken back from a shared staging pool
        # Only state that outlives this engine needs a fingerprint (it reads the model file's header and samples).
        if self.conversations is not None and (staging is not None or config.conversation_cache_dir is not None):
            self.conversations.fingerprint = self.state_fingerprint()
            if staging is not None:
                self.recovered = self.conversations.recover(self.conversations.fingerprint,
                                                            row_bytes(self.scheduler.pool))
            if config.conversation_cache_dir is not None:
                open_disk_tier(self.conversations, config.conversation_cache_dir,
                               config.conversation_cache_disk_mib, disk_lock)
        self.last_completion: Completion | None = None
        self.loaded_at = time.time()
        self.grammars = GrammarCompiler(tokenizer)  # its vocabulary is built on the first constrained request

    @cached_property
    def _turns(self) -> TurnMarker | None:
        """Where a chat prompt's turns start (checkpoints go there), read from the template once."""
        return TurnMarker.of(self.chat_template, self.tokenizer)

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

    def state_fingerprint(self) -> str:
        """What this engine's parked state means (``files.fingerprint``, ``state.layout``): entries of
        another fingerprint are never taken back."""
        identity = model_file_identity(self.gguf.path, int(self.gguf.reader.data_offset))
        return state_fingerprint(identity, self.gguf.architecture, self.config.kv, self.model.compute_path.name,
                                 self.scheduler.pool, [str(d) for d in self.model.placement.stage_devices])

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

    def generate_n(self, prompt: str | Sequence[int], n: int, *, cache_scope: str = "",
                   **sampling: Any) -> list[Completion]:
        """``n`` continuations of one ``prompt`` decoded together; the prompt is
        read once and its state copied to the others. With a ``seed``, choice
        ``i`` draws with ``seed + i`` (each reproducible alone)."""
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
            raise RequestError(f"n must be a whole number in 1..16, got {n!r}")
        seed = sampling.get("seed")
        runs = [self._start(prompt, {**sampling, **({} if seed is None else {"seed": seed + i})},
                            cache_scope=cache_scope) for i in range(n)]
        return [run.completion for run in run_together(self.scheduler, runs, siblings=True)]

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
             abort: Callable[[], bool] | None = None, cache_scope: str = "", tools: Sequence[dict] | None = None,
             tool_choice: Any = None, parallel_tool_calls: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None, **sampling: Any):
        """Generate the assistant's reply to ``messages`` (OpenAI-shaped:
        tool calls and results, reasoning) through the model's chat template.
        ``tools``/``tool_choice``/``parallel_tool_calls`` as OpenAI's; the
        completion's ``reply`` holds the content, reasoning and tool calls read
        back in the model's tool-call format. ``chat_template_kwargs``: other
        variables the template reads (``{"enable_thinking": False}``)."""
        run = self._chat_run(messages, sampling, abort, cache_scope, tools, tool_choice, parallel_tool_calls,
                             chat_template_kwargs)
        if stream:
            return iter(run)
        for _ in run:
            pass
        return run.completion

    @property
    def tool_call_format(self) -> str:
        """The tool-call format requests use (``config.tool_call_format``, or the template's)."""
        if self.config.tool_call_format != "auto":
            return self.config.tool_call_format
        return detect_format(self.chat_template.source if self.chat_template is not None else None)

    def chat_request_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict] | None = None,
                            tool_choice: Any = None, parallel_tool_calls: bool = True,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            abort: Callable[[], bool] | None = None) -> tuple[list[int], ToolCalling]:
        """The prompt tokens ``chat`` reads for these arguments (the tool-call
        format's view of the tools and history included: what a token count
        must see), and the request's ``ToolCalling``."""
        messages = normalize_messages(messages)
        tools = normalize_tools(tools)
        names = [t["function"]["name"] for t in tools or []]
        if not isinstance(parallel_tool_calls, bool):
            raise RequestTypeError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}")
        calling = ToolCalling(self.tool_call_format, tools, ToolChoice.of(tool_choice, names), parallel_tool_calls,
                              self.tokenizer)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise RequestTypeError("chat_template_kwargs must be a dict of the template's variables")
        prompt = self.chat_prompt(calling.template_messages(messages), abort=abort, tools=calling.template_tools(),
                                  chat_template_kwargs=chat_template_kwargs)
        return prompt, calling

    def _chat_run(self, messages: Sequence[dict[str, Any]], sampling: dict[str, Any],
                  abort: Callable[[], bool] | None, cache_scope: str, tools: Sequence[dict] | None = None,
                  tool_choice: Any = None, parallel_tool_calls: bool = True,
                  chat_template_kwargs: dict[str, Any] | None = None) -> "Run":
        prompt, calling = self.chat_request_prompt(messages, tools, tool_choice, parallel_tool_calls,
                                                   chat_template_kwargs, abort)
        grammar = calling.grammar()
        if grammar is not None:
            if sampling.get("grammar") is not None:
                raise RequestError("give tools or a grammar (response_format), not both")
            sampling = {**sampling, "grammar": grammar}
        # Turn boundaries are where a returning conversation diverges: checkpoint there.
        boundaries = [] if self.conversations is None or self._turns is None else self._turns.boundaries(prompt)
        # (messages were checked by chat_request_prompt: the first is a dict with a role)
        root = boundaries[0] if boundaries and messages[0]["role"] in ("system", "developer") else None
        run = self._start(prompt, sampling, boundaries, root=root, abort=abort, cache_scope=cache_scope)
        # A template that opens the reasoning itself (the prompt ends in <think>): the reply starts inside it.
        opened = self.tokenizer.decode(prompt[-3:], special=True).rstrip().endswith("<think>")

        def read_reply(tokens: list[int], text: str) -> AssistantReply:
            if grammar is None:  # no calls to read: the text as decoded (stop strings cut), reasoning split off
                reasoning, content = split_reasoning(text, opened)
                return AssistantReply(content, reasoning)
            # Calls are read with their marker tokens spelled out.
            return calling.parse(self.tokenizer.decode(tokens, special=True), opened)

        run.read_reply = read_reply
        run.reply_stream = ReplyStream(calling, opened)
        run.special_text = StopTextStream(self.tokenizer.stream_decoder(special=True), run.params.stop)
        return run

    def submit(self, prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict[str, Any]] | None = None,
               abort: Callable[[], bool] | None = None, cache_scope: str = "", tools: Sequence[dict] | None = None,
               tool_choice: Any = None, parallel_tool_calls: bool = True,
               chat_template_kwargs: dict[str, Any] | None = None, sibling_of: "Run | None" = None,
               **sampling: Any) -> "Run":
        """Queue one generation (a ``prompt``, or chat ``messages`` with
        ``chat``'s tool arguments) and return its ``Run`` without stepping:
        whoever drives ``scheduler.step()`` (a server's loop) takes its text
        with ``run.pump()`` until ``run.completion`` is set. ``QueueFull``
        where the waiting queue is at its bound. Arguments are checked here,
        as ``generate``/``chat`` check them. ``sibling_of``: a run of the same
        prompt (another of a request's ``n`` choices) whose prompt state this
        one copies rather than reading the prompt again."""
        if (prompt is None) == (messages is None):
            raise RequestTypeError("give a prompt or messages, not both")
        if messages is None and (tools is not None or tool_choice is not None or chat_template_kwargs is not None):
            raise RequestTypeError("tools, tool_choice and chat_template_kwargs go with messages, not a prompt")
        run = (self._chat_run(messages, dict(sampling), abort, cache_scope, tools, tool_choice, parallel_tool_calls,
                              chat_template_kwargs) if messages is not None
               else self._start(prompt, dict(sampling), abort=abort, cache_scope=cache_scope))
        # Another choice of the same request: the prompt's state is copied from the first once it has read it.
        run.submit(bounded=True, sibling=None if sibling_of is None else sibling_of.seq)
        return run

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
                    abort: Callable[[], bool] | None = None, tools: Sequence[dict] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt tokens of ``messages`` (and ``tools``, as the template
        writes them): control tokens come from the template only; a control
        token's text inside anything a client sent stays text."""
        if self.chat_template is None:
            raise ChatTemplateError(
                f"{self.gguf.path} has no chat template (tokenizer.chat_template); use generate() with a plain prompt"
            )
        return render_and_tokenize(self.chat_template, self.tokenizer, normalize_messages(messages),
                                   add_generation_prompt, self._check_chars, abort, tools=normalize_tools(tools),
                                   variables=chat_template_kwargs)

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
            "tool_call_format": self.tool_call_format,
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
        return {"requested": path.requested, "activations": path.name, "weights": weight_paths(self.model),
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
        far = [t for t, _ in params.logit_bias if t >= self.tokenizer.vocab.size]
        if far:
            raise RequestError(f"logit_bias names token {far[0]}; the vocabulary has {self.tokenizer.vocab.size} tokens")
        text = StopTextStream(self.tokenizer.stream_decoder(), params.stop)
        constraint = None
        if params.grammar is not None:  # compiled here: a grammar it cannot enforce is the request's error
            constraint = Constraint(self.grammars.matcher(params.grammar), self.tokenizer.vocab.size)
        return Run(self.scheduler, text, ids, params, boundaries, root, abort, cache_scope, self._completed,
                   constraint=constraint)

    def _completed(self, completion: Completion) -> None:
        self.last_completion = completion

