"""Outages that cost only what they must: a dead Cluster master costs its own slots, and a
cluster or a Sentinel group that is down when the cache starts costs nothing once it is up.

Real processes on loopback, every test on redis-server and valkey-server. Local tiers are off,
so every read goes to Redis. The servers run with ``cluster-require-full-coverage no``, as
docs/operating.md says to run a cluster. No exception may escape a cache, and every tensor
read must be bit-exact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from ec_redis.embedded import EmbeddedCluster, EmbeddedSentinel, Flavor
from tests.topology_helpers import FULL_COVERAGE_NO, Caches, Guarded, bf16, exact, wait_for

pytestmark = pytest.mark.redis

ROUNDS = 5


@pytest.fixture
def caches() -> Iterator[Caches]:
    made = Caches()
    yield made
    made.finish()


@pytest.fixture
def lone_masters(server_flavor: Flavor) -> Iterator[EmbeddedCluster]:
    """Three masters without replicas: a killed master stays dead, its slots unserved."""
    with EmbeddedCluster.start(
        masters=3, replicas_per_master=0, flavor=server_flavor, extra_args=FULL_COVERAGE_NO
    ) as cluster:
        yield cluster


def owners(cluster: EmbeddedCluster, cache: Guarded, items: list[str]) -> dict[str, int]:
    return {item: cluster.key_owner(cache.head(item)) for item in items}


def test_a_dead_master_costs_only_its_own_slots(
    lone_masters: EmbeddedCluster, caches: Caches
) -> None:
    """SIGKILL one of three masters: in every round, one batch over all items serves every
    item of the two healthy masters (one-value and chunked), misses the dead master's, and
    raises nothing; writes to healthy masters land; only the dead master's breaker opens."""
    cluster = lone_masters
    cache = caches.open(cluster.url, "dead")
    expected = {f"item-{i}": bf16(8, seed=i, width=64) for i in range(60)}
    expected |= {f"big-{i}": bf16(300, seed=100 + i) for i in range(6)}  # 5 chunks each
    for key, tensor in expected.items():
        cache.put(key, tensor)
    assert cache.flush(10)
    where = owners(cluster, cache, list(expected))
    victim = where["big-0"]
    healthy = [k for k in expected if where[k] != victim]
    lost = [k for k in expected if where[k] == victim]
    assert len(set(where.values())) == 3 and lost and any(k.startswith("big") for k in healthy)

    cluster.kill(victim)
    late = caches.open(cluster.url, "dead")  # built after the kill: its seeds include the dead
    for round_ in range(ROUNDS):
        for reader in (cache, late):
            got = reader.get_many(list(expected))
            missed = [k for k in healthy if not exact(got.get(k), expected[k])]
            assert not missed, f"round {round_}: healthy items missed: {missed}"
            assert all(got.get(k) is None for k in lost)

    # writes: the healthy masters take theirs, the dead master's are dropped and counted
    fresh = {f"new-{i}": bf16(8, seed=500 + i, width=64) for i in range(30)}
    for key, tensor in fresh.items():
        cache.put(key, tensor)
    assert cache.flush(10)
    fresh_where = owners(cluster, cache, list(fresh))
    got = late.get_many(list(fresh))
    assert all(exact(got[k], t) for k, t in fresh.items() if fresh_where[k] != victim)
    assert all(got[k] is None for k in fresh if fresh_where[k] == victim)

    for reader in (cache, late):
        stats = reader.cache.stats()["redis"]
        assert stats["breaker_nodes_not_closed"] == 1, stats  # the dead master's only
        assert stats["errors"] >= 3 and stats["hits"] >= ROUNDS * len(healthy), stats
        assert "internal_errors" not in stats, stats


def test_a_cluster_down_at_start_serves_once_it_is_up(
    lone_masters: EmbeddedCluster, caches: Caches, caplog: pytest.LogCaptureFixture
) -> None:
    """Every node down when the cache starts: it starts (a warning, no exception), misses,
    and the same cache stores, reads and hears announcements once the nodes are back."""
    cluster = lone_masters
    for port in cluster.servers:
        cluster.kill(port)
    with caplog.at_level(logging.WARNING, logger="ec_redis"):
        cache = caches.open(cluster.url, "late-cluster")
    assert "unreachable at start" in caplog.text
    heard: list[str] = []
    assert cache.cache.subscribe(heard.append) is not None  # retries until the client exists
    cache.put("early", bf16(8, seed=1))
    assert cache.flush(10)
    assert cache.get("early") is None
    assert cache.redis_stat("errors") >= 1

    for server in cluster.servers.values():
        server.restart()  # same ports, same nodes.conf: the cluster forms again, empty
    cluster.wait_ready(masters=3, timeout_s=30)
    expected = {f"item-{i}": bf16(8, seed=i, width=64) for i in range(30)}
    expected["big"] = bf16(300, seed=99)

    def round_trip() -> bool:
        for key, tensor in expected.items():
            cache.put(key, tensor)
        assert cache.flush(10)
        got = cache.get_many(list(expected))
        return all(exact(got[k], t) for k, t in expected.items())

    # bounded by the breakers' cool-down (at most 1 s here) and the build backoff (2 s)
    wait_for(round_trip, "the same cache to use the cluster", 15)
    assert len(set(owners(cluster, cache, list(expected)).values())) == 3
    wait_for(lambda: "big" in heard, "the announcement of a write", 10)


def test_a_sentinel_group_down_at_start_serves_once_it_is_up(
    server_flavor: Flavor, caches: Caches, caplog: pytest.LogCaptureFixture
) -> None:
    """Every Sentinel down when the cache starts: it starts (a warning), misses, and the same
    cache stores and reads once the Sentinels are back."""
    with EmbeddedSentinel.start("ecdown", flavor=server_flavor) as setup:
        for sentinel in setup.sentinels:
            sentinel.kill()
        with caplog.at_level(logging.WARNING, logger="ec_redis"):
            cache = caches.open(setup.url, "late-sentinel")
        assert "unreachable at start" in caplog.text
        cache.put("early", bf16(8, seed=1))
        assert cache.flush(10)
        assert cache.get("early") is None

        for sentinel in setup.sentinels:
            sentinel.restart()  # the config file each Sentinel rewrote names the master
        setup.wait_ready(replicas=1)
        tensor = bf16(300, seed=2)

        def round_trip() -> bool:
            cache.put("late", tensor)
            return cache.flush(2) and exact(cache.get("late"), tensor)

        wait_for(round_trip, "the same cache to use the Sentinels' master", 15)
