"""TieredCache end to end: tier walk and promotion, spills, memory bounds, the write queue,
a paused / dead / absent Redis, concurrency and lifecycle."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
import redis
import torch

from ec_redis import TensorError, TieredCache
from ec_redis.breaker import CLOSED, CircuitBreaker
from ec_redis.embedded import EmbeddedRedis, free_port
from tests.conftest import BlockingSink, bit_exact, embedding, paused, wait_for
from tests.counters import count

KiB = 1024


def config(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"device": "cpu", "producer_id": "test", "compression": "none"}
    base.update(overrides)
    return base


def kib_tensor(kib: int, seed: int) -> torch.Tensor:
    """``kib`` KiB of float32 with deterministic contents."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(kib * 256, generator=gen)


def stat(stats: dict[str, Any], *path: str) -> float:
    node: Any = stats
    for part in path[:-1]:
        node = node[part]
    return count(node, path[-1])


@pytest.fixture
def fake_cache() -> Iterator[Callable[..., TieredCache]]:
    """TieredCaches over one shared in-process fakeredis server."""
    server = fakeredis.FakeServer()
    made: list[TieredCache] = []

    def make(**overrides: Any) -> TieredCache:
        cache = TieredCache.from_config(
            config(**overrides), redis_client=fakeredis.FakeRedis(server=server)
        )
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close(timeout_s=1)


def test_put_says_false_when_no_tier_took_the_item(fake_cache: Callable[..., TieredCache]) -> None:
    """Too large for the CPU tier and for the write queue: stored nowhere, and said so (a
    producer counts it as a failed save instead of a saved one)."""
    cache = fake_cache(gpu_cache_bytes=0, cpu_cache_bytes=64 * KiB, write_queue_bytes=64 * KiB)
    assert cache.put("small", kib_tensor(16, seed=1)) is True
    assert cache.put("big", kib_tensor(128, seed=2)) is False
    assert cache.get("big") is None
    assert stat(cache.stats(), "writer", "dropped_too_large") == 1


# -- the tier walk ---------------------------------------------------------------------------


@pytest.mark.redis
def test_get_walks_gpu_then_cpu_then_redis_and_promotes(redis_url: str) -> None:
    x = kib_tensor(64, seed=1)
    with TieredCache.from_config(config(redis_url=redis_url)) as producer:
        producer.put("x", x)
        assert producer.flush(10)

    cfg = config(redis_url=redis_url, gpu_cache_bytes=200 * KiB, cpu_cache_bytes=1024 * KiB)
    with TieredCache.from_config(cfg) as cache:
        assert bit_exact(cache.get("x"), x)  # from Redis, promoted into CPU and GPU
        s = cache.stats()
        assert stat(s, "gpu", "misses") == 1 and stat(s, "cpu", "misses") == 1
        assert stat(s, "redis", "hits") == 1
        assert cache.gpu.contains("x") and cache.cpu.contains("x")

        assert bit_exact(cache.get("x"), x)  # now a GPU hit
        s = cache.stats()
        assert stat(s, "gpu", "hits") == 1 and stat(s, "redis", "hits") == 1
        assert stat(s, "cpu", "hits") == 0

        for i in range(3):  # push x out of the 200 KiB GPU tier
            cache.put(f"filler{i}", kib_tensor(64, seed=10 + i))
        assert not cache.gpu.contains("x")
        assert bit_exact(cache.get("x"), x)  # a CPU hit, promoted back to the GPU
        s = cache.stats()
        assert stat(s, "cpu", "hits") == 1 and stat(s, "redis", "hits") == 1
        assert cache.gpu.contains("x")
        assert stat(s, "hits") == 3 and stat(s, "misses") == 0

        assert cache.get("never-put") is None
        s = cache.stats()
        assert stat(s, "misses") == 1 and stat(s, "redis", "misses") == 1


