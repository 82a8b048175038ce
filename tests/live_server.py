"""A real ``strata serve`` process on 127.0.0.1 for tests: start, poll, read metrics, stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """One server process; its combined output goes to a log file the tests can read."""

    def __init__(self, *args: str, api_key: str | None = None, new_session: bool = False):
        """``new_session``: the server leads a process group of its own, as
        a service manager starts it (a signal to the group reaches no test)."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = Path(tempfile.mkstemp(prefix="strata-serve-", suffix=".log")[1])
        command = [sys.executable, "-m", "strata_server.cli", "serve", "--port", str(self.port), *args]
        if api_key:
            command += ["--api-key", api_key]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=new_session)
        self.http = httpx.Client(base_url=self.base, timeout=120,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    # --- state ---------------------------------------------------------------------

    def health(self) -> tuple[int, dict]:
        r = self.http.get("/health")
        return r.status_code, r.json()

    def wait_for_health(self, status: int, timeout: float = 180) -> dict:
        """Poll /health (and nothing else) until it answers ``status``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                code, body = self.health()
                if code == status:
                    return body
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"/health did not answer {status} within {timeout} s:\n{self.log()}")

    def engine_pid(self) -> int:
        props = self.http.get("/props")
        assert props.status_code == 200, f"/props answered {props.status_code} (no engine answering): {props.text}"
        return props.json()["engine_pid"]

    def kill_engine(self, sig: int = signal.SIGKILL) -> int:
        pid = self.engine_pid()
        os.kill(pid, sig)
        return pid

    def metrics(self) -> dict[str, float]:
        """Samples by ``name{label="value",...}`` (labels sorted), as floats."""
        text = self.http.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    # --- requests ------------------------------------------------------------------

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.http.post(path, content=content, headers={"content-type": "application/json"}, **kwargs)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()


@contextlib.contextmanager
def healthy_server(*args: str, api_key: str | None = None):
    """A ``LiveServer`` answering /health 200 for the block's duration, stopped after."""
    s = LiveServer(*args, api_key=api_key)
    try:
        s.wait_for_health(200)
        yield s
    finally:
        s.stop()
