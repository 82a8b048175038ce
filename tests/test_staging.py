"""The staging pool: admission, all-or-nothing leases, copies, and no host
allocation after start."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from test_memory import _proc, _v2

from strata_runtime.conversations.memory import MiB, HostMemory
from strata_runtime.conversations.staging import StagingPool

PAGE = 1 * MiB


def _memory_with_room(tmp_path, room_mib: int) -> HostMemory:
    proc = _proc(tmp_path, cgroup="0::/svc\n")
    cg = _v2(tmp_path, "/svc", str(4096 * MiB), current=(4096 - room_mib) * MiB, inactive=0)
    return HostMemory(proc, cg)


def test_grants_what_fits(tmp_path):
    pool, d = StagingPool.reserve(64 * MiB, min_free_bytes=100 * MiB, memory=_memory_with_room(tmp_path, 1000),
                                  page_bytes=PAGE)
    assert pool.total_bytes == d.granted == 64 * MiB
    assert "reserved: 64 MiB of 64 MiB requested (headroom 1000 MiB; floor 100 MiB)" in d.message


def test_shrinks_to_headroom_minus_floor(tmp_path, caplog):
    caplog.set_level("INFO")
    pool, d = StagingPool.reserve(512 * MiB, min_free_bytes=100 * MiB, memory=_memory_with_room(tmp_path, 130),
                                  page_bytes=PAGE)
    assert pool.total_bytes == d.granted == 30 * MiB
    assert "shrunk to fit: 30 MiB of 512 MiB requested (headroom 130 MiB; floor 100 MiB)" in caplog.text


def test_strict_refuses_instead_of_shrinking(tmp_path):
    pool, d = StagingPool.reserve(512 * MiB, min_free_bytes=100 * MiB, memory=_memory_with_room(tmp_path, 130),
                                  page_bytes=PAGE, strict=True)
    assert pool.total_bytes == 0 and "refused (strict)" in d.message
    assert pool.lease(1) is None


def test_unknown_telemetry_refuses_with_its_reason(tmp_path):
    proc = _proc(tmp_path, available_kb="lots")
    pool, d = StagingPool.reserve(64 * MiB, min_free_bytes=0, memory=HostMemory(proc, tmp_path), page_bytes=PAGE)
    assert pool.total_bytes == 0
    assert "refused: memory telemetry unknown: cannot parse" in d.message


def test_leases_are_all_or_nothing_and_pages_come_back():
    pool = StagingPool(8, PAGE)
    a = pool.lease(3 * PAGE)
    b = pool.lease(4 * PAGE + 1)  # five pages
    assert a is not None and b is not None and len(b.pages) == 5
    assert not set(a.pages) & set(b.pages)
    assert pool.lease(1 * PAGE + 1) is None  # two pages asked, none given
    assert pool.free_bytes == 0 * PAGE and pool.used_bytes == 8 * PAGE
    pool.release(a)
    assert pool.free_bytes == 3 * PAGE
    with pytest.raises(ValueError, match="already released"):
        pool.release(a)
    assert pool.lease(3 * PAGE) is not None


def test_copies_round_trip_across_page_boundaries():
    pool = StagingPool(6, PAGE)
    pool.lease(PAGE)  # so the next lease's pages are not the first ones
    lease = pool.lease(3 * PAGE + 100)
    x = torch.randn(300_000)  # 1.2 MB: spans two pages
    y = torch.randint(-128, 127, (700_000,), dtype=torch.int8)
    start = pool.buffer.data_ptr()
    end = lease.copy_in(0, x)
    lease.copy_in(end, y)
    x2, y2 = torch.empty_like(x), torch.empty_like(y)
    lease.copy_out(0, x2)
    lease.copy_out(end, y2)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert pool.buffer.data_ptr() == start  # never reallocated
    with pytest.raises(ValueError, match="outside this"):
        lease.copy_in(3 * PAGE, torch.zeros(200, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        lease.copy_in(0, torch.zeros(10, 10).T)


def test_no_host_allocation_after_start():
    """A child reserves the pool, then caps its address space at what it has:
    any further host allocation of size fails, yet parking, checkpoints and
    restores of a real KV cache keep working."""
    code = textwrap.dedent("""
        import resource, torch
        from strata_runtime.conversations.cache import ConversationCache, Parked, Restored, Saved
        from strata_runtime.state.kv_cache import KVCache
        from strata_runtime.state import AttentionState
        from strata_runtime.conversations.staging import StagingPool
        cc = ConversationCache(StagingPool(64, 1 << 20), slots=2)   # 64 MiB, reserved at start
        cache = KVCache("int8", [AttentionState(2, 128, 64), AttentionState(2, 128)] * 2, 4096)
        for store in cache.stores:                   # about 1 MiB of live state per sequence
            store.k.random_(-127, 127)
            store.v.random_(-127, 127)
            store.k_scales.uniform_()
            store.v_scales.uniform_()
        before = [s.k.clone() for s in cache.stores]
        tokens = list(range(1000))
        vm = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm + (24 << 20), resource.RLIM_INFINITY))
        try:
            torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
            print('allocation after start unexpectedly succeeded')
        except (RuntimeError, MemoryError):
            pass
        ok = True
        for i in range(20):                          # park, checkpoint, restore, over and over
            cache.length = 1000
            ok &= isinstance(cc.park(cache, tokens[:999] + [i]), Parked)
            ok &= isinstance(cc.save_checkpoint(cache, tokens[:999] + [i]), Saved)
            for s in cache.stores:
                s.k.zero_()
            ok &= cc.restore(cache, [], tokens[:999] + [i, 7]) == Restored(1000, "parked")
            ok &= all(torch.equal(s.k[:1000], b[:1000]) for s, b in zip(cache.stores, before) if s.capacity >= 1000)
        print('ok', bool(ok))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["ok", "True"], out.stdout + out.stderr


def test_parks_checkpoints_and_restores_allocate_no_tensor_storage():
    """Issue 23, item 13: capping the address space (above) catches growth,
    not allocation. Here torch's profiler counts every tensor allocation the
    copy paths make: parks, checkpoints and restores (the pool's pages were
    reserved at start) allocate none, however often they run."""
    from torch.profiler import ProfilerActivity, profile

    from strata_runtime.conversations.cache import ConversationCache, Parked, Restored, Saved
    from strata_runtime.state.kv_cache import KVCache
    from strata_runtime.state.spec import AttentionState

    cc = ConversationCache(StagingPool(64, 1 << 20), slots=2)
    cache = KVCache("int8", [AttentionState(2, 128, 64), AttentionState(2, 128)] * 2, 4096)
    for store in cache.stores:
        store.k.random_(-127, 127)
        store.v.random_(-127, 127)
    tokens = list(range(1000))
    outcomes = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in range(5):
            cache.length = 1000
            outcomes.append(isinstance(cc.park(cache, tokens[:999] + [i]), Parked))
            outcomes.append(isinstance(cc.save_checkpoint(cache, tokens[:999] + [i]), Saved))
            outcomes.append(cc.restore(cache, [], tokens[:999] + [i, 7]) == Restored(1000, "parked"))
    assert all(outcomes)
    allocated = [(e.name, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert allocated == [], allocated[:10]