def test_gpu_evictions_spill_to_the_cpu_tier() -> None:
    cfg = config(gpu_cache_bytes=150 * KiB, cpu_cache_bytes=1024 * KiB)
    with TieredCache.from_config(cfg) as cache:
        tensors = {f"k{i}": kib_tensor(64, seed=i) for i in range(4)}
        for key, tensor in tensors.items():
            cache.put(key, tensor)
        s = cache.stats()
        assert stat(s, "spills") == 2 and stat(s, "gpu", "evictions") == 2
        assert stat(s, "gpu", "bytes") <= 150 * KiB
        assert not cache.gpu.contains("k0") and cache.cpu.contains("k0")
        assert bit_exact(cache.get("k0"), tensors["k0"])
        assert stat(cache.stats(), "cpu", "hits") == 1
        for key, tensor in tensors.items():
            assert bit_exact(cache.get(key), tensor)


def test_cpu_evictions_are_dropped() -> None:
    cfg = config(gpu_cache_bytes=64 * KiB, cpu_cache_bytes=128 * KiB)  # no Redis behind
    with TieredCache.from_config(cfg) as cache:
        tensors = {f"k{i}": kib_tensor(64, seed=i) for i in range(6)}
        for key, tensor in tensors.items():
            cache.put(key, tensor)
        s = cache.stats()
        assert stat(s, "cpu", "evictions") >= 1
        assert stat(s, "cpu", "bytes") <= 128 * KiB
        assert cache.get("k0") is None and cache.get("k1") is None and cache.get("k2") is None
        # k5 on the GPU, k3 and k4 spilled to the CPU (looked up per tier: a get would
        # promote and so reshuffle both tiers)
        assert bit_exact(cache.gpu.get("k5"), tensors["k5"])
        assert bit_exact(cache.cpu.get("k3"), tensors["k3"])
        assert bit_exact(cache.cpu.get("k4"), tensors["k4"])
        assert stat(cache.stats(), "cpu", "entries") == 2


def test_an_overwrite_is_served_after_the_old_value_was_spilled() -> None:
    """The CPU copy of an older value must not outlive an overwrite that went to the GPU."""
    cfg = config(gpu_cache_bytes=100 * KiB, cpu_cache_bytes=1024 * KiB)
    with TieredCache.from_config(cfg) as cache:
        old, new = kib_tensor(40, seed=1), kib_tensor(40, seed=2)
        cache.put("k", old)
        cache.put("f1", kib_tensor(40, seed=3))
        cache.put("f2", kib_tensor(40, seed=4))  # k spills to the CPU
        assert cache.cpu.contains("k") and not cache.gpu.contains("k")
        cache.put("k", new)  # the new value lands on the GPU
        assert bit_exact(cache.get("k"), new)
        cache.put("f3", kib_tensor(40, seed=5))
        cache.put("f4", kib_tensor(40, seed=6))  # k is evicted from the GPU again
        assert not cache.gpu.contains("k")
        got = cache.get("k")
        assert got is None or bit_exact(got, new), "served the value that was overwritten"


def test_an_overwrite_too_big_for_the_gpu_never_serves_the_old_gpu_copy() -> None:
    cfg = config(gpu_cache_bytes=100 * KiB, cpu_cache_bytes=1024 * KiB)
    with TieredCache.from_config(cfg) as cache:
        cache.put("k", kib_tensor(40, seed=1))
        big = kib_tensor(200, seed=2)  # over the GPU budget: goes to the CPU tier
        cache.put("k", big)
        assert bit_exact(cache.get("k"), big)


# -- memory bounds and the write queue -------------------------------------------------------


