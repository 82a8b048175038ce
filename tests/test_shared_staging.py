"""The staging pool in a shared segment outlives the engine (issue 26): an
engine started on the segment a dead one used takes back every committed
entry of its model whose hashes hold, and discards the rest by cause.

Engines here run in this process, one after the other, on one segment: what
a server does across engine processes (``test_persistent_conversations.py``
kills real ones).
"""

from __future__ import annotations

import os
import stat

import pytest

import strata_runtime
from strata_runtime.conversations import parked_entry as entry
from strata_runtime.conversations.memory import MiB
from strata_runtime.conversations.staging_segment import StagingSegment

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
QUESTIONS = ["Name a river in Europe and say where it flows.", "What is a prime number? Give an example."]
OPTIONS = dict(parallel=1, dtype="float32", progress=False, context_length=512, conversation_cache_mib=32,
               min_free_mib=0)


def _turn(question, answer=None):
    messages = [SYSTEM, {"role": "user", "content": question}]
    if answer is not None:
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say more."}]
    return messages


@pytest.fixture
def segment():
    seg, decision = StagingSegment.reserve(32 * MiB, min_free_bytes=0)
    assert not seg.refused, decision.message
    yield seg
    seg.close()


def _park_two(model_file, segment, **options):
    """An engine that answers two conversations and parks both (the second
    evicts the first from the device, the third prompt the second)."""
    engine = strata_runtime.load(model_file, staging=segment, **{**OPTIONS, **options})
    answers = [engine.chat(_turn(q), max_tokens=8, temperature=0).text for q in QUESTIONS]
    engine.chat([{"role": "user", "content": "Hello."}], max_tokens=2, temperature=0)
    assert engine.stats()["parked_now"] == 2, engine.stats()
    return engine, answers


def test_the_segment_is_private_and_allocated(segment):
    mode = os.fstat(segment.fd).st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert os.fstat(segment.fd).st_blocks * 512 >= segment.nbytes  # every page allocated at start
    assert os.readlink(f"/proc/self/fd/{segment.fd}").startswith(f"/memfd:strata-staging-{os.getpid()}")


def test_a_new_engine_takes_back_what_the_last_one_parked(model_file, segment):
    first, answers = _park_two(model_file, segment)
    fingerprint = first.conversations.fingerprint
    del first
    second = strata_runtime.load(model_file, staging=segment, **OPTIONS)
    assert second.conversations.fingerprint == fingerprint
    assert second.recovered["conversations"] == 2 and second.recovered["rejected"] == {}
    assert second.stats()["recovered_snapshots"] == 2
    cold = strata_runtime.load(model_file, **{**OPTIONS, "conversation_cache_mib": 0})
    for question, answer in zip(QUESTIONS, answers):
        warm = second.chat(_turn(question, answer), max_tokens=8, temperature=0)
        assert warm.cached_tokens > 20  # restored from the entry the dead engine left
        assert warm.tokens == cold.chat(_turn(question, answer), max_tokens=8, temperature=0).tokens
    assert second.stats()["restored"] == 2


def test_cut_off_and_corrupt_entries_are_discarded_and_counted(model_file, segment):
    first, _ = _park_two(model_file, segment)
    cut, flipped = (snap.stored.lease.pages[0] for snap in first.conversations.snapshots)
    checkpoints = len(first.conversations.checkpoints)
    del first
    buf = segment.map()
    # One entry as a crash in the middle of its copy leaves it: header written, never committed.
    buf[cut * segment.page_bytes + entry.STATE_OFFSET:cut * segment.page_bytes + entry.STATE_OFFSET + 4].zero_()
    # One with a byte of its payload flipped (the header says where the payload starts).
    at = flipped * segment.page_bytes
    header = entry.parse_prefix(buf[at:at + entry.PREFIX_BYTES].numpy().tobytes()).header_bytes
    buf[at + header + 100] ^= 0x40
    second = strata_runtime.load(model_file, staging=segment, **OPTIONS)
    assert second.recovered["rejected"] == {"cut_off": 1, "corrupt": 1}
    assert second.recovered["snapshots"] == 0 and second.recovered["checkpoints"] == checkpoints
    assert second.stats()["rejected_by_reason"] == {"cut_off": 1, "corrupt": 1}
    # Discarded means gone: a third engine finds nothing to count again, and every page is free.
    del second
    third = strata_runtime.load(model_file, staging=segment, **OPTIONS)
    assert third.recovered["rejected"] == {} and third.recovered["snapshots"] == 0


def test_another_kv_format_rejects_every_entry(model_file, segment):
    first, _ = _park_two(model_file, segment)
    other = strata_runtime.load(model_file, staging=segment, **{**OPTIONS, "kv": "int8"})
    assert other.recovered["rejected"] == {"other_model": 2 + len(first.conversations.checkpoints)}
    assert other.recovered["snapshots"] == 0
    assert other.conversations.pool.used_bytes == 0


def test_a_refused_segment_leaves_a_cache_that_skips_and_names_the_refusal(model_file):
    segment, decision = StagingSegment.reserve(32 * MiB, min_free_bytes=1 << 60)  # more than any host has free
    assert segment.refused and "shrunk to fit: 0 MiB" in decision.message
    engine = strata_runtime.load(model_file, staging=StagingSegment.attach(segment.describe()), **OPTIONS)
    for question in QUESTIONS:
        engine.chat(_turn(question), max_tokens=2, temperature=0)
    stats = engine.stats()
    assert stats["skipped_by_reason"]["park:no_pool"] >= 1 and stats["parked_now"] == 0
    assert "shrunk to fit" in stats["pool_decision"]
