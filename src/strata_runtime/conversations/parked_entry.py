"""The bytes of one parked entry (a snapshot or a checkpoint), as it lies in
the staging pool and in a file of the disk tier: a self-describing header,
then the payload (the copied KV and recurrent state).

Layout (little-endian)::

    prefix    56 bytes: magic, format version, state, header bytes, page count,
              meta bytes, token count, payload bytes, payload hash, header hash
    pages     u32 per page of the entry's lease (in the pool; none in a file)
    meta      JSON: kind, id, base id, scope digest, root, model fingerprint,
              parts (layer, field, first position, end position, payload offset),
              creation time
    tokens    i32 per token of the conversation (whose state the payload holds)
    padding   to a multiple of 64 bytes; the payload starts there

``state`` is written last: ``COMMITTED`` only once every byte above and the
payload are in place, and cleared first when the entry is dropped. A reader
trusts an entry only when it is committed, its format version is this one,
both hashes hold and its fingerprint is the model's: a copy cut off by a
crash, a flipped byte, a truncated file or another model's state is
rejected (``EntryRejected``, with a cause counters group by), never loaded.
Hashes are xxh3-64 (``xxhash``), about 10 GB/s on one core here.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import xxhash

MAGIC = b"STRATAPK"
FORMAT_VERSION = 1
WRITING, COMMITTED = 0, 0x544D4D43  # "CMMT": a value random bytes are unlikely to hold
_PREFIX = struct.Struct("<8sIIIIIIQQQ")
PREFIX_BYTES = _PREFIX.size  # 56
STATE_OFFSET = 12  # where ``state`` lies in the prefix
_ALIGN = 64
KINDS = ("snapshot", "checkpoint")

# Why an entry was not taken back, as counted (``recovered`` / ``rejected_by_reason``).
REJECT_CAUSES = {
    "cut_off": "its copy was not finished (the engine died while writing it)",
    "corrupt": "a hash does not hold, or the header does not parse",
    "truncated": "the file is shorter than its header says",
    "version": "written by another version of the entry format",
    "other_model": "written for another model, KV format, backend or split",
    "orphan": "the snapshot it extends was not taken back",
    "overlap": "its pages are claimed by another entry",
    "unreadable": "the file could not be read",
    "not_a_file": "a directory, FIFO, device or symlink where a file of the disk tier should be (left alone)",
    "changed": "the file no longer holds what was indexed (replaced since the index was built)",
}

# (layer, field name, first position, end position, byte offset in the payload)
Part = tuple[int, str, int, int, int]


class EntryRejected(Exception):
    """An entry that must not be loaded; ``cause`` is a key of ``REJECT_CAUSES``."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class EntryMeta:
    """What an entry holds, apart from its bytes' place.

    Invariant: ``parts`` tile ``0..payload_bytes`` in order; ``base`` is the
    id of the snapshot this one extends (None: it stands alone)."""

    kind: str
    id: str
    tokens: tuple[int, ...]
    parts: tuple[Part, ...]
    payload_bytes: int
    fingerprint: str
    scope: str = ""  # the digest of the request scope (``scope_digest``), never the scope itself
    base: str | None = None
    root: bool = False
    created: float = 0.0
    owner: str = ""  # the digest of the scope's owner (``owner_digest``): who may see it listed

    def _json(self) -> bytes:
        return json.dumps({"kind": self.kind, "id": self.id, "base": self.base, "scope": self.scope,
                           "root": self.root, "fingerprint": self.fingerprint, "created": self.created,
                           "owner": self.owner, "parts": [list(p) for p in self.parts]},
                          separators=(",", ":")).encode()


@dataclass(frozen=True)
class Prefix:
    """The fixed-size start of a header (parsed, not yet trusted)."""

    state: int
    header_bytes: int
    n_pages: int
    meta_bytes: int
    n_tokens: int
    payload_bytes: int
    payload_hash: int
    header_hash: int

    @property
    def committed(self) -> bool:
        return self.state == COMMITTED


def scope_digest(scope: str) -> str:
    """What an entry records of a request's scope: enough to compare, nothing to read back."""
    return hashlib.sha256(scope.encode()).hexdigest()[:32]


def owner_digest(scope: str) -> str:
    """The digest of a scope's owner. A scope is ``OWNER[/SALT]`` (a server:
    the API key's scope, then the request's ``cache_salt``): state of any
    salt is listed to its owner (``/slots``), and restored only for its whole scope."""
    return scope_digest(scope.partition("/")[0])