def test_every_tier_and_the_write_queue_stay_within_budget(
    fake_cache: Callable[..., TieredCache],
) -> None:
    budgets = {"gpu": 256 * KiB, "cpu": 512 * KiB, "queue": 400 * KiB}
    cache = fake_cache(
        gpu_cache_bytes=budgets["gpu"],
        cpu_cache_bytes=budgets["cpu"],
        write_queue_bytes=budgets["queue"],
        write_queue_items=64,
    )
    sink = BlockingSink(cache)  # Redis "slow": the queue fills up
    rng = random.Random(3)
    for i in range(80):
        kib = rng.choice([1, 8, 40, 100, 150, 300, 600])
        cache.put(f"k{rng.randrange(30)}", kib_tensor(kib, seed=i))
        s = cache.stats()
        assert stat(s, "gpu", "bytes") <= budgets["gpu"]
        assert stat(s, "cpu", "bytes") <= budgets["cpu"]
        assert stat(s, "writer", "queue_bytes") <= budgets["queue"]
    s = cache.stats()
    assert stat(s, "writer", "dropped") > 0  # the byte bound, not the item bound, dropped
    assert stat(s, "writer", "dropped_too_large") > 0  # 600 KiB never fits a 400 KiB queue
    sink.release.set()
    assert cache.flush(10)


def test_a_full_write_queue_drops_the_oldest_pending_write(
    fake_cache: Callable[..., TieredCache],
) -> None:
    cache = fake_cache(write_queue_items=2, cpu_cache_bytes=4096 * KiB)
    sink = BlockingSink(cache)
    tensors = {f"k{i}": kib_tensor(4, seed=i) for i in range(4)}
    cache.put("k0", tensors["k0"])
    assert sink.started.wait(10)  # k0 is in flight, the writer is stuck on it
    for key in ("k1", "k2", "k3"):
        cache.put(key, tensors[key])
    s = cache.stats()["writer"]
    assert s["dropped"] == 1
    assert s["queue_depth"] == 3  # k2, k3 queued + k0 in flight
    assert cache.writer is not None and cache.writer.pending("k1") is None
    assert bit_exact(cache.get("k1"), tensors["k1"])  # still served from the CPU tier
    sink.release.set()
    assert cache.flush(10)
    assert sink.keys == ["k0", "k2", "k3"]
    assert cache.redis is not None
    assert cache.redis.contains_many(list(tensors)) == {
        "k0": True,
        "k1": False,
        "k2": True,
        "k3": True,
    }


def test_a_newer_write_of_a_pending_key_replaces_the_older(
    fake_cache: Callable[..., TieredCache],
) -> None:
    cache = fake_cache(write_queue_items=2, cpu_cache_bytes=0)
    sink = BlockingSink(cache)
    cache.put("k0", kib_tensor(4, seed=0))
    assert sink.started.wait(10)
    old, new = kib_tensor(4, seed=1), kib_tensor(4, seed=2)
    cache.put("k", old)
    cache.put("k", new)
    assert bit_exact(cache.get("k"), new)  # read-your-writes sees the newest
    s = cache.stats()["writer"]
    assert s["coalesced"] == 1 and count(s, "dropped") == 0
    sink.release.set()
    assert cache.flush(10)
    assert sink.keys == ["k0", "k"]
    reader = fake_cache(cpu_cache_bytes=0)
    assert bit_exact(reader.get("k"), new)


def test_read_your_writes_before_the_write_lands(fake_cache: Callable[..., TieredCache]) -> None:
    cache = fake_cache(cpu_cache_bytes=0, gpu_cache_bytes=0)
    sink = BlockingSink(cache)
    first, second = kib_tensor(16, seed=1), kib_tensor(16, seed=2)
    cache.put("in-flight", first)
    assert sink.started.wait(10)
    cache.put("queued", second)
    assert cache.contains("queued") and cache.contains("in-flight")
    assert bit_exact(cache.get("in-flight"), first)
    assert bit_exact(cache.get("queued"), second)
    assert stat(cache.stats(), "pending_write_hits") == 2
    assert stat(cache.stats(), "redis", "hits") == 0
    sink.release.set()
    assert cache.flush(10)
    assert bit_exact(cache.get("queued"), second)  # now from Redis
    assert stat(cache.stats(), "redis", "hits") == 1


