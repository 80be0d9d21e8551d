"""Reading versioned entries from one node: one whole version per item, or a miss.

The heads come in one pipelined round trip, each cut after ``head_bytes`` (``GETRANGE``): a
head no writer with this chunk size makes longer (a one-value entry is at most one part; a
chunked entry's head is its blob's first part) comes whole, and a longer one only as far as
its header, so one over ``max_blob_bytes`` is a miss (``oversized``) without its payload
crossing the network; one within the limit is read again whole (``long_heads``: a writer with
a larger ``chunk_bytes``). A one-value entry is decoded from its head. A chunked entry, when
the client allows (``bulk_read``), is read whole in that same round trip: as soon as its
head's header has arrived, the ``GET``s of exactly the chunks it names go out on the same
connection while the rest of the head streams into the destination, and the chunks follow
(``bulk_read.read_streamed``; one copy, kernel -> buffer; raw: the tensor's bytes; lz4: the
compressed payload, decompressed into the tensor). Other clients read all chunks in one more
pipelined round trip. Directly read bytes are checksummed as they land
(``codec/landing.py``), while the next ones are on the wire, into recycled memory
(``codec/destination.py``). With a sliding TTL, the head is renewed by a ``PEXPIRE`` sent
ahead of its read and the chunks by a script sent ahead of their ``GET``s. A bad version is
deleted only while it is still current (compare-and-delete). An error reply to one key (a key
of another type) is that item's miss alone; the batch's other items are served.
Single-flight claims (``tiers/lease.py``) go in the heads' round trip, after the reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ec_redis.codec import decode_parts, destination, read_header
from ec_redis.codec.direct import DirectLayout, direct_layout, finish_direct, raw_landing
from ec_redis.codec.format import CODEC_NONE, HEADER_SIZE, PRODUCER_LEN_AT, BlobHeader
from ec_redis.codec.landing import Landing
from ec_redis.errors import BlobError, BlobTooLargeError
from ec_redis.tiers import bulk_read, entry_ops
from ec_redis.tiers.guard import REDIS_ERRORS, Guard
from ec_redis.tiers.layout import chunk_keys, looks_chunked
from ec_redis.tiers.lease import Claim
from ec_redis.tiers.nodes import REDIRECTS
from ec_redis.tiers.scripts import RENEW, is_noscript

Out = dict[str, torch.Tensor | None]
# Chunk bytes a batch's read asks for mid-head (beyond its first chunked entry's), in heads
PLAN_PARTS = 2
Buffer = bytes | memoryview


@dataclass(frozen=True)
class _Found:
    """A chunked entry's head as read: which chunks to fetch, what to compare against."""

    item: str
    head_key: str
    head: Buffer
    header: BlobHeader
    chunk_keys: list[str]


@dataclass(frozen=True)
class _Direct:
    """A chunked entry read straight into one buffer (``data``): the stretch its head carries
    lands at 0, chunk ``j`` at ``starts[j + 1]``; a raw blob's checksum runs as they land."""

    entry: _Found  # its head: the lead only (header, producer info, safetensors prefix)
    layout: DirectLayout
    data: torch.Tensor
    view: memoryview
    targets: list[memoryview]
    starts: list[int]
    landing: Landing | None

    @classmethod
    def make(cls, entry: _Found, layout: DirectLayout) -> _Direct:
        # A raw blob's buffer becomes the tensor: it may land where the caller wants it.
        raw = entry.header.codec == CODEC_NONE
        data = destination.buffer(layout.size) if raw else destination.fresh(layout.size)
        view = data.numpy().data
        targets, starts, start = [], [0], layout.in_head
        for length in layout.chunks:
            targets.append(view[start : start + length])
            starts.append(start)
            start += length
        landing = raw_landing(entry.header, entry.head, view)
        return cls(entry, layout, data, view, targets, starts, landing)

    def landed(self, index: int, _: memoryview, count: int) -> None:
        """Stretch ``index`` (0: the head's, ``j + 1``: chunk ``j``) holds ``count`` bytes."""
        if self.landing is not None:
            self.landing.landed(self.starts[index] + count, self.starts[index])


