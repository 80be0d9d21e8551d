"""Redis cold tier: versioned entries (a head, chunks named by the write), switched atomically.

An entry is a head key (header, plus the whole blob when small) and, for large entries, chunk
keys named by the write's random id (``tiers/layout.py``), all in the head's Cluster hash slot.
A write stores its chunks and head value under a grace TTL, then one Lua script
(``tiers/scripts.py``) checks they are all there, renames the head value onto the head key,
gives them the entry's TTL and puts the grace TTL on the chunks of the version it replaced. A
reader fetches the head, then the chunks that head names: one whole version or a miss,
whatever other writers do meanwhile; a bad version it read is deleted only while it is still
current. Every failure is a miss or False plus a counter; nothing raises out of this tier,
and every call the breaker admits settles it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ec_redis.breaker import CircuitBreaker
from ec_redis.codec import decode_parts, direct_layout, encode_parts, finish_direct, read_header
from ec_redis.codec.format import HEADER_SIZE, MAX_PRODUCER_BYTES, BlobHeader, new_write_id
from ec_redis.errors import BlobError, BlobTooLargeError
from ec_redis.keys import KeyBuilder
from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters
from ec_redis.tiers import bulk_read, entry_ops
from ec_redis.tiers.base import Tier, tensor_nbytes
from ec_redis.tiers.guard import REDIS_ERRORS, Guard
from ec_redis.tiers.layout import chunk_keys, part_size
from ec_redis.tiers.scripts import RENEW, is_noscript


@dataclass(frozen=True)
class RedisTierOptions:
    """The subset of the configuration the Redis tier uses."""

    chunk_bytes: int = 4 * 1024 * 1024
    max_blob_bytes: int = 512 * 1024 * 1024
    ttl_s: float = 0.0
    ttl_sliding: bool = True
    orphan_grace_s: float = 30.0
    compression: str = "none"
    compression_min_ratio: float = 1.1
    byte_shuffle: bool = False
    producer_id: str = ""
    model: str = ""  # written into blob headers for operators' tools
    announce: bool = True  # PUBLISH each stored entry's id on the model's channel


@dataclass(frozen=True)
class _Found:
    """A chunked entry's head as read: which chunks to fetch, what to compare against."""

    item: str
    head_key: str
    head: bytes
    header: BlobHeader
    chunk_keys: list[str]


