"""LazyCluster (a cluster client built on first use) and redis-py's cluster errors as outages,
without servers: a build function that fails as redis-py's constructor does, a fake clock."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import redis
import torch
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisClusterException, SlotNotCoveredError

from ec_redis.breaker import OPEN, CircuitBreaker
from ec_redis.cluster_client import LazyCluster
from ec_redis.config import CacheConfig
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.redis_conn import check_connection, make_client
from ec_redis.tiers.redis_tier import RedisTier, RedisTierOptions


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Seeds:
    """Builds a "cluster client" once ``up``; until then fails as ``RedisCluster(...)`` does."""

    def __init__(self) -> None:
        self.up = False
        self.attempts = 0

    def build(self) -> Any:
        self.attempts += 1
        if not self.up:
            raise RedisClusterException("Redis Cluster cannot be connected. (every seed down)")
        return redis.Redis(host="127.0.0.1", port=1)  # never connected by these tests


def test_a_cluster_client_is_built_on_first_use_and_retried_after_a_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seeds, clock = Seeds(), Clock()
    lazy = LazyCluster(seeds.build, ExponentialBackoff(cap=2.0, base=0.5), clock)
    assert seeds.attempts == 0 and lazy.built is None  # nothing happens when it is made
    with caplog.at_level(logging.WARNING, logger="ec_redis"):
        for _ in range(3):
            with pytest.raises(redis.ConnectionError, match="every seed down"):
                lazy.ping()  # an outage redis-py users know, not RedisClusterException
    assert seeds.attempts == 1  # within the backoff, no new attempt
    assert caplog.text.count("no Redis Cluster seed node answers") == 1
    clock.now += 1.0  # backoff after one failure: 0.5 * 2 = 1 s
    with pytest.raises(redis.ConnectionError):
        lazy.cluster()
    assert seeds.attempts == 2
    clock.now += 2.0
    seeds.up = True
    with caplog.at_level(logging.WARNING, logger="ec_redis"):
        client = lazy.cluster()
    assert lazy.built is client and lazy.cluster() is client and seeds.attempts == 3
    assert "reachable after 2 failed attempts" in caplog.text
    lazy.close()
    with pytest.raises(redis.ConnectionError, match="closed"):
        lazy.cluster()
    assert seeds.attempts == 3


def test_callers_never_queue_behind_a_slow_build_and_its_backoff_starts_when_it_fails() -> None:
    """Black-holed seeds make a build take its connect timeouts: other threads miss at once
    meanwhile, and the next attempt waits a backoff counted from the failure."""
    clock, building, release = Clock(), threading.Event(), threading.Event()

    def slow_build() -> Any:
        building.set()
        release.wait(10)
        clock.now += 5.0  # the attempt took longer than the whole backoff
        raise RedisClusterException("Redis Cluster cannot be connected. (timeouts)")

    lazy = LazyCluster(slow_build, ExponentialBackoff(cap=2.0, base=0.5), clock)
    errors: list[Exception] = []

    def build_in_background() -> None:
        try:
            lazy.cluster()
        except redis.ConnectionError as exc:
            errors.append(exc)

    builder = threading.Thread(target=build_in_background)
    builder.start()
    assert building.wait(10)
    with pytest.raises(redis.ConnectionError, match="being built"):
        lazy.cluster()  # does not wait for the builder
    release.set()
    builder.join(10)
    assert len(errors) == 1  # the builder itself got the outage
    with pytest.raises(redis.ConnectionError, match="timeouts"):
        lazy.cluster()  # still within the backoff that began when the build failed
    assert lazy.build_failures == 1


def test_make_client_does_no_io_for_a_cluster_and_the_start_check_says_outage() -> None:
    """``TieredCache`` starts with the whole cluster down: building the client raises nothing,
    and the start-up check calls it an outage (a warning), not a configuration error."""
    client = make_client(
        CacheConfig(redis_url="redis+cluster://127.0.0.1:1,127.0.0.1:2", redis_retries=0)
    )
    assert isinstance(client, LazyCluster) and client.built is None
    outage = check_connection(client)
    assert outage is not None and "ConnectionError" in outage
    client.close()


class _Refusing:
    """A client whose every pipeline fails with one of redis-py's cluster errors."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def pipeline(self, transaction: bool = True) -> Any:
        raise self.error

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "error",
    [SlotNotCoveredError("slot 7 not covered"), RedisClusterException("cannot be connected")],
)
def test_cluster_errors_are_outages_not_internal_errors(error: Exception) -> None:
    """They are not ``RedisError``s, but they are infrastructure: a miss, ``errors`` and a
    breaker failure, like a refused connection; never ``internal_errors``."""
    breaker = CircuitBreaker(failures=2)
    tier = RedisTier(
        _Refusing(error), KeyBuilder("t", ModelIdentity("m")), RedisTierOptions(), breaker
    )
    assert tier.get_many(["a", "b"]) == {"a": None, "b": None}
    assert not tier.put("a", torch.ones(4))
    stats = tier.stats()
    assert stats["errors"] == 2 and "internal_errors" not in stats, stats
    assert breaker.state == OPEN  # two failures in a row opened it


def test_redis_commands_pass_through_even_where_a_name_could_clash() -> None:
    """``get``/``set``/``delete`` are Redis commands of the built client (the CLI's doctor
    probes with them), never methods of the wrapper."""
    from redis.cluster import RedisCluster

    calls: list[tuple[str, tuple[object, ...]]] = []

    class Fake(RedisCluster):  # type: ignore[misc]
        def __init__(self) -> None:  # no connection
            pass

        def get(self, *args: object) -> object:  # type: ignore[override]
            calls.append(("get", args))
            return b"v"

    lazy = LazyCluster.of(Fake())
    assert lazy.get("k") == b"v" and calls == [("get", ("k",))]