class EntryReader:
    """Reads entries through ``client`` (any client that reaches the node holding them);
    faults of the cleanup and renewal side calls are counted through ``guard``."""

    def __init__(
        self, guard: Guard, max_blob_bytes: int, renew_ms: int | None, head_bytes: int
    ) -> None:
        """``head_bytes``: the longest head read in the first round trip (at least the longest
        header, ``PROBE_BYTES``)."""
        self._guard = guard
        self.counters = guard.counters
        self._max_blob_bytes = max_blob_bytes
        self._renew_ms = renew_ms
        self._head_bytes = head_bytes

    def read(
        self,
        client: Any,
        items: Sequence[str],
        head_keys: Sequence[str],
        claim: Claim | None = None,
    ) -> Out:
        """One whole version per item, or a miss; with ``claim``, the single-flight claims of
        its items ride in the heads' round trip, after them."""
        out: Out = dict.fromkeys(items)
        direct = bulk_read.supported(client)
        claimed: list[str] = []
        claims: list[tuple[Any, ...]] = []
        if claim is not None:
            claimed, claims = claim.commands(items, head_keys)
        landings: dict[int, Landing] = {}
        planned: dict[int, _Direct] = {}
        planner = self._planner(items, head_keys, planned) if direct else None
        heads, replies = self._heads(
            client, head_keys, direct, self._head_bytes, self._renew_ms, claims, landings, planner
        )
        if claim is not None:
            claim.settle_all(claimed, replies, lambda exc: self._refused(exc, "claim"))
        longer = [i for i, head in enumerate(heads) if self._read_again(head)]
        if longer:  # heads longer than this reader's own writers make: whole, within the limit
            self.counters.inc("long_heads", len(longer))
            again = [head_keys[i] for i in longer]
            for i, head in zip(longer, self._heads(client, again, direct)[0], strict=True):
                heads[i] = head
                landings.pop(i, None)
        found: list[_Found] = []
        for i, (item, head_key, head) in enumerate(zip(items, head_keys, heads, strict=True)):
            if isinstance(head, bulk_read.Streamed):  # read whole in the heads' round trip
                self._finish(client, planned[i], head.prelude, head.sizes, out)
                continue
            entry = self._classify(client, item, head_key, head, out, landings.get(i))
            if entry is not None:
                found.append(entry)
        rest = [entry for entry in found if not (direct and self._read_direct(client, entry, out))]
        if rest:
            self._read_chunks(client, rest, out)
        return out

    def _heads(
        self,
        client: Any,
        head_keys: Sequence[str],
        direct: bool,
        limit: int | None = None,
        renew_ms: int | None = None,
        tail: Sequence[tuple[Any, ...]] = (),
        landings: dict[int, Landing] | None = None,
        planner: bulk_read.Planner | None = None,
    ) -> tuple[list[Any], list[Any]]:
        """Every head in one round trip, each read up to ``limit + 1`` bytes (default
        ``limit``: the largest entry accepted), so one that arrives longer than ``limit`` may
        have been cut; with ``renew_ms``, a ``PEXPIRE`` ahead of each read renews its TTL: hot
        entries stay. ``tail``: commands sent after the reads, whose replies come second.
        ``landings`` gets the running checksum of each head received in place, by index;
        ``planner`` (direct reads only) reads a chunked entry whole in the same round trip."""
        last = self._max_blob_bytes if limit is None else limit
        reads = [("GETRANGE", key, 0, last) for key in head_keys]
        renewals = [] if renew_ms is None else [("PEXPIRE", key, renew_ms) for key in head_keys]
        if direct:

            def landed(index: int, buffer: memoryview, count: int) -> None:
                if landings is not None:
                    landing = landings.get(index)
                    if landing is None:
                        landing = landings[index] = Landing(buffer)
                    landing.landed(count)

            replies, heads, after = bulk_read.read_streamed(
                client, reads, renewals, tail, planner, landed
            )
        else:
            pipe = client.pipeline(transaction=False)
            for command in (*renewals, *reads, *tail):
                pipe.execute_command(*command)
            answers = pipe.execute(raise_on_error=False)
            replies = answers[: len(renewals)]
            heads = answers[len(renewals) : len(renewals) + len(reads)]
            after = answers[len(renewals) + len(reads) :]
        for reply in replies:
            if isinstance(reply, Exception):
                self._refused(reply, "renew")
        return list(heads), list(after)

    def _read_again(self, head: Any) -> bool:
        """Whether a head may have been cut (it arrived longer than ``head_bytes`` and is not
        the whole blob its header declares) although that header is within this reader's
        limit: it is read again whole. Any other long head is judged by its header alone
        (oversized, or rejected) in ``_classify``."""
        if not isinstance(head, bytes | memoryview) or len(head) <= self._head_bytes:
            return False
        try:
            header = read_header(head, max_blob_bytes=self._max_blob_bytes)
        except BlobError:
            return False
        return len(head) != header.total_len

    def _refused(self, exc: Exception, op: str) -> None:
        """One key's error reply: a redirection raises (the caller reads the node's part of the
        batch where its slot lives now); anything else costs only that key."""
        if isinstance(exc, REDIRECTS):
            raise exc
        if op == "renew":  # a renewal is best effort: the read itself goes on
            self.counters.inc("renew_errors")
            self._guard.count(op, exc)
        else:
            self._guard.refused_key(op, exc)

    def _classify(
        self,
        client: Any,
        item: str,
        head_key: str,
        head: Any,
        out: Out,
        landing: Landing | None = None,
    ) -> _Found | None:
        """Decode a one-value entry now (``landing``: its checksum as it landed, if it was
        followed), or say which chunks the head names."""
        if isinstance(head, Exception):
            self._refused(head, "read")
            return None
        if not head:  # GETRANGE answers "" for a missing key
            return None
        try:
            header = read_header(head, max_blob_bytes=self._max_blob_bytes)
            if len(head) == header.total_len:
                out[item] = decode_parts([head], header=header, landing=landing)
                return None
            return _Found(item, head_key, head, header, chunk_keys(head_key, header, len(head)))
        except BlobTooLargeError:
            # Valid but over *our* limit: a miss here; a reader with a larger limit may use it.
            self.counters.inc("oversized")
        except BlobError as exc:
            self._reject(client, item, head_key, head, [], exc)
        return None

    def _planner(
        self, items: Sequence[str], head_keys: Sequence[str], planned: dict[int, _Direct]
    ) -> bulk_read.Planner:
        """Plans, from a head's first bytes, where a chunked entry's bytes land, so that its
        chunks' GETs go out while the head still streams in (``bulk_read.read_streamed``):
        its header names them. Anything else (a one-value entry, a head that may have been
        cut, a header no direct read follows or that fails its checks) is received whole and
        judged as before (``_classify``). The first chunked entry of a batch is planned, more
        only while the chunk bytes planned stay within ``PLAN_PARTS`` heads: Redis holds a
        planned entry's chunk replies in this connection's output buffer (which counts
        towards ``maxmemory``, and may meet a ``client-output-buffer-limit``) until the heads
        before them are read, so a batch of large entries must not have them all sent at
        once. The others are read one by one after the heads, as before."""
        budget = PLAN_PARTS * self._head_bytes
        planned_bytes = [0]

        def plan(index: int, take: Callable[[int], bytes], size: int) -> bulk_read.Plan | None:
            if size > self._head_bytes:
                return None
            first = take(HEADER_SIZE)
            if not looks_chunked(first):
                return None
            first += take(int.from_bytes(first[PRODUCER_LEN_AT : PRODUCER_LEN_AT + 2], "little"))
            try:
                header = read_header(first, max_blob_bytes=self._max_blob_bytes)
                keys = chunk_keys(head_keys[index], header, size)
            except BlobError:
                return None
            layout = direct_layout(header, size)
            if layout is None or len(layout.chunks) != len(keys):
                return None
            in_chunks = layout.size - layout.in_head
            if planned and planned_bytes[0] + in_chunks > budget:
                return None
            planned_bytes[0] += in_chunks
            first += take(layout.lead - len(first))
            entry = _Found(items[index], head_keys[index], first, header, keys)
            direct = planned[index] = _Direct.make(entry, layout)
            return bulk_read.Plan(
                direct.view[: layout.in_head],
                [self._renew_command(entry)] if self._renew_ms is not None else [],
                keys,
                direct.targets,
                direct.landed if direct.landing is not None else None,
            )

        return plan

    def _read_direct(self, client: Any, entry: _Found, out: Out) -> bool:
        """Read a chunked entry's chunks straight into one buffer (one copy instead of two),
        with the bytes its head carries. False when its layout does not allow that (the
        pipelined read then does)."""
        layout = direct_layout(entry.header, len(entry.head))
        if layout is None or len(layout.chunks) != len(entry.chunk_keys):
            return False
        lead = memoryview(entry.head)[: layout.lead]
        direct = _Direct.make(replace(entry, head=lead), layout)
        direct.view[: layout.in_head] = memoryview(entry.head)[layout.lead :]
        if direct.landing is not None and layout.in_head:
            direct.landing.landed(layout.in_head)
        prelude = [self._renew_command(entry)] if self._renew_ms is not None else []
        replies, sizes = bulk_read.read_into(
            client,
            entry.chunk_keys,
            direct.targets,
            prelude,
            (lambda i, b, n: direct.landed(i + 1, b, n)) if direct.landing is not None else None,
        )
        self._finish(client, direct, replies, sizes, out)
        return True

    def _finish(
        self,
        client: Any,
        direct: _Direct,
        replies: Sequence[Any],
        sizes: Sequence[int | Exception | None],
        out: Out,
    ) -> None:
        """Settle a direct read: its renewal's reply, then the entry or its miss."""
        entry = direct.entry
        for reply in replies:
            self._renewed(client, entry, reply)
        self.counters.inc("direct_reads")
        refused = [size for size in sizes if isinstance(size, Exception)]
        if refused:
            self._refused(refused[0], "read")
            return
        if any(size is None for size in sizes):
            self._partial(client, entry)
            return
        try:
            if list(sizes) != direct.layout.chunks:
                raise BlobError("a chunk's length disagrees with the blob header")
            out[entry.item] = finish_direct(entry.header, entry.head, direct.data, direct.landing)
        except BlobError as exc:
            self._reject(client, entry.item, entry.head_key, entry.head, entry.chunk_keys, exc)

    def _read_chunks(self, client: Any, found: list[_Found], out: Out) -> None:
        """All chunks of every entry in one pipelined round trip (with their TTL renewals)."""
        pipe = client.pipeline(transaction=False)
        for entry in found:
            if self._renew_ms is not None:
                pipe.execute_command(*self._renew_command(entry))
            for key in entry.chunk_keys:
                pipe.get(key)
        replies = pipe.execute(raise_on_error=False)
        renewals: list[Any] = []
        chunks: list[list[Any]] = []
        at = 0
        for entry in found:
            if self._renew_ms is not None:
                renewals.append(replies[at])
                at += 1
            chunks.append(replies[at : at + len(entry.chunk_keys)])
            at += len(entry.chunk_keys)
        for entry, reply in zip(found, renewals, strict=False):
            self._renewed(client, entry, reply)
        for entry, parts in zip(found, chunks, strict=True):
            refused = [r for r in parts if isinstance(r, Exception)]
            if refused:  # e.g. a chunk key of another type: this entry's miss alone
                self._refused(refused[0], "read")
                continue
            out[entry.item] = self._assemble(client, entry, [entry.head, *parts])

    def _assemble(
        self, client: Any, entry: _Found, parts: Sequence[Buffer | None]
    ) -> torch.Tensor | None:
        if any(p is None for p in parts):
            self._partial(client, entry)
            return None
        try:
            return decode_parts([p for p in parts if p is not None], header=entry.header)
        except BlobError as exc:
            self._reject(client, entry.item, entry.head_key, entry.head, entry.chunk_keys, exc)
            return None

    def _renew_command(self, entry: _Found) -> tuple[Any, ...]:
        return RENEW.command(*self._renew_args(entry))

    def _renew_args(self, entry: _Found) -> tuple[list[str], list[Any]]:
        return [entry.head_key, *entry.chunk_keys], [
            bytes(entry.head[:HEADER_SIZE]),
            self._renew_ms,
        ]

    def _renewed(self, client: Any, entry: _Found, reply: Any) -> None:
        """Check a chunk-TTL renewal's reply; a server that lacks the script gets it now."""
        if not isinstance(reply, Exception):
            return
        if isinstance(reply, REDIRECTS):
            raise reply  # the slot moved: the caller reads the entry where it lives now
        try:
            if not is_noscript(reply):
                raise reply
            RENEW.eval(client, *self._renew_args(entry))
        except REDIS_ERRORS as exc:  # a renewal is best effort: the read itself succeeded
            self.counters.inc("renew_errors")
            self._guard.count("renew", exc)

    # -- bad entries -----------------------------------------------------------------------

    def _partial(self, client: Any, entry: _Found) -> None:
        # Part of the entry was evicted: a miss, and clean up (if nobody replaced it since).
        self.counters.inc("partial_entries")
        self._discard(client, entry.head_key, entry.head, entry.chunk_keys)

    def _reject(
        self, client: Any, item: str, head_key: str, head: Buffer, chunks: list[str], exc: Exception
    ) -> None:
        self.counters.inc("bad_blobs")
        self._guard.log.warning(
            "blob", "ec_redis: rejected blob for item %r (%s); deleting it", item, exc
        )
        self._discard(client, head_key, head, chunks)

    def _discard(self, client: Any, head_key: str, head: Buffer, chunks: list[str]) -> None:
        """Compare-and-delete what a reader read: the head and its chunks go only while the
        head is still the one read, never a version written since."""
        try:
            if not entry_ops.discard(client, head_key, head, chunks):
                self.counters.inc("discards_skipped_newer")
        except REDIS_ERRORS as exc:
            self._guard.count("unlink", exc)  # the enclosing call settles the breaker
