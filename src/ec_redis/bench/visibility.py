"""Push vs poll: how long after an encoder's ``save_caches`` returns a waiting PD scheduler
half answers yes in ``has_cache_item``, next to a raw SET + GET of the same bytes.

Per item size and mode, ``runs`` items go through ``one_item`` (``demo/drive.py``): the
encoder's worker half saves (the Redis write runs on its writer thread), PD's scheduler half
is asked step after step like an engine's (an idle step does the connector's bounded wait).
Modes:

- ``poll``: ``push_notifications`` off; a missing item is looked at again every
  ``recheck_s`` (0.05 s, the default);
- ``push``: the default; the writer announces each stored entry and the waiting consumer
  fetches it at once (polling stays the fallback). The fetched item is staged as a tmpfs
  file, as in vLLM's default layout (workers in other processes): the read lands in a
  spare file made ahead of time (``spares.py``);
- ``push no spares``: the same with ``stage_spare_bytes: 0``: the item is read into fresh
  memory and written into a new tmpfs file;
- ``push inline``: the same as ``push``, with the item handed over in memory
  (``stage_transport: inline``, as when the workers share the scheduler's process; its
  spares are memory, not files).

Next to them, on the same server: ``raw SET+GET``, one redis-py SET of the tensor's bytes
and one GET; ``write+read``, ec_redis's own Redis write of the item (chunks, then the head)
and its read (heads, chunks, checksum), back to back: what a waiting consumer cannot beat.

Every column first runs ``WARMUP`` untimed item(s): new connections, and in the push modes
the first ask that sizes the spare staging files. p99 is then the steady state's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ec_redis.bench.timing import percentile
from ec_redis.demo.drive import build_connectors, one_item
from ec_redis.demo.workload import Item, activation_like

WARMUP = 1  # untimed items before each column's samples

MODES: dict[str, dict[str, object]] = {
    "poll": {"push_notifications": False, "recheck_s": 0.05},
    "push": {"push_notifications": True},
    "push no spares": {"push_notifications": True, "stage_spare_bytes": 0},
    "push inline": {"push_notifications": True, "stage_transport": "inline"},
}


@dataclass
class VisibilityRow:
    item: str
    mib: float
    mode: str  # "raw SET+GET", "write+read" or one of MODES
    p50_ms: float
    p99_ms: float


def run(
    redis_url: str, items: tuple[Item, ...], runs: int, progress: Callable[[str], None]
) -> list[VisibilityRow]:
    rows: list[VisibilityRow] = []
    for item in items:
        mib = item.nbytes / 2**20
        progress(f"raw SET+GET: {item.label} ({mib:.1f} MiB) x{runs}")
        rows.append(_row(item, "raw SET+GET", raw_set_get(redis_url, item, runs)))
        progress(f"write+read: {item.label} ({mib:.1f} MiB) x{runs}")
        rows.append(_row(item, "write+read", write_read(redis_url, item, runs)))
        for mode, extra in MODES.items():
            progress(f"{mode}: {item.label} ({mib:.1f} MiB) x{runs}")
            rows.append(_row(item, mode, visible_after_save(redis_url, item, runs, mode, extra)))
    return rows


def visible_after_save(
    redis_url: str, item: Item, runs: int, mode: str, extra: dict[str, object]
) -> list[float]:
    settings = {"redis_url": redis_url, "namespace": f"benchvis-{mode.replace(' ', '-')}", **extra}
    producer, scheduler, worker = build_connectors("ECRedisConnector", settings, item.width)
    # Each item leaves Redis after its run, as the baselines' keys do: every mode then runs
    # on a server of the same size (a server that grows by GBs slows down on this VM).
    forget = producer._cache.delete
    try:
        return [
            one_item(producer, scheduler, worker, item, run, mode, forget)["visible_after_save"]
            for run in range(WARMUP + runs)
        ][WARMUP:]
    finally:
        for connector in (producer, scheduler, worker):
            connector.shutdown()


def raw_set_get(redis_url: str, item: Item, runs: int) -> list[float]:
    """Seconds for one SET and one GET of the item's bytes with a plain redis-py client."""
    import redis

    client = redis.Redis.from_url(redis_url)
    out: list[float] = []
    try:
        for run in range(WARMUP + runs):
            data = activation_like(item.rows, item.width, seed=run).view(torch.uint8)
            value = data.numpy().tobytes()
            key = f"benchvis-raw-{run}-{time.time_ns()}"
            start = time.perf_counter()
            client.set(key, value)
            got = client.get(key)
            out.append(time.perf_counter() - start)
            if got != value:
                raise RuntimeError("raw GET returned other bytes: refusing to report")
            client.unlink(key)
    finally:
        client.close()
    return out[WARMUP:]


def write_read(redis_url: str, item: Item, runs: int) -> list[float]:
    """Seconds for ec_redis's Redis write of the item, then its read, on one thread."""
    from ec_redis.cache import TieredCache
    from ec_redis.config import CacheConfig

    config = CacheConfig(
        redis_url=redis_url, namespace="benchvis-tier", cpu_cache_bytes=0, embed_width=item.width
    )
    out: list[float] = []
    with TieredCache(config) as cache:
        assert cache.redis is not None
        for run in range(WARMUP + runs):
            tensor = activation_like(item.rows, item.width, seed=run)
            key = f"benchvis-{run}-{time.time_ns()}"
            start = time.perf_counter()
            stored = cache.redis.put(key, tensor)
            got = cache.redis.get_many([key])[key]
            out.append(time.perf_counter() - start)
            if not stored or got is None or not torch.equal(got, tensor):
                raise RuntimeError("the tier read back other bytes: refusing to report")
            cache.redis.delete(key)
    return out[WARMUP:]


def _row(item: Item, mode: str, seconds: list[float]) -> VisibilityRow:
    return VisibilityRow(
        item.label,
        item.nbytes / 2**20,
        mode,
        percentile(seconds, 50) * 1e3,
        percentile(seconds, 99) * 1e3,
    )


def render(rows: list[VisibilityRow]) -> str:
    lines = [
        "| item | MiB | raw SET+GET | ec_redis write+read | poll only | push (file) "
        "| push (file, no spares) | push (inline) | push - write+read (p50): file / inline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r.item, r.mode): r for r in rows}
    modes = ("raw SET+GET", "write+read", "poll", "push", "push no spares", "push inline")
    for item in dict.fromkeys(r.item for r in rows):
        raw, tier, poll, push, no_spares, inline = (by_key[(item, m)] for m in modes)
        cells = " | ".join(
            f"{r.p50_ms:.1f} / {r.p99_ms:.1f}" for r in (raw, tier, poll, push, no_spares, inline)
        )
        deltas = f"{push.p50_ms - tier.p50_ms:+.1f} / {inline.p50_ms - tier.p50_ms:+.1f}"
        lines.append(f"| {item} | {raw.mib:.2f} | {cells} | {deltas} |")
    lines.append("\n(p50 / p99 ms; poll only, push: save_caches returned -> has_cache_item yes)")
    return "\n".join(lines)
