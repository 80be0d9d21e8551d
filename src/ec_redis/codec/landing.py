"""A blob's payload checksum, computed while its bytes land (``tiers/bulk_read.py``).

Checking a read blob costs one pass over its bytes (xxh3-64: about 5 ms for 64 MiB here)
after the last byte arrived, on top of the read. A ``Landing`` instead hashes each stretch of
``STEP`` bytes as soon as it has landed in the buffer that will hold it, while the server
keeps sending the next ones into the socket's buffer: by the time the last byte is in, only
the tail is left to hash, and the bytes are hashed while they are still in the CPU's cache.

It computes exactly the digest ``decode_parts`` would: xxh3-64 of the payload (the bytes
after the header and producer info), over the same bytes, in order, in the buffer the tensor
will alias, which nothing writes once they have landed. The decoder takes the digest only
when the running hash covers exactly the range it checks (``digest``); anything else (a head
that is not a blob of this format, a chunk that did not arrive whole) gives ``None`` and the
decoder hashes the bytes itself, as before. The digest is compared with the header's
checksum like any other: a corrupt, truncated or foreign blob is rejected all the same.
"""

from __future__ import annotations

import struct

import xxhash

from ec_redis.codec.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_PRODUCER_BYTES,
    PRODUCER_LEN_AT,
)

STEP = 256 * 1024  # hash this much at a time: a stretch is still in cache when it is hashed
_MAGIC_VERSION = MAGIC + struct.pack("<H", FORMAT_VERSION)
_PRODUCER_LEN = struct.Struct("<H")

Buffer = bytes | memoryview


class Landing:
    """xxh3-64 of ``seed`` followed by ``buffer[start:]``, fed as the buffer's bytes land in
    order (``landed``). ``start`` ``None``: the buffer holds a whole blob and the payload
    starts after its header, read from the buffer once those bytes have landed."""

    def __init__(self, buffer: memoryview, start: int | None = None, seed: Buffer = b"") -> None:
        self._buffer = buffer
        self._start = start
        self._done = start or 0
        self._hasher = xxhash.xxh3_64(seed)
        self._given_up = False
        self._seen = 0  # bytes [0, _seen) have landed

    def landed(self, count: int, since: int | None = None) -> None:
        """Bytes ``[0, count)`` of the buffer now hold what was received, and nothing writes
        them again; ``since``: only ``[since, count)`` landed just now (a stretch after a
        gap, say a chunk skipped, ends the running hash: ``digest`` is then ``None``)."""
        if since is not None and since > self._seen:
            self._given_up = True
        self._seen = max(self._seen, count)
        if self._given_up:
            return
        if self._start is None:
            if count < HEADER_SIZE:
                return
            self._start = payload_start(self._buffer)
            if self._start is None:
                self._given_up = True
                return
            self._done = self._start
        if count - self._done >= STEP:
            self._hasher.update(self._buffer[self._done : count])
            self._done = count

    def digest(self, start: int, end: int) -> int | None:
        """The digest of ``seed`` + ``buffer[start:end]`` (hashing what is left of it), or
        ``None`` when this running hash did not start at ``start`` or went past ``end``.
        Call it once every byte up to ``end`` has landed; once only."""
        if self._given_up or self._start != start or not start <= self._done <= end:
            return None
        if end > len(self._buffer):
            return None
        self._given_up = True  # a second call would hash the tail twice
        self._hasher.update(self._buffer[self._done : end])
        return self._hasher.intdigest()


def payload_start(blob: Buffer) -> int | None:
    """Where the payload of the blob starting ``blob`` begins (after the header and producer
    info), from its first ``HEADER_SIZE`` bytes; ``None`` if they are not this format's.
    Nothing else is checked here: ``read_header`` validates the header as it always does."""
    if len(blob) < HEADER_SIZE or bytes(blob[:6]) != _MAGIC_VERSION:
        return None
    (producer_len,) = _PRODUCER_LEN.unpack_from(blob, PRODUCER_LEN_AT)
    if producer_len > MAX_PRODUCER_BYTES:
        return None
    return HEADER_SIZE + int(producer_len)
