"""The server's settings, fixed at start. ``argparse`` stays in ``cli.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    api_key: str | None = None  # when set, every route but /health needs "Authorization: Bearer KEY"
    max_queue: int = 16  # requests waiting behind the one being served; more get 503
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    max_restarts: int = 5  # engine crashes within restart_window_s that make the server exit
    restart_window_s: float = 600.0
    restart_backoff_s: float = 1.0  # first restart delay; doubles per crash in the window
    restart_backoff_max_s: float = 30.0
    ping_interval_s: float = 1.0  # how often the engine is asked whether it is answering
    hang_timeout_s: float = 30.0  # silence after which the engine is killed and restarted
    log_level: str = "info"

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
            (self.api_key is None or len(self.api_key) > 0, "the API key must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def served_model_id(self) -> str:
        """The id clients use in ``model``: the file name without ``.gguf``."""
        name = self.model.rsplit("/", 1)[-1]
        return name[:-5] if name.lower().endswith(".gguf") else name
