"""Redis writes in a writer process (``offload/``), against real redis-server processes: the
bytes arrive whole, counters are counted once, and a child that dies, hangs or cannot start
costs neither the engine nor a half-visible entry."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch

from ec_redis import TieredCache
from ec_redis.config import CacheConfig
from ec_redis.embedded.server import EmbeddedRedis
from ec_redis.offload import sink as sink_module
from tests.conftest import bit_exact, embedding, emptied, paused, wait_for

pytestmark = pytest.mark.redis


def settings(url: str, **more: Any) -> dict[str, Any]:
    return {
        "redis_url": url,
        "namespace": "offload",
        "device": "cpu",
        "gpu_cache_bytes": 0,
        "cpu_cache_bytes": 0,  # a hit can then only come from Redis
        "writer_process": True,
        **more,
    }


@pytest.fixture
def writing(redis_url: str) -> Iterator[TieredCache]:
    """A cache whose writer process is up."""
    cache = TieredCache.from_config(settings(redis_url))
    assert cache.warm_writes(60), "the writer process never came up"
    yield cache
    cache.close()


def reader(url: str) -> TieredCache:
    return TieredCache.from_config(settings(url, writer_process=False))


def writer_stat(cache: TieredCache, name: str) -> float:
    stats = cache.stats()["writer"]
    assert name in stats, f"{name} missing from {sorted(stats)}"
    return float(stats[name])


def test_a_write_lands_whole_from_another_process(writing: TieredCache, redis_url: str) -> None:
    item = embedding(4096, 1024, seed=1)  # 8 MiB: two chunks
    assert writing.process_sink is not None
    pids = writing.process_sink.pids()
    assert pids and os.getpid() not in pids
    assert writing.put("img", item) and writing.flush(30)
    other = reader(redis_url)
    try:
        assert bit_exact(other.get("img"), item)
    finally:
        other.close()
    assert writer_stat(writing, "process_fallback_writes") == 0
    assert writer_stat(writing, "written") == 1
    assert writer_stat(writing, "process_breaker_state") == 0  # closed, from the child


def test_counters_are_counted_once_as_if_written_here(redis_url: str) -> None:
    """The tier counters the child sends back equal those of the same write made in-process."""
    item = embedding(1024, 512, seed=2)
    counted = {}
    for offload in (True, False):
        cache = TieredCache.from_config(settings(redis_url, writer_process=offload))
        try:
            assert cache.warm_writes(60)
            assert cache.put(f"img-{offload}", item) and cache.flush(30)
            stats = cache.stats()
            counted[offload] = {k: stats["redis"][k] for k in ("writes", "bytes_written")}
            if offload:
                assert writer_stat(cache, "process_fallback_writes") == 0
        finally:
            cache.close()
    assert counted[True] == counted[False] and counted[True]["writes"] == 1


def test_the_configuration_survives_the_trip_to_the_child() -> None:
    """The child rebuilds the config from JSON: every key of every type must round-trip."""
    config = CacheConfig.from_dict(
        {"redis_url": "redis://127.0.0.1:1/0", "namespace": "n1", "ttl_s": 12.5,
         "compression": "lz4", "write_queue_bytes": "64MiB", "tenant_salt": "s"}
    )  # fmt: skip
    raw = json.loads(json.dumps(dataclasses.asdict(config)))
    assert CacheConfig.from_dict(raw) == config


def test_a_child_killed_mid_write_shows_nothing_half_and_is_replaced(
    private_redis: EmbeddedRedis,
) -> None:
    """Redis paused, the child blocks mid-write (a 64 MiB value fills its socket); SIGKILL it.
    Nothing of the item is visible meanwhile, its chunks are never immortal, and the write is
    retried in a fresh child once Redis is back."""
    url = emptied(private_redis)
    cache = TieredCache.from_config(settings(url, orphan_grace_s=1.0))
    try:
        assert cache.warm_writes(60)
        assert cache.put("warm", embedding(8, 8)) and cache.flush(30)  # connected
        (pid,) = cache.process_sink.pids()  # type: ignore[union-attr]
        item = embedding(32768, 1024, seed=3)  # 64 MiB
        with paused(private_redis):
            assert cache.put("big", item)
            time.sleep(1.0)  # the child is inside the write, blocked on the paused server
            assert cache.writer is not None and cache.writer.pending("big") is not None
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: writer_stat(cache, "process_deaths") == 1, 30, "the death seen")
        other = reader(url)
        try:  # Redis back, the retry under way: the item is missing or whole, never half
            got = other.get("big")
            assert got is None or bit_exact(got, item)
        finally:
            other.close()
        assert cache.flush(60)
        assert writer_stat(cache, "process_retried_writes") == 1
        (new_pid,) = cache.process_sink.pids()  # type: ignore[union-attr]
        assert new_pid != pid
        other = reader(url)
        try:
            assert bit_exact(other.get("big"), item)
        finally:
            other.close()
        client = redis.Redis.from_url(url)
        try:  # the killed write's chunks expire (orphan grace): what stays is two entries
            wait_for(lambda: all(client.pttl(k) == -1 for k in client.scan_iter("*")), 30)
            left = len(list(client.scan_iter("offload:*")))
            same = TieredCache.from_config(settings(url, namespace="again", writer_process=False))
            assert same.put("warm", embedding(8, 8)) and same.put("big", item)
            assert same.flush(30)
            same.close()
            assert left == len(list(client.scan_iter("again:*")))
        finally:
            client.close()
        assert cache.put("after", embedding(16, 16)) and cache.flush(30)  # engine unharmed
    finally:
        cache.close()


def test_a_hung_child_is_killed_after_the_reply_timeout_and_the_write_retried(
    writing: TieredCache, redis_url: str
) -> None:
    assert writing.process_sink is not None
    (pid,) = writing.process_sink.pids()
    writing.process_sink._reply_timeout_s = 1.0
    os.kill(pid, signal.SIGSTOP)  # silent, not dead
    item = embedding(256, 256, seed=4)
    assert writing.put("img", item)
    assert writing.flush(60)
    assert writer_stat(writing, "process_deaths") == 1
    assert writer_stat(writing, "process_retried_writes") == 1
    wait_for(lambda: not pid_alive(pid), 10, "the hung child reaped")
    other = reader(redis_url)
    try:
        assert bit_exact(other.get("img"), item)
    finally:
        other.close()


def test_a_child_that_cannot_start_costs_nothing(
    monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """A broken interpreter (or no descriptor left): the write is made on the writer thread,
    counted, and no start is retried before the back-off."""
    monkeypatch.setattr(sink_module, "command", lambda *_: ["/nonexistent/python3"])
    cache = TieredCache.from_config(settings(redis_url))
    try:
        assert not cache.warm_writes(30)
        item = embedding(64, 64, seed=5)
        assert cache.put("img", item) and cache.flush(30)
        assert writer_stat(cache, "process_start_failures") == 1
        assert writer_stat(cache, "process_fallback_writes") == 1
        assert writer_stat(cache, "process_alive") == 0
        other = reader(redis_url)
        try:
            assert bit_exact(other.get("img"), item)
        finally:
            other.close()
    finally:
        cache.close()


def test_no_memfd_means_the_writer_thread_writes(
    monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    def no_descriptors(*_: Any) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "memfd_create", no_descriptors)
    cache = TieredCache.from_config(settings(redis_url))
    try:
        cache.warm_writes(30)
        wait_for(lambda: writer_stat(cache, "process_start_failures") == 1, 30)
        item = embedding(64, 64, seed=6)
        assert cache.put("img", item) and cache.flush(30)
        assert writer_stat(cache, "process_fallback_writes") == 1
    finally:
        cache.close()


def test_writer_process_false_starts_none(redis_url: str) -> None:
    cache = TieredCache.from_config(settings(redis_url, writer_process=False))
    try:
        assert cache.process_sink is None
        assert cache.put("img", embedding(8, 8)) and cache.flush(10)
        assert "process_starts" not in cache.stats()["writer"]
    finally:
        cache.close()


def test_the_child_exits_when_its_parent_dies(redis_url: str) -> None:
    """An engine killed outright leaves no writer process behind."""
    script = textwrap.dedent(
        f"""
        import os, sys
        from ec_redis import TieredCache
        cache = TieredCache.from_config({settings(redis_url)!r})
        assert cache.warm_writes(60)
        print(cache.process_sink.pids()[0], flush=True)
        sys.stdin.read()
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert pid_alive(pid)
        parent.kill()
        parent.wait(30)
        wait_for(lambda: not pid_alive(pid), 30, "the orphaned writer process to exit")
    finally:
        if parent.poll() is None:
            parent.kill()


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_item_of_every_dtype_crosses_whole(writing: TieredCache, redis_url: str) -> None:
    other = reader(redis_url)
    try:
        for i, dtype in enumerate((torch.float32, torch.float16, torch.int8, torch.bool)):
            item = (torch.arange(3 * 257) % 7).reshape(3, 257).to(dtype)
            assert writing.put(f"d{i}", item) and writing.flush(30)
            assert bit_exact(other.get(f"d{i}"), item), dtype
        assert writing.put("empty", torch.empty(0, 16, dtype=torch.bfloat16))
        assert writing.flush(30)
        got = other.get("empty")
        assert got is not None and tuple(got.shape) == (0, 16)
    finally:
        other.close()
    assert writer_stat(writing, "process_fallback_writes") == 0


