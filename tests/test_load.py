"""Load: six threads mixing puts and gets of encoder-sized bf16 tensors against a real
redis-server for a fixed time, with a small CPU tier so most reads go to Redis.

Asserted: no wrong tensor (each tensor is derived from its key and checked by content hash
on every read), nothing raises, bounded RSS growth, no thread or connection left behind after
``close()``. Printed (``pytest -s``): throughput and get/put latency percentiles.
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch
import xxhash

from ec_redis import TieredCache
from ec_redis.embedded import EmbeddedRedis
from tests.counters import count

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MiB = 1024**2
WIDTH = 3584  # Qwen2.5-VL-7B's hidden size
# (rows, share of operations, distinct keys): a 448x448 image (256 rows), a large image
# (1369 rows, 9.4 MiB) and an occasional video-sized item (2304 rows, 15.8 MiB)
SIZES = ((256, 0.60, 24), (1369, 0.37, 12), (2304, 0.03, 4))
THREADS = 6
WARMUP_S = 1.5
DURATION_S = 8.0
PUT_SHARE = 0.3
CPU_CACHE_BYTES = 32 * MiB  # small: most reads miss locally and go to Redis
WRITE_QUEUE_BYTES = 128 * MiB
# The process may hold what the cache is allowed to hold (CPU tier, write queue) plus
# buffers that are bounded but not budgeted: redis-py's per-connection read buffers, blobs
# being decoded, Python's own pools. Measured growth: ~120-240 MiB on a 2-core box.
RSS_SLACK = 256 * MiB
RSS_BOUND = CPU_CACHE_BYTES + WRITE_QUEUE_BYTES + RSS_SLACK
# glibc keeps freed memory in per-thread arenas (six threads moving 4-16 MB buffers retain
# several hundred MiB that any later allocation reuses): RSS is read after handing that back
# with malloc_trim(0), so retention by the allocator does not pass for growth of the cache.
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # None off glibc


def tensor_for(key: str) -> torch.Tensor:
    """The one tensor ``key`` stands for: seeded by the key, stamped with its hash."""
    rows = int(key.split("-")[0][1:])
    seed = xxhash.xxh64_intdigest(key.encode()) & (2**63 - 1)
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(rows, WIDTH, generator=gen).to(torch.bfloat16)
    out.view(-1).view(torch.int64)[0] = seed  # distinct even if two seeds drew alike
    return out


def digest(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.detach().contiguous().view(-1).view(torch.uint8).numpy().data)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_rss_bytes() -> int:
    """RSS after a garbage collection and after the allocator returned its free memory."""
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
    return rss_bytes()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


class Worker:
    """One thread's loop and its own records (no shared lists, no lock contention)."""

    def __init__(self, seed: int, cache: TieredCache, tensors: dict[str, torch.Tensor]) -> None:
        self.rng = random.Random(seed)
        self.cache = cache
        self.tensors = tensors
        self.digests = {key: digest(t) for key, t in tensors.items()}
        self.by_size = {
            rows: [k for k in tensors if k.startswith(f"r{rows}-")] for rows, _, _ in SIZES
        }
        self.get_s: list[float] = []
        self.put_s: list[float] = []
        self.bytes_moved = 0
        self.hits = 0
        self.wrong: list[str] = []
        self.errors: list[BaseException] = []

    def pick(self) -> str:
        rows = self.rng.choices([r for r, _, _ in SIZES], [w for _, w, _ in SIZES])[0]
        return self.rng.choice(self.by_size[rows])

    def run(self, until: float, record: bool) -> None:
        while time.monotonic() < until:
            key = self.pick()
            try:
                if self.rng.random() < PUT_SHARE:
                    tensor = self.tensors[key]
                    started = time.perf_counter()
                    self.cache.put(key, tensor)
                    elapsed = time.perf_counter() - started
                    if record:
                        self.put_s.append(elapsed)
                        self.bytes_moved += tensor.numel() * 2
                else:
                    started = time.perf_counter()
                    got = self.cache.get(key)
                    elapsed = time.perf_counter() - started
                    if got is not None:
                        want = self.tensors[key]
                        if (
                            got.dtype != want.dtype
                            or tuple(got.shape) != tuple(want.shape)
                            or digest(got) != self.digests[key]
                        ):
                            self.wrong.append(key)
                    if record:
                        self.get_s.append(elapsed)
                        if got is not None:
                            self.hits += 1
                            self.bytes_moved += got.numel() * 2
            except BaseException as exc:  # anything escaping the cache is a failure
                self.errors.append(exc)
                return


