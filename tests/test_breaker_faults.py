"""The Redis tier's circuit breaker always settles, whatever a Redis call raises.

A hypothesis property test injects random exceptions -- redis-py's errors, OSError, the cluster
client's ``RedisClusterException``/``SlotNotCoveredError`` (not ``RedisError`` subclasses),
the ``TypeError`` redis-py 5.0-5.2 raise from ``pool.get_connection()``, a ``MemoryError`` from
``torch.empty``, plain bugs -- at a random point of reads, writes, exists and deletes against a
real redis-server, with a breaker that opens on the first failure and probes at once. After
every call the breaker is never left half-open, nothing has escaped the tier, and a call
without a fault closes it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import (
    ClusterError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    RedisClusterException,
    SlotNotCoveredError,
)

from ec_redis.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from ec_redis.config import CacheConfig
from ec_redis.embedded import EmbeddedRedis
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.redis_conn import make_client
from ec_redis.tiers.guard import REDIS_ERRORS
from ec_redis.tiers.redis_tier import RedisTier, RedisTierOptions
from tests.conftest import bit_exact
from tests.counters import count

pytestmark = pytest.mark.redis

FAULTS: list[Callable[[], BaseException]] = [
    lambda: redis.ConnectionError("connection reset"),
    lambda: redis.TimeoutError("timed out"),
    lambda: redis.ResponseError("ERR something"),
    lambda: OutOfMemoryError("command not allowed when used memory > 'maxmemory'"),
    lambda: NoPermissionError("no permissions"),
    lambda: NoScriptError("No matching script"),
    lambda: ClusterError("TTL exhausted."),
    lambda: OSError("network unreachable"),
    lambda: ConnectionResetError("reset by peer"),
    lambda: RedisClusterException("Redis Cluster cannot be connected"),
    lambda: SlotNotCoveredError("slot 42 is not covered by the cluster"),
    lambda: TypeError("get_connection() takes 1 positional argument but 3 were given"),
    lambda: MemoryError(),
    lambda: ValueError("bad value"),
    lambda: KeyError("missing"),
    lambda: AttributeError("'NoneType' object has no attribute 'sendall'"),
    lambda: RuntimeError("bug"),
]
OPS = ["get", "get_many", "put_small", "put_big", "contains", "delete"]
KEYS = KeyBuilder("bf", ModelIdentity("breaker"))
SMALL = torch.arange(64, dtype=torch.float32).reshape(8, 8)
BIG = torch.arange(300 * 512, dtype=torch.float32).reshape(300, 512).to(torch.bfloat16)


class Plan:
    """Raises ``fault`` at the ``at``-th Redis-facing call (counted across every kind)."""

    def __init__(self) -> None:
        self.fault: BaseException | None = None
        self.at = -1
        self.calls = 0
        self.fired = False

    def arm(self, fault: BaseException | None, at: int) -> None:
        self.fault, self.at, self.calls, self.fired = fault, at, 0, False

    def tick(self) -> None:
        self.calls += 1
        if self.fault is not None and not self.fired and self.calls - 1 == self.at:
            self.fired = True
            raise self.fault


class _Pipeline:
    def __init__(self, pipe: Any, plan: Plan) -> None:
        self._pipe = pipe
        self._plan = plan

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        self._plan.tick()
        return self._pipe.execute(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


class FaultyRedis(redis.Redis):
    """Our real client (same pool, so chunk reads take the direct path), with a fault point
    at every command, pipeline, pipeline execute and pooled connection."""

    def __init__(self, pool: Any, plan: Plan) -> None:
        super().__init__(connection_pool=pool)
        self.plan = plan
        real = pool.get_connection

        def get_connection(*args: Any, **kwargs: Any) -> Any:
            plan.tick()
            return real(*args, **kwargs)

        pool.get_connection = get_connection

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.plan.tick()
        return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        self.plan.tick()
        return _Pipeline(super().pipeline(transaction, shard_hint), self.plan)


@contextmanager
def faulty_allocations(plan: Plan) -> Iterator[None]:
    """``torch.empty`` (the tier's tensor allocation) is a fault point too."""
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> Any:
        plan.tick()
        return real(*args, **kwargs)

    torch.empty = empty  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = real


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    started = EmbeddedRedis.start()
    yield started
    started.stop()


def make_tier(server: EmbeddedRedis, plan: Plan, ttl_s: float) -> RedisTier:
    pool = make_client(CacheConfig(redis_url=server.url)).connection_pool
    # opens on the first failure and probes at once: every call after a failure is a probe
    breaker = CircuitBreaker(failures=1, cooldown_s=0.0, max_cooldown_s=0.0)
    options = RedisTierOptions(chunk_bytes=64 * 1024, ttl_s=ttl_s, orphan_grace_s=5)
    return RedisTier(FaultyRedis(pool, plan), KEYS, options, breaker)


def run(tier: RedisTier, op: str) -> None:
    if op == "get":
        tier.get("big")
    elif op == "get_many":
        tier.get_many(["small", "big", "missing"])
    elif op == "put_small":
        tier.put("small", SMALL)
    elif op == "put_big":
        tier.put("big", BIG)
    elif op == "contains":
        tier.contains_many(["small", "big"])
    else:
        tier.delete("big")


steps = st.lists(
    st.tuples(
        st.sampled_from(OPS),
        st.one_of(st.none(), st.integers(0, len(FAULTS) - 1)),
        st.integers(0, 14),
    ),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=steps, ttl_s=st.sampled_from([0.0, 60.0]))
def test_the_breaker_is_never_left_half_open(
    server: EmbeddedRedis, steps: list[tuple[str, int | None, int]], ttl_s: float
) -> None:
    plan = Plan()
    tier = make_tier(server, plan, ttl_s)
    try:
        with faulty_allocations(plan):
            assert tier.put("big", BIG) and tier.put("small", SMALL)
            for op, fault_index, at in steps:
                fault = None if fault_index is None else FAULTS[fault_index]()
                internal_before = count(tier.stats(), "internal_errors")
                plan.arm(fault, at)
                run(tier, op)  # nothing may escape
                fired = plan.fired
                plan.arm(None, -1)
                state = tier.breaker.state
                assert state != HALF_OPEN, (op, fault, at)
                if not fired:
                    assert state == CLOSED, (op, at)
                elif not isinstance(fault, REDIS_ERRORS):
                    # not a Redis error: an internal error, and an answered (failed) probe
                    assert state == OPEN, (op, fault, at)
                    assert tier.stats()["internal_errors"] == internal_before + 1
            # a call without a fault is a probe that succeeds: the breaker closes
            tier.contains("big")
            assert tier.breaker.state == CLOSED
            assert tier.put("big", BIG)
            assert bit_exact(tier.get("big"), BIG)
            assert tier.breaker.state == CLOSED
    finally:
        tier.close()


@pytest.mark.parametrize("op", OPS)
def test_an_interrupt_still_answers_the_probe(server: EmbeddedRedis, op: str) -> None:
    """A ``KeyboardInterrupt`` mid-call goes on up, but not before the probe is answered."""
    plan = Plan()
    tier = make_tier(server, plan, 0.0)
    try:
        assert tier.put("big", BIG) and tier.put("small", SMALL)
        tier.breaker.failure()  # open; the next call is the half-open probe
        # the second Redis-facing call, or the only one: a read of a chunked entry is one
        # connection, one round trip (heads and chunks)
        plan.arm(KeyboardInterrupt(), 0 if op in ("get", "get_many") else 1)
        with pytest.raises(KeyboardInterrupt):
            run(tier, op)
        assert tier.breaker.state == OPEN
        plan.arm(None, -1)
        tier.contains("big")
        assert tier.breaker.state == CLOSED
    finally:
        tier.close()
