"""TieredCache on production topologies: Redis Cluster (slots, redirections, a master
killed) and Sentinel (a master killed, the same cache following the promoted replica).

Real processes on loopback: one 3-master/3-replica cluster and one master/replica/3-Sentinel
set-up per server flavor (redis-server, then valkey-server: every test runs on both). Local
tiers are off, so every read after a flush goes to Redis.
Whatever a test does to a topology, no exception may escape the cache, and every tensor read
must be bit-exact; during a failover a read may miss, never return a wrong tensor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from ec_redis.embedded import EmbeddedCluster, EmbeddedSentinel, Flavor, free_port
from tests.topology_helpers import (
    CHUNK,
    CODECS,
    FULL_COVERAGE_NO,
    Caches,
    Guarded,
    assert_one_copy_reads,
    bf16,
    errorstat,
    exact,
    node_keys,
    replicated,
    wait_for,
)

pytestmark = pytest.mark.redis


@pytest.fixture
def caches() -> Iterator[Caches]:
    made = Caches()
    yield made
    made.finish()


# -- Redis Cluster ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_setup(server_flavor: Flavor) -> Iterator[EmbeddedCluster]:
    # as docs/operating.md says to run a cluster: healthy masters keep serving while one fails over
    with EmbeddedCluster.start(
        masters=3, replicas_per_master=1, flavor=server_flavor, extra_args=FULL_COVERAGE_NO
    ) as cluster:
        yield cluster


@pytest.fixture
def cluster(cluster_setup: EmbeddedCluster) -> EmbeddedCluster:
    """The module's cluster, healthy (a test before may have failed a master over)."""
    cluster_setup.wait_ready(masters=3, timeout_s=20)
    return cluster_setup


def test_cluster_round_trip_and_one_slot_per_entry(
    cluster: EmbeddedCluster, caches: Caches
) -> None:
    writer = caches.open(cluster.url, "c-rt")
    expected = {f"small-{i}": bf16(16, seed=i) for i in range(8)}
    expected["big"] = bf16(1024, seed=100)  # 1 MiB: a head and 16 chunks of 64 KiB
    expected["odd"] = bf16(333, seed=101, width=1000)  # a chunked entry of odd size
    for key, tensor in expected.items():
        writer.put(key, tensor)
    assert writer.flush(10)

    reader = caches.open(cluster.url, "c-rt")  # a fresh cache: nothing local
    got = reader.get_many(list(expected))
    assert all(exact(got.get(k), t) for k, t in expected.items())
    assert reader.redis_stat("hits") == len(expected)
    assert all(exact(reader.get(k), t) for k, t in expected.items())  # one by one too

    # the whole chunked entry lives in one slot, on the one master serving that slot
    head = reader.head("big")
    per_master = {port: node_keys(port, head + "*") for port in cluster.masters()}
    holders = [port for port, keys in per_master.items() if keys]
    assert holders == [cluster.key_owner(head)]
    keys = per_master[holders[0]]
    assert head in keys and len(keys) >= 1 + (1024 * 512 * 2) // CHUNK
    assert {int(cluster.call(holders[0], "CLUSTER", "KEYSLOT", k)) for k in keys} == {
        key_slot(head.encode())
    }


