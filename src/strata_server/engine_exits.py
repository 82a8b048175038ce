"""What an engine's end means for the requests it held: how it ended
(described once, for the log, ``/health`` and the 500s), which requests
are suspects of having caused it, and what each request in flight is
answered. A part of ``Supervisor``, whose state it reads: ``config``,
``metrics``, ``last_exit``, ``crash_suspects``, the jobs waiting and in
flight, the child process, and how the supervisor last ended one (hung,
stuck, slow to start) or what the engine named."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from .errors import ApiError, unavailable

log = logging.getLogger("strata_server.supervisor")


class ExitAccounting:
    def _kill_stuck(self, busy: float, bound: float, requests: list[int]) -> None:
        proc = self._proc
        self._stuck = f"after one piece of its work ran {busy:.1f} s (its bound {bound:.1f} s)"
        self._suspects = requests
        log.error("engine process %s is stuck: one piece of its work has run %.1f s, past its bound of %.1f s "
                  "(requests %s); killing it", None if proc is None else proc.pid, busy, bound, requests)
        if proc is not None and proc.returncode is None:
            proc.kill()

    def _settle_in_flight(self) -> None:
        """After a crash: the requests that were in the failed work (named by
        the engine, else all in flight) get a 500 not to be retried, and are
        remembered; others in flight get a 503 to retry; waiting ones stay."""
        jobs = list(self._in_flight.values())
        self._in_flight = {}
        if self._suspects is not None:
            suspects = [j for j in jobs if j.id in self._suspects]
        else:  # not named: those the engine had taken (one sent to a dead engine could not have caused its end)
            suspects = [j for j in jobs if j.taken]
        # A SIGKILL nobody explained (the OOM killer, an operator) says nothing of a request: unsure.
        sure = len(suspects) == 1 and not (self.last_exit["signal"] == "SIGKILL" and self._outside_kill())
        reason = f"{self.last_exit['reason']} (last error: {self.last_exit['error']})"
        for job in jobs:
            job.finished = True
            if job in suspects:
                self.crash_suspects.record(job.command, sure=sure, reason=reason)
                refused = ("an identical one is refused" if sure else
                           "an identical one is refused if it is in another crash")
                error = ApiError(500, f"the engine process exited {reason} while serving this request; it is being "
                                      f"restarted. Do not retry this request as is: {refused} for "
                                      f"{self.config.restart_window_s:.0f} s in case it caused the crash",
                                 "server_error", "engine_crashed", {"x-should-retry": "false"})
            else:
                error = unavailable(f"the engine process exited {self.last_exit['reason']} while this request was "
                                    "pending; it is being restarted, retry shortly", "engine_restarted")
            job.events.put_nowait(("error", error))

    def _outside_kill(self) -> bool:
        """Whether the engine was killed by something other than this
        supervisor (which kills it only when hung, stuck or slow to start)
        and said nothing of why (no fatal report)."""
        return not (self._hung or self._stuck or self._start_timed_out) and self._suspects is None

    def _fail_jobs(self, error: ApiError) -> None:
        jobs = list(self._in_flight.values()) + list(self._waiting)
        self._in_flight = {}
        self._waiting.clear()
        self.metrics.queue_depth.set(0)
        for job in jobs:
            job.finished = True
            job.events.put_nowait(("error", error))

    def _describe_exit(self, code: int) -> dict[str, Any]:
        if self._hung:
            reason = f"after it stopped answering for {self.config.hang_timeout_s:g} s (exit code {code})"
        elif self._stuck:
            reason = f"{self._stuck} (exit code {code})"
        elif self._start_timed_out:
            reason = (f"after it was not ready within the start deadline of {self.config.start_timeout_s:g} s "
                      f"(exit code {code}; see --start-timeout)")
        elif code < 0:
            reason = f"on signal {signal_name(-code)} (exit code {code})"
        else:
            reason = f"with exit code {code}"
        return {"code": code, "signal": signal_name(-code) if code < 0 else None, "reason": reason,
                "error": self._last_error or "none reported", "at": time.time()}


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