def run_phase(workers: list[Worker], seconds: float, record: bool) -> None:
    until = time.monotonic() + seconds
    threads = [
        threading.Thread(target=w.run, args=(until, record), name=f"load-{i}", daemon=True)
        for i, w in enumerate(workers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    assert not any(t.is_alive() for t in threads), "a worker hung"


def test_mixed_load_is_correct_bounded_and_leaves_nothing_behind(
    private_redis: EmbeddedRedis,
) -> None:
    admin = redis.Redis.from_url(private_redis.url)
    try:
        _run_load(private_redis, admin)
    finally:
        admin.close()


def _run_load(server: EmbeddedRedis, admin: redis.Redis) -> None:
    tensors = {f"r{rows}-{i}": tensor_for(f"r{rows}-{i}") for rows, _, n in SIZES for i in range(n)}
    cfg: dict[str, Any] = {
        "redis_url": server.url,
        "device": "cpu",
        "producer_id": "load",
        "gpu_cache_bytes": 0,
        "cpu_cache_bytes": CPU_CACHE_BYTES,
        "write_queue_bytes": WRITE_QUEUE_BYTES,
        "write_queue_items": 16,
        "redis_socket_timeout_s": 10.0,  # generous: the machine is shared
    }
    threads_before = set(threading.enumerate())
    clients_before = len(admin.client_list())
    cache = TieredCache.from_config(cfg)
    try:
        workers = [Worker(seed, cache, tensors) for seed in range(THREADS)]
        run_phase(workers, WARMUP_S, record=False)
        rss_before = live_rss_bytes()
        started = time.monotonic()
        run_phase(workers, DURATION_S, record=True)
        elapsed = time.monotonic() - started
        raw_growth = rss_bytes() - rss_before
        rss_growth = live_rss_bytes() - rss_before
        stats = cache.stats()
    finally:
        cache.close()
    closed_growth = live_rss_bytes() - rss_before

    get_s = [x for w in workers for x in w.get_s]
    put_s = [x for w in workers for x in w.put_s]
    moved = sum(w.bytes_moved for w in workers)
    print(
        f"\nload: {THREADS} threads, {elapsed:.1f}s: {(len(get_s) + len(put_s)) / elapsed:.0f}"
        f" ops/s, {moved / elapsed / MiB:.0f} MiB/s through the cache API"
        f"\n  get: n={len(get_s)} hits={sum(w.hits for w in workers)}"
        f" p50={percentile(get_s, 0.5) * 1e3:.2f} ms p99={percentile(get_s, 0.99) * 1e3:.2f} ms"
        f"\n  put: n={len(put_s)}"
        f" p50={percentile(put_s, 0.5) * 1e3:.2f} ms p99={percentile(put_s, 0.99) * 1e3:.2f} ms"
        f"\n  RSS growth {rss_growth / MiB:.0f} MiB (bound {RSS_BOUND / MiB:.0f} MiB;"
        f" {raw_growth / MiB:.0f} MiB untrimmed; {closed_growth / MiB:.0f} MiB after close)"
        f"\n  redis {stats['redis']}\n  writer {stats['writer']}\n  cpu {stats['cpu']}"
    )
    assert [e for w in workers for e in w.errors] == []
    assert [k for w in workers for k in w.wrong] == []
    assert get_s and put_s
    assert count(stats["redis"], "hits") > 0, "no read reached Redis: the test proves little"
    assert count(stats["writer"], "written") > 0
    assert rss_growth < RSS_BOUND, f"RSS grew by {rss_growth / MiB:.0f} MiB"

    wait_for(
        lambda: set(threading.enumerate()) <= threads_before,
        timeout_s=10,
        what=f"the cache's threads to end: {set(threading.enumerate()) - threads_before}",
    )
    wait_for(
        lambda: len(admin.client_list()) <= clients_before,
        timeout_s=10,
        what="the cache's Redis connections to close",
    )
