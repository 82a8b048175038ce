"""Parking, restoring and checkpoints on the default model: restored state
continues exactly like a cold run; every failure is an outcome, not an error."""

from __future__ import annotations

import pytest
import torch

from strata_runtime.conversations.cache import ConversationCache, Parked, Restored, Saved, Skipped
from strata_runtime.models.generation import forward_chunks
from strata_runtime.conversations.memory import MiB
from strata_runtime.conversations.staging import StagingPool
from strata_runtime.testing import inject_fault


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [2] + [int(t) for t in torch.randint(300, 20000, (n - 1,), generator=g)]


def _run(engine, cache, tokens):
    """Prefill ``tokens`` after what the cache holds; logits of every new position."""
    with torch.inference_mode():
        return forward_chunks(engine.model, cache, tokens[cache.length:], last_only=False)


@pytest.fixture
def cc():
    return ConversationCache(StagingPool(64, MiB), slots=4)


def test_park_restore_continues_like_a_cold_run(engine, cc):
    a = _tokens(300, 1)
    b = _tokens(200, 2)
    cache = engine.new_cache(1024)
    _run(engine, cache, a)
    assert isinstance(cc.park(cache, a), Parked)
    cache.reset()
    _run(engine, cache, b)
    prompt = a + _tokens(40, 3)[1:]
    outcome = cc.restore(cache, b, prompt)
    assert outcome == Restored(300, "parked")
    warm = _run(engine, cache, prompt)
    cold = _run(engine, engine.new_cache(1024), prompt)[300:]
    assert torch.allclose(warm, cold, atol=1e-4), float((warm - cold).abs().max())
    assert cc.stats()["parked"] == 1 and cc.stats()["restored"] == 1


def test_late_divergence_restarts_from_a_checkpoint(engine, cc):
    """Past window + chunk the rings have moved on: the sliding layers restart
    from the nearest checkpoint at or before the divergence."""
    a = _tokens(1200, 4)
    cache = engine.new_cache(2048)
    _run(engine, cache, a[:512])
    assert isinstance(cc.save_checkpoint(cache, a[:512]), Saved)
    _run(engine, cache, a)
    assert isinstance(cc.park(cache, a), Parked)
    prompt = a[:600] + _tokens(30, 5)[1:]
    outcome = cc.restore(cache, a, prompt)
    assert outcome == Restored(512, "live")  # the live cache holds the prefix; rings from the checkpoint
    warm = _run(engine, cache, prompt)
    cold = _run(engine, engine.new_cache(2048), prompt)[512:]
    assert torch.allclose(warm, cold, atol=1e-4), float((warm - cold).abs().max())


def test_without_a_checkpoint_the_match_falls_back_to_cold(engine, cc):
    a = _tokens(1200, 6)
    cache = engine.new_cache(2048)
    _run(engine, cache, a)
    prompt = a[:600] + [5, 6, 7]
    assert cc.restore(cache, a, prompt) == Restored(0, "live")


@pytest.mark.parametrize("point", ["park_copy", "staging_lease"])
def test_park_faults_are_skipped_and_counted(engine, cc, point, caplog):
    caplog.set_level("INFO")
    a = _tokens(100, 7)
    cache = engine.new_cache(256)
    _run(engine, cache, a)
    with inject_fault(point):
        outcome = cc.park(cache, a)
    assert isinstance(outcome, Skipped) and "skip parking" in outcome.reason
    assert cc.pool.used_bytes == 0 and cc.snapshots == []
    assert cc.stats()["park_skipped"] == 1
    assert "conversation cache: skip parking" in caplog.text


def test_restore_fault_leaves_the_cache_cold_and_consistent(engine, cc):
    a, b = _tokens(100, 8), _tokens(100, 9)
    cache = engine.new_cache(256)
    _run(engine, cache, a)
    cc.park(cache, a)
    cache.reset()
    _run(engine, cache, b)
    with inject_fault("restore_copy"):
        outcome = cc.restore(cache, b, a + [7])
    assert isinstance(outcome, Skipped) and "prefilling from scratch" in outcome.reason
    assert cache.length == 0
    cold = _run(engine, cache, a + [7])
    ref = _run(engine, engine.new_cache(256), a + [7])
    assert torch.equal(cold, ref)


def test_a_checkpoint_out_of_memory_is_skipped_and_a_device_error_is_raised(engine, cc):
    """Out-of-memory (torch's error, or the CPU allocator's RuntimeError) is
    an optimization's skip; any other device error is raised (it ends the
    engine: the device is in an unknown state), its pages given back."""
    a = _tokens(50, 10)
    cache = engine.new_cache(128)
    _run(engine, cache, a)
    cpu_oom = RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory")
    with inject_fault("checkpoint_copy", exc=cpu_oom):
        outcome = cc.save_checkpoint(cache, a)
    assert isinstance(outcome, Skipped) and outcome.cause == "out_of_memory", outcome
    assert cc.stats()["skipped_by_reason"] == {"checkpoint:out_of_memory": 1}
    with inject_fault("checkpoint_copy", kind="device_error"), pytest.raises(RuntimeError, match="illegal memory"):
        cc.save_checkpoint(cache, a)
    assert cc.pool.used_bytes == 0 and not cc.checkpoints


