"""Helpers for the tests that run TieredCache on real topologies (Cluster, Sentinel): caches
that record anything escaping them, exact tensor comparison, and looks at the servers."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import redis
import torch

from ec_redis import TieredCache
from ec_redis.codec import decode_parts
from ec_redis.embedded import EmbeddedCluster
from tests.conftest import bits
from tests.counters import count

CHUNK = 64 * 1024
FULL_COVERAGE_NO = ("--cluster-require-full-coverage", "no")
# compression settings of a chunked entry: raw, lz4, lz4 of the byte-shuffled payload
CODECS = {
    "raw": {"compression": "none"},
    "lz4": {"compression": "lz4"},
    "shuffle-lz4": {"compression": "lz4", "byte_shuffle": True},
}


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
        return float(count(self.cache.stats()["redis"], name))


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
    return int(stat.get("count", 0)) if isinstance(stat, dict) else 0  # Redis INFO: sparse


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


def assert_one_copy_reads(
    url: str, caches: Caches, namespace: str, codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked entries of ``codec`` are read straight into one buffer (``direct_reads``), never
    fetched as one ``bytes`` per chunk and joined (``decode_parts`` with several parts)."""
    joined: list[int] = []

    def spy(parts: Sequence[Any], **kwargs: Any) -> Any:
        if len(parts) > 1:
            joined.append(len(parts))
        return decode_parts(parts, **kwargs)

    monkeypatch.setattr("ec_redis.tiers.entry_read.decode_parts", spy)
    writer = caches.open(url, namespace, **CODECS[codec])
    expected = {f"big-{i}": bf16(300, seed=i) for i in range(4)}  # ~300 KB: 5 chunks each
    expected["small"] = bf16(8, seed=9)
    for key, tensor in expected.items():
        writer.put(key, tensor)
    assert writer.flush(10)
    reader = caches.open(url, namespace, **CODECS[codec])
    for _ in range(2):
        got = reader.get_many(list(expected))
        assert all(exact(got[k], t) for k, t in expected.items())
    assert reader.redis_stat("direct_reads") == 2 * 4 and not joined
