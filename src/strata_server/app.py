"""The HTTP side: Starlette routes over a supervised engine, served by uvicorn.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (both
with ``stream: true`` as server-sent events ending in ``data: [DONE]``),
``GET /v1/models``, ``GET /props``, ``GET /health`` (open without the API
key, details only with it) and ``GET /metrics`` (Prometheus text).

At the edge (``edge.py``): only the configured ``Host`` names are answered
(a web page cannot rebind its own domain to this server), bodies must be
``application/json`` (a cross-site form post cannot reach the engine), and
each API key is its own cache scope (one client's prompts cannot be probed
through another's cached prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from strata_runtime.conversations import owner_digest

from . import anthropic_api, choices, openai_api, responses_api, tokens_api
from .config import ServerConfig
from .edge import AllowedHosts, RequireApiKey, authenticated, cache_scope
from .errors import ApiError, json_error
from .json_body import read_json
from .metrics import Metrics
from .supervisor import Job, Supervisor

log = logging.getLogger("strata_server.app")


def build_app(config: ServerConfig, supervisor: Supervisor, metrics: Metrics) -> Starlette:
    api = _Api(config, supervisor, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        supervisor.start()
        yield
        await supervisor.stop()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
            Route("/v1/responses", api.responses, methods=["POST"]),
            Route("/v1/messages", api.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
            Route("/tokenize", api.tokenize, methods=["POST"]),
            Route("/detokenize", api.detokenize, methods=["POST"]),
            Route("/props", api.props, methods=["GET"]),
            Route("/slots", api.slots, methods=["GET"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/metrics", api.metrics_text, methods=["GET"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, ClientDisconnect: api.client_gone,
                            Exception: _internal_error},
        lifespan=lifespan,
    )
    app.add_middleware(RequireApiKey, keys=config.api_keys)
    app.add_middleware(AllowedHosts, hosts=config.host_names)
    app.add_middleware(_CountRequests, metrics=metrics)  # outermost: counts 401s and 421s too
    return app


class _Api:
    """The route handlers. Each generation is a ``Job`` of the supervisor."""

    def __init__(self, config: ServerConfig, supervisor: Supervisor, metrics: Metrics):
        self.config = config
        self.supervisor = supervisor
        self.metrics = metrics

    # --- generation ---------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, openai_api.parse_chat,
                                    lambda command: openai_api.Reply(command["kind"], self.config.served_model_id))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, openai_api.parse_completion,
                                    lambda command: openai_api.Reply(command["kind"], self.config.served_model_id))

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API: the same engine command, Anthropic's shapes and errors."""
        try:
            return await self._generate(request, anthropic_api.parse_messages,
                                        lambda command: anthropic_api.MessageReply(self.config.served_model_id))
        except ApiError as e:
            return JSONResponse(anthropic_api.error_body(e), status_code=e.status, headers=e.headers)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, stateless: the same engine command, its items and events."""
        return await self._generate(request, responses_api.parse_responses,
                                    lambda command: responses_api.ResponseReply(self.config.served_model_id,
                                                                                command.pop("echo")))

    async def count_tokens(self, request: Request) -> Response:
        try:
            body = await read_json(request, self.config.max_body_bytes, self.config.body_timeout_s)
            command = anthropic_api.parse_count(body, openai_api.PromptLimits.of(self.supervisor.props))
            done = await self._answer(command)
        except ApiError as e:
            return JSONResponse(anthropic_api.error_body(e), status_code=e.status, headers=e.headers)
        return JSONResponse({"input_tokens": len(done["tokens"])})

    async def _generate(self, request: Request, parse: Callable, make_reply: Callable) -> Response:
        """Parse a body into an engine command, run it (``n`` choices: one job
        each, the later ones copying the first's prompt state), and answer
        through ``make_reply(command)`` (``whole`` or its ``sse`` stream of events)."""
        body = await read_json(request, self.config.max_body_bytes, self.config.body_timeout_s)
        command = parse(body, self._model_ids(), openai_api.PromptLimits.of(self.supervisor.props))
        salt = command.pop("cache_salt")
        command["cache_scope"] = cache_scope(request) + ("" if salt is None else "/" + salt)
        n = command.pop("n", 1)
        reply = make_reply(command)  # before the command goes: it may take what is only the reply's
        replies = [reply] if n == 1 else reply.choices(n)
        commands = [command] if n == 1 else choices.choice_commands(command, n)
        jobs, opened = [], []
        gone = asyncio.create_task(_client_gone(request))
        try:
            for c in commands:
                jobs.append(self.supervisor.submit(c))
            for job in jobs:
                events = self._events(job, gone, owns_gone=n == 1)
                opened.append((events, await events.__anext__()))
                if opened[-1][1] is None or opened[-1][1][0] == "error":
                    break
        except BaseException:
            await _close(opened, jobs, self.supervisor, gone)
            raise
        if any(first is None or first[0] == "error" for _, first in opened):
            await _close(opened, jobs, self.supervisor, gone)
            failed = next(first for _, first in opened if first is None or first[0] == "error")
            if failed is None:  # the client left before anything was generated
                return Response(status_code=499)
            raise failed[1]
        if command["stream"]:
            if n == 1:
                return _EventStream(reply.sse(opened[0][1], opened[0][0], command["include_usage"]))
            return _EventStream(_closing(choices.sse_choices(replies, opened, command["include_usage"]), opened,
                                         jobs, self.supervisor, gone))
        try:
            results = await asyncio.gather(*(_collect(events, first) for events, first in opened))
        finally:
            await _close(opened, jobs, self.supervisor, gone)
        if any(r is None for r in results):
            return Response(status_code=499)
        if n == 1:
            return JSONResponse(reply.whole(*results[0]))
        return JSONResponse(choices.whole_choices(replies, results))

    async def _events(self, job: Job, gone: asyncio.Task, owns_gone: bool = True
                      ) -> AsyncIterator[tuple[str, Any] | None]:
        """The job's events, with metrics; ``None`` once the client has left
        (the job is then cancelled). Closing this cancels an unfinished job
        (and ``gone``, where this job alone watches it)."""
        first_piece: float | None = None
        last_piece = 0.0
        try:
            while True:
                get = asyncio.ensure_future(job.events.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    yield None
                    return
                kind, value = get.result()
                if kind == "piece":
                    now = time.perf_counter()
                    if first_piece is None:
                        first_piece = now
                        self.metrics.ttft.observe(now - job.arrived)
                        self.metrics.vllm_ttft.observe(now - job.arrived)
                    else:
                        self.metrics.vllm_itl.observe(now - last_piece)
                    last_piece = now
                if kind == "done":
                    self._record(value, first_piece)
                yield kind, value
                if kind not in ("piece", "deltas", "logprobs"):
                    return
        finally:
            if owns_gone:
                gone.cancel()
            self.supervisor.cancel(job)  # no-op for a finished job

    def _record(self, done: dict[str, Any], first_piece: float | None) -> None:
        self.metrics.prompt_tokens.inc(done["prompt_tokens"])
        self.metrics.cached_tokens.inc(done["cached_tokens"])
        self.metrics.generated_tokens.inc(done["completion_tokens"])
        self.metrics.vllm_prompt_tokens.inc(done["prompt_tokens"])
        self.metrics.vllm_generation_tokens.inc(done["completion_tokens"])
        if first_piece is not None and done["completion_tokens"] > 1:
            self.metrics.per_token.observe((time.perf_counter() - first_piece) / (done["completion_tokens"] - 1))

    async def client_gone(self, request: Request, exc: ClientDisconnect) -> Response:
        """The client went away while sending its body: nothing to answer, nobody to tell but a counter."""
        self.metrics.body_disconnects.inc()
        log.debug("a client disconnected while sending its body to %s", request.url.path)
        return Response(status_code=499)

    # --- the rest ---------------------------------------------------------------------

    def _model_ids(self) -> set[str]:
        ids = {self.config.served_model_id}
        if self.supervisor.props and self.supervisor.props.get("model"):
            ids.add(self.supervisor.props["model"])
        return ids

    def _model_card(self) -> dict[str, Any]:
        card = {"id": self.config.served_model_id, "object": "model", "created": 0, "owned_by": "strata"}
        if self.supervisor.props:
            card["max_model_len"] = self.supervisor.props.get("context_length")
        return card

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id not in self._model_ids():
            raise ApiError(404, f"model {model_id!r} is not served here; GET /v1/models lists what is",
                           code="model_not_found")
        return JSONResponse(self._model_card())

    async def tokenize(self, request: Request) -> Response:
        body = await read_json(request, self.config.max_body_bytes, self.config.body_timeout_s)
        limits = openai_api.PromptLimits.of(self.supervisor.props)
        done = await self._answer(tokens_api.parse_tokenize(body, limits))
        return JSONResponse({"count": len(done["tokens"]), "max_model_len": limits.context_length,
                             "tokens": done["tokens"]})

    async def detokenize(self, request: Request) -> Response:
        body = await read_json(request, self.config.max_body_bytes, self.config.body_timeout_s)
        done = await self._answer(tokens_api.parse_detokenize(body))
        return JSONResponse({"prompt": done["text"]})

    async def _answer(self, command: dict[str, Any]) -> dict[str, Any]:
        """Run a command the engine answers at once (no generation); its ``done`` event."""
        job = self.supervisor.submit(command)
        try:
            kind, value = await job.events.get()
        finally:
            self.supervisor.cancel(job)  # no-op for a finished job
        if kind == "error":
            raise value
        return value

    async def slots(self, request: Request) -> Response:
        """The sequences the engine holds state for, as of its last step."""
        s = self.supervisor
        if not s.answering:
            status, body = s.health()
            return JSONResponse(body, status_code=status)
        # A caller sees its own sequences only: one API key's conversations are not another's to watch.
        owner = owner_digest(cache_scope(request))
        mine = [{k: v for k, v in slot.items() if k != "owner"} for slot in s.slots if slot.get("owner") == owner]
        return JSONResponse({"parallel": s.parallel, "in_flight": s.in_flight, "queued": s.queue_length,
                             "scheduler": s.scheduler, "slots": mine})

    async def props(self, request: Request) -> Response:
        s = self.supervisor
        if not s.answering or s.props is None:
            status, body = s.health()
            return JSONResponse(body, status_code=status)
        return JSONResponse({
            **s.props,
            "engine_pid": s.engine_pid,
            "engine_uptime_s": round(time.time() - s.ready_at, 3),
            "restarts": s.restarts,
            "conversation_cache": s.stats,
            "server": {"max_queue": self.config.max_queue, "max_body_bytes": self.config.max_body_bytes,
                       "max_connections": self.config.max_connections, "body_timeout_s": self.config.body_timeout_s,
                       "api_key_required": bool(self.config.api_keys), "api_keys": len(self.config.api_keys)},
        })

    async def health(self, request: Request) -> Response:
        """Open to all; the last exit's details (the engine's error text) only with the key."""
        status, body = self.supervisor.health()
        if not authenticated(request):
            body = {k: v for k, v in body.items() if k in ("status", "restarts")}
        return JSONResponse(body, status_code=status)

    async def metrics_text(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


# --- request bodies and responses -----------------------------------------------------


async def _collect(events: AsyncIterator, first) -> tuple[str, dict[str, Any]] | None:
    """A job's whole answer: its text and its ``done`` (with the tokens' logprobs); None if the client left."""
    text: list[str] = []
    logprobs: list[dict] = []
    event = first
    while event is not None:
        kind, value = event
        if kind == "error":
            raise value
        if kind == "done":
            return "".join(text), {**value, "logprobs": logprobs or None}
        if kind == "piece":
            text.append(value)
        elif kind == "logprobs":
            logprobs += value
        event = await events.__anext__()
    return None


async def _close(opened: list, jobs: list[Job], supervisor: Supervisor, gone: asyncio.Task) -> None:
    """End a request's jobs however it ended: their event streams, the jobs still running, the client watch."""
    for events, _ in opened:
        await events.aclose()
    for job in jobs:
        supervisor.cancel(job)
    gone.cancel()