def test_wait_written_waits_for_the_named_writes_and_no_others(
    fake_cache: Callable[..., TieredCache],
) -> None:
    cache = fake_cache(cpu_cache_bytes=0)
    sink = BlockingSink(cache)
    cache.put("in-flight", kib_tensor(4, seed=0))
    assert sink.started.wait(10)
    cache.put("queued", kib_tensor(4, seed=1))
    assert cache.wait_written(["in-flight"], 0.05) is False
    assert cache.wait_written(["queued"], 0.05) is False
    assert cache.wait_written(["never-put"], 0.05) is True  # nothing of it pending
    releaser = threading.Timer(0.1, sink.release.set)
    releaser.start()
    assert cache.wait_written(["in-flight", "queued"], 10) is True
    releaser.join()
    assert cache.redis is not None
    assert cache.redis.contains_many(["in-flight", "queued"]) == {"in-flight": True, "queued": True}


def test_delete_also_cancels_a_pending_write(fake_cache: Callable[..., TieredCache]) -> None:
    cache = fake_cache(cpu_cache_bytes=0)
    sink = BlockingSink(cache)
    cache.put("k0", kib_tensor(4, seed=0))
    assert sink.started.wait(10)
    cache.put("k", kib_tensor(4, seed=1))
    cache.delete("k")
    assert cache.get("k") is None
    assert not cache.contains("k")
    sink.release.set()
    assert cache.flush(10)
    assert "k" not in sink.keys
    assert cache.get("k") is None  # not resurrected in Redis by the queued write


@pytest.mark.redis
def test_read_your_writes_against_a_real_redis(redis_url: str) -> None:
    cfg = config(redis_url=redis_url, cpu_cache_bytes=0, gpu_cache_bytes=0)
    with TieredCache.from_config(cfg) as cache:
        for i in range(20):
            tensor = kib_tensor(8 + i, seed=i)
            cache.put(f"k{i}", tensor)
            assert bit_exact(cache.get(f"k{i}"), tensor)  # pending or landed, never a miss


# -- a slow, paused, dead or absent Redis ----------------------------------------------------


@pytest.mark.redis
def test_put_never_waits_on_a_paused_redis(private_redis: EmbeddedRedis) -> None:
    cfg = config(
        redis_url=private_redis.url,
        redis_socket_timeout_s=2.0,
        cpu_cache_bytes=0,
        gpu_cache_bytes=0,
    )
    tensors = {f"k{i}": kib_tensor(300, seed=i) for i in range(5)}
    with TieredCache.from_config(cfg) as cache:
        cache.put("warm", kib_tensor(1, seed=99))
        assert cache.flush(10)  # the connection is open before the pause
        with paused(private_redis):
            for key, tensor in tensors.items():
                started = time.monotonic()
                cache.put(key, tensor)
                assert time.monotonic() - started < 0.5, "put waited on Redis"
            started = time.monotonic()
            assert bit_exact(cache.get("k0"), tensors["k0"])  # served from the pending write
            assert time.monotonic() - started < 0.5
        assert cache.flush(15)
        assert stat(cache.stats(), "writer", "written") == 6
    with TieredCache.from_config(cfg) as reader:
        for key, tensor in tensors.items():
            assert bit_exact(reader.get(key), tensor)


@pytest.mark.redis
def test_flush_reports_whether_the_writes_landed(private_redis: EmbeddedRedis) -> None:
    cfg = config(redis_url=private_redis.url, redis_socket_timeout_s=2.0)
    raw = redis.Redis.from_url(private_redis.url)
    try:
        with TieredCache.from_config(cfg) as cache:
            assert cache.redis is not None
            cache.put("a", kib_tensor(100, seed=1))
            assert cache.flush(10) is True
            assert raw.exists(cache.redis.keys.head("a")) == 1
            with paused(private_redis):
                cache.put("b", kib_tensor(100, seed=2))
                assert cache.flush(0.3) is False
            assert cache.flush(15) is True
            assert raw.exists(cache.redis.keys.head("b")) == 1
    finally:
        raw.close()


