"""Runs the benchmark: every tier's put/get next to raw redis-py SET/GET of the same bytes,
interleaved run by run against the same server so both see the same machine noise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import redis
import torch

from ec_redis.bench.results import CodecRow, Report, Row, make_row
from ec_redis.bench.timing import Timing, measure
from ec_redis.bench.workload import ITEMS, QUICK_ITEMS, Item, activation_like
from ec_redis.cache import TieredCache
from ec_redis.codec import decode_blob, encode_blob
from ec_redis.config import CacheConfig
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.redis_conn import make_client
from ec_redis.redis_url import parse_target
from ec_redis.tiers.redis_tier import RedisTier, RedisTierOptions

Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(
    url: str,
    server: str,
    *,
    name: str = "",
    quick: bool = False,
    repeat: int = 5,
    chunk_bytes: int = 4 * 1024 * 1024,
    codecs: bool = True,
    progress: Progress = _stderr,
) -> Report:
    report = Report(server=server, machine=_machine(), name=name or server)
    items = QUICK_ITEMS if quick else ITEMS
    raw = raw_client(url)
    config = CacheConfig(redis_url=url, compression="none", chunk_bytes=chunk_bytes)
    tier = RedisTier(
        make_client(config),
        KeyBuilder("bench", ModelIdentity("bench-model")),
        RedisTierOptions(chunk_bytes=chunk_bytes, compression="none"),
    )
    steps = len(items) * (2 + (1 if codecs else 0))
    step = 0
    try:
        for item in items:
            tensor = activation_like(item.rows)
            runs = max(2, repeat if item.nbytes < 32 << 20 else repeat // 2 + 1)
            step += 1
            progress(f"[{step}/{steps}] Redis tier vs raw redis-py, {_label(item)} x{runs}")
            report.rows += _redis_rows(item, tensor, raw, tier, runs)
            step += 1
            progress(f"[{step}/{steps}] local tiers, {_label(item)}")
            report.rows += _local_rows(item, tensor, runs, url)
            if codecs:
                step += 1
                progress(f"[{step}/{steps}] codecs, {_label(item)}")
                report.codecs += _codec_rows(item, tensor, runs)
        if torch.cuda.is_available():
            progress("CUDA: spill and load bandwidth vs tensor.copy_ of pinned memory")
            from ec_redis.bench.cuda import cuda_rows

            report.rows += cuda_rows(items, repeat)
        else:
            report.notes.append("No CUDA device: GPU-tier rows hold CPU tensors; no CUDA rows.")
    finally:
        for key in raw.scan_iter("bench*", count=1000):
            raw.unlink(key)
        raw.close()
        tier.close()
    return report


def _redis_rows(
    item: Item, tensor: torch.Tensor, raw: Any, tier: RedisTier, runs: int
) -> list[Row]:
    payload = tensor.view(-1).view(torch.uint8).numpy().tobytes()  # the same number of bytes
    head = tier.keys.head("item")
    raw_key = "bench:raw" + head[head.index("{") :]  # the entry's hash tag: the same master

    def clear() -> None:
        for key in [raw_key, *raw.scan_iter(head + "*")]:
            raw.unlink(key)  # one key per call: a cluster refuses cross-slot UNLINKs

    def raw_set() -> None:
        samples["raw_set"].append(_time(lambda: raw.set(raw_key, payload)))

    def put() -> None:
        samples["put"].append(_time(lambda: tier.put("item", tensor)))

    def raw_get() -> None:
        samples["raw_get"].append(_time(lambda: raw.get(raw_key)))

    def get() -> None:
        start = time.perf_counter()
        got.append(tier.get("item"))
        samples["get"].append(time.perf_counter() - start)

    samples: dict[str, list[float]] = {"raw_set": [], "put": [], "raw_get": [], "get": []}
    got: list[torch.Tensor | None] = []
    for run in range(runs):  # interleaved: both sides see the same noise ...
        clear()
        settle(raw)
        # ... and go first in turn; a write's replication is over before anything else runs
        for step in (raw_set, put, raw_get, get) if run % 2 else (put, raw_set, get, raw_get):
            step()
            settle(raw)
    if not all(t is not None and torch.equal(t, tensor) for t in got):
        raise RuntimeError("benchmark read back a wrong tensor: refusing to report")
    t = {k: Timing(tuple(v)) for k, v in samples.items()}
    return [
        make_row(item, "redis put (encode+SET)", t["put"], "raw SET", t["raw_set"]),
        make_row(item, "redis get (GET+verify)", t["get"], "raw GET", t["raw_get"]),
    ]


def settle(raw: Any) -> None:
    """Wait (untimed) until every master's replicas have what it was sent: on one machine, a
    replica applying the last write would slow whatever is measured next."""
    from redis.cluster import RedisCluster

    servers = (
        [raw.get_redis_connection(node) for node in raw.get_primaries()]  # type: ignore[no-untyped-call]
        if isinstance(raw, RedisCluster)
        else [raw]
    )
    for server in servers:
        replicas = int(server.info("replication").get("connected_slaves", 0))
        if replicas:
            server.execute_command("WAIT", replicas, 10_000)


def _local_rows(item: Item, tensor: torch.Tensor, runs: int, url: str) -> list[Row]:
    budget = item.nbytes * 2
    with TieredCache(CacheConfig(gpu_cache_bytes=budget, cpu_cache_bytes=budget)) as cache:
        cache.put("x", tensor)
        gpu = measure(lambda: cache.get("x"), runs * 20)
        cache.gpu.delete("x")
        cpu = measure(lambda: cache.cpu.get("x"), runs * 20)
    clone = measure(lambda: tensor.clone(), runs * 2)
    config = CacheConfig(redis_url=url, namespace="bench", compression="none")
    with TieredCache(config) as cache:
        put = measure(lambda: cache.put("y", tensor), runs, setup=lambda: cache.flush(30))
    kind = "cuda" if torch.cuda.is_available() else "no CUDA: CPU tensors"
    return [
        make_row(item, f"gpu tier hit ({kind})", gpu),
        make_row(item, "cpu tier hit", cpu, "tensor.clone()", clone),
        make_row(item, "TieredCache.put returns", put),
    ]


def _codec_rows(item: Item, tensor: torch.Tensor, runs: int) -> list[CodecRow]:
    rows = []
    nbytes = item.nbytes
    for name, options in (
        ("none", {"compression": "none"}),
        ("lz4", {"compression": "lz4"}),
        ("shuffle+lz4", {"compression": "lz4", "byte_shuffle": True}),
        ("auto", {"compression": "auto"}),
        ("auto+shuffle", {"compression": "auto", "byte_shuffle": True}),
    ):
        blob = encode_blob(tensor, **options)
        enc = measure(lambda o=options: encode_blob(tensor, **o), runs)  # type: ignore[misc]
        dec = measure(lambda b=blob: decode_blob(b), runs)  # type: ignore[misc]
        rows.append(CodecRow(item.label, name, nbytes / len(blob), enc.median_s * 1e3,
                             dec.median_s * 1e3))  # fmt: skip
    return rows


def raw_client(url: str) -> Any:
    """The baseline: a default redis-py client (hiredis) for the same server or cluster."""
    target = parse_target(url)
    if target.kind == "cluster":
        from redis.cluster import ClusterNode, RedisCluster

        nodes = [ClusterNode(host, port) for host, port in target.nodes]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes, username=target.username, password=target.password)
    return redis.Redis.from_url(url)


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _label(item: Item) -> str:
    return f"{item.label} {item.rows}x{item.width} bf16 ({item.nbytes / 2**20:.1f} MiB)"


def _machine() -> str:
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    return (f"{os.cpu_count()} cores {cpu}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, redis-py {redis.__version__}")  # fmt: skip
