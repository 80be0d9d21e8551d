"""Single-flight leases in the Redis tier (``tiers/lease.py``), against real servers: the
claim rides in the lookup's own round trip and is atomic against writers and other claimants;
a lease is keyed like its entry, ends with the entry's write or by itself, and is released
only by its own claimant; whatever else sits under the lease key never makes anyone wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from ec_redis import TieredCache
from ec_redis.embedded import EmbeddedCluster, Flavor
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.tiers.lease import Claim, Lease
from tests.conftest import embedding, wait_for
from tests.counters import count

pytestmark = pytest.mark.redis


@pytest.fixture
def open_cache(redis_url: str) -> Iterator[Callable[..., TieredCache]]:
    made: list[TieredCache] = []

    def make(**overrides: Any) -> TieredCache:
        config = {"redis_url": redis_url, "cpu_cache_bytes": 0, "gpu_cache_bytes": 0}
        cache = TieredCache.from_config({**config, **overrides})
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()


def claim(token: str, rows: int = 16, ttl_ms: int = 5000, *items: str) -> Claim:
    return Claim(token, ttl_ms, dict.fromkeys(items or ("x",), rows))


def lease_keys(raw: redis.Redis) -> list[bytes]:
    return sorted(k for k in raw.keys("*") if k.endswith(b":lease"))


@pytest.mark.parametrize("path", ["get", "describe"])
def test_of_many_claimants_at_once_exactly_one_wins(
    open_cache: Callable[..., TieredCache], raw: redis.Redis, path: str
) -> None:
    caches = [open_cache() for _ in range(8)]
    claims = [claim(f"c{i}") for i in range(8)]
    start = threading.Barrier(len(caches))

    def run(cache: TieredCache, mine: Claim) -> None:
        start.wait()
        if path == "get":
            assert cache.get_many(["x"], on_host=True, claim=mine) == {"x": None}
        else:
            assert cache.describe_many(["x"], mine) == {"x": None}

    threads = [threading.Thread(target=run, args=pair) for pair in zip(caches, claims, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outcomes = [c.results["x"] for c in claims]
    winners = [i for i, lease in enumerate(outcomes) if lease.won]
    assert len(winners) == 1, outcomes
    losers = [lease for lease in outcomes if not lease.won]
    assert all(lease.rows == 16 and 0 < lease.ttl_s <= 5 for lease in losers), losers
    assert raw.get(lease_keys(raw)[0]) == f"16|c{winners[0]}".encode()


def test_no_claim_where_the_entry_is_and_the_write_ends_the_lease(
    open_cache: Callable[..., TieredCache], raw: redis.Redis
) -> None:
    writer, reader = open_cache(), open_cache()
    won = claim("w")
    assert writer.get_many(["x"], on_host=True, claim=won)["x"] is None
    assert won.results["x"].won and len(lease_keys(raw)) == 1
    writer.put("x", embedding(16, 128))
    assert writer.flush(10)
    assert lease_keys(raw) == []  # the write's own round trip deleted it
    late = claim("r")
    assert reader.get_many(["x"], on_host=True, claim=late)["x"] is not None
    assert late.results == {}  # found: nothing to claim
    assert lease_keys(raw) == []


def test_a_claimant_gets_its_own_lease_back_without_a_longer_deadline(
    open_cache: Callable[..., TieredCache],
) -> None:
    cache = open_cache()
    first = claim("me", ttl_ms=3000)
    cache.get_many(["x"], on_host=True, claim=first)
    time.sleep(0.3)
    again = claim("me", ttl_ms=3000)
    cache.get_many(["x"], on_host=True, claim=again)
    assert again.results["x"].won
    assert again.results["x"].ttl_s < 2.9  # the time left, not a fresh deadline


def test_release_deletes_only_ones_own_lease(
    open_cache: Callable[..., TieredCache], raw: redis.Redis
) -> None:
    a, b = open_cache(), open_cache()
    mine = claim("a")
    a.get_many(["x"], on_host=True, claim=mine)
    b.release_lease("x", claim("b").value("x"))  # not b's: stays
    assert len(lease_keys(raw)) == 1
    a.release_lease("x", mine.value("x"))
    assert lease_keys(raw) == []


def test_leases_expire_by_themselves(
    open_cache: Callable[..., TieredCache], raw: redis.Redis
) -> None:
    cache = open_cache()
    # 2 s leases: the checks below (22 round trips) must find them all on a loaded host
    burst = claim("t", 16, 2000, *[f"i{n}" for n in range(20)])
    cache.get_many(list(burst.rows), on_host=True, claim=burst)
    assert len(burst.results) == 20 and len(lease_keys(raw)) == 20
    assert all(0 < raw.pttl(key) <= 2000 for key in lease_keys(raw))
    wait_for(lambda: lease_keys(raw) == [], 15, "the leases to expire")


@pytest.mark.parametrize(
    ("planted", "expected"),
    [
        (b"garbage", Lease(False, -1, 5.0)),  # no rows: never waited on (the gate's rule)
        (b"16|", Lease(False, -1, 5.0)),  # no token
        (b"99999999999999|t", Lease(False, -1, 5.0)),  # absurd rows
    ],
)
def test_a_foreign_lease_value_reads_as_nobodys_rows(
    open_cache: Callable[..., TieredCache], raw: redis.Redis, planted: bytes, expected: Lease
) -> None:
    cache = open_cache()
    head = cache.redis.keys.head("x")  # type: ignore[union-attr]
    raw.set(KeyBuilder.lease_of(head), planted)  # no TTL: nobody of ours set it
    mine = claim("me", ttl_ms=5000)
    assert cache.get_many(["x"], on_host=True, claim=mine) == {"x": None}
    assert mine.results["x"] == expected  # waited on for our own deadline at most


def test_a_lease_key_of_another_type_is_no_claim_and_no_crash(
    open_cache: Callable[..., TieredCache], raw: redis.Redis
) -> None:
    cache = open_cache()
    head = cache.redis.keys.head("x")  # type: ignore[union-attr]
    raw.rpush(KeyBuilder.lease_of(head), b"a list")
    mine = claim("me")
    assert cache.get_many(["x"], on_host=True, claim=mine) == {"x": None}
    assert mine.results == {}  # no lease: encoded, nobody waits
    assert count(cache.stats()["redis"], "foreign_keys") == 1


def test_a_lease_is_keyed_like_its_entry(open_cache: Callable[..., TieredCache]) -> None:
    """Model, weights, tenant salt and a request's salt (in the item id) all part leases."""
    base = open_cache()
    others = [
        open_cache(tenant_salt="tenant-b"),
        open_cache(namespace="other"),
    ]
    first = claim("a")
    base.get_many(["x"], on_host=True, claim=first)
    assert first.results["x"].won
    for cache in others:
        theirs = claim("b")
        cache.get_many(["x"], on_host=True, claim=theirs)
        assert theirs.results["x"].won, "a lease of another tenant or namespace was shared"
    salted = claim("b", 16, 5000, "%salt%x")  # a request's cache_salt lives in the item id
    base.get_many(["%salt%x"], on_host=True, claim=salted)
    assert salted.results["%salt%x"].won
    keys = KeyBuilder("ecr", ModelIdentity("m"))
    assert keys.lease("x") == keys.head("x") + ":lease"
    assert key_slot(keys.lease("x").encode()) == key_slot(keys.head("x").encode())