@pytest.mark.redis
def test_redis_outage_mid_stream_and_recovery(private_redis: EmbeddedRedis) -> None:
    cfg = config(
        redis_url=private_redis.url,
        cpu_cache_bytes=192 * KiB,  # small: most gets go to Redis
        gpu_cache_bytes=0,
        breaker_cooldown_s=0.2,
        breaker_max_cooldown_s=1.0,
        redis_socket_timeout_s=1.0,
        redis_connect_timeout_s=0.5,
        write_queue_items=16,
    )
    expected = {f"k{i}": kib_tensor(16, seed=i) for i in range(24)}
    cache = TieredCache.from_config(cfg)
    stop = threading.Event()
    errors: list[BaseException] = []
    wrong: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                roll = rng.random()
                if roll < 0.35:
                    key = rng.choice(list(expected))
                    cache.put(key, expected[key])
                elif roll < 0.4:
                    cache.flush(0.05)
                else:
                    keys = rng.sample(list(expected), 3)
                    for key, got in cache.get_many(keys).items():
                        if got is not None and not bit_exact(got, expected[key]):
                            wrong.append(key)
                time.sleep(0.001)
            except BaseException as exc:  # anything escaping the cache is a failure
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(3)]
    for t in threads:
        t.start()
    try:

        def redis_stats() -> dict[str, float]:
            return cache.stats()["redis"]  # type: ignore[no-any-return]

        wait_for(lambda: count(redis_stats(), "hits") >= 10, what="Redis hits before the outage")

        private_redis.kill()
        wait_for(lambda: redis_stats()["breaker_trips"] >= 1, what="the breaker to open")
        # stay down through two failed half-open probes (0.2 s, then 0.4 s of cooldown)
        wait_for(lambda: redis_stats()["breaker_trips"] >= 3, what="failed probes to reopen it")
        outage = redis_stats()
        assert outage["breaker_state"] != 0
        assert outage["breaker_cooldown_s"] > cfg["breaker_cooldown_s"]  # doubled
        assert count(outage, "skipped_breaker_open") > 0  # calls short-circuited meanwhile
        assert count(outage, "errors") >= 3

        private_redis.restart()
        probe = kib_tensor(16, seed=1000)

        def fresh_instance_works() -> bool:
            with TieredCache.from_config({**cfg, "cpu_cache_bytes": 0}) as writer:
                writer.put("probe", probe)
                writer.flush(2)
            with TieredCache.from_config({**cfg, "cpu_cache_bytes": 0}) as reader:
                return bit_exact(reader.get("probe"), probe)

        wait_for(fresh_instance_works, timeout_s=10, what="a fresh cache to work again")
        wait_for(
            lambda: redis_stats()["breaker_state"] == 0,
            timeout_s=10,
            what="the original cache's breaker to close",
        )
        hits_before = count(redis_stats(), "hits")
        assert bit_exact(cache.get("probe"), probe)  # read through Redis by the old instance
        assert redis_stats()["hits"] > hits_before
        raw = redis.Redis.from_url(private_redis.url)
        assert cache.redis is not None
        head = cache.redis.keys.head("after")
        try:

            def original_writes_land() -> bool:
                cache.put("after", expected["k0"])
                cache.flush(2)
                return bool(raw.exists(head))

            wait_for(original_writes_land, timeout_s=10, what="the original cache's writes")
        finally:
            raw.close()
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        cache.flush(5)
        cache.close()  # raising here fails the test too
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert wrong == []


