"""Writing and deleting one versioned entry: keys under a grace TTL, then compare-and-swap.

A write stores its chunks and its head value under new keys named by its write id, with the
grace TTL, and in the same round trip runs the swap script, which renames the pending head
onto the head key in one step if the head is the one the writer expects (at first: any head
without chunks); else it returns the current head and the write tries again against it,
retiring that head's chunks. Deletes compare the
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
from ec_redis.tiers.scripts import CONFLICT as CONFLICT_REPLY
from ec_redis.tiers.scripts import DELETE, DELETED, INCOMPLETE, SWAP, SWAPPED, is_noscript

ATTEMPTS = 4  # compare-and-swap rounds while other writers keep switching the entry
STORED, CONFLICT, INCOMPLETE_WRITE = "stored", "conflict", "incomplete"


def write_entry(
    client: Any,
    head_key: str,
    parts: Sequence[Any],
    write_id: int,
    ttl_ms: int | None,
    grace_ms: int,
    announce: tuple[str, bytes] = ("", b""),
) -> str:
    """Store ``parts`` (head first) as the entry's new current version: ``STORED``;
    ``INCOMPLETE_WRITE`` when a key of the write vanished before the switch (evicted, or older
    than the grace); ``CONFLICT`` when other writers switched the entry ``ATTEMPTS`` times in a
    row. Redis errors raise; whatever the outcome, no key this call wrote outlives the grace
    TTL unless the head names it, and a refused or unknown outcome never touches a key of the
    version that is current (leftovers are the grace TTL's). ``announce`` = (channel, message):
    PUBLISHed by the switch itself, so a subscriber hears of the entry the moment its head is
    current."""
    pending = KeyBuilder.pending(head_key, write_id)
    new_chunks = KeyBuilder.chunks(head_key, write_id, len(parts) - 1)
    written = [pending, *new_chunks]
    # One round trip: the write's keys, then the swap, assuming no chunked entry is there
    # (true for a new item or a one-value one). When one is, the script answers with its head
    # and the next round retires that head's chunks.
    own_head = bytes(parts[0][:HEADER_SIZE])  # unique: it holds this write's id

    def swap_args(expected: bytes) -> list[Any]:
        return [expected, len(new_chunks), ttl_ms or 0, grace_ms, *announce, own_head]

    args = swap_args(b"")
    pipe = client.pipeline(transaction=False)
    for key, part in zip(new_chunks, parts[1:], strict=True):
        pipe.set(key, part, px=grace_ms)
    pipe.set(pending, parts[0], px=grace_ms)
    pipe.execute_command(*SWAP.command([head_key, *written], args))
    # Single flight: the entry ends the lease of whoever claimed it (``tiers/lease.py``),
    # whatever the swap's outcome (no entry after all: a waiter's next look claims it).
    pipe.unlink(KeyBuilder.lease_of(head_key))
    *stored, reply, _ = pipe.execute(raise_on_error=False)
    refused = [r for r in stored if isinstance(r, Exception)]
    if refused:  # e.g. OOM
        # redis-py re-sends a pipeline whose reply was lost: its first send may have switched
        # this write in, and the head may name these very keys now. Only the script, in this
        # same reply, can say: its own head is current (SWAPPED: the entry is whole, leave it)
        # or it is not (then nothing names these keys: unlink them). Any other answer leaves
        # them to their grace TTL.
        if _swapped(reply):
            return STORED
        if _not_swapped(reply):
            drop(client, written)
        raise refused[0]
    # From here a call that raises may have switched the entry in before its reply was lost:
    # the write's keys are left to their grace TTL (a retried call answers SWAPPED, as the
    # script sees its own head).
    if is_noscript(reply):  # the server does not know the script yet
        reply = SWAP.eval(client, [head_key, *written], args)
    elif isinstance(reply, Exception):
        raise reply
    attempts = 1
    while int(reply[0]) == CONFLICT_REPLY and attempts < ATTEMPTS:
        # a chunked version is current (or another writer switched the entry since we
        # looked): retire that version's chunks instead
        expected, retired = replaced(head_key, reply[1], int(reply[2]))
        retired = [k for k in retired if k not in new_chunks]
        reply = SWAP.run(client, [head_key, *written, *retired], swap_args(expected))
        attempts += 1
    if int(reply[0]) == SWAPPED:
        return STORED
    drop(client, written)  # never named by the head: nobody can be reading them
    return INCOMPLETE_WRITE if int(reply[0]) == INCOMPLETE else CONFLICT


def _swapped(reply: Any) -> bool:
    return isinstance(reply, list) and bool(reply) and int(reply[0]) == SWAPPED


def _not_swapped(reply: Any) -> bool:
    """The swap script answered and switched nothing: it compares its own head first, so the
    head it saw names none of this write's keys."""
    return isinstance(reply, list) and bool(reply) and int(reply[0]) in (CONFLICT_REPLY, INCOMPLETE)


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


def discard(client: Any, head_key: str, head: bytes | memoryview, chunks: list[str]) -> bool:
    """Compare-and-delete what a reader read: the head and ``chunks`` go only while the head
    is still ``head``; False (nothing deleted) when a newer version is there."""
    reply = DELETE.run(client, [head_key, *chunks], [bytes(head[:HEADER_SIZE])])
    return int(reply[0]) == DELETED


def drop(client: Any, chunk_keys: list[str]) -> None:
    """UNLINK a write's chunks that no head will name (their grace TTL is the backstop).
    UNLINK, not DEL: freeing megabytes must not block Redis."""
    if chunk_keys:
        with contextlib.suppress(redis.RedisError, OSError):
            client.unlink(*chunk_keys)
