"""The server's settings, fixed at start. ``argparse`` stays in ``cli.py``."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})


@dataclass(frozen=True)
class ServerConfig:
    """How ``strata serve`` listens, supervises its engine and limits requests.

    ``engine_options`` are ``strata_runtime.load`` options (checked by the
    caller before the engine process is started); ``model`` is a concrete path.
    """

    model: str
    engine_options: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()  # when set, every route but /health needs "Authorization: Bearer KEY" for one
    # Host names answered (besides loopback and the bound address); None: the
    # default, which answers any name on a wildcard bind and only those otherwise.
    allowed_hosts: tuple[str, ...] | None = None
    max_queue: int = 16  # requests waiting behind the one being served; more get 503
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    body_timeout_s: float = 30.0  # a body still arriving after this gets 408
    max_connections: int = 64  # open connections past this get 503 at once (uvicorn's limit_concurrency)
    max_restarts: int = 5  # engine crashes within restart_window_s that make the server exit
    restart_window_s: float = 600.0
    restart_backoff_s: float = 1.0  # first restart delay; doubles per crash in the window
    restart_backoff_max_s: float = 30.0
    ping_interval_s: float = 1.0  # how often the engine is asked whether it is answering
    hang_timeout_s: float = 30.0  # silence after which the engine is killed and restarted
    # An engine not ready this long after it started is killed and counted as a crash
    # (a model file on a hung mount, a device that never answers).
    start_timeout_s: float = 600.0
    # One piece of the engine's work (a step, a request's tokenizing) may take
    # this long, and this long again per 256 tokens it handles; past that the
    # engine is stuck (a kernel, a deadlock) and is killed and restarted.
    stall_timeout_s: float = 60.0
    shutdown_grace_s: float = 30.0  # on SIGTERM, requests in flight get this long to finish
    log_level: str = "info"
    faults: tuple[str, ...] = ()  # "POINT[:RATE[:KIND]][@TEXT]": what the engine fails on purpose (chaos tests)

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.port <= 65535, f"port must be in 1..65535, got {self.port}"),
            (self.max_queue >= 0, f"max_queue must be at least 0, got {self.max_queue}"),
            (self.max_body_bytes >= 1024, f"the body limit must be at least 1 KiB, got {self.max_body_bytes} bytes"),
            (self.max_restarts >= 1, f"max_restarts must be at least 1, got {self.max_restarts}"),
            (self.restart_window_s > 0, f"the restart window must be positive, got {self.restart_window_s}"),
            (self.restart_backoff_s >= 0, f"the restart backoff must be at least 0, got {self.restart_backoff_s}"),
            (self.ping_interval_s > 0, f"the ping interval must be positive, got {self.ping_interval_s}"),
            (self.hang_timeout_s > self.ping_interval_s,
             f"the hang timeout ({self.hang_timeout_s} s) must exceed the ping interval ({self.ping_interval_s} s)"),
            (all(self.api_keys), "an API key must not be empty"),
            (all(k.isprintable() and " " not in k for k in self.api_keys),
             "an API key must be printable characters without spaces"),
            (self.body_timeout_s > 0, f"the body timeout must be positive, got {self.body_timeout_s}"),
            (self.max_connections >= 1, f"max_connections must be at least 1, got {self.max_connections}"),
            (self.start_timeout_s > 0, f"the start timeout must be positive, got {self.start_timeout_s}"),
            (self.stall_timeout_s > 0, f"the stall timeout must be positive, got {self.stall_timeout_s}"),
            (self.shutdown_grace_s >= 0, f"the shutdown grace must be at least 0, got {self.shutdown_grace_s}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def loopback_only(self) -> bool:
        """Whether only this machine can connect (the bound address is a loopback one)."""
        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def host_names(self) -> frozenset[str] | None:
        """The ``Host`` names answered, or None for any (a wildcard bind with no list given)."""
        given = frozenset(h.lower() for h in self.allowed_hosts or ())
        if "*" in given or (self.allowed_hosts is None and self.host in WILDCARDS):
            return None
        return LOOPBACK_NAMES | given | ({self.host.lower()} - WILDCARDS)

    @property
    def served_model_id(self) -> str:
        """The id clients use in ``model``: the file name without ``.gguf``."""
        name = self.model.rsplit("/", 1)[-1]
        return name[:-5] if name.lower().endswith(".gguf") else name
