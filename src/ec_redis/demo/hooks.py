"""``ec-redis demo --hooks-only``: the quick walk for machines without room for engines — the
connector's hooks driven in vLLM's call order in this process (or the cache alone without
vLLM), one synthetic encoder output per size."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ec_redis.demo.workload import QUICK_ITEMS, Item, activation_like

Say = Callable[[str], None]


def run(url: str, say: Say) -> dict[str, Any]:
    try:
        from ec_redis.demo.drive import build_connectors, one_item
    except ImportError:
        return _cache_only(url, say)
    say(
        "hooks only, no engine: an encoder's worker half saves, a PD scheduler half finds and "
        "a PD worker half loads, through Redis, calling the connector's hooks in vLLM's order"
    )
    extra = {"redis_url": url, "namespace": "demo", "recheck_s": 0.005}
    producer, scheduler, worker = build_connectors("ECRedisConnector", extra, QUICK_ITEMS[0].width)
    report: dict[str, Any] = {"mode": "connector", "items": []}
    try:
        for n, item in enumerate(QUICK_ITEMS):
            hooks = one_item(producer, scheduler, worker, item, n, "demo")
            report["items"].append({"item": item.label, "mib": item.nbytes / 2**20, **hooks})
            say(
                f"  {_label(item)}: encoder's save_caches returned in {_ms(hooks['save_caches'])}; "
                f"PD found it in Redis {_ms(hooks['visible_after_save'])} later and loaded it in "
                f"{_ms(hooks['start_load_caches'])}; bit-exact"
            )
        report["pd_counters"] = scheduler.stats_snapshot()
    finally:
        for connector in (producer, scheduler, worker):
            connector.shutdown()
    from_redis = int(report["pd_counters"].get("hits_redis", 0))
    say(f"  PD took {from_redis} of {len(QUICK_ITEMS)} items from Redis")
    return report


def _cache_only(url: str, say: Say) -> dict[str, Any]:
    from ec_redis.cache import TieredCache
    from ec_redis.config import CacheConfig

    say("vLLM is not installed: showing the cache alone (install vllm for the connector demo)")
    report: dict[str, Any] = {"mode": "cache", "items": []}
    encoder = TieredCache(CacheConfig(redis_url=url, namespace="demo", producer_id="encoder"))
    pd = TieredCache(CacheConfig(redis_url=url, namespace="demo", producer_id="pd"))
    try:
        for n, item in enumerate(QUICK_ITEMS):
            timings = _cache_item(encoder, pd, item, n)
            report["items"].append({"item": item.label, **timings})
            say(
                f"  {_label(item)}: the encoder's put returned in {_ms(timings['put_s'])}; PD's "
                f"first get (from Redis) took {_ms(timings['redis_get_s'])}, its second (from "
                f"its CPU tier) {_ms(timings['cpu_get_s'])}; bit-exact"
            )
        report["pd_stats"] = pd.stats()
    finally:
        encoder.close()
        pd.close()
    return report


def _cache_item(encoder: Any, pd: Any, item: Item, n: int) -> dict[str, float]:
    tensor = activation_like(item.rows, item.width, seed=n)
    key = f"demo-{n}-{time.time_ns()}"
    out = {"put_s": _timed(lambda: encoder.put(key, tensor))}
    encoder.flush(30)
    for name in ("redis_get_s", "cpu_get_s"):  # the first get reaches Redis, then the CPU tier
        start = time.perf_counter()
        got = pd.get(key)
        out[name] = time.perf_counter() - start
        if got is None or not torch.equal(got, tensor):
            raise RuntimeError("demo read back a wrong tensor")
    return out


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _label(item: Item) -> str:
    return f"{item.label} ({item.rows}x{item.width} bf16, {item.nbytes / 2**20:.1f} MiB)"
