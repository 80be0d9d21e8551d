"""Connector benchmark: drive the hooks the way vLLM does, ECRedisConnector next to vLLM's
ECExampleConnector (safetensors files on local disk), in one run on the same machine.

Per item: producer ``save_caches`` -> (consumer scheduler) ``ensure_cache_available`` until
ready -> ``has_cache_item`` -> ``update_state_after_alloc`` -> ``build_connector_meta`` ->
(consumer worker) ``bind`` + ``start_load_caches`` + ``clear``. Reports p50/p99 per hook and
the time from ``save_caches`` returning to the item being loadable. The connectors and the
walk through the hooks are ``demo/drive.py``'s (``build_connectors``, ``one_item``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ec_redis.bench.timing import percentile
from ec_redis.demo.drive import build_connectors, one_item
from ec_redis.demo.workload import Item

HOOKS = ("save_caches", "visible_after_save", "has_cache_item", "alloc+meta", "start_load_caches")


@dataclass
class HookRow:
    connector: str
    item: str
    hook: str
    p50_ms: float
    p99_ms: float


def run_hooks(
    name: str, extra: dict[str, Any], items: tuple[Item, ...], runs: int,
    progress: Callable[[str], None],
) -> list[HookRow]:  # fmt: skip
    producer, scheduler, worker = build_connectors(name, extra, items[0].width)
    rows: list[HookRow] = []
    try:
        for item in items:
            progress(f"{name}: {item.label} ({item.nbytes / 2**20:.1f} MiB) x{runs}")
            samples = _one_size(producer, scheduler, worker, item, runs, name)
            rows += [
                HookRow(name, item.label, hook, percentile(v, 50) * 1e3, percentile(v, 99) * 1e3)
                for hook, v in samples.items()
            ]
    finally:
        for connector in (producer, scheduler, worker):
            connector.shutdown()
    return rows


def _one_size(
    producer: Any, scheduler: Any, worker: Any, item: Item, runs: int, tag: str
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {hook: [] for hook in HOOKS}
    for run in range(runs):
        for hook, seconds in one_item(producer, scheduler, worker, item, run, tag).items():
            samples[hook].append(seconds)
    return samples


def run(
    redis_url: str, items: tuple[Item, ...], runs: int, progress: Callable[[str], None]
) -> list[HookRow]:
    ours = run_hooks(
        "ECRedisConnector",
        {"redis_url": redis_url, "namespace": "benchconn", "recheck_s": 0.005},
        items, runs, progress,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ec_example_") as path:
        theirs = run_hooks("ECExampleConnector", {"shared_storage_path": path}, items, runs,
                           progress)  # fmt: skip
    return ours + theirs


def render(rows: list[HookRow]) -> str:
    lines = [
        "| item | hook | ECRedisConnector p50 ms | p99 ms | ECExampleConnector p50 ms | p99 ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    by_key = {(r.connector, r.item, r.hook): r for r in rows}
    for item in dict.fromkeys(r.item for r in rows):
        for hook in HOOKS:
            ours = by_key.get(("ECRedisConnector", item, hook))
            theirs = by_key.get(("ECExampleConnector", item, hook))
            if ours is None or theirs is None:
                continue
            lines.append(
                f"| {item} | {hook} | {ours.p50_ms:.3f} | {ours.p99_ms:.3f} "
                f"| {theirs.p50_ms:.3f} | {theirs.p99_ms:.3f} |"
            )
    return "\n".join(lines)
