"""A Redis Cluster client built on first use, so a cache starts while every node is down.

redis-py's ``RedisCluster(...)`` asks a seed node for the slot map in its constructor and
raises ``RedisClusterException`` (not a ``RedisError``) when none answers. ``LazyCluster``
builds it when it is first needed instead; while no seed answers, every use raises a plain
``redis.ConnectionError`` (an outage the tier counts and turns into misses) and a new build is
tried only after a backoff that grows per failure. The first failure is logged once; the
build that finally succeeds is logged too. Everything else is the built ``RedisCluster``'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from redis.backoff import AbstractBackoff, ExponentialBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

logger = logging.getLogger("ec_redis")

# Between build attempts: 0.1 s doubling to 2 s. Calls are throttled by the nodes' breakers
# anyway; this stops threads that bypass them (the notification subscriber, CLI checks) from
# hammering seeds that do not answer.
BUILD_BACKOFF = ExponentialBackoff(cap=2.0, base=0.05)


class LazyCluster:
    """``build()`` makes the ``RedisCluster``; ``cluster()`` returns it, building it first if
    needed. Attribute access is forwarded to it (``pipeline``, ``pubsub``, ``ping``, ``get``
    ...), so no method of this class may share a name with a Redis command."""

    def __init__(
        self,
        build: Callable[[], RedisCluster],
        backoff: AbstractBackoff = BUILD_BACKOFF,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._build = build
        self._backoff = backoff
        self._clock = clock
        self._lock = threading.Lock()
        self._client: RedisCluster | None = None
        self._closed = False
        self._retry_at = 0.0
        self._last_error = ""
        self.build_failures = 0

    @classmethod
    def of(cls, client: RedisCluster) -> LazyCluster:
        """Wrap a cluster client that is already built."""
        lazy = cls(lambda: client)
        lazy._client = client
        return lazy

    @property
    def built(self) -> RedisCluster | None:
        """The cluster client, or ``None`` while it could not be built yet."""
        return self._client

    def cluster(self) -> RedisCluster:
        """The cluster client; ``redis.ConnectionError`` while no seed node answers."""
        client = self._client
        if client is not None:
            return client
        # One thread builds (with black-holed seeds that takes the connect timeouts); the
        # others miss at once instead of queueing behind it.
        if not self._lock.acquire(blocking=False):
            raise RedisConnectionError("Redis Cluster client being built by another thread")
        try:
            return self._build_locked()
        finally:
            self._lock.release()

    def _build_locked(self) -> RedisCluster:
        if self._client is not None:
            return self._client
        if self._closed:
            raise RedisConnectionError("the Redis Cluster client is closed")
        if self._clock() < self._retry_at:
            raise RedisConnectionError(f"Redis Cluster unreachable ({self._last_error})")
        try:
            self._client = self._build()
        except (RedisClusterException, RedisError, OSError) as exc:
            self.build_failures += 1
            # from the failure, not the attempt: a build may spend the whole backoff
            self._retry_at = self._clock() + self._backoff.compute(self.build_failures)
            self._last_error = f"{type(exc).__name__}: {exc}"
            if self.build_failures == 1:
                logger.warning(
                    "ec_redis: no Redis Cluster seed node answers (%s); later calls "
                    "try again (misses meanwhile)", self._last_error,
                )  # fmt: skip
            raise RedisConnectionError(f"Redis Cluster unreachable ({self._last_error})") from None
        if self.build_failures:
            logger.warning(
                "ec_redis: Redis Cluster reachable after %d failed attempts",
                self.build_failures,
            )
        return self._client

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never build for private lookups (copy, pickle probes)
            raise AttributeError(name)
        return getattr(self.cluster(), name)

    def close(self) -> None:
        """Close the built client (if any); later uses raise ``ConnectionError``."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
