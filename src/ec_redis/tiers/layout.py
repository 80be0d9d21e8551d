"""Where an entry's bytes live in Redis: part sizes, and the chunk keys a head names.

An entry is a head key and, when its blob is larger than one part, chunk keys
``KeyBuilder.chunks(head, write_id, n)``: the head's header fixes ``write_id`` and, with the
head's own length, ``n``. Every write has its own ``write_id``, so two versions of an entry
never share a chunk key. The tier, its Lua scripts and the CLI all derive keys from here.
"""

from __future__ import annotations

import struct

from ec_redis.codec import read_header
from ec_redis.codec.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_PRODUCER_BYTES,
    PART_BYTES_AT,
    BlobHeader,
)
from ec_redis.errors import BlobError
from ec_redis.keys import KeyBuilder

# Chunks stay this much under chunk_bytes so a chunk plus Redis's string header fits in the
# allocator's size class (an exact 4 MiB value costs jemalloc a 5 MiB allocation).
ALLOCATOR_SLACK = 4096
MIN_PART_BYTES = 60 * 1024  # a forged header cannot make a reader fetch millions of keys
MAX_CHUNKS = 1 << 16  # 3.75 GiB at the smallest part size: more is a forged header
PROBE_BYTES = HEADER_SIZE + MAX_PRODUCER_BYTES  # a GETRANGE this long holds any header
MAGIC_VERSION = MAGIC + struct.pack("<H", FORMAT_VERSION)
_ANY_SIZE = 1 << 62  # other writers may allow larger entries than this process does


def part_size(chunk_bytes: int) -> int:
    """The size of the data parts for a ``chunk_bytes`` setting (see ``ALLOCATOR_SLACK``)."""
    return chunk_bytes - ALLOCATOR_SLACK if chunk_bytes > 2 * ALLOCATOR_SLACK else chunk_bytes


def chunk_count(header: BlobHeader, head_len: int) -> int:
    """How many chunk keys follow a head of ``head_len`` bytes (``BlobError`` when the header
    cannot describe such an entry, e.g. a forged tiny part size)."""
    if header.part_bytes < MIN_PART_BYTES:
        raise BlobError(f"blob is longer than its head but declares parts of {header.part_bytes}")
    rest = header.total_len - head_len
    if rest <= 0:
        raise BlobError("head is longer than the blob it declares")
    count = -(-rest // header.part_bytes)
    if count > MAX_CHUNKS:
        raise BlobError(f"blob declares {count} chunks; at most {MAX_CHUNKS} are followed")
    return count


def chunk_keys(head_key: str, header: BlobHeader, head_len: int) -> list[str]:
    """The chunk keys of the entry whose head (``head_len`` bytes) carries ``header``."""
    if head_len >= header.total_len:
        return []
    return KeyBuilder.chunks(head_key, header.write_id, chunk_count(header, head_len))


def named_chunks(head_key: str, prefix: bytes, head_len: int) -> list[str]:
    """The chunk keys a stored head names, from its first ``PROBE_BYTES`` bytes and its length;
    none for a one-value entry, a missing head, or one no reader would follow (foreign or
    forged data: its chunks, if any, cannot be named and expire or are evicted)."""
    try:
        return chunk_keys(head_key, read_header(prefix, max_blob_bytes=_ANY_SIZE), head_len)
    except BlobError:
        return []


def looks_chunked(prefix: bytes) -> bool:
    """Whether a head's first bytes declare a chunked blob of this format. The swap script
    makes the same byte test in Lua, so a writer and the script agree on which heads need
    their chunks retired."""
    field = prefix[PART_BYTES_AT : PART_BYTES_AT + 8]
    return prefix[:6] == MAGIC_VERSION and len(field) == 8 and field != bytes(8)


def replaced(head_key: str, prefix: bytes, head_len: int) -> tuple[bytes, list[str]]:
    """What a writer replacing the head it saw passes to the swap script: the head's first
    ``HEADER_SIZE`` bytes (``b""``: any head without chunks) and the chunk keys to retire."""
    if not looks_chunked(prefix):
        return b"", []
    return prefix[:HEADER_SIZE], named_chunks(head_key, prefix, head_len)
