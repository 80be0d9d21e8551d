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
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import torch
from redis.crc import key_slot

from ec_redis import TieredCache
from ec_redis.embedded import EmbeddedCluster, EmbeddedSentinel, Flavor, free_port
from tests.conftest import bits

pytestmark = pytest.mark.redis

CHUNK = 64 * 1024


def bf16(rows: int, seed: int, width: int = 512) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen).to(torch.bfloat16)


def exact(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return (
        got is not None
        and got.dtype == want.dtype
        and tuple(got.shape) == tuple(want.shape)
        and bits(got) == bits(want)
    )


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> float:
    """Poll ``check`` until it holds (errors count as "not yet"); seconds it took."""
    started = time.monotonic()
    last = ""
    while time.monotonic() - started < timeout_s:
        try:
            if check():
                return time.monotonic() - started
        except Exception as exc:
            last = f" (last error: {exc!r})"
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}{last}")


class Guarded:
    """A TieredCache whose get/put/flush/close calls record anything that escapes them."""

    def __init__(self, cache: TieredCache) -> None:
        self.cache = cache
        self.escaped: list[str] = []

    def _call(self, name: str, default: Any, *args: Any) -> Any:
        try:
            return getattr(self.cache, name)(*args)
        except BaseException as exc:  # nothing may escape the cache
            self.escaped.append(f"{name}{args[:1]}: {exc!r}")
            return default

    def get(self, key: str) -> torch.Tensor | None:
        result: torch.Tensor | None = self._call("get", None, key)
        return result

    def get_many(self, keys: list[str]) -> dict[str, torch.Tensor | None]:
        result: dict[str, torch.Tensor | None] = self._call("get_many", {}, keys)
        return result

    def put(self, key: str, tensor: torch.Tensor) -> None:
        self._call("put", None, key, tensor)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return bool(self._call("flush", False, timeout_s))

    def close(self) -> None:
        self._call("close", None)

    def head(self, item: str) -> str:
        assert self.cache.redis is not None
        return self.cache.redis.keys.head(item)

    def redis_stat(self, name: str) -> float:
        return float(self.cache.stats()["redis"].get(name, 0))


class Caches:
    """Opens caches for a test; ``finish()`` closes them and asserts nothing escaped."""

    def __init__(self) -> None:
        self.opened: list[Guarded] = []

    def open(self, url: str, namespace: str, **overrides: Any) -> Guarded:
        config: dict[str, Any] = {
            "redis_url": url,
            "namespace": namespace,
            "device": "cpu",
            "producer_id": "topologies",
            "compression": "none",
            "chunk_bytes": "64KiB",
            "cpu_cache_bytes": 0,  # local tiers off: reads after a flush go to Redis
            "gpu_cache_bytes": 0,
            "write_queue_items": 1024,
            "breaker_cooldown_s": 0.2,
            "breaker_max_cooldown_s": 1.0,
            "redis_socket_timeout_s": 1.0,
            "redis_connect_timeout_s": 0.5,
        }
        config.update(overrides)
        cache = Guarded(TieredCache.from_config(config))
        self.opened.append(cache)
        return cache

    def finish(self) -> None:
        for cache in self.opened:
            cache.close()
        escaped = [e for cache in self.opened for e in cache.escaped]
        self.opened.clear()
        assert not escaped, f"exceptions escaped the cache: {escaped}"


@pytest.fixture
def caches() -> Iterator[Caches]:
    made = Caches()
    yield made
    made.finish()


def node_keys(port: int, pattern: str) -> set[str]:
    """The keys one node holds (SCAN on that node alone)."""
    client = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
    try:
        return set(client.scan_iter(match=pattern, count=1000))
    finally:
        client.close()


def errorstat(cluster: EmbeddedCluster, port: int, code: str) -> int:
    """How many ``code`` (MOVED, ASK) error replies a node has sent."""
    stat = cluster.call(port, "INFO", "errorstats").get(f"errorstat_{code}", {})
    return int(stat.get("count", 0)) if isinstance(stat, dict) else 0


def replicated(port: int, replica: int) -> bool:
    """Whether the replica on ``replica`` has everything the master on ``port`` wrote."""
    master = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
    follower = redis.Redis(host="127.0.0.1", port=replica, decode_responses=True)
    try:
        offset = int(master.info("replication")["master_repl_offset"])
        return int(follower.info("replication")["slave_repl_offset"]) >= offset
    finally:
        master.close()
        follower.close()


# -- Redis Cluster ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_setup(server_flavor: Flavor) -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster.start(masters=3, replicas_per_master=1, flavor=server_flavor) as cluster:
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

    # a cache whose breaker never opens keeps asking Redis all through the failover, one
    # key per call: an entry on a surviving master is served until the cluster declares the
    # victim failed (then every master answers CLUSTERDOWN until the replica takes over)
    prober = caches.open(cluster.url, "c-kill", breaker_failures=1_000_000)
    survivor = next(k for k in expected if cluster.key_owner(prober.head(k)) != victim)
    assert exact(prober.get(survivor), expected[survivor])
    cluster.kill(victim)
    started = time.monotonic()
    wrong: list[str] = []
    served: dict[str, int] = {}
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
    assert served.get(survivor, 0) > 0  # the surviving masters served during the failover
    assert slowest < 3.0, f"a read took {slowest:.1f}s during the failover"
    cluster.wait_ready(masters=3, timeout_s=20)

    # the original caches follow the new master once their breakers let a probe through
    def round_trip(via: Guarded, key: str, seed: int) -> bool:
        tensor = bf16(700, seed=seed)  # chunked
        via.put(key, tensor)
        return via.flush(2) and exact(fresh_reader.get(key), tensor) and exact(via.get(key), tensor)

    fresh_reader = caches.open(cluster.url, "c-kill")
    wait_for(lambda: round_trip(writer, "after-writer", 2000), "the old cache")
    wait_for(lambda: round_trip(reader, "after-reader", 2001), "the old reader", 5)
    fresh = caches.open(cluster.url, "c-kill")
    assert round_trip(fresh, "after-fresh", 2002)

    # the entries were replicated before the kill: all of them survive, bit-exact
    for cache in (writer, reader, fresh):
        got = cache.get_many(list(expected))
        assert all(exact(got.get(k), t) for k, t in expected.items())
    assert heir in cluster.masters() and victim not in cluster.masters()


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