def test_a_snapshot_larger_than_the_pool_is_refused_up_front(engine):
    small = ConversationCache(StagingPool(1, MiB), slots=4)
    a = _tokens(400, 11)
    cache = engine.new_cache(512)
    _run(engine, cache, a)
    outcome = small.park(cache, a)
    assert isinstance(outcome, Skipped) and "the whole pool is 1 MiB" in outcome.reason
    assert small.counters["evictions"] == 0


@pytest.mark.parametrize("pool_mib,slots,kept", [(32, 2, [1, 2]), (12, 4, [2])])
def test_eviction_by_slots_and_by_bytes(engine, pool_mib, slots, kept):
    """200 tokens park in about 7 MiB: 32 MiB holds four but two slots keep
    two; 12 MiB holds one, so each park evicts the one before."""
    cc = ConversationCache(StagingPool(pool_mib, MiB), slots=slots)
    cache = engine.new_cache(512)
    seqs = [_tokens(200, 20 + i) for i in range(3)]
    for s in seqs:
        cache.reset()
        _run(engine, cache, s)
        assert isinstance(cc.park(cache, s), Parked)
    assert [snap.tokens for snap in cc.snapshots] == [tuple(seqs[i]) for i in kept]
    assert cc.counters["evictions"] == 3 - len(kept)
    assert cc.pool.used_bytes == sum(cc.pool.pages_for(s.stored.nbytes) for s in cc.snapshots) * MiB


def test_checkpoints_never_evict_a_parked_conversation(engine):
    cc = ConversationCache(StagingPool(8, MiB), slots=4)
    cache = engine.new_cache(512)
    a = _tokens(200, 30)  # about 7 MiB parked
    _run(engine, cache, a)
    assert isinstance(cc.park(cache, a), Parked)
    cache.reset()
    b = _tokens(100, 31)
    _run(engine, cache, b)
    outcome = cc.save_checkpoint(cache, b)
    assert isinstance(outcome, Skipped) and "staging pool" in outcome.reason
    assert [s.tokens for s in cc.snapshots] == [tuple(a)]


@pytest.mark.parametrize("grown", [60, 1100])  # within the rings' reach of the base, and past it
def test_a_conversation_parked_again_keeps_its_older_snapshot_until_the_new_copy_is_in(engine, grown):
    """Issue 23, item 2. Parking a conversation that extends its older
    snapshot used to drop the older one first, so a failed copy lost both.
    Now the older one stays and becomes the base: a failed copy leaves it
    restorable; a successful one copies only what the base lacks, and a
    restore through the chain continues like a cold run."""
    cc = ConversationCache(StagingPool(128, MiB), slots=1)
    a = _tokens(300, 40)
    grown_tokens = a + _tokens(grown + 1, 41)[1:]
    cache = engine.new_cache(2048)
    _run(engine, cache, a)
    full = cc.park(cache, a)
    assert isinstance(full, Parked)
    _run(engine, cache, grown_tokens)
    with inject_fault("park_copy"):
        assert isinstance(cc.park(cache, grown_tokens), Skipped)
    assert [s.tokens for s in cc.snapshots] == [tuple(a)]  # the older state survived the failed copy

    delta = cc.park(cache, grown_tokens)
    assert isinstance(delta, Parked)
    head = cc.snapshots[-1]
    assert head.base is cc.snapshots[0] and cc.counters["evictions"] == 0  # one conversation, one slot
    assert delta.bytes < Parked(len(grown_tokens), full.bytes * len(grown_tokens) // len(a), 0).bytes
    for prompt in (grown_tokens + [7], a + [7]):  # the whole chain, and its base alone
        fresh = engine.new_cache(2048)
        outcome = cc.restore(fresh, [], prompt)
        assert outcome == Restored(len(prompt) - 1, "parked"), outcome
        warm = _run(engine, fresh, prompt)
        cold = _run(engine, engine.new_cache(2048), prompt)[len(prompt) - 1:]
        assert torch.allclose(warm, cold, atol=1e-4), float((warm - cold).abs().max())
    # Another conversation needs the slot: the whole chain goes, both members.
    b = _tokens(200, 42)
    other = engine.new_cache(1024)
    _run(engine, other, b)
    assert isinstance(cc.park(other, b), Parked)
    assert [s.tokens for s in cc.snapshots] == [tuple(b)] and cc.counters["evictions"] == 1
    assert cc.pool.used_bytes == cc.pool.pages_for(cc.snapshots[0].stored.nbytes) * MiB
