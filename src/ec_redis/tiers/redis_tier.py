"""Redis cold tier: one self-describing blob per entry, chunked above ``chunk_bytes``.

An entry is a head key (header, plus the whole blob when small) and, for large entries,
chunk keys ``<head>:c1..cN`` that share the head's Cluster hash slot. Writes send chunks
first and the head **last** in one pipeline, so a reader that finds the head finds a whole
entry (or, after a partial eviction, a clean miss). Reads pipeline the heads of a batch, then
all the chunks. Every failure is a miss plus a counter; nothing raises out of this tier.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import torch
from redis.exceptions import NoPermissionError, OutOfMemoryError

from ec_redis.breaker import CircuitBreaker
from ec_redis.codec import (
    decode_parts,
    direct_layout,
    encode_parts,
    finish_direct,
    read_header,
)
from ec_redis.codec.format import HEADER_SIZE, MAX_PRODUCER_BYTES, BlobHeader
from ec_redis.errors import BlobError, BlobTooLargeError
from ec_redis.keys import KeyBuilder
from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters
from ec_redis.tiers import bulk_read
from ec_redis.tiers.base import Tier, tensor_nbytes

# Chunks stay this much under chunk_bytes so a chunk plus Redis's string header fits in the
# allocator's size class (an exact 4 MiB value costs jemalloc a 5 MiB allocation).
ALLOCATOR_SLACK = 4096
MIN_PART_BYTES = 60 * 1024  # a forged header cannot make a reader fetch millions of keys
REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError)


@dataclass(frozen=True)
class RedisTierOptions:
    """The subset of the configuration the Redis tier uses."""

    chunk_bytes: int = 4 * 1024 * 1024
    max_blob_bytes: int = 512 * 1024 * 1024
    ttl_s: float = 0.0
    ttl_sliding: bool = True
    compression: str = "none"
    compression_min_ratio: float = 1.1
    byte_shuffle: bool = False
    producer_id: str = ""
    model: str = ""  # written into blob headers for operators' tools


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
        self.breaker = breaker or CircuitBreaker()
        self.counters = Counters()
        self._log = RateLimitedLog()
        self._ttl_ms = int(options.ttl_s * 1000) if options.ttl_s > 0 else None
        self._direct = bulk_read.supported(client)

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: str) -> torch.Tensor | None:
        return self.get_many([key])[key]

    def get_many(self, keys: Iterable[str]) -> dict[str, torch.Tensor | None]:
        items = list(dict.fromkeys(keys))
        out: dict[str, torch.Tensor | None] = dict.fromkeys(items)
        head_keys = [self.keys.head(item) for item in items]  # bad ids raise before the probe
        if not items or not self._allow():
            return out
        started = time.perf_counter()
        try:
            heads = self._read(head_keys)
            pending: list[tuple[str, str, bytes, BlobHeader, int]] = []
            for item, head in zip(items, heads, strict=True):
                self._classify(item, head, out, pending)
            pending = [p for p in pending if not self._read_direct(p, out)]
            if pending:
                chunk_keys = [
                    self.keys.chunk(head_key, i) for _, head_key, _, _, n in pending
                    for i in range(1, n + 1)
                ]  # fmt: skip
                chunks = iter(self._read(chunk_keys))
                for item, head_key, head, header, n in pending:
                    parts = [head, *(next(chunks) for _ in range(n))]
                    out[item] = self._assemble(item, head_key, parts, header)
        except REDIS_ERRORS as exc:
            self._failed("read", exc)
            return dict.fromkeys(items)
        self.breaker.success()
        hits = sum(t is not None for t in out.values())
        self.counters.inc("hits", hits)
        self.counters.inc("misses", len(items) - hits)
        self.counters.inc(
            "bytes_read", sum(tensor_nbytes(t) for t in out.values() if t is not None)
        )
        self.counters.inc("read_us", int((time.perf_counter() - started) * 1e6))
        return out

    def _classify(
        self,
        item: str,
        head: bytes | None,
        out: dict[str, torch.Tensor | None],
        pending: list[tuple[str, str, bytes, BlobHeader, int]],
    ) -> None:
        """Decode a complete head now, or queue its chunks for the second round trip."""
        if head is None:
            return
        head_key = self.keys.head(item)
        try:
            header = read_header(head, max_blob_bytes=self.options.max_blob_bytes)
            if len(head) == header.total_len:
                out[item] = decode_parts([head], header=header)
                return
            n = chunk_count(header, len(head))
        except BlobTooLargeError:
            # Valid but over *our* limit: a miss here; a reader with a larger limit may use it.
            self.counters.inc("oversized")
            return
        except BlobError as exc:
            self._reject(item, head_key, None, len(head), exc)
            return
        pending.append((item, head_key, head, header, n))

    def _read_direct(
        self, entry: tuple[str, str, bytes, BlobHeader, int], out: dict[str, torch.Tensor | None]
    ) -> bool:
        """Read a raw chunked entry's chunks straight into its tensor (one copy instead of
        two). False when this entry or client cannot take that path (decode_parts then does)."""
        item, head_key, head, header, n = entry
        layout = direct_layout(header, len(head))
        if not self._direct or layout is None or len(layout) != n:
            return False
        data = torch.empty(header.tensor_nbytes, dtype=torch.uint8)
        view = data.numpy().data
        targets, start = [], 0
        for length in layout:
            targets.append(view[start : start + length])
            start += length
        keys = [self.keys.chunk(head_key, i) for i in range(1, n + 1)]
        renew = self._ttl_ms if self.options.ttl_sliding else None
        sizes = bulk_read.read_into(self.client, keys, targets, renew)
        self.counters.inc("direct_reads")
        if any(size is None for size in sizes):
            self.counters.inc("partial_entries")  # evicted (or rewritten) chunks: a miss
            self._unlink(head_key, header, len(head))
            out[item] = None
            return True
        try:
            if sizes != layout:
                raise BlobError("a chunk's length disagrees with the blob header")
            out[item] = finish_direct(header, head, data)
        except BlobError as exc:
            self._reject(item, head_key, header, len(head), exc)
            out[item] = None
        return True

    def _assemble(
        self, item: str, head_key: str, parts: Sequence[bytes | None], header: BlobHeader
    ) -> torch.Tensor | None:
        if any(p is None for p in parts):
            # Part of the entry was evicted (or is being rewritten): a miss, and clean up.
            self.counters.inc("partial_entries")
            self._unlink(head_key, header, len(parts[0] or b""))
            return None
        try:
            return decode_parts([p for p in parts if p is not None], header=header)
        except BlobError as exc:
            self._reject(item, head_key, header, len(parts[0] or b""), exc)
            return None

    def _read(self, redis_keys: list[str]) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for k in redis_keys:
            if self._ttl_ms is not None and self.options.ttl_sliding:
                pipe.getex(k, px=self._ttl_ms)  # reads renew the TTL: hot entries stay
            else:
                pipe.get(k)
        result: list[bytes | None] = pipe.execute()
        return result

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[key]

    def contains_many(self, keys: Iterable[str]) -> dict[str, bool]:
        items = list(dict.fromkeys(keys))
        head_keys = [self.keys.head(item) for item in items]  # bad ids raise before the probe
        if not items or not self._allow():
            return dict.fromkeys(items, False)
        try:
            pipe = self.client.pipeline(transaction=False)
            for head_key in head_keys:
                pipe.exists(head_key)
            found = pipe.execute()
        except REDIS_ERRORS as exc:
            self._failed("exists", exc)
            return dict.fromkeys(items, False)
        self.breaker.success()
        return {item: bool(n) for item, n in zip(items, found, strict=True)}

    def describe_many(
        self, keys: Iterable[str]
    ) -> dict[str, tuple[torch.dtype, tuple[int, ...]] | None]:
        """dtype and shape of stored entries, from a bounded prefix of each head (GETRANGE):
        no tensor bytes move. A missing, foreign or corrupt head is ``None``."""
        items = list(dict.fromkeys(keys))
        head_keys = [self.keys.head(item) for item in items]  # bad ids raise before the probe
        out: dict[str, tuple[torch.dtype, tuple[int, ...]] | None] = dict.fromkeys(items)
        if not items or not self._allow():
            return out
        try:
            pipe = self.client.pipeline(transaction=False)
            for head_key in head_keys:
                pipe.getrange(head_key, 0, HEADER_SIZE + MAX_PRODUCER_BYTES - 1)
            prefixes = pipe.execute()
        except REDIS_ERRORS as exc:
            self._failed("describe", exc)
            return out
        self.breaker.success()
        for item, prefix in zip(items, prefixes, strict=True):
            if not prefix:
                continue
            try:
                header = read_header(prefix, max_blob_bytes=self.options.max_blob_bytes)
            except BlobError:
                continue  # a reader will meet it, count it and clean it up
            out[item] = (header.dtype.torch_dtype, header.shape)
        return out

    # -- writes --------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Encode and store a host tensor; False (and a counter) on any failure."""
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
            )
        except ValueError as exc:
            self.counters.inc("write_rejected")
            self._log.warning("encode", "ec_redis: not storing %r: %s", key, exc)
            return False
        head_key = self.keys.head(key)  # a bad id raises before taking a half-open probe
        if not self._allow():
            self.counters.inc("write_skipped_breaker_open")
            return False
        started = time.perf_counter()
        chunk_keys = [self.keys.chunk(head_key, i) for i in range(1, len(parts))]
        try:
            if chunk_keys:
                pipe = self.client.pipeline(transaction=False)
                for chunk_key, part in zip(chunk_keys, parts[1:], strict=True):
                    pipe.set(chunk_key, part, px=self._ttl_ms)
                refused = [
                    r for r in pipe.execute(raise_on_error=False) if isinstance(r, Exception)
                ]
                if refused:  # e.g. OOM for one chunk: store no head, drop what did land
                    with contextlib.suppress(*REDIS_ERRORS):
                        self.client.unlink(*chunk_keys)
                    raise refused[0]
            # The head only after every chunk is stored: the entry becomes visible whole.
            self.client.set(head_key, parts[0], px=self._ttl_ms)
        except REDIS_ERRORS as exc:
            self._failed("write", exc)
            self.counters.inc("write_errors")
            return False
        self.breaker.success()
        self.counters.inc("writes")
        self.counters.inc("bytes_written", sum(len(p) for p in parts))
        self.counters.inc("write_us", int((time.perf_counter() - started) * 1e6))
        return True

    def delete(self, key: str) -> None:
        head_key = self.keys.head(key)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.getrange(head_key, 0, HEADER_SIZE + MAX_PRODUCER_BYTES - 1)
            pipe.strlen(head_key)
            prefix, head_len = pipe.execute()
            header = None
            if prefix:
                try:
                    header = read_header(prefix, max_blob_bytes=self.options.max_blob_bytes)
                except BlobError:
                    header = None
            self._unlink(head_key, header, head_len)
        except REDIS_ERRORS as exc:
            self._failed("delete", exc)

    # -- failure handling ----------------------------------------------------------------

    def _reject(
        self, item: str, head_key: str, header: BlobHeader | None, head_len: int, exc: Exception
    ) -> None:
        self.counters.inc("bad_blobs")
        self._log.warning(
            "blob", "ec_redis: rejected blob for item %r (%s); deleting it", item, exc
        )
        self._unlink(head_key, header, head_len)

    def _unlink(self, head_key: str, header: BlobHeader | None, head_len: int) -> None:
        """UNLINK, not DEL: freeing a 100 MB value must not block Redis."""
        keys = [head_key]
        if header is not None and head_len < header.total_len:
            # a head declaring parts below the floor (forged) is never read: delete just it
            n = chunk_count(header, head_len) if header.part_bytes >= MIN_PART_BYTES else 0
            keys += [self.keys.chunk(head_key, i) for i in range(1, n + 1)]
        try:
            self.client.unlink(*keys)
        except REDIS_ERRORS as exc:
            self._failed("unlink", exc)

    def _allow(self) -> bool:
        if self.breaker.allow():
            return True
        self.counters.inc("skipped_breaker_open")
        return False

    def _failed(self, op: str, exc: BaseException) -> None:
        """Count a failed call. A reply from a healthy server (an OOM or ACL refusal) is not
        an outage: only connection errors and timeouts count towards the circuit breaker."""
        self.counters.inc("errors")
        if isinstance(exc, redis.ResponseError):
            # redis-py parses the error code into the class and strips it from the text
            # (and pipelines prefix the text with the failed command): test the class first.
            text = str(exc)
            oom = isinstance(exc, OutOfMemoryError) or text.startswith("OOM")
            noperm = isinstance(exc, NoPermissionError) or "NOPERM" in text
            kind = "oom" if oom else "noperm" if noperm else "reply"
            self.counters.inc(f"{kind}_errors")
            self.breaker.success()
        else:
            self.breaker.failure()
        self._log.warning(
            "redis-" + op, "ec_redis: Redis %s failed (%s: %s); treating as a miss",
            op, type(exc).__name__, exc,
        )  # fmt: skip

    def stats(self) -> dict[str, float]:
        out = self.counters.snapshot()
        out.update(self.breaker.stats())
        return out

    def close(self) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            self.client.close()


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
    return -(-rest // header.part_bytes)
