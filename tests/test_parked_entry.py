"""The parked-entry header (``parked_entry``): what is written reads back
the same, and a header with any byte changed, cut short, of another model or
of another format version is rejected, never read as an entry."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_runtime.conversations import parked_entry as entry
from strata_runtime.conversations.parked_entry import COMMITTED, EntryMeta, EntryRejected

FINGERPRINT = "f" * 64


@st.composite
def metas(draw):
    n_parts = draw(st.integers(0, 6))
    parts, offset = [], 0
    for layer in range(n_parts):
        first = draw(st.integers(0, 100))
        end = first + draw(st.integers(0, 50))
        parts.append((layer, draw(st.sampled_from(["k", "v", "k_scales", "conv", "state"])), first, end, offset))
        offset += (end - first) * 64
    return EntryMeta(kind=draw(st.sampled_from(entry.KINDS)), id=draw(st.text("0123456789abcdef", min_size=1,
                                                                             max_size=32)),
                     tokens=tuple(draw(st.lists(st.integers(0, 2**31 - 1), max_size=300))), parts=tuple(parts),
                     payload_bytes=offset, fingerprint=FINGERPRINT, scope=draw(st.text(max_size=40)),
                     base=draw(st.none() | st.text("0123456789abcdef", min_size=1, max_size=32)),
                     root=draw(st.booleans()), created=draw(st.floats(0, 2e9)))


def _header(meta, pages=(3, 9, 4)):
    return entry.encode_header(meta, pages, payload_hash=12345, state=COMMITTED)


@settings(max_examples=150, deadline=None)
@given(metas(), st.lists(st.integers(0, 2**20), max_size=8, unique=True))
def test_a_header_reads_back_as_written(meta, pages):
    prefix, back, back_pages = entry.parse_header(_header(meta, pages), FINGERPRINT)
    assert back == meta and back_pages == tuple(pages)
    assert prefix.payload_hash == 12345 and prefix.committed and prefix.header_bytes % 64 == 0


@settings(max_examples=300, deadline=None)
@given(metas(), st.data())
def test_any_changed_byte_is_rejected(meta, data):
    raw = bytearray(_header(meta))
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    if at < 8:  # the magic: not an entry at all (a free page), which loads nothing either
        assert entry.parse_prefix(bytes(raw)) is None
        return
    with pytest.raises(EntryRejected):
        entry.parse_header(bytes(raw), FINGERPRINT)


@settings(max_examples=150, deadline=None)
@given(metas(), st.data())
def test_a_header_cut_short_is_rejected(meta, data):
    raw = _header(meta)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(EntryRejected):
        entry.parse_header(raw[:cut], FINGERPRINT) if cut >= 8 else _no_entry(raw[:cut])


def _no_entry(raw):
    assert entry.parse_prefix(raw) is None
    raise EntryRejected("truncated", "no prefix")


def test_uncommitted_other_model_and_other_version_are_rejected_by_cause():
    meta = EntryMeta("snapshot", "a1", (1, 2, 3), ((0, "k", 0, 3, 0),), 192, FINGERPRINT)
    with pytest.raises(EntryRejected) as caught:
        entry.parse_header(entry.encode_header(meta, (0,), 1), FINGERPRINT)  # state WRITING
    assert caught.value.cause == "cut_off"
    with pytest.raises(EntryRejected) as caught:
        entry.parse_header(_header(meta), "0" * 64)
    assert caught.value.cause == "other_model"
    raw = bytearray(_header(meta))
    raw[8:12] = struct.pack("<I", entry.FORMAT_VERSION + 1)
    with pytest.raises(EntryRejected) as caught:
        entry.parse_header(bytes(raw), FINGERPRINT)
    assert caught.value.cause == "version"


def test_pages_needed_holds_the_header_and_its_own_page_list():
    meta = EntryMeta("snapshot", "a1", tuple(range(5000)), ((0, "k", 0, 5000, 0),), 5000 * 4096, FINGERPRINT)
    for page_bytes in (4096, 65536, 2 << 20):
        n = entry.pages_needed(meta, page_bytes)
        assert (n - 1) * page_bytes < entry.header_bytes(meta, n) + meta.payload_bytes <= n * page_bytes
