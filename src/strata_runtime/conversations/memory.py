"""What the host can give: the least of MemAvailable and the cgroup's room.

Every figure is read fresh from files whose roots are parameters, so tests
point them at fake trees. Anything that cannot be read or parsed makes the
answer *unknown*, and an unknown answer refuses the optimization that asked,
naming the file and what was wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
# cgroup v1 reports "no limit" as a page-rounded 2**63 - 1.
_V1_UNLIMITED = 1 << 60


class TelemetryError(Exception):
    """A memory figure that could not be read or parsed (the message says which)."""


@dataclass(frozen=True)
class Headroom:
    """Bytes the host can still give, or ``None`` when unknown (``reason`` says why).

    ``mem_available`` and ``cgroup_room`` are the two figures it is the least
    of (``cgroup_room`` None: no memory limit applies)."""

    bytes: int | None
    reason: str
    mem_available: int | None = None
    cgroup_room: int | None = None

    @property
    def known(self) -> bool:
        return self.bytes is not None


class HostMemory:
    """Reads host memory telemetry from ``proc_root`` and ``cgroup_root``."""

    def __init__(self, proc_root: str | Path = "/proc", cgroup_root: str | Path = "/sys/fs/cgroup"):
        self.proc_root = Path(proc_root)
        self.cgroup_root = Path(cgroup_root)

    def headroom(self) -> Headroom:
        try:
            available = self._mem_available()
            room, where = self._cgroup_room()
        except TelemetryError as e:
            return Headroom(None, f"memory telemetry unknown: {e}")
        if room is None:
            return Headroom(available, f"MemAvailable {available // MiB} MiB (no cgroup memory limit)", available, None)
        least = min(available, room)
        return Headroom(least, f"MemAvailable {available // MiB} MiB, cgroup {where} room {room // MiB} MiB",
                        available, room)

    # --- /proc/meminfo --------------------------------------------------------

    def _mem_available(self) -> int:
        path = self.proc_root / "meminfo"
        for line in _read(path).splitlines():
            if line.startswith("MemAvailable:"):
                parts = line.split()
                if len(parts) != 3 or parts[2] != "kB" or not parts[1].isdigit():
                    raise TelemetryError(f"cannot parse {path}: {line!r}")
                return int(parts[1]) * 1024
        raise TelemetryError(f"{path} has no MemAvailable line")

    # --- cgroups --------------------------------------------------------------

    def _cgroup_room(self) -> tuple[int | None, str]:
        """The least room of the process's cgroup and its ancestors (None: unlimited)."""
        membership = self.proc_root / "self" / "cgroup"
        if not membership.exists():
            return None, ""
        v1_path = v2_path = None
        for line in _read(membership).splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3:
                raise TelemetryError(f"cannot parse {membership}: {line!r}")
            hierarchy, controllers, path = parts
            if hierarchy == "0" and controllers == "":
                v2_path = path
            elif "memory" in controllers.split(","):
                v1_path = path
        if v1_path is not None:
            return self._walk(self.cgroup_root / "memory", v1_path, _v1_room)
        if v2_path is not None and (self.cgroup_root / "cgroup.controllers").exists():
            return self._walk(self.cgroup_root, v2_path, _v2_room)
        return None, ""

    @staticmethod
    def _walk(mount: Path, path: str, room_of) -> tuple[int | None, str]:
        # Inside a container the mount often shows the container's own cgroup
        # as its root, so the recorded path may not exist below it: start from
        # the deepest part of the path that does.
        parts = [p for p in path.split("/") if p]
        while parts and not (mount.joinpath(*parts)).is_dir():
            parts.pop(0)
        here = mount.joinpath(*parts)
        least, where = None, ""
        while True:
            room = room_of(here)
            if room is not None and (least is None or room < least):
                least, where = room, "/" + "/".join(here.relative_to(mount).parts)
            if here == mount:
                return least, where
            here = here.parent


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise TelemetryError(f"cannot read {path}: {e.strerror or e}") from None


def _int_file(path: Path) -> int:
    text = _read(path).strip()
    if not text.isdigit():
        raise TelemetryError(f"cannot parse {path}: {text[:40]!r}")
    return int(text)


def _stat_value(path: Path, keys: tuple[str, ...]) -> int:
    values = {}
    for line in _read(path).splitlines():
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise TelemetryError(f"cannot parse {path}: {line!r}")
        values[parts[0]] = int(parts[1])
    for key in keys:
        if key in values:
            return values[key]
    raise TelemetryError(f"{path} has none of {', '.join(keys)}")


def _v2_room(directory: Path) -> int | None:
    limit_file = directory / "memory.max"
    if not limit_file.exists():
        return None
    limit = _read(limit_file).strip()
    if limit == "max":
        return None
    if not limit.isdigit():
        raise TelemetryError(f"cannot parse {limit_file}: {limit[:40]!r}")
    current = _int_file(directory / "memory.current")
    reclaimable = _stat_value(directory / "memory.stat", ("inactive_file",))
    return max(0, int(limit) - current + reclaimable)


def _v1_room(directory: Path) -> int | None:
    limit_file = directory / "memory.limit_in_bytes"
    if not limit_file.exists():
        return None
    limit = _int_file(limit_file)
    if limit >= _V1_UNLIMITED:
        return None
    usage = _int_file(directory / "memory.usage_in_bytes")
    reclaimable = _stat_value(directory / "memory.stat", ("total_inactive_file", "inactive_file"))
    return max(0, limit - usage + reclaimable)
