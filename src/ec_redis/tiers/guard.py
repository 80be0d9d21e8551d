"""Faults of Redis calls -> counters, log lines and the verdicts of each node's breaker.

``Guard.run`` wraps every call a node's breaker admitted: whatever happens inside, success or
any exception, that breaker hears about it, so a half-open probe is always answered. A reply
from a healthy server (an OOM or ACL refusal, a redirection) is not an outage; everything else
that fails is. redis-py's cluster errors (``RedisClusterException``, ``SlotNotCoveredError``)
are not ``RedisError``s, but they are outages too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import redis
from redis.exceptions import NoPermissionError, OutOfMemoryError, RedisClusterException

from ec_redis.breaker import Breakers
from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters

REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, RedisClusterException, OSError)
T = TypeVar("T")


class Guard:
    def __init__(self, breakers: Breakers, counters: Counters, log: RateLimitedLog) -> None:
        self.breakers = breakers
        self.counters = counters
        self.log = log

    def allow(self, address: str) -> bool:
        """May a call go to the node at ``address`` now (its breaker decides)?"""
        if self.breakers.get(address).allow():
            return True
        self.counters.inc("skipped_breaker_open")
        return False

    def run(self, address: str, op: str, call: Callable[[], T], fallback: T) -> T:
        """``call()``, or ``fallback`` when it raised; the breaker of the node at ``address``
        settles either way. Redis faults, redis-py's cluster errors, a ``TypeError`` from an
        old redis-py, a ``MemoryError`` from an allocation, and our own bugs alike: nothing
        raises out."""
        breaker = self.breakers.get(address)
        try:
            result = call()
        except REDIS_ERRORS as exc:
            if self.count(op, exc):
                breaker.success()
            else:
                breaker.failure()
            return fallback
        except Exception as exc:
            self.counters.inc("internal_errors")
            if op == "write":
                self.counters.inc("write_errors")
            breaker.failure()
            self.log.warning(
                "internal-" + op, "ec_redis: unexpected error in a Redis %s (%s: %s); "
                "treating it as a miss", op, type(exc).__name__, exc,
            )  # fmt: skip
            return fallback
        except BaseException:
            breaker.failure()  # e.g. KeyboardInterrupt: answer the probe, then go on
            raise
        breaker.success()
        return result

    def refused_key(self, op: str, exc: BaseException) -> None:
        """Count one key's error reply in a batch that otherwise went through: that key is a
        miss, the batch's other keys are served, and the breaker hears a success (the server
        answered). A key holding another type (``WRONGTYPE``: a list or hash someone stored
        under our name) counts as ``foreign_keys``; any other refusal as a failed call."""
        if str(exc).startswith("WRONGTYPE"):
            self.counters.inc("foreign_keys")
            self.log.warning(
                "foreign-" + op, "ec_redis: a Redis %s met a key of another type (%s); that "
                "item is a miss", op, exc,
            )  # fmt: skip
        else:
            self.count(op, exc)

    def count(self, op: str, exc: BaseException) -> bool:
        """Count a failed Redis call; True when it was a reply from a healthy server (an OOM
        or ACL refusal), which is not an outage and so not a breaker failure."""
        self.counters.inc("errors")
        if op == "write":
            self.counters.inc("write_errors")
        healthy = isinstance(exc, redis.ResponseError)
        if healthy:
            # redis-py parses the error code into the class and strips it from the text
            # (and pipelines prefix the text with the failed command): test the class first.
            text = str(exc)
            oom = isinstance(exc, OutOfMemoryError) or text.startswith("OOM")
            noperm = isinstance(exc, NoPermissionError) or "NOPERM" in text
            kind = "oom" if oom else "noperm" if noperm else "reply"
            self.counters.inc(f"{kind}_errors")
        self.log.warning(
            "redis-" + op, "ec_redis: Redis %s failed (%s: %s); treating as a miss",
            op, type(exc).__name__, exc,
        )  # fmt: skip
        return healthy