def test_no_claim_is_made_while_the_breaker_is_open(
    open_cache: Callable[..., TieredCache], raw: redis.Redis
) -> None:
    cache = open_cache(breaker_cooldown_s=60)
    tier = cache.redis
    assert tier is not None
    for _ in range(20):
        tier.breaker.failure()
    assert tier.breaker.state == 1  # open: the fault happened
    mine = claim("me")
    assert cache.get_many(["x"], on_host=True, claim=mine) == {"x": None}
    assert mine.results == {} and lease_keys(raw) == []


def test_a_cluster_claim_lives_in_the_entrys_slot(server_flavor: Flavor) -> None:
    with EmbeddedCluster.start(masters=3, replicas_per_master=0, flavor=server_flavor) as cluster:
        caches = [
            TieredCache.from_config(
                {"redis_url": cluster.url, "cpu_cache_bytes": 0, "gpu_cache_bytes": 0}
            )
            for _ in range(2)
        ]
        try:
            items = [f"img-{i}" for i in range(12)]
            first, second = claim("a", 16, 5000, *items), claim("b", 16, 5000, *items)
            caches[0].get_many(items, on_host=True, claim=first)
            caches[1].get_many(items, on_host=True, claim=second)
            assert all(first.results[i].won for i in items)
            assert all(not second.results[i].won for i in items)
            keys = caches[0].redis.keys  # type: ignore[union-attr]
            owners = {cluster.key_owner(keys.head(i)) for i in items}
            assert len(owners) > 1  # spread over masters, each lease with its entry
            for item in items:
                owner = cluster.key_owner(keys.head(item))
                assert cluster.call(owner, "EXISTS", keys.lease(item)) == 1
        finally:
            for cache in caches:
                cache.close()


