"""Writing and deleting one versioned entry: keys under a grace TTL, then compare-and-swap.

A write stores its chunks and its head value under new keys named by its write id, with the
grace TTL, and in the same round trip reads the head it is about to replace; the swap script
then renames the pending head onto the head key in one step if that head is still current
(else it returns the newer head and the write tries again against it). Deletes compare the
same way, so nobody ever deletes a version written after the one they looked at.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import redis

from ec_redis.codec.format import HEADER_SIZE
from ec_redis.keys import KeyBuilder
from ec_redis.tiers.layout import PROBE_BYTES, named_chunks, replaced
from ec_redis.tiers.scripts import DELETE, DELETED, INCOMPLETE, SWAP, SWAPPED

ATTEMPTS = 4  # compare-and-swap rounds while other writers keep switching the entry
STORED, CONFLICT, INCOMPLETE_WRITE = "stored", "conflict", "incomplete"


def write_entry(
    client: Any,
    head_key: str,
    parts: Sequence[Any],
    write_id: int,
    ttl_ms: int | None,
    grace_ms: int,
) -> str:
    """Store ``parts`` (head first) as the entry's new current version: ``STORED``;
    ``INCOMPLETE_WRITE`` when a key of the write vanished before the switch (evicted, or older
    than the grace); ``CONFLICT`` when other writers switched the entry ``ATTEMPTS`` times in a
    row. Redis errors raise; whatever the outcome, no key this call wrote outlives the grace
    TTL unless the head names it."""
    pending = KeyBuilder.pending(head_key, write_id)
    new_chunks = KeyBuilder.chunks(head_key, write_id, len(parts) - 1)
    written = [pending, *new_chunks]
    pipe = client.pipeline(transaction=False)
    for key, part in zip(new_chunks, parts[1:], strict=True):
        pipe.set(key, part, px=grace_ms)
    pipe.set(pending, parts[0], px=grace_ms)
    pipe.getrange(head_key, 0, PROBE_BYTES - 1)  # the version this write replaces
    pipe.strlen(head_key)
    replies = pipe.execute(raise_on_error=False)
    refused = [r for r in replies if isinstance(r, Exception)]
    if refused:  # e.g. OOM for one chunk: no switch, drop what did land
        drop(client, written)
        raise refused[0]
    expected, retired = replaced(head_key, replies[-2], replies[-1])
    try:
        for _ in range(ATTEMPTS):
            retired = [k for k in retired if k not in new_chunks]
            args = [expected, len(new_chunks), ttl_ms or 0, grace_ms]
            reply = SWAP.run(client, [head_key, *written, *retired], args)
            if int(reply[0]) == SWAPPED:
                return STORED
            if int(reply[0]) == INCOMPLETE:
                drop(client, written)
                return INCOMPLETE_WRITE
            # another writer switched the entry since we looked: retire what it wrote instead
            expected, retired = replaced(head_key, reply[1], int(reply[2]))
    except BaseException:
        drop(client, written)
        raise
    drop(client, written)
    return CONFLICT


def delete_entry(client: Any, head_key: str) -> bool:
    """Delete the entry's head and the chunks it names in one step; False when it was
    rewritten ``ATTEMPTS`` times while we tried (the newest version then stays)."""
    pipe = client.pipeline(transaction=False)
    pipe.getrange(head_key, 0, PROBE_BYTES - 1)
    pipe.strlen(head_key)
    prefix, head_len = pipe.execute()
    for _ in range(ATTEMPTS):
        keys = [head_key, *named_chunks(head_key, prefix, head_len)]
        reply = DELETE.run(client, keys, [prefix[:HEADER_SIZE]])
        if int(reply[0]) == DELETED:
            return True
        prefix, head_len = reply[1], int(reply[2])  # rewritten meanwhile: delete that one
    return False


def discard(client: Any, head_key: str, head: bytes, chunks: list[str]) -> bool:
    """Compare-and-delete what a reader read: the head and ``chunks`` go only while the head
    is still ``head``; False (nothing deleted) when a newer version is there."""
    reply = DELETE.run(client, [head_key, *chunks], [head[:HEADER_SIZE]])
    return int(reply[0]) == DELETED


def drop(client: Any, chunk_keys: list[str]) -> None:
    """UNLINK a write's chunks that no head will name (their grace TTL is the backstop).
    UNLINK, not DEL: freeing megabytes must not block Redis."""
    if chunk_keys:
        with contextlib.suppress(redis.RedisError, OSError):
            client.unlink(*chunk_keys)
