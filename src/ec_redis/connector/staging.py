"""Scheduler-side staging: fetch items off the scheduling path, hold them until loaded.

A lookup runs on a small thread pool (one batched ``get_many`` per request: local tiers,
then one pipelined Redis round trip). Its result is a staged host tensor, or "absent" with a
timestamp. Staged bytes are bounded by ``stage_bytes``; entries nobody loads expire.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ec_redis.cache import TieredCache
from ec_redis.logutil import RateLimitedLog
from ec_redis.tiers.base import tensor_nbytes

FETCHING, STAGED, ABSENT = "fetching", "staged", "absent"


@dataclass
class Entry:
    state: str
    since: float
    tensor: torch.Tensor | None = None
    requests: set[str] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.tensor) if self.tensor is not None else 0


class Stager:
    """Thread-safe table of item id -> Entry, filled by background fetches."""

    def __init__(
        self,
        cache: TieredCache,
        *,
        threads: int,
        stage_bytes: int,
        stage_ttl_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        on_fetch: Callable[[float], None] | None = None,
    ) -> None:
        self._cache = cache
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ec_redis-stage")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._entries: dict[str, Entry] = {}
        self._staged_bytes = 0
        self._stage_bytes = stage_bytes
        self._stage_ttl_s = stage_ttl_s
        self._clock = clock
        self._on_fetch = on_fetch
        self._closed = False
        self._log = RateLimitedLog()

    def entry(self, item: str) -> Entry | None:
        with self._lock:
            return self._entries.get(item)

    @property
    def staged_bytes(self) -> int:
        with self._lock:
            return self._staged_bytes

    def has_room(self) -> bool:
        with self._lock:
            return self._staged_bytes < self._stage_bytes

    def fetch(self, items: Iterable[str], request_id: str) -> None:
        """Start one batched lookup for ``items`` (those not already being fetched)."""
        now = self._clock()
        batch = []
        with self._lock:
            if self._closed:
                return
            for item in items:
                entry = self._entries.get(item)
                if entry is not None and entry.state == FETCHING:
                    entry.requests.add(request_id)
                    continue
                self._drop_locked(item)
                self._entries[item] = Entry(FETCHING, now, requests={request_id})
                batch.append(item)
        if batch:
            self._pool.submit(self._run, batch)

    def _run(self, batch: list[str]) -> None:
        started = time.perf_counter()
        try:
            found = self._cache.get_many(batch, on_host=True)  # staged bytes cross processes
        except Exception as exc:  # never let a lookup thread die silently
            self._log.warning("stage", "ec_redis: lookup failed: %r", exc)
            found = {}
        if self._on_fetch is not None:
            self._on_fetch(time.perf_counter() - started)
        now = self._clock()
        with self._lock:
            for item in batch:
                entry = self._entries.get(item)
                if entry is None or entry.state != FETCHING:
                    continue  # dropped meanwhile (request finished, shutdown)
                tensor = found.get(item)
                entry.since = now
                if tensor is None:
                    entry.state = ABSENT
                else:
                    entry.state, entry.tensor = STAGED, tensor
                    self._staged_bytes += entry.nbytes
            self._changed.notify_all()

    def wait(self, timeout_s: float) -> None:
        """Sleep until a lookup completes or ``timeout_s`` passes (releases the GIL, so the
        lookup threads run at full speed instead of in the engine loop's GIL slices)."""
        if timeout_s > 0:
            with self._changed:
                self._changed.wait(timeout_s)

    def take(self, item: str) -> torch.Tensor | None:
        """Hand over a staged tensor (for a load) and forget the entry."""
        with self._lock:
            entry = self._entries.get(item)
            if entry is None or entry.state != STAGED:
                return None
            self._drop_locked(item)
            return entry.tensor

    def drop(self, item: str) -> None:
        with self._lock:
            self._drop_locked(item)

    def release_request(self, request_id: str) -> None:
        """A request finished: forget entries only it was waiting for."""
        with self._lock:
            for item, entry in list(self._entries.items()):
                entry.requests.discard(request_id)
                if not entry.requests and entry.state != FETCHING:
                    self._drop_locked(item)

    def expire(self) -> None:
        """Drop staged entries nobody loaded within the TTL (aborted or preempted requests)."""
        cutoff = self._clock() - self._stage_ttl_s
        with self._lock:
            for item, entry in list(self._entries.items()):
                if entry.state != FETCHING and entry.since < cutoff:
                    self._drop_locked(item)

    def _drop_locked(self, item: str) -> None:
        entry = self._entries.pop(item, None)
        if entry is not None and entry.state == STAGED:
            self._staged_bytes -= entry.nbytes

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._entries.clear()
            self._staged_bytes = 0
        self._pool.shutdown(wait=False, cancel_futures=True)