def test_a_write_that_will_never_land_ends_the_lease(
    open_cache: Callable[..., TieredCache], raw: redis.Redis
) -> None:
    """The claimant encoded, but Redis refuses the entry (larger than max_blob_bytes): the
    lease goes at once, so waiters elsewhere encode now rather than at the deadline."""
    cache = open_cache(max_blob_bytes="64KiB")
    won = claim("me", 64, 30000)
    cache.get_many(["x"], on_host=True, claim=won)
    assert won.results["x"].won and len(lease_keys(raw)) == 1
    assert cache.put("x", embedding(1024, 128))  # 256 KiB: kept locally, refused by Redis
    assert cache.flush(10)
    assert count(cache.stats()["redis"], "write_rejected") == 1  # the refusal happened
    wait_for(lambda: lease_keys(raw) == [], 10, "the refused write to end the lease")


def test_every_write_the_queue_drops_is_reported_once() -> None:
    from ec_redis.tiers.transfer import HostCopy
    from ec_redis.writer import BackgroundWriter

    started, release = threading.Event(), threading.Event()
    lost: list[str] = []

    def sink(key: str, host: HostCopy) -> bool:
        started.set()
        release.wait(10)
        return key != "fails"

    writer = BackgroundWriter(sink, max_items=2, max_bytes=1 << 20, on_lost=lost.append)
    try:
        host = lambda n: HostCopy(embedding(n, 128))  # noqa: E731
        assert writer.submit("busy", host(4))
        assert started.wait(5)  # taken by the thread, blocked in the sink
        assert writer.submit("a", host(4)) and writer.submit("fails", host(4))
        assert writer.submit("b", host(4))  # full: "a", the oldest queued, is dropped
        assert writer.submit("huge", host(8192)) is False  # 2 MiB > max_bytes
        release.set()
        assert writer.flush(10)
        deadline = time.monotonic() + 5
        while len(lost) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # a failed write is not reported (Redis failed: waiters see it too)
        assert sorted(lost) == ["a", "huge"]
        assert writer.stats()["failed"] == 1
    finally:
        release.set()
        writer.close(2)


def test_a_huge_value_under_a_lease_key_costs_that_claim_only(
    open_cache: Callable[..., TieredCache], raw: redis.Redis
) -> None:
    """The claim answers with a prefix of a holder's value, never the whole: a 2 MiB value
    planted there once failed the whole batch (a reply larger than the reader takes) and
    opened the breaker."""
    cache = open_cache()
    cache.put("other", embedding(16, 128))
    assert cache.flush(10)
    head = cache.redis.keys.head("big")  # type: ignore[union-attr]
    raw.set(KeyBuilder.lease_of(head), b"1" * (2 << 20) + b"6|tok", px=600000)
    for _ in range(4):
        mine = claim("me", 16, 2000, "big")
        got = cache.get_many(["big", "other"], on_host=True, claim=mine)
        assert got["other"] is not None and got["big"] is None
        assert mine.results["big"] == Lease(False, -1, mine.results["big"].ttl_s)
    assert cache.redis.breaker.state == 0  # type: ignore[union-attr]