@pytest.mark.redis
def test_redis_unreachable_from_the_start() -> None:
    before = set(threading.enumerate())
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    cfg = config(redis_url=url, redis_connect_timeout_s=0.5, cpu_cache_bytes=0)
    cache = TieredCache.from_config(cfg)
    tensor = kib_tensor(16, seed=1)
    started = time.monotonic()
    assert cache.get("x") is None
    assert time.monotonic() - started < 3.0
    cache.put("x", tensor)
    assert cache.flush(5)
    for i in range(5):
        assert cache.get(f"y{i}") is None
    assert not cache.contains("nothing")
    s = cache.stats()
    assert stat(s, "redis", "errors") >= 3
    assert stat(s, "redis", "breaker_trips") >= 1
    cache.close()
    assert cache.writer is not None and cache.writer.threads_alive() == 0
    wait_for(
        lambda: set(threading.enumerate()) <= before,
        timeout_s=5,
        what="every thread the cache started to end",
    )


# -- concurrency -----------------------------------------------------------------------------


def _versioned(key_index: int, version: int) -> torch.Tensor:
    """Content that names its (key, version) and is otherwise seeded by them; 32-160 KiB."""
    gen = torch.Generator().manual_seed(key_index * 100_003 + version)
    numel = 8_000 + (key_index * 7919 + version * 104_729) % 32_000
    out = torch.randint(-(2**31), 2**31 - 1, (numel,), generator=gen, dtype=torch.int32)
    out[0], out[1] = key_index, version
    return out


@pytest.mark.redis
def test_concurrent_puts_and_gets_never_return_a_wrong_tensor(redis_url: str) -> None:
    cfg = config(
        redis_url=redis_url,
        gpu_cache_bytes=256 * KiB,
        cpu_cache_bytes=512 * KiB,
        chunk_bytes=64 * KiB,
        writer_threads=2,
        write_queue_items=8,
    )
    caches = [TieredCache.from_config(cfg), TieredCache.from_config(cfg)]  # share via Redis
    n_keys = 10
    lock = threading.Lock()
    next_version = [0] * n_keys
    written: list[set[int]] = [set() for _ in range(n_keys)]
    errors: list[BaseException] = []
    wrong: list[str] = []
    checked = [0]

    def verify(key_index: int, got: torch.Tensor | None) -> None:
        if got is None:
            return
        if got.dtype != torch.int32 or got.dim() != 1 or int(got[0]) != key_index:
            wrong.append(f"k{key_index}: foreign tensor {got.dtype} {tuple(got.shape)}")
            return
        version = int(got[1])
        with lock:
            known = version in written[key_index]
            checked[0] += 1
        if not known or not bit_exact(got, _versioned(key_index, version)):
            wrong.append(f"k{key_index} v{version}")

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        cache = caches[seed % 2]
        try:
            for _ in range(120):
                roll = rng.random()
                k = rng.randrange(n_keys)
                if roll < 0.35:
                    with lock:
                        version = next_version[k]
                        next_version[k] += 1
                        written[k].add(version)  # valid from before the put starts
                    cache.put(f"k{k}", _versioned(k, version))
                elif roll < 0.8:
                    verify(k, cache.get(f"k{k}"))
                else:
                    picks = rng.sample(range(n_keys), 3)
                    got = cache.get_many([f"k{i}" for i in picks])
                    for i in picks:
                        verify(i, got[f"k{i}"])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for cache in caches:
        assert cache.flush(10)
    redis_hits = sum(stat(c.stats(), "redis", "hits") for c in caches)
    evictions = sum(stat(c.stats(), "gpu", "evictions") for c in caches)
    for cache in caches:
        cache.close()
    assert errors == []
    assert wrong == []
    assert checked[0] > 200  # the readers really saw data
    assert redis_hits > 0 and evictions > 0  # Redis reads and evictions were exercised


