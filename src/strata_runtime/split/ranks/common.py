"""What the modules of a split across processes share: its error, its timeouts."""

from __future__ import annotations

import datetime

from ...errors import StrataError

# Joining the job, planning and loading wait for the slowest rank to load its
# weights: far longer than one step may take. Steps use the rank timeout.
SETUP_TIMEOUT_S = 1800.0
# A follower waits this long for rank 0's next command: a server may sit idle
# for days; rank 0 dying still ends the wait at once (its sockets close).
IDLE_WAIT = datetime.timedelta(days=365)
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class StageLost(StrataError):
    """A rank of a split across processes died or stopped answering: the job
    cannot go on without it."""


def first_line(e: BaseException) -> str:
    """An error's first line, without gloo's source prefix: what a log line or
    a reply to rank 0 says."""
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    # gloo prefixes its messages with a source location: "[.../pair.cc:553] Connection closed by peer ..."
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". This is typically")[0][:200]