def test_cluster_entries_spread_over_all_masters(cluster: EmbeddedCluster, caches: Caches) -> None:
    writer = caches.open(cluster.url, "c-spread")
    expected = {f"item-{i}": bf16(4, seed=i, width=64) for i in range(240)}
    for key, tensor in expected.items():
        writer.put(key, tensor)
    assert writer.flush(20)

    masters = cluster.masters()
    assert len(masters) == 3
    counts = {port: len(node_keys(port, "c-spread:*")) for port in masters}
    assert sum(counts.values()) == len(expected)
    assert all(n >= len(expected) // 6 for n in counts.values()), counts  # ~80 each

    reader = caches.open(cluster.url, "c-spread")
    got = reader.get_many(list(expected))
    assert all(exact(got.get(k), t) for k, t in expected.items())


def test_cluster_client_seeded_with_one_node(cluster: EmbeddedCluster, caches: Caches) -> None:
    """A URL naming a single node (here a replica) still reaches every master."""
    replica = cluster.replicas_of(cluster.masters()[0])[0]
    writer = caches.open(f"redis+cluster://127.0.0.1:{replica}", "c-seed")
    expected = {f"item-{i}": bf16(8, seed=i, width=64) for i in range(60)}
    expected["big"] = bf16(600, seed=7)
    for key, tensor in expected.items():
        writer.put(key, tensor)
    assert writer.flush(10)
    assert all(node_keys(port, "c-seed:*") for port in cluster.masters())  # all 3 masters

    other = cluster.masters()[1]
    reader = caches.open(f"redis+cluster://127.0.0.1:{other}", "c-seed")
    got = reader.get_many(list(expected))
    assert all(exact(got.get(k), t) for k, t in expected.items())


def _two_items_in_slot(cache: Guarded, slot: int) -> tuple[str, str]:
    found = (
        f"late-{i}" for i in range(1_000_000) if key_slot(cache.head(f"late-{i}").encode()) == slot
    )
    return next(found), next(found)


def test_cluster_reads_follow_ask_and_moved_during_a_slot_migration(
    cluster: EmbeddedCluster, caches: Caches
) -> None:
    """Migrate the slot of a chunked entry by hand while caches use it: half-migrated (ASK)
    and after the move (MOVED to a client whose slot map is stale), reads stay bit-exact.

    A new entry written into the half-migrated slot cannot be switched in while the slot's
    keys are split over two nodes (Redis answers TRYAGAIN to the multi-key swap script until
    the migration ends): the write fails cleanly -- counted, no exception, nothing
    half-visible -- and lands once the slot has moved."""
    writer = caches.open(cluster.url, "c-mig")
    big = bf16(1024, seed=5)
    writer.put("big", big)
    assert writer.flush(10)
    reader = caches.open(cluster.url, "c-mig")
    assert exact(reader.get("big"), big)  # the reader's slot map now points at the owner

    head = reader.head("big")
    slot = key_slot(head.encode())
    source = cluster.key_owner(head)
    target = next(port for port in cluster.masters() if port != source)
    ids = {n["port"]: n["id"] for n in cluster.cluster_nodes()}
    # entries that will be written into the slot while it migrates
    late_item, small_item = _two_items_in_slot(reader, slot)
    late, small = bf16(300, seed=6), bf16(8, seed=7)

    cluster.call(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
    cluster.call(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
    try:
        keys = sorted(cluster.call(source, "CLUSTER", "GETKEYSINSLOT", slot, 10_000))
        moved_now = [k for i, k in enumerate(keys) if k == head or i % 2]
        cluster.call(source, "MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *moved_now)
        assert node_keys(source, head + "*") and node_keys(target, head + "*")  # split

        asks = errorstat(cluster, source, "ASK")
        assert exact(reader.get("big"), big)  # head and odd chunks via ASK, the rest direct
        writer.put(small_item, small)  # new entries cannot be switched in yet
        writer.put(late_item, late)
        assert writer.flush(20)
        assert reader.get(small_item) is None and reader.get(late_item) is None
        assert writer.redis_stat("write_errors") == 2
        assert errorstat(cluster, source, "ASK") > asks
    finally:
        rest = cluster.call(source, "CLUSTER", "GETKEYSINSLOT", slot, 10_000)
        if rest:
            cluster.call(source, "MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *rest)
        for port in [target, source, *cluster.masters()]:
            cluster.call(port, "CLUSTER", "SETSLOT", slot, "NODE", ids[target])
    wait_for(
        lambda: all(cluster.slot_owner(slot, port) == target for port in cluster.live_ports()),
        "every node to see the slot's new owner",
    )

    moved = errorstat(cluster, source, "MOVED")
    assert exact(reader.get("big"), big)  # the reader still maps the slot to the source
    assert errorstat(cluster, source, "MOVED") > moved
    assert exact(writer.get("big"), big)
    writer.put(small_item, small)  # the slot has moved: the new entries land now
    writer.put(late_item, late)
    assert writer.flush(10)
    assert exact(reader.get(small_item), small) and exact(reader.get(late_item), late)


def test_cluster_master_killed(cluster: EmbeddedCluster, caches: Caches) -> None:
    """Kill the master of a known entry: during the failover reads miss or are exact and
    nothing raises; after the replica's promotion the same and a fresh cache work again,
    and the replicated entries are all there."""
    writer = caches.open(cluster.url, "c-kill")
    expected = {f"item-{i}": bf16(8, seed=i, width=64) for i in range(40)}
    expected["big"] = bf16(1024, seed=40)
    for key, tensor in expected.items():
        writer.put(key, tensor)
    assert writer.flush(10)

    victim = cluster.key_owner(writer.head("big"))
    (heir,) = cluster.replicas_of(victim)
    wait_for(lambda: replicated(victim, heir), "the victim's replica to catch up", 10)
    reader = caches.open(cluster.url, "c-kill")
    got = reader.get_many(list(expected))
    assert all(exact(got.get(k), t) for k, t in expected.items())

    # a cache whose breaker never opens keeps asking the dead master all through the
    # failover, one key per call; every cache gets an entry on a surviving master in every
    # call, alone or batched with entries of the dead master
    prober = caches.open(cluster.url, "c-kill", breaker_failures=1_000_000)
    survivor = next(k for k in expected if cluster.key_owner(prober.head(k)) != victim)
    assert exact(prober.get(survivor), expected[survivor])
    cluster.kill(victim)
    started = time.monotonic()
    wrong: list[str] = []
    served: dict[str, int] = {}
    asked: dict[str, int] = {}
    slowest = 0.0
    promoted = False
    n = 0
    while not promoted:
        assert time.monotonic() - started < 20, "the replica was not promoted within 20 s"
        for cache, keys in [
            (prober, [survivor]),
            (prober, ["big"]),
            (writer, ["big", "item-1", survivor]),
            (reader, ["big", "item-1", survivor]),
        ]:
            call_started = time.monotonic()
            for key in keys:
                asked[key] = asked.get(key, 0) + 1
            for key, got in cache.get_many(keys).items():
                if got is not None:
                    served[key] = served.get(key, 0) + 1
                    if not exact(got, expected[key]):
                        wrong.append(key)
            slowest = max(slowest, time.monotonic() - call_started)
        writer.put(f"during-{n}", bf16(4, seed=1000 + n, width=64))
        writer.flush(0.5)
        n += 1
        try:
            promoted = heir in cluster.masters(heir)
        except redis.RedisError:
            promoted = False
        time.sleep(0.02)
    assert not wrong, f"wrong tensors during the failover: {wrong}"
    assert served.get(survivor, 0) == asked[survivor], (served, asked)  # in every call
    assert slowest < 3.0, f"a read took {slowest:.1f}s during the failover"
    cluster.wait_ready(masters=3, timeout_s=20)

    # the original caches follow the new master once their breakers let a probe through
    def round_trip(via: Guarded, key: str, seed: int) -> bool:
        tensor = bf16(700, seed=seed)  # chunked
        via.put(key, tensor)
        return via.flush(2) and exact(fresh_reader.get(key), tensor) and exact(via.get(key), tensor)

    fresh_reader = caches.open(cluster.url, "c-kill")
    wait_for(lambda: round_trip(writer, "after-writer", 2000), "the old cache")
    # expected within ~2 s (a 1 s cool-down ceiling, then a slot-map refresh at most once a
    # second); both waits are the helper's generous 15 s, as a loaded CI machine needs
    wait_for(lambda: round_trip(reader, "after-reader", 2001), "the old reader")
    fresh = caches.open(cluster.url, "c-kill")
    assert round_trip(fresh, "after-fresh", 2002)

    # the entries were replicated before the kill: all of them survive, bit-exact, once each
    # cache has re-read the slot map (on a background thread, at most once a second, when a
    # call meets the dead master or its open breaker)
    def all_served(cache: Guarded) -> bool:
        got = cache.get_many(list(expected))
        return all(exact(got.get(k), t) for k, t in expected.items())

    for cache in (writer, reader, fresh):
        wait_for(lambda c=cache: all_served(c), "every entry again", 10)  # type: ignore[misc]

    # the dead master serves no slot any more: its breaker is forgotten, the state is closed
    def all_closed(cache: Guarded) -> bool:
        return (
            cache.redis_stat("breaker_nodes_not_closed") == 0 == cache.redis_stat("breaker_state")
        )

    assert writer.redis_stat("breaker_trips") >= 1  # the writer's breaker of it did open
    wait_for(lambda: all_closed(writer), "the dead master's breaker to be forgotten", 10)
    assert heir in cluster.masters() and victim not in cluster.masters()


@pytest.mark.parametrize("codec", list(CODECS))
def test_one_server_chunked_reads_take_one_copy(
    redis_url: str, caches: Caches, codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_one_copy_reads(redis_url, caches, f"copy-{codec}", codec, monkeypatch)


@pytest.mark.parametrize("codec", list(CODECS))
def test_cluster_chunked_reads_take_one_copy(
    cluster: EmbeddedCluster, caches: Caches, codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_one_copy_reads(cluster.url, caches, f"c-copy-{codec}", codec, monkeypatch)


def test_cluster_entry_calls_never_ask_a_server_for_their_keys(
    cluster: EmbeddedCluster, caches: Caches
) -> None:
    """Entries go to their master on its own pipeline. (redis-py 8's cluster pipeline asked the
    default node ``COMMAND GETKEYS`` for every script it carried: one extra synchronous round
    trip per write, the unexplained 0.69x of a 1.8 MB put against a plain RedisCluster SET.)"""
    masters = cluster.masters()
    for port in masters:
        cluster.call(port, "CONFIG", "RESETSTAT")
    cache = caches.open(cluster.url, "c-keys", ttl_s=600)  # sliding TTL: reads run scripts too
    expected = {f"item-{i}": bf16(8, seed=i, width=64) for i in range(24)}
    expected |= {f"big-{i}": bf16(300, seed=50 + i) for i in range(3)}
    for key, tensor in expected.items():
        cache.put(key, tensor)
    assert cache.flush(10)
    got = cache.get_many(list(expected))
    assert all(exact(got[k], t) for k, t in expected.items())
    cache.cache.delete("big-0")
    assert cache.get("big-0") is None
    stats = {port: cluster.call(port, "INFO", "commandstats") for port in masters}
    assert all(s.get("cmdstat_evalsha", {}).get("calls", 0) > 0 for s in stats.values()), stats
    assert not [p for p, s in stats.items() if "cmdstat_command|getkeys" in s], stats


# -- Sentinel ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentinel_setup(server_flavor: Flavor) -> Iterator[EmbeddedSentinel]:
    with EmbeddedSentinel.start("ecmaster", flavor=server_flavor) as setup:
        yield setup


@pytest.fixture
def sentinel(sentinel_setup: EmbeddedSentinel) -> EmbeddedSentinel:
    """The module's Sentinel set-up with a live master (a test before may have killed one)."""
    wait_for(
        lambda: sentinel_setup.server(sentinel_setup.master_port()).alive,
        "Sentinel to name a running master",
        20,
    )
    return sentinel_setup


def test_sentinel_round_trip(sentinel: EmbeddedSentinel, caches: Caches) -> None:
    writer = caches.open(sentinel.url, "s-rt")
    expected = {f"small-{i}": bf16(16, seed=i) for i in range(8)}
    expected["big"] = bf16(1024, seed=100)
    for key, tensor in expected.items():
        writer.put(key, tensor)
    assert writer.flush(10)
    reader = caches.open(sentinel.url, "s-rt")
    got = reader.get_many(list(expected))
    assert all(exact(got.get(k), t) for k, t in expected.items())
    assert reader.redis_stat("hits") == len(expected)
    assert node_keys(sentinel.master_port(), reader.head("big") + "*")  # on the master


def test_sentinel_first_listed_sentinel_down_costs_no_time(
    sentinel: EmbeddedSentinel, caches: Caches
) -> None:
    """An unreachable Sentinel listed first is skipped at once (not retried for seconds)."""
    url = sentinel.url.replace("://", f"://127.0.0.1:{free_port()},", 1)
    started = time.monotonic()
    cache = caches.open(url, "s-dead")
    tensor = bf16(64, seed=1)
    cache.put("x", tensor)
    assert cache.flush(5)
    assert exact(caches.open(url, "s-dead").get("x"), tensor)
    assert time.monotonic() - started < 3.0


def test_sentinel_cache_close_releases_sentinel_connections(
    sentinel: EmbeddedSentinel, caches: Caches
) -> None:
    def connections() -> int:
        return sum(int(s.call("INFO", "clients")["connected_clients"]) for s in sentinel.sentinels)

    before = connections()
    cache = caches.open(sentinel.url, "s-close")
    cache.put("x", bf16(4, seed=1))
    assert cache.flush(5)
    assert connections() > before  # the master lookup talked to a Sentinel
    cache.close()  # the cache object stays referenced: no garbage collection helps
    wait_for(lambda: connections() == before, "the closed cache's Sentinel connections to go", 5)


def test_sentinel_master_killed(sentinel: EmbeddedSentinel, caches: Caches) -> None:
    """Kill the master: Sentinel promotes the replica, the SAME cache follows it, and the
    replicated entries are read bit-exactly (or missed during the failover, never wrong)."""
    cache = caches.open(sentinel.url, "s-kill")
    expected = {f"item-{i}": bf16(8, seed=i, width=64) for i in range(30)}
    expected["big"] = bf16(1024, seed=30)
    for key, tensor in expected.items():
        cache.put(key, tensor)
    assert cache.flush(10)
    got = cache.get_many(list(expected))
    assert all(exact(got.get(k), t) for k, t in expected.items())

    old = sentinel.master_port()
    replica = next(s.port for s in sentinel.servers if s.port != old and s.alive)
    wait_for(lambda: replicated(old, replica), "the replica to catch up", 10)

    prober = caches.open(sentinel.url, "s-kill", breaker_failures=1_000_000)  # never skips
    assert sentinel.kill_master() == old
    started = time.monotonic()
    wrong: list[str] = []
    slowest = 0.0
    n = 0
    while True:
        assert time.monotonic() - started < 15, "Sentinel did not promote the replica in 15 s"
        for reader in (cache, prober):
            call_started = time.monotonic()
            for key, got in reader.get_many(["big", "item-1"]).items():
                if got is not None and not exact(got, expected[key]):
                    wrong.append(key)
            slowest = max(slowest, time.monotonic() - call_started)
        cache.put(f"during-{n}", bf16(4, seed=1000 + n, width=64))
        cache.flush(0.5)
        n += 1
        try:
            if sentinel.master_port() == replica:
                break
        except RuntimeError:
            pass
        time.sleep(0.05)
    assert not wrong, f"wrong tensors during the failover: {wrong}"
    assert slowest < 3.0, f"a read took {slowest:.1f}s during the failover"

    # the same cache object writes to and reads from the new master within a bounded time
    probe = bf16(700, seed=2000)

    def follows() -> bool:
        cache.put("after", probe)
        return (
            cache.flush(2)
            and bool(node_keys(replica, cache.head("after")))
            and exact(cache.get("after"), probe)
        )

    wait_for(follows, "the same cache to use the new master", 10)
    got = cache.get_many(list(expected))
    assert all(exact(got.get(k), t) for k, t in expected.items())  # replicated before the kill
    fresh = caches.open(sentinel.url, "s-kill")
    assert exact(fresh.get("after"), probe) and exact(fresh.get("big"), expected["big"])


@pytest.mark.parametrize("codec", list(CODECS))
def test_sentinel_chunked_reads_take_one_copy(
    sentinel: EmbeddedSentinel, caches: Caches, codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_one_copy_reads(sentinel.url, caches, f"s-copy-{codec}", codec, monkeypatch)