@pytest.mark.parametrize("op", ["get", "get_many", "put", "contains"])
def test_an_invalid_item_id_never_uses_up_the_half_open_probe(
    fake_cache: Callable[..., TieredCache], op: str
) -> None:
    """An empty id is refused; it must not take the breaker's only probe with it, or Redis
    would stay switched off for good."""
    clock = [0.0]
    cache = fake_cache(cpu_cache_bytes=0)
    assert cache.redis is not None
    cache.redis.breaker = CircuitBreaker(3, 1.0, 1.0, clock=lambda: clock[0])
    for _ in range(3):
        cache.redis.breaker.failure()
    clock[0] += 1.0  # the cool-down is over: the next Redis call is the probe
    try:
        if op == "get":
            cache.get("")
        elif op == "get_many":
            cache.get_many(["", "x"])
        elif op == "put":
            cache.put("", torch.ones(2))
            cache.flush(5)
        else:
            cache.contains("")
    except ValueError:
        pass  # refusing the id loudly is fine; wedging the breaker is not
    tensor = kib_tensor(4, seed=1)
    cache.put("k", tensor)
    assert cache.flush(5)
    assert cache.redis.breaker.state == CLOSED
    reader = fake_cache(cpu_cache_bytes=0)
    assert bit_exact(reader.get("k"), tensor)


# -- lifecycle and input checks --------------------------------------------------------------


@pytest.mark.redis
def test_close_is_idempotent_drains_and_stops_the_writers(redis_url: str) -> None:
    tensor = embedding(64, 128, seed=5)
    cache = TieredCache.from_config(config(redis_url=redis_url, writer_threads=3))
    assert cache.writer is not None and cache.writer.threads_alive() == 3
    cache.put("a", tensor)
    cache.close()
    cache.close()
    assert cache.writer.threads_alive() == 0
    # the pending write was drained into Redis before the threads stopped
    with TieredCache.from_config(config(redis_url=redis_url)) as reader:
        assert bit_exact(reader.get("a"), tensor)
    # everything after close is harmless
    cache.put("b", tensor)
    got = cache.get("a")
    assert got is None or bit_exact(got, tensor)
    assert cache.get_many(["a", "b"])["b"] is None
    cache.contains("a")
    cache.delete("zzz")
    assert cache.flush(1)
    assert isinstance(cache.stats(), dict)
    with TieredCache.from_config(config(redis_url=redis_url)) as ctx:
        ctx.put("c", tensor)
    assert ctx.writer is not None and ctx.writer.threads_alive() == 0


def test_cache_without_redis_works_and_closes() -> None:
    with TieredCache.from_config(config(cpu_cache_bytes=1024 * KiB)) as cache:
        assert cache.redis is None and cache.writer is None
        tensor = embedding(16, 16, seed=1)
        cache.put("a", tensor)
        assert bit_exact(cache.get("a"), tensor)
        assert cache.flush(0.1)
        assert "redis" not in cache.stats()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(torch.zeros(4, dtype=torch.complex64), id="complex64"),
        pytest.param(torch.zeros(4, dtype=torch.uint16), id="uint16"),
        pytest.param(torch.tensor(1.0), id="rank0"),
        pytest.param(torch.zeros(1, 1, 1, 1, 1), id="rank5"),
        pytest.param(torch.eye(3).to_sparse(), id="sparse"),
        pytest.param([1.0, 2.0], id="list"),
    ],
)
def test_unsupported_tensors_raise_tensor_error_and_store_nothing(
    fake_cache: Callable[..., TieredCache], bad: Any
) -> None:
    cache = fake_cache(gpu_cache_bytes=1024 * KiB)
    with pytest.raises(TensorError):
        cache.put("bad", bad)
    assert isinstance(TensorError("x"), ValueError)
    assert cache.flush(5)
    s = cache.stats()
    assert stat(s, "gpu", "entries") == 0 and stat(s, "cpu", "entries") == 0
    assert stat(s, "writer", "submitted") == 0
    cache.put("good", torch.ones(3))  # the cache is still fine
    assert bit_exact(cache.get("good"), torch.ones(3))


