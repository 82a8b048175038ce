"""Host memory telemetry against fake /proc and cgroup trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata_runtime.conversations.memory import MiB, HostMemory


def _proc(root: Path, available_kb: int | str = 8 * 1024 * 1024, cgroup: str | None = None) -> Path:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:   {available_kb} kB\n"
    )
    if cgroup is not None:
        (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def _write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)


def _v2(root: Path, path: str, limit: str, current: int, inactive: int) -> Path:
    cg = root / "cgroup"
    (cg / "cgroup.controllers").parent.mkdir(parents=True, exist_ok=True)
    (cg / "cgroup.controllers").write_text("cpu memory\n")
    d = cg / path.strip("/") if path.strip("/") else cg
    _write(d, memory_max=limit + "\n", memory_current=f"{current}\n",
           memory_stat=f"anon 1000\nfile 5000\ninactive_file {inactive}\nactive_file 10\n")
    return cg


def test_no_cgroup_uses_mem_available(tmp_path):
    h = HostMemory(_proc(tmp_path), tmp_path / "none").headroom()
    assert h.bytes == 8 * 1024 * MiB and h.cgroup_room is None
    assert "no cgroup memory limit" in h.reason


def test_v2_limit_below_mem_available_wins(tmp_path):
    proc = _proc(tmp_path, cgroup="0::/user.slice/strata\n")
    cg = _v2(tmp_path, "/user.slice/strata", str(3 * 1024 * MiB), current=2 * 1024 * MiB, inactive=100 * MiB)
    h = HostMemory(proc, cg).headroom()
    assert h.cgroup_room == 1024 * MiB + 100 * MiB
    assert h.bytes == h.cgroup_room  # less than the 8 GiB MemAvailable
    assert "cgroup /user.slice/strata room 1124 MiB" in h.reason


def test_v2_max_is_unlimited_and_an_ancestor_limit_applies(tmp_path):
    proc = _proc(tmp_path, cgroup="0::/a/b\n")
    cg = _v2(tmp_path, "/a/b", "max", current=10, inactive=0)
    _write(cg / "a", memory_max=f"{2 * 1024 * MiB}\n", memory_current=f"{1536 * MiB}\n",
           memory_stat="inactive_file 0\n")
    h = HostMemory(proc, cg).headroom()
    assert h.bytes == 512 * MiB and "cgroup /a room 512 MiB" in h.reason


def test_v1_limit_and_unlimited(tmp_path):
    proc = _proc(tmp_path, cgroup="4:memory:/docker/abc\n0::/\n")
    mem = tmp_path / "cgroup" / "memory"
    _write(mem, memory_limit_in_bytes="9223372036854771712\n", memory_usage_in_bytes="5\n",
           memory_stat="total_inactive_file 0\n")
    _write(mem / "docker" / "abc", memory_limit_in_bytes=f"{4096 * MiB}\n",
           memory_usage_in_bytes=f"{3072 * MiB}\n", memory_stat="inactive_file 1\ntotal_inactive_file 1048576\n")
    h = HostMemory(proc, tmp_path / "cgroup").headroom()
    assert h.cgroup_room == 1025 * MiB and h.bytes == 1025 * MiB


def test_container_view_of_its_own_cgroup_as_root(tmp_path):
    # /proc/self/cgroup names a path that the container's mount shows as its root.
    proc = _proc(tmp_path, cgroup="4:memory:/kubepods/pod1/c1\n")
    mem = tmp_path / "cgroup" / "memory"
    _write(mem, memory_limit_in_bytes=f"{1024 * MiB}\n", memory_usage_in_bytes=f"{1000 * MiB}\n",
           memory_stat="total_inactive_file 0\n")
    assert HostMemory(proc, tmp_path / "cgroup").headroom().bytes == 24 * MiB


@pytest.mark.parametrize("bad_file,content,message", [
    ("memory.max", "lots\n", "cannot parse .*memory.max: 'lots'"),
    ("memory.current", "", "cannot parse .*memory.current"),
    ("memory.stat", "inactive_file many\n", "cannot parse .*memory.stat"),
])
def test_garbage_cgroup_files_mean_unknown(tmp_path, bad_file, content, message):
    proc = _proc(tmp_path, cgroup="0::/x\n")
    cg = _v2(tmp_path, "/x", str(1024 * MiB), current=0, inactive=0)
    (cg / "x" / bad_file).write_text(content)
    h = HostMemory(proc, cg).headroom()
    assert h.bytes is None and not h.known
    assert h.reason.startswith("memory telemetry unknown")
    import re

    assert re.search(message, h.reason), h.reason


def test_unreadable_meminfo_means_unknown(tmp_path):
    proc = _proc(tmp_path)
    (proc / "meminfo").unlink()
    h = HostMemory(proc, tmp_path).headroom()
    assert h.bytes is None and "cannot read" in h.reason and "meminfo" in h.reason


def test_meminfo_without_mem_available(tmp_path):
    proc = _proc(tmp_path)
    (proc / "meminfo").write_text("MemTotal: 100 kB\n")
    assert "has no MemAvailable line" in HostMemory(proc, tmp_path).headroom().reason


def test_this_machine_reads_something():
    h = HostMemory().headroom()
    assert h.known and h.bytes > 0, h.reason