def header_bytes(meta: EntryMeta, n_pages: int) -> int:
    raw = PREFIX_BYTES + 4 * n_pages + len(meta._json()) + 4 * len(meta.tokens)
    return -(-raw // _ALIGN) * _ALIGN


def pages_needed(meta: EntryMeta, page_bytes: int) -> int:
    """Pages of ``page_bytes`` that hold ``meta``'s entry with its own page list."""
    n = -(-(header_bytes(meta, 0) + meta.payload_bytes) // page_bytes)
    while -(-(header_bytes(meta, n) + meta.payload_bytes) // page_bytes) > n:
        n += 1
    return n


def encode_header(meta: EntryMeta, pages: Sequence[int] = (), payload_hash: int = 0, state: int = WRITING) -> bytes:
    """The header of ``meta``'s entry whose lease is ``pages`` (none: a file)."""
    body = struct.pack(f"<{len(pages)}I", *pages) + meta._json()
    tokens = struct.pack(f"<{len(meta.tokens)}i", *meta.tokens)
    size = header_bytes(meta, len(pages))
    rest = body + tokens
    rest += bytes(size - PREFIX_BYTES - len(rest))
    unhashed = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, size, len(pages), len(meta._json()), len(meta.tokens),
                            meta.payload_bytes, payload_hash, 0)
    digest = xxhash.xxh3_64_intdigest(unhashed + rest)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, state, size, len(pages), len(meta._json()), len(meta.tokens),
                        meta.payload_bytes, payload_hash, digest) + rest


def commit_flag() -> bytes:
    return struct.pack("<I", COMMITTED)


def cleared_flag() -> bytes:
    """Written over ``magic`` and ``state`` of a dropped entry: no reader takes it for one."""
    return bytes(STATE_OFFSET + 4)


def parse_prefix(data: bytes) -> Prefix | None:
    """The prefix at the start of ``data``; None where no entry starts there
    (no magic: a free page, or a page inside another entry). Raises
    ``EntryRejected`` for an entry of another format version."""
    if len(data) < PREFIX_BYTES or data[:8] != MAGIC:
        return None
    magic, version, *fields = _PREFIX.unpack_from(data)
    if version != FORMAT_VERSION:
        raise EntryRejected("version", f"entry format version {version}, this build reads {FORMAT_VERSION}")
    prefix = Prefix(*fields)
    low = PREFIX_BYTES + 4 * prefix.n_pages + prefix.meta_bytes + 4 * prefix.n_tokens
    if not (low <= prefix.header_bytes <= low + _ALIGN) or prefix.header_bytes % _ALIGN:
        raise EntryRejected("corrupt", f"header sizes do not add up ({prefix.header_bytes} bytes for {low})")
    return prefix


def parse_header(data: bytes, fingerprint: str) -> tuple[Prefix, EntryMeta, tuple[int, ...]]:
    """(prefix, meta, lease pages) of the complete header ``data`` (its
    ``header_bytes``), checked: committed, hashed right, of this model."""
    prefix = parse_prefix(data)
    if prefix is None:
        raise EntryRejected("corrupt", "no entry magic")
    if len(data) < prefix.header_bytes:
        raise EntryRejected("truncated", f"header of {prefix.header_bytes} bytes, {len(data)} present")
    data = data[:prefix.header_bytes]
    unhashed = data[:STATE_OFFSET] + bytes(4) + data[STATE_OFFSET + 4:PREFIX_BYTES - 8] + bytes(8) + data[PREFIX_BYTES:]
    if xxhash.xxh3_64_intdigest(unhashed) != prefix.header_hash:
        raise EntryRejected("corrupt", "the header's hash does not hold")
    if not prefix.committed:
        raise EntryRejected("cut_off", "the entry was never committed (its copy was cut off)")
    at = PREFIX_BYTES
    pages = struct.unpack_from(f"<{prefix.n_pages}I", data, at)
    at += 4 * prefix.n_pages
    try:
        raw = json.loads(data[at:at + prefix.meta_bytes])
        at += prefix.meta_bytes
        tokens = struct.unpack_from(f"<{prefix.n_tokens}i", data, at)
        meta = EntryMeta(kind=raw["kind"], id=str(raw["id"]), tokens=tuple(tokens),
                         parts=tuple((int(a), str(b), int(c), int(d), int(e)) for a, b, c, d, e in raw["parts"]),
                         payload_bytes=prefix.payload_bytes, fingerprint=str(raw["fingerprint"]),
                         scope=str(raw["scope"]), base=None if raw["base"] is None else str(raw["base"]),
                         root=bool(raw["root"]), created=float(raw["created"]), owner=str(raw.get("owner", "")))
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise EntryRejected("corrupt", f"the header's metadata does not parse ({e})") from None
    if meta.fingerprint != fingerprint:
        raise EntryRejected("other_model", "written for another model, KV format, backend or split")
    if meta.kind not in KINDS or not _tiles(meta.parts, meta.payload_bytes):
        raise EntryRejected("corrupt", "the header's parts do not tile its payload")
    return prefix, meta, pages


def _tiles(parts: Sequence[Part], payload_bytes: int) -> bool:
    """Offsets start at 0, rise and stay inside the payload (the exact sizes
    need the model's row sizes: the cache checks them against its stores)."""
    offsets = [p[4] for p in parts]
    return (all(p[2] <= p[3] for p in parts) and offsets == sorted(offsets)
            and all(0 <= o <= payload_bytes for o in offsets) and (not parts or offsets[0] == 0))


def payload_hash(views: Iterable) -> int:
    """xxh3-64 of the payload, given as buffers in order (a lease's page views)."""
    h = xxhash.xxh3_64()
    for view in views:
        h.update(view)
    return h.intdigest()
