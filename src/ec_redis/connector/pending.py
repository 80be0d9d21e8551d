"""Whether the scheduler half must keep vLLM stepping: work the instance did that is not
reported yet (vLLM reports connector stats only while the engine steps).

That is a lookup in flight, or one returned since the last report (an encoder's head check
can return after its request was encoded and finished), and a producer-only engine's Redis
writes. With the worker in the scheduler's process the shared cache's write queue says so
directly (vLLM's V1 encoder-only path drops worker metadata); otherwise the workers' last
report counts, for a bounded time.
"""

from __future__ import annotations

from collections.abc import Callable

from ec_redis.cache import TieredCache
from ec_redis.connector.staging import Stager

FRESH_S = 10.0  # how long a report of queued writes (or a stats reader's interest) counts


class PendingWork:
    def __init__(
        self,
        stager: Stager,
        cache: TieredCache,
        *,
        pure_producer: bool,
        clock: Callable[[], float],
    ) -> None:
        self._stager = stager
        self._cache = cache
        self._pure_producer = pure_producer
        self._clock = clock
        self._pending_writes = 0
        self._writes_reported_at = 0.0
        self._reported_generation = 0  # the stager's generation when stats were last taken
        self._reported_at = -FRESH_S
        # Gauges of the worker halves as last read from the stats channel (reporting.py).
        self.worker_gauges: dict[str, float] = {}

    def worker_reported(self, pending_writes: int) -> None:
        """A worker's step metadata said how many of its writes are still queued."""
        self._pending_writes = pending_writes
        self._writes_reported_at = self._clock()

    def begin_report(self) -> None:
        """The stats vLLM is about to get include every lookup returned by now."""
        self._reported_generation = self._stager.generation
        self._reported_at = self._clock()

    def any(self) -> bool:
        if self._stager.in_flight > 0:
            return True
        unreported = self._stager.generation != self._reported_generation
        if unreported and self._clock() - self._reported_at < FRESH_S:
            return True  # (only while someone takes the stats: never spin for nobody)
        if not self._pure_producer:
            return False
        writer = self._cache.writer
        if writer is not None and writer.depth()[0] > 0:
            return True  # the worker shares this process (and this cache)
        if self.worker_gauges.get("write_queue_depth", 0) > 0:
            return True  # a worker process's queue, as its stats last said
        fresh = self._clock() - self._writes_reported_at < FRESH_S
        return self._pending_writes > 0 and fresh