async def _closing(source: AsyncIterator[bytes], opened: list, jobs: list[Job], supervisor: Supervisor,
                   gone: asyncio.Task) -> AsyncIterator[bytes]:
    try:
        async for out in source:
            yield out
    finally:
        await _close(opened, jobs, supervisor, gone)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream:
    """A server-sent-events response that closes its source however it ends,
    so a client that goes away cancels its generation at once."""

    def __init__(self, source: AsyncIterator[bytes]):
        self.source = source

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for data in self.source:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client is gone; closing the source cancels the job
        finally:
            await self.source.aclose()


async def _api_error(request: Request, exc: ApiError) -> Response:
    return json_error(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        message = f"no route {request.url.path}; the API is under /v1 (see GET /v1/models)"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return json_error(ApiError(exc.status_code, message, code=None))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s", request.url.path)
    return json_error(ApiError(500, f"internal error ({type(exc).__name__}); see the server log", "server_error"))


# --- middleware (pure ASGI, so streaming passes straight through) -------------------


class _CountRequests:
    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = self.metrics.route(scope["path"])

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


# --- running it -------------------------------------------------------------------------


def run(config: ServerConfig) -> int:
    """Serve until stopped; 0 on a clean stop, 3 when the engine kept crashing."""
    import uvicorn

    metrics = Metrics(cache_stats=lambda: supervisor.stats, scheduler_stats=lambda: supervisor.scheduler,
                      queued=lambda: supervisor.queue_length, props=lambda: supervisor.props)
    server: uvicorn.Server | None = None

    def give_up() -> None:
        if server is not None:
            server.should_exit = True

    supervisor = Supervisor(config, metrics, on_failed=give_up)
    app = build_app(config, supervisor, metrics)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM the listener stays open while the requests accepted are
        served (up to the grace period): a new request gets a 503 it can
        retry elsewhere, not a refused connection. Then uvicorn shuts down."""

        drain_until: float | None = None

        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGTERM and self.drain_until is None and not self.should_exit:
                supervisor.begin_drain()
                self.drain_until = time.monotonic() + config.shutdown_grace_s
                return
            super().handle_exit(sig, frame)  # SIGINT, or a second SIGTERM: stop now

        async def on_tick(self, counter: int) -> bool:
            if self.drain_until is not None and not self.should_exit:
                left = self.drain_until - time.monotonic()
                if supervisor.idle or left <= 0:
                    self.config.timeout_graceful_shutdown = max(1.0, left)  # what is left of the grace
                    self.should_exit = True
            return await super().on_tick(counter)

    if not config.api_keys and not config.loopback_only:
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model and "
                    "read /props; start with --api-key-file (or STRATA_API_KEY)", config.host)
    # limit_concurrency: connections (and tasks) past it get a 503 at once, so
    # slow or huge bodies cannot pile up without bound.
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           access_log=False, timeout_graceful_shutdown=config.shutdown_grace_s,
                                           limit_concurrency=config.max_connections))
    # uvicorn raises a captured SIGTERM again once it has shut down; with the
    # default handler that would end the process by the signal after a clean drain.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 3 if supervisor.state == "failed" else 0
