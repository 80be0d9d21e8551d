"""Faults against real redis-server processes: a server paused mid-stream (SIGSTOP), Redis
running out of memory (evicting, or refusing writes), and writes issued during an outage.

The kill/restart-under-load scenario lives in test_tiered_cache.py; this file covers what it
does not assert: latency bounds while Redis hangs, the breaker's open/half-open/closed cycle
with its doubling cool-down, memory pressure, and the accounting of writes lost in an outage.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import torch

from ec_redis import TieredCache
from ec_redis.breaker import CLOSED, OPEN
from ec_redis.embedded import EmbeddedRedis, Flavor
from tests.conftest import bit_exact, embedding, paused, wait_for
from tests.counters import count

pytestmark = pytest.mark.redis

KiB = 1024


def config(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "device": "cpu",
        "producer_id": "test",
        "compression": "none",
        "gpu_cache_bytes": 0,
    }
    base.update(overrides)
    return base


def redis_stats(cache: TieredCache) -> dict[str, float]:
    return dict(cache.stats()["redis"])


def writer_stats(cache: TieredCache) -> dict[str, float]:
    return dict(cache.stats()["writer"])


@pytest.fixture
def server_factory(server_flavor: Flavor) -> Iterator[Callable[..., EmbeddedRedis]]:
    """Private servers (of the test's flavor) with extra arguments, stopped (and resumed) at
    the end."""
    started: list[EmbeddedRedis] = []

    def start(*extra_args: str) -> EmbeddedRedis:
        server = EmbeddedRedis.start(server_flavor, extra_args=tuple(extra_args))
        started.append(server)
        return server

    yield start
    for server in started:
        if server.process is not None and server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGCONT)  # a stopped process ignores SIGTERM
        server.stop()


# -- a server paused mid-stream (SIGSTOP) ----------------------------------------------------

SOCKET_TIMEOUT_S = 0.5
CONNECT_TIMEOUT_S = 0.5
RETRIES = 1
BACKOFF_S = 0.02
COOLDOWN_S = 0.2
# The longest a call may take on a hung server: every attempt waits one socket timeout (a
# retry reconnects first: the kernel still accepts, so at most a connect timeout more), plus
# the capped backoff between attempts (cap = 8 * base); then 1 s of slack for a shared box.
GET_BOUND_S = (RETRIES + 1) * SOCKET_TIMEOUT_S + CONNECT_TIMEOUT_S + 8 * BACKOFF_S + 1.0
# A call the open breaker skips does no I/O at all: one such call stays under half a socket
# timeout (one preemption on a loaded host must not fail it; I/O on the paused server costs a
# whole timeout), and 100 of them together under 5 s (100 waits would be 50 s).
IMMEDIATE_S = SOCKET_TIMEOUT_S / 2
SKIPPED_100_S = 5.0


def test_paused_server_bounded_misses_breaker_cycle_and_recovery(
    private_redis: EmbeddedRedis,
) -> None:
    assert GET_BOUND_S < 3.0
    cfg = config(
        redis_url=private_redis.url,
        cpu_cache_bytes=0,  # every get goes to Redis
        redis_socket_timeout_s=SOCKET_TIMEOUT_S,
        redis_connect_timeout_s=CONNECT_TIMEOUT_S,
        redis_retries=RETRIES,
        redis_backoff_s=BACKOFF_S,
        breaker_failures=3,
        breaker_cooldown_s=COOLDOWN_S,
        breaker_max_cooldown_s=30.0,
        write_queue_items=4,
    )
    warm = {f"w{i}": embedding(rows=16, width=256, seed=i) for i in range(6)}
    cache = TieredCache.from_config(cfg)
    try:
        for key, tensor in warm.items():
            cache.put(key, tensor)
            assert cache.flush(10)  # the queue holds 4: keep every warm write
        for key, tensor in warm.items():  # Redis hits: the connections are open and warm
            assert bit_exact(cache.get(key), tensor)
        assert redis_stats(cache)["hits"] == len(warm)
        written_before = count(writer_stats(cache), "written")

        with paused(private_redis):
            # -- 1. threads get and put on the hung server until the breaker has tripped
            stop = threading.Event()
            latencies: list[float] = []
            results: list[torch.Tensor | None] = []
            errors: list[BaseException] = []

            def worker(seed: int) -> None:
                rng = random.Random(seed)
                i = 0
                while not stop.is_set():
                    try:
                        if rng.random() < 0.3:
                            i += 1
                            cache.put(f"p{seed}-{i}", embedding(rows=4, width=256, seed=i))
                        else:
                            started = time.monotonic()
                            got = cache.get(rng.choice(list(warm)))
                            latencies.append(time.monotonic() - started)
                            results.append(got)
                    except BaseException as exc:  # anything escaping the cache is a failure
                        errors.append(exc)
                        return

            threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(3)]
            for t in threads:
                t.start()
            try:
                wait_for(
                    lambda: redis_stats(cache)["breaker_trips"] >= 1,
                    timeout_s=15,
                    what="the breaker to trip",
                )
                tripped = redis_stats(cache)
                wait_for(lambda: len(latencies) >= 20, timeout_s=10, what="gets while open")
            finally:
                stop.set()
                for t in threads:
                    t.join(2 * GET_BOUND_S)
            assert not any(t.is_alive() for t in threads)
            assert errors == []
            assert results and all(r is None for r in results)  # Redis had them: misses
            assert max(latencies) < GET_BOUND_S, f"slowest get {max(latencies):.2f}s"
            assert tripped["breaker_state"] != CLOSED
            assert count(tripped, "errors") >= cfg["breaker_failures"]

            # -- 2. while open, calls skip Redis at once; each failed probe doubles the wait.
            # The queued writes go first (failed or skipped) so that only this thread's gets
            # touch the breaker and a skipped get can be told from a probe by the counter.
            assert cache.flush(15)
            skipped_latencies: list[float] = []
            deadline = time.monotonic() + 20
            while True:
                s = redis_stats(cache)
                if s["breaker_trips"] >= 2 and len(skipped_latencies) >= 10:
                    break
                assert time.monotonic() < deadline, f"no second trip: {s}"
                before = count(s, "skipped_breaker_open")
                started = time.perf_counter()
                got = cache.get("w0")
                elapsed = time.perf_counter() - started
                assert got is None
                if count(redis_stats(cache), "skipped_breaker_open") > before:
                    skipped_latencies.append(elapsed)  # this get was skipped, not a probe
                else:
                    assert elapsed < GET_BOUND_S  # it was the half-open probe: it timed out
                time.sleep(0.01)
            assert max(skipped_latencies) < IMMEDIATE_S, sorted(skipped_latencies)[-3:]
            s = redis_stats(cache)
            # one snapshot: every trip after the first came from a failed probe, which
            # doubled the cool-down (nothing succeeded since the first trip)
            assert s["breaker_cooldown_s"] == pytest.approx(
                min(COOLDOWN_S * 2 ** (s["breaker_trips"] - 1), cfg["breaker_max_cooldown_s"])
            )
            assert s["breaker_cooldown_s"] >= 2 * COOLDOWN_S
            # writes issued during the pause: none written; lost ones are counted
            w = writer_stats(cache)
            assert count(w, "written") == written_before
            assert count(w, "failed") + count(w, "dropped") > 0

        # -- 3. after SIGCONT the next probe (after the cool-down) closes the breaker
        wait_for(
            lambda: bit_exact(cache.get("w1"), warm["w1"]),
            timeout_s=20,
            what="a read through Redis after SIGCONT",
        )
        s = redis_stats(cache)
        assert s["breaker_state"] == CLOSED
        assert s["breaker_cooldown_s"] == pytest.approx(COOLDOWN_S)  # reset on success
        cache.put("after", warm["w2"])
        assert cache.flush(10)
        assert writer_stats(cache)["written"] == written_before + 1
        with TieredCache.from_config(cfg) as reader:
            assert bit_exact(reader.get("after"), warm["w2"])
    finally:
        cache.close()


def test_breaker_state_is_open_between_trip_and_probe(private_redis: EmbeddedRedis) -> None:
    """The stats report state 1 (open) right after the trip, before any probe."""
    cfg = config(
        redis_url=private_redis.url,
        cpu_cache_bytes=0,
        redis_socket_timeout_s=SOCKET_TIMEOUT_S,
        redis_connect_timeout_s=CONNECT_TIMEOUT_S,
        redis_retries=0,
        breaker_failures=2,
        breaker_cooldown_s=30.0,  # no probe during this test
        breaker_max_cooldown_s=30.0,
    )
    with TieredCache.from_config(cfg) as cache:
        assert cache.get("x") is None  # connect while the server runs
        with paused(private_redis):
            for _ in range(2):
                started = time.monotonic()
                assert cache.get("x") is None
                assert time.monotonic() - started < GET_BOUND_S
            s = redis_stats(cache)
            assert s["breaker_state"] == OPEN and s["breaker_trips"] == 1
            started = time.perf_counter()
            for _ in range(100):
                assert cache.get("x") is None
            assert time.perf_counter() - started < SKIPPED_100_S
            assert redis_stats(cache)["skipped_breaker_open"] == 100


# -- out of memory ---------------------------------------------------------------------------


def test_evicting_redis_serves_whole_entries_or_clean_misses(
    server_factory: Callable[..., EmbeddedRedis],
) -> None:
    server = server_factory("--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru")
    cfg = config(
        redis_url=server.url,
        cpu_cache_bytes=0,
        chunk_bytes="64KiB",
        write_queue_items=256,
        redis_socket_timeout_s=5.0,
    )
    # ~300 KB entries (a head and five chunks of at most 64 KiB each); 60 of them are over
    # twice maxmemory. After every batch of writes, everything written so far is read back
    # while Redis evicts: an entry is whole (bit-exact) or a miss, never anything else.
    expected = {f"e{i}": embedding(rows=42 + i % 3, width=3584, seed=i) for i in range(60)}
    keys = list(expected)
    wrong: list[str] = []
    hits = misses = 0
    with TieredCache.from_config(cfg) as writer, TieredCache.from_config(cfg) as reader:
        for batch in range(0, len(keys), 6):
            for key in keys[batch : batch + 6]:
                writer.put(key, expected[key])
            assert writer.flush(30)
            for key, got in reader.get_many(keys[: batch + 6]).items():
                if got is None:
                    misses += 1
                elif bit_exact(got, expected[key]):
                    hits += 1
                else:
                    wrong.append(key)
        ws, s, wr = writer_stats(writer), redis_stats(reader), redis_stats(writer)
    print(f"\nevicting Redis: {hits} whole reads, {misses} misses; reader {s}")
    assert wrong == []
    assert hits > 0 and misses > 0, "no eviction (or no survivor): the test proves nothing"
    # eviction made room for every write; a write whose own keys were evicted before its
    # switch (LRU's clock ticks once a second: keys just written are candidates too) is
    # refused whole: counted, its head never switched in
    incomplete = count(wr, "write_incomplete")
    assert count(ws, "written") + incomplete == len(expected)
    assert incomplete <= len(expected) // 10
    assert count(s, "bad_blobs") == 0  # an evicted chunk never looks like corruption
    assert count(s, "errors") == 0
    # a head whose chunk was evicted is a partial entry: a miss (and its remains unlinked)
    assert count(s, "misses") == misses and count(s, "partial_entries") <= misses


def test_noeviction_oom_refusals_are_counted_not_raised_and_keep_the_breaker_closed(
    server_factory: Callable[..., EmbeddedRedis],
) -> None:
    server = server_factory("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    cfg = config(
        redis_url=server.url,
        cpu_cache_bytes=0,
        chunk_bytes="64KiB",
        breaker_failures=2,
        write_queue_items=64,
    )
    expected = {f"o{i}": embedding(rows=42, width=3584, seed=i) for i in range(12)}  # ~3.6 MB
    raw = redis.Redis.from_url(server.url)
    try:
        with TieredCache.from_config(cfg) as cache:
            assert cache.redis is not None
            for key, tensor in expected.items():
                cache.put(key, tensor)
                assert cache.flush(15)
            got = {key: cache.get(key) for key in expected}  # never raises
            s = cache.stats()
            heads_left = [
                k for k, t in got.items() if t is None and raw.exists(cache.redis.keys.head(k))
            ]
    finally:
        raw.close()
    rs, ws = s["redis"], s["writer"]
    print(f"\nnoeviction Redis: redis {rs}, writer {ws}")
    assert count(rs, "oom_errors") > 0, rs
    assert count(rs, "reply_errors") == 0, rs
    assert count(ws, "failed") > 0 and ws["failed"] == rs["oom_errors"]
    assert count(ws, "written") + ws["failed"] == len(expected)
    assert rs["breaker_state"] == CLOSED and rs["breaker_trips"] == 0
    assert count(rs, "skipped_breaker_open") == 0
    # what was written is served whole; what was refused is a miss, and leaves no head: the
    # head is only ever set by the swap script, after it checked every chunk landed.
    assert all(t is None or bit_exact(t, expected[k]) for k, t in got.items())
    assert sum(t is not None for t in got.values()) == count(ws, "written")
    assert heads_left == []


# -- writes during an outage -----------------------------------------------------------------


def test_writes_during_an_outage_are_dropped_or_failed_and_counted(
    private_redis: EmbeddedRedis,
) -> None:
    cfg = config(
        redis_url=private_redis.url,
        cpu_cache_bytes=4 * 1024 * KiB,  # the local tier keeps serving what was put
        redis_connect_timeout_s=0.5,
        redis_socket_timeout_s=0.5,
        breaker_failures=2,
        breaker_cooldown_s=30.0,  # no probe: the outage lasts the whole test
        breaker_max_cooldown_s=30.0,
        write_queue_items=4,
    )
    tensors = {f"k{i}": embedding(rows=8, width=256, seed=i) for i in range(24)}
    with TieredCache.from_config(cfg) as cache:
        cache.put("before", tensors["k0"])
        assert cache.flush(10)
        before = writer_stats(cache)
        assert count(before, "written") == 1
        private_redis.kill()
        for key, tensor in tensors.items():
            started = time.monotonic()
            cache.put(key, tensor)
            assert time.monotonic() - started < 0.5  # put never waits on Redis
        assert cache.flush(20)
        after = writer_stats(cache)
        submitted = after["submitted"] - before["submitted"]
        failed = count(after, "failed") - count(before, "failed")
        dropped = count(after, "dropped") - count(before, "dropped")
        assert submitted == len(tensors)
        assert failed > 0
        assert count(after, "written") == before["written"]  # nothing landed
        assert failed + dropped + count(after, "coalesced") == submitted  # all accounted
        rs = redis_stats(cache)
        assert count(rs, "write_errors") >= cfg["breaker_failures"]
        assert count(rs, "write_skipped_breaker_open") > 0
        assert rs["breaker_trips"] == 1
        for key, tensor in tensors.items():  # only sharing is lost, not the data
            assert bit_exact(cache.get(key), tensor)