def test_an_arena_gives_a_videos_pages_back_and_serves_the_next_item(
    redis_url: str,
) -> None:
    """After an item larger than KEEP_BYTES the arena is emptied; the child's older, larger
    mapping of it must then still read the next (smaller, then larger) items right."""
    from ec_redis.offload.arena import KEEP_BYTES

    cache = TieredCache.from_config(settings(redis_url, write_queue_bytes="256MiB"))
    other = reader(redis_url)
    try:
        assert cache.warm_writes(60) and cache.process_sink is not None
        video = embedding(KEEP_BYTES // 2048 + 1024, 1024, seed=7)  # just over KEEP_BYTES
        image = embedding(2048, 1024, seed=8)
        for key, item in (("video", video), ("image", image), ("video2", video)):
            assert cache.put(key, item) and cache.flush(60)
            (child,) = cache.process_sink._idle
            if item is video:
                assert child.arena.size == 0  # its pages given back
            else:
                assert image.numel() * 2 <= child.arena.size <= KEEP_BYTES
            assert bit_exact(other.get(key), item), key
        assert writer_stat(cache, "process_fallback_writes") == 0
        assert writer_stat(cache, "process_deaths") == 0
    finally:
        other.close()
        cache.close()


def test_the_childs_breaker_opens_on_failed_writes_and_is_reported(
    private_redis: EmbeddedRedis,
) -> None:
    """The breaker that sees the writes is the child's: its state is reported from there, and
    its failures are counted once in the parent's tier counters."""
    url = emptied(private_redis)
    cache = TieredCache.from_config(
        settings(url, breaker_failures=1, breaker_cooldown_s=60, redis_retries=0)
    )
    try:
        assert cache.warm_writes(60)
        assert cache.put("ok", embedding(8, 8)) and cache.flush(30)
        assert writer_stat(cache, "process_breaker_state") == 0
        private_redis.stop()
        for i in range(3):
            cache.put(f"lost{i}", embedding(8, 8, seed=i))
        assert cache.flush(60)
        assert writer_stat(cache, "process_breaker_state") == 1  # open
        stats = cache.stats()
        assert stats["redis"]["write_errors"] >= 1
        assert stats["redis"]["write_skipped_breaker_open"] >= 1
        assert stats["redis"]["breaker_state"] == 0  # the parent's own saw none of it
        assert writer_stat(cache, "process_fallback_writes") == 0
    finally:
        cache.close()