@pytest.mark.parametrize("bad", ["", None, 7, b"id"])
def test_invalid_item_ids_are_a_clear_error_before_any_tier(bad: object) -> None:
    with TieredCache.from_config({"cpu_cache_bytes": "1MiB"}) as cache:
        with pytest.raises(ValueError, match="item id"):
            cache.put(bad, embedding())  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="item id"):
            cache.get(bad)  # type: ignore[arg-type]
        assert cache.stats()["cpu"]["entries"] == 0


def test_on_host_lookups_return_owned_host_tensors_and_promote_nothing() -> None:
    tensor = embedding(64, 128, seed=3)
    nbytes = tensor.numel() * tensor.element_size()
    config = {"gpu_cache_bytes": nbytes * 4, "cpu_cache_bytes": nbytes * 4}
    with TieredCache.from_config(config) as cache:
        cache.put("k", tensor)
        gpu_hit = cache.get_many(["k"], on_host=True)["k"]
        assert gpu_hit is not None and torch.equal(gpu_hit, tensor)
        cache.gpu.delete("k")
        cache.cpu.put("k", tensor)  # only the CPU tier has it now
        got = cache.get_many(["k", "absent"], on_host=True)
        assert got["absent"] is None
        found = got["k"]
        assert found is not None and found.device.type == "cpu" and torch.equal(found, tensor)
        assert not cache.gpu.contains("k")  # an on-host lookup promotes nothing to the GPU
        assert cache.stats()["cpu"]["hits"] == 1


@pytest.mark.redis
def test_describe_many_reads_heads_only(
    private_redis: EmbeddedRedis,
) -> None:
    """A pure producer's "already published?" check: dtype and shape from the blob head,
    never the tensor."""
    with TieredCache.from_config(
        config(redis_url=private_redis.url, chunk_bytes="64KiB", cpu_cache_bytes=0)
    ) as cache:
        big, small = embedding(600, 128, seed=1), embedding(4, 128, seed=2)
        cache.put("big", big)
        cache.put("small", small)
        assert cache.flush(10)
        client = redis.Redis.from_url(private_redis.url)
        head = next(k for k in client.scan_iter("*") if k.endswith(b"big}"))
        client.config_resetstat()
        described = cache.describe_many(["big", "small", "absent"])
        assert described == {
            "big": (torch.bfloat16, (600, 128)),
            "small": (torch.bfloat16, (4, 128)),
            "absent": None,
        }
        stats = client.info("commandstats")
        assert "cmdstat_get" not in stats and "cmdstat_getrange" in stats  # heads only
        client.set(head, b"ECRB not a header at all" * 8)  # corrupt: not published
        assert cache.describe_many(["big"]) == {"big": None}
        client.close()


def test_a_write_not_yet_in_redis_is_not_published(
    fake_cache: Callable[..., TieredCache],
) -> None:
    """``describe_many`` answers "published" only once the write landed: one still queued or
    in flight may yet be dropped (here by a full queue), and a producer told "published"
    skips encoding the item for good."""
    cache = fake_cache(write_queue_items=1, cpu_cache_bytes=0)
    sink = BlockingSink(cache)
    tensors = {key: kib_tensor(4, seed=i) for i, key in enumerate(["in-flight", "lost", "late"])}
    cache.put("in-flight", tensors["in-flight"])
    assert sink.started.wait(10)
    cache.put("lost", tensors["lost"])
    assert cache.describe_many(["in-flight", "lost"]) == {"in-flight": None, "lost": None}
    cache.put("late", tensors["late"])  # the full queue drops "lost"
    assert stat(cache.stats(), "writer", "dropped") == 1
    assert cache.describe_many(list(tensors)) == dict.fromkeys(tensors)
    sink.release.set()
    assert cache.flush(10)
    shape = (torch.float32, (4 * 256,))
    assert cache.describe_many(list(tensors)) == {"in-flight": shape, "lost": None, "late": shape}