class RedisTier(Tier):
    name = "redis"

    def __init__(
        self,
        client: Any,
        keys: KeyBuilder,
        options: RedisTierOptions,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.options = options
        self.counters = Counters()
        self._log = RateLimitedLog()
        self._guard = Guard(breaker or CircuitBreaker(), self.counters, self._log)
        self._ttl_ms = int(options.ttl_s * 1000) if options.ttl_s > 0 else None
        self._renew_ms = self._ttl_ms if options.ttl_sliding else None
        self._grace_ms = max(1, int(options.orphan_grace_s * 1000))
        self._direct = bulk_read.supported(client)

    @property
    def breaker(self) -> CircuitBreaker:
        return self._guard.breaker

    @breaker.setter
    def breaker(self, breaker: CircuitBreaker) -> None:
        self._guard.breaker = breaker

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: str) -> torch.Tensor | None:
        return self.get_many([key])[key]

    def get_many(self, keys: Iterable[str]) -> dict[str, torch.Tensor | None]:
        items = list(dict.fromkeys(keys))
        head_keys = [self.keys.head(item) for item in items]  # bad ids raise before the probe
        if not items or not self._guard.allow():
            return dict.fromkeys(items)
        started = time.perf_counter()
        out = self._guard.run("read", lambda: self._get_many(items, head_keys), None)
        if out is None:
            return dict.fromkeys(items)
        hits = sum(t is not None for t in out.values())
        self.counters.inc("hits", hits)
        self.counters.inc("misses", len(items) - hits)
        self.counters.inc(
            "bytes_read", sum(tensor_nbytes(t) for t in out.values() if t is not None)
        )
        self.counters.inc("read_us", int((time.perf_counter() - started) * 1e6))
        return out

    def _get_many(self, items: list[str], head_keys: list[str]) -> dict[str, torch.Tensor | None]:
        out: dict[str, torch.Tensor | None] = dict.fromkeys(items)
        pipe = self.client.pipeline(transaction=False)
        for head_key in head_keys:
            if self._renew_ms is not None:
                pipe.getex(head_key, px=self._renew_ms)  # reads renew the TTL: hot entries stay
            else:
                pipe.get(head_key)
        found: list[_Found] = []
        for item, head_key, head in zip(items, head_keys, pipe.execute(), strict=True):
            entry = self._classify(item, head_key, head, out)
            if entry is not None:
                found.append(entry)
        rest = [entry for entry in found if not self._read_direct(entry, out)]
        if rest:
            self._read_chunks(rest, out)
        return out

    def _classify(
        self, item: str, head_key: str, head: bytes | None, out: dict[str, torch.Tensor | None]
    ) -> _Found | None:
        """Decode a one-value entry now, or say which chunks the head names."""
        if head is None:
            return None
        try:
            header = read_header(head, max_blob_bytes=self.options.max_blob_bytes)
            if len(head) == header.total_len:
                out[item] = decode_parts([head], header=header)
                return None
            return _Found(item, head_key, head, header, chunk_keys(head_key, header, len(head)))
        except BlobTooLargeError:
            # Valid but over *our* limit: a miss here; a reader with a larger limit may use it.
            self.counters.inc("oversized")
        except BlobError as exc:
            self._reject(item, head_key, head, [], exc)
        return None

    def _read_direct(self, entry: _Found, out: dict[str, torch.Tensor | None]) -> bool:
        """Read a raw chunked entry's chunks straight into its tensor (one copy instead of
        two). False when this entry or client cannot take that path (decode_parts then does)."""
        layout = direct_layout(entry.header, len(entry.head))
        if not self._direct or layout is None or len(layout) != len(entry.chunk_keys):
            return False
        data = torch.empty(entry.header.tensor_nbytes, dtype=torch.uint8)
        view = data.numpy().data
        targets, start = [], 0
        for length in layout:
            targets.append(view[start : start + length])
            start += length
        prelude = [self._renew_command(entry)] if self._renew_ms is not None else []
        replies, sizes = bulk_read.read_into(self.client, entry.chunk_keys, targets, prelude)
        for reply in replies:
            self._renewed(entry, reply)
        self.counters.inc("direct_reads")
        if any(size is None for size in sizes):
            self._partial(entry)
            return True
        try:
            if sizes != layout:
                raise BlobError("a chunk's length disagrees with the blob header")
            out[entry.item] = finish_direct(entry.header, entry.head, data)
        except BlobError as exc:
            self._reject(entry.item, entry.head_key, entry.head, entry.chunk_keys, exc)
        return True

    def _read_chunks(self, found: list[_Found], out: dict[str, torch.Tensor | None]) -> None:
        """All chunks of every entry in one pipelined round trip (with their TTL renewals)."""
        pipe = self.client.pipeline(transaction=False)
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
        failed = [r for parts in chunks for r in parts if isinstance(r, Exception)]
        if failed:
            raise failed[0]  # a GET refused (e.g. a foreign key's type): the read failed
        for entry, reply in zip(found, renewals, strict=False):
            self._renewed(entry, reply)
        for entry, parts in zip(found, chunks, strict=True):
            out[entry.item] = self._assemble(entry, [entry.head, *parts])

    def _assemble(self, entry: _Found, parts: Sequence[bytes | None]) -> torch.Tensor | None:
        if any(p is None for p in parts):
            self._partial(entry)
            return None
        try:
            return decode_parts([p for p in parts if p is not None], header=entry.header)
        except BlobError as exc:
            self._reject(entry.item, entry.head_key, entry.head, entry.chunk_keys, exc)
            return None

    def _renew_command(self, entry: _Found) -> tuple[Any, ...]:
        return RENEW.command(*self._renew_args(entry))

    def _renew_args(self, entry: _Found) -> tuple[list[str], list[Any]]:
        return [entry.head_key, *entry.chunk_keys], [entry.head[:HEADER_SIZE], self._renew_ms]

    def _renewed(self, entry: _Found, reply: Any) -> None:
        """Check a chunk-TTL renewal's reply; a server that lacks the script gets it now."""
        if not isinstance(reply, Exception):
            return
        try:
            if not is_noscript(reply):
                raise reply
            RENEW.eval(self.client, *self._renew_args(entry))
        except REDIS_ERRORS as exc:  # a renewal is best effort: the read itself succeeded
            self.counters.inc("renew_errors")
            self._guard.count("renew", exc)

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[key]

    def contains_many(self, keys: Iterable[str]) -> dict[str, bool]:
        items = list(dict.fromkeys(keys))
        head_keys = [self.keys.head(item) for item in items]  # bad ids raise before the probe
        if not items or not self._guard.allow():
            return dict.fromkeys(items, False)

        def exists() -> dict[str, bool]:
            pipe = self.client.pipeline(transaction=False)
            for head_key in head_keys:
                pipe.exists(head_key)
            return {item: bool(n) for item, n in zip(items, pipe.execute(), strict=True)}

        return self._guard.run("exists", exists, dict.fromkeys(items, False))

    def describe_many(
        self, keys: Iterable[str]
    ) -> dict[str, tuple[torch.dtype, tuple[int, ...]] | None]:
        """dtype and shape of stored entries, from a bounded prefix of each head (GETRANGE):
        no tensor bytes move. A missing, foreign or corrupt head is ``None``."""
        items = list(dict.fromkeys(keys))
        head_keys = [self.keys.head(item) for item in items]  # bad ids raise before the probe
        if not items or not self._guard.allow():
            return dict.fromkeys(items)

        def describe() -> dict[str, tuple[torch.dtype, tuple[int, ...]] | None]:
            pipe = self.client.pipeline(transaction=False)
            for head_key in head_keys:
                pipe.getrange(head_key, 0, HEADER_SIZE + MAX_PRODUCER_BYTES - 1)
            out: dict[str, tuple[torch.dtype, tuple[int, ...]] | None] = dict.fromkeys(items)
            for item, prefix in zip(items, pipe.execute(), strict=True):
                with contextlib.suppress(BlobError):  # a reader meets it, counts, cleans up
                    if prefix:
                        header = read_header(prefix, max_blob_bytes=self.options.max_blob_bytes)
                        out[item] = (header.dtype.torch_dtype, header.shape)
            return out

        return self._guard.run("describe", describe, dict.fromkeys(items))

    # -- writes --------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Encode and store a host tensor; False (and a counter) on any failure."""
        write_id = new_write_id()
        try:
            parts = encode_parts(
                tensor,
                compression=self.options.compression,
                min_ratio=self.options.compression_min_ratio,
                byte_shuffle=self.options.byte_shuffle,
                producer_id=self.options.producer_id,
                part_bytes=part_size(self.options.chunk_bytes),
                max_blob_bytes=self.options.max_blob_bytes,
                model=self.options.model,
                write_id=write_id,
            )
        except ValueError as exc:
            self.counters.inc("write_rejected")
            self._log.warning("encode", "ec_redis: not storing %r: %s", key, exc)
            return False
        head_key = self.keys.head(key)  # a bad id raises before taking a half-open probe
        if not self._guard.allow():
            self.counters.inc("write_skipped_breaker_open")
            return False
        started = time.perf_counter()
        stored = self._guard.run(
            "write", lambda: self._write(key, head_key, parts, write_id), False
        )
        if stored:
            self.counters.inc("writes")
            self.counters.inc("bytes_written", sum(len(p) for p in parts))
            self.counters.inc("write_us", int((time.perf_counter() - started) * 1e6))
        return stored

    def _write(self, item: str, head_key: str, parts: Sequence[Any], write_id: int) -> bool:
        announce = (self.keys.channel(), item.encode("utf-8", "surrogatepass"))
        outcome = entry_ops.write_entry(
            self.client,
            head_key,
            parts,
            write_id,
            self._ttl_ms,
            self._grace_ms,
            announce if self.options.announce else ("", b""),
        )
        if outcome != entry_ops.STORED:
            self.counters.inc(f"write_{outcome}")  # write_conflict, write_incomplete
        return outcome == entry_ops.STORED

    def delete(self, key: str) -> None:
        """Delete the entry's head and the chunks it names, atomically."""
        head_key = self.keys.head(key)
        if not self._guard.allow():
            self.counters.inc("delete_skipped_breaker_open")
            return
        self._guard.run("delete", lambda: self._delete(head_key), None)

    def _delete(self, head_key: str) -> None:
        if not entry_ops.delete_entry(self.client, head_key):
            self.counters.inc("delete_conflicts")

    # -- failure handling ----------------------------------------------------------------

    def _partial(self, entry: _Found) -> None:
        # Part of the entry was evicted: a miss, and clean up (if nobody replaced it since).
        self.counters.inc("partial_entries")
        self._discard(entry.head_key, entry.head, entry.chunk_keys)

    def _reject(
        self, item: str, head_key: str, head: bytes, chunks: list[str], exc: Exception
    ) -> None:
        self.counters.inc("bad_blobs")
        self._log.warning(
            "blob", "ec_redis: rejected blob for item %r (%s); deleting it", item, exc
        )
        self._discard(head_key, head, chunks)

    def _discard(self, head_key: str, head: bytes, chunks: list[str]) -> None:
        """Compare-and-delete what a reader read: the head and its chunks go only while the
        head is still the one read, never a version written since."""
        try:
            if not entry_ops.discard(self.client, head_key, head, chunks):
                self.counters.inc("discards_skipped_newer")
        except REDIS_ERRORS as exc:
            self._guard.count("unlink", exc)  # the enclosing call settles the breaker

    def stats(self) -> dict[str, float]:
        out = self.counters.snapshot()
        out.update(self.breaker.stats())
        return out

    def close(self) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            self.client.close()
