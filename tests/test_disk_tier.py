"""The conversation cache's disk tier (issue 26): files written through from
the staging pool, an index rebuilt from them at start, and every file that
is cut short, corrupted, swapped, of another model or of another format
version rejected and removed, never loaded.

The property tests drive ``DiskTier`` with synthetic entries (random
payloads in a real pool); the engine tests park real conversations of
Gemma 3 and bring them back in a new engine, as a server restart does.
"""

from __future__ import annotations

import os
import stat
import struct
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strata_runtime
from strata_runtime.conversations import parked_entry as entry
from strata_runtime.conversations.disk_tier import SUFFIX, DiskTier
from strata_runtime.conversations.memory import MiB
from strata_runtime.conversations.parked_entry import EntryMeta, EntryRejected
from strata_runtime.conversations.staging import StagingPool
from strata_runtime.testing import inject_fault

FP = "e" * 64
PAGE = 4096


def _entry(pool: StagingPool, tier: DiskTier, name: str, payload: bytes, scope: str = "s") -> EntryMeta:
    """Put ``payload`` in the pool as a committed entry and spill it; its meta."""
    meta = EntryMeta("snapshot", name, tuple(range(len(payload) // 64)), ((0, "k", 0, len(payload) // 64, 0),),
                     len(payload), FP, scope=scope)
    header = entry.header_bytes(meta, entry.pages_needed(meta, PAGE))
    lease = pool.lease(header + len(payload))
    lease.write(header, payload)
    digest = entry.payload_hash(v.numpy() for v in lease.byte_views(header, len(payload)))
    assert tier.spill(meta, lease, header, digest) is not None
    return meta


def _read_back(pool: StagingPool, tier: DiskTier, entry_id: str) -> bytes:
    found = tier.entries[entry_id]
    meta = found.meta
    header = entry.header_bytes(meta, entry.pages_needed(meta, PAGE))
    lease = pool.lease(header + meta.payload_bytes)
    try:
        tier.read_into(found, lease, header)
        return lease.read(header, meta.payload_bytes)
    finally:
        pool.release(lease)


PAYLOADS = [bytes(range(256)) * 20, os.urandom(64 * 97), b"\x07" * (64 * 40)]


@pytest.fixture
def written(tmp_path):
    directory = tmp_path / "cache"
    pool = StagingPool(64, PAGE)
    tier = DiskTier(directory, 1 * MiB, FP)
    metas = [_entry(pool, tier, f"id{i}", p) for i, p in enumerate(PAYLOADS)]
    assert tier.flush(10)
    tier.close()
    return directory, metas


def test_files_are_private_complete_and_read_back(written):
    directory, metas = written
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / FP).stat().st_mode) == 0o700
    for meta in metas:
        path = directory / FP / (meta.id + SUFFIX)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not list(directory.glob("*/*.tmp"))
    pool = StagingPool(64, PAGE)
    tier = DiskTier(directory, 1 * MiB, FP)
    assert sorted(tier.entries) == ["id0", "id1", "id2"]
    for meta, payload in zip(metas, PAYLOADS):
        assert _read_back(pool, tier, meta.id) == payload
    assert tier.counters["disk_reads"] == 3


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_damaged_files_are_always_rejected_and_removed(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("damaged")
    pool = StagingPool(64, PAGE)
    tier = DiskTier(directory, 1 * MiB, FP)
    metas = [_entry(pool, tier, f"id{i}", p) for i, p in enumerate(PAYLOADS)]
    assert tier.flush(10)
    tier.close()
    paths = [directory / FP / (m.id + SUFFIX) for m in metas]
    damage = data.draw(st.sampled_from(["flip", "truncate", "swap", "version", "append"]))
    victim = data.draw(st.integers(0, len(paths) - 1))
    raw = bytearray(paths[victim].read_bytes())
    damaged = {victim}
    if damage == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
        paths[victim].write_bytes(raw)
    elif damage == "truncate":
        paths[victim].write_bytes(raw[:data.draw(st.integers(0, len(raw) - 1))])
    elif damage == "append":
        paths[victim].write_bytes(raw + b"\0" * data.draw(st.integers(1, 100)))
    elif damage == "version":
        raw[8:12] = struct.pack("<I", entry.FORMAT_VERSION + 1)
        paths[victim].write_bytes(raw)
    else:  # two files swapped: each holds the other's entry under its name
        other = (victim + 1) % len(paths)
        a, b = paths[victim].read_bytes(), paths[other].read_bytes()
        paths[victim].write_bytes(b)
        paths[other].write_bytes(a)
        damaged.add(other)
    fresh = DiskTier(directory, 1 * MiB, FP)
    try:
        for i, meta in enumerate(metas):
            if i not in damaged:
                assert _read_back(pool, fresh, meta.id) == PAYLOADS[i]
                continue
            if meta.id in fresh.entries:  # its header held: the payload's hash must not
                with pytest.raises(EntryRejected):
                    _read_back(pool, fresh, meta.id)
            assert meta.id not in fresh.entries and not paths[i].exists()
        assert sum(fresh.rejected.values()) == len(damaged)
    finally:
        fresh.close()


def test_another_model_leaves_the_files_alone_and_leftover_temporary_files_are_removed(written):
    directory, metas = written
    (directory / FP / "half.tmp").write_bytes(b"cut off")
    other = DiskTier(directory, 1 * MiB, "0" * 64)
    assert other.entries == {} and other.rejected == {} and len(other.foreign) == 3
    other.close()
    assert len(list((directory / FP).glob("*" + SUFFIX))) == 3  # left for their model
    again = DiskTier(directory, 1 * MiB, FP)
    assert sorted(again.entries) == ["id0", "id1", "id2"] and again.rejected == {"cut_off": 1}
    assert not (directory / FP / "half.tmp").exists()
    again.close()


def test_a_full_disk_skips_the_spill_and_the_budget_evicts_the_oldest(tmp_path):
    pool = StagingPool(64, PAGE)
    tier = DiskTier(tmp_path / "d", 2 * len(PAYLOADS[0]) + 4096, FP)
    with inject_fault("disk_write", exc=OSError(28, "No space left on device")):
        _entry(pool, tier, "full", PAYLOADS[0])
        assert tier.flush(10)
    assert tier.skipped == {"spill:no_space": 1} and tier.entries == {}
    for i in range(3):
        _entry(pool, tier, f"e{i}", PAYLOADS[0])
        assert tier.flush(10)
    assert sorted(tier.entries) == ["e1", "e2"] and tier.counters["disk_evictions"] == 1
    assert not (tmp_path / "d" / FP / ("e0" + SUFFIX)).exists()
    tier.close()


def test_a_slow_disk_skips_spills_instead_of_queueing_them_all(tmp_path, monkeypatch):
    import strata_runtime.testing as testing

    monkeypatch.setattr(testing, "SLOW_SECONDS", 0.5)
    pool = StagingPool(64, PAGE)
    tier = DiskTier(tmp_path / "d", 1 * MiB, FP, max_queued=2)
    with inject_fault("disk_write", kind="slow"):
        spilled = [tier.spill(*_spill_args(pool, "s0"))]
        while tier._queue.qsize():  # the writer has taken the first (and sleeps in its write)
            time.sleep(0.01)
        spilled += [tier.spill(*_spill_args(pool, f"s{i}")) for i in range(1, 5)]
        assert tier.flush(30)
    # The first is being written while two wait: the last two find the queue full and are skipped.
    assert [s is not None for s in spilled] == [True, True, True, False, False]
    assert tier.skipped == {"spill:disk_slow": 2} and sorted(tier.entries) == ["s0", "s1", "s2"]
    tier.close()


def _spill_args(pool, name):
    payload = PAYLOADS[0]
    meta = EntryMeta("snapshot", name, (1, 2), ((0, "k", 0, len(payload) // 64, 0),), len(payload), FP)
    header = entry.header_bytes(meta, entry.pages_needed(meta, PAGE))
    lease = pool.lease(header + len(payload))
    lease.write(header, payload)
    return meta, lease, header, entry.payload_hash(v.numpy() for v in lease.byte_views(header, len(payload)))


# --- with a real model ---------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
QUESTIONS = ["Name a river in Europe and say where it flows.", "What is a prime number? Give an example."]
OPTIONS = dict(parallel=1, dtype="float32", progress=False, context_length=512, conversation_cache_mib=32,
               min_free_mib=0)


def _first(question):
    return [SYSTEM, {"role": "user", "content": question}]


def _second(question, answer):
    return _first(question) + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say more."}]


@pytest.fixture(scope="module")
def cold(model_file):
    """The tokens a cold engine (no conversation cache) answers, loaded once for the module."""
    engine = strata_runtime.load(model_file, **{**OPTIONS, "conversation_cache_mib": 0})
    return lambda messages: engine.chat(messages, max_tokens=8, temperature=0).tokens


def _engine_that_parked(model_file, directory: Path, **options):
    engine = strata_runtime.load(model_file, conversation_cache_dir=str(directory), **{**OPTIONS, **options})
    answers = [engine.chat(_first(q), max_tokens=8, temperature=0).text for q in QUESTIONS]
    assert engine.persist(timeout=30)  # as a server stopping does: residents parked, files written
    return engine, answers


def test_a_new_engine_restores_conversations_from_disk(model_file, tmp_path, cold):
    directory = tmp_path / "conversations"
    first, answers = _engine_that_parked(model_file, directory)
    assert first.stats()["disk_spills"] == 2 and len(list(directory.glob("*/*" + SUFFIX))) == 2
    first.close()  # lets go of the directory, as a stopped server does
    second = strata_runtime.load(model_file, conversation_cache_dir=str(directory), **OPTIONS)
    assert second.stats()["disk_entries"] == 2 and second.stats()["parked_now"] == 0
    for question, answer in zip(QUESTIONS, answers):
        warm = second.chat(_second(question, answer), max_tokens=8, temperature=0)
        assert warm.cached_tokens > 20
        assert warm.tokens == cold(_second(question, answer))
    stats = second.stats()
    assert stats["restored_from_disk"] == 2 and stats["disk_reads"] == 2 and stats["disk_read_bytes"] > 0


def test_a_corrupt_file_is_rejected_and_the_request_served_cold(model_file, tmp_path, cold):
    directory = tmp_path / "conversations"
    first, answers = _engine_that_parked(model_file, directory)
    first.close()
    for path in directory.glob("*/*" + SUFFIX):  # a byte of every payload flipped: headers hold, payloads do not
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0x01
        path.write_bytes(raw)
    second = strata_runtime.load(model_file, conversation_cache_dir=str(directory), **OPTIONS)
    warm = second.chat(_second(QUESTIONS[0], answers[0]), max_tokens=8, temperature=0)
    assert warm.tokens == cold(_second(QUESTIONS[0], answers[0]))
    stats = second.stats()
    assert stats["rejected_by_reason"].get("corrupt", 0) >= 1 and stats.get("restored_from_disk", 0) == 0
    assert stats["skipped_by_reason"].get("disk_read:disk_corrupt", 0) >= 1


def test_another_kv_format_leaves_every_file_for_its_own(model_file, tmp_path):
    directory = tmp_path / "conversations"
    first, _ = _engine_that_parked(model_file, directory)
    first.close()
    other = strata_runtime.load(model_file, conversation_cache_dir=str(directory), **{**OPTIONS, "kv": "int8"})
    stats = other.stats()
    assert stats["rejected_by_reason"] == {} and stats["disk_entries"] == 0 and stats["disk_foreign_entries"] == 2
    other.close()
    assert len(list(directory.glob("*/*" + SUFFIX))) == 2


@pytest.mark.parametrize("point", ["disk_write", "disk_read"])
def test_faults_at_the_disk_points_skip_and_the_request_is_served(model_file, tmp_path, point, cold):
    directory = tmp_path / "conversations"
    with inject_fault(point) as fault:  # out of memory (the default kind) on every call
        first, answers = _engine_that_parked(model_file, directory)
        if point == "disk_read":
            first.close()
            first = strata_runtime.load(model_file, conversation_cache_dir=str(directory), **OPTIONS)
        warm = first.chat(_second(QUESTIONS[0], answers[0]), max_tokens=8, temperature=0)
    assert fault.fired > 0
    assert warm.tokens == cold(_second(QUESTIONS[0], answers[0]))
    stats = first.stats()
    if point == "disk_write":
        assert stats["skipped_by_reason"]["spill:write_error"] == 2 and stats["disk_entries"] == 0
    else:
        assert stats["skipped_by_reason"]["disk_read:disk_read_failed"] >= 1
        assert stats["disk_entries"] == 2  # not the files' fault: kept


def test_two_conversations_alternating_through_a_pool_that_holds_one_keep_every_turn(model_file, tmp_path):
    """Issue 38's scenario in one process: each conversation's snapshot takes
    most of the pool, so every turn parks one and reads the other back from
    disk (waiting for the writer where it still holds the pages). Each turn
    adds a small snapshot on top (a whole page each): when a conversation's
    own chain leaves no room, and all of it is on disk, it is parked whole in
    its place. Every returning turn restores all of the turn before it."""
    engine = strata_runtime.load(model_file, conversation_cache_dir=str(tmp_path / "c"),
                                 **{**OPTIONS, "context_length": 1024})
    history = {name: [{"role": "system", "content": f"You are {name}. " + " ".join(
        f"Rule {i} of {name}: answer question {i} in one short sentence." for i in range(40))}] for name in "AB"}
    previous = {}
    for turn in range(6):
        for name, messages in history.items():
            messages.append({"role": "user", "content": f"Question {turn}?"})
            out = engine.chat(messages, max_tokens=4, temperature=0)
            messages.append({"role": "assistant", "content": out.text})
            if turn:
                assert out.cached_tokens >= previous[name], (name, turn, out.cached_tokens, previous[name])
            previous[name] = out.prompt_tokens
    stats = engine.stats()
    assert stats["chains_consolidated"] >= 1 and stats.get("park_skipped", 0) == 0, stats
    assert stats["restored_from_disk"] >= 8 and stats["spill_skipped"] == 0
    engine.close()
