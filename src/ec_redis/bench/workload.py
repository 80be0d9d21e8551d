"""Benchmark inputs: Qwen2.5-VL-shaped encoder outputs with activation-like statistics.

The item type, the quick items and their generator are product code in ``demo/workload.py``
(the demo's ``--hooks-only`` walk uses them too); the benchmark-only sizes are here."""

from __future__ import annotations

from ec_redis.demo.workload import QUICK_ITEMS, Item, activation_like

# Re-exported for the benchmarks that still import them from here (runner.py, results.py).
__all__ = ["BENCH_ITEMS", "ITEMS", "QUICK_ITEMS", "Item", "activation_like"]

ITEMS = (
    Item("448px image", 256),
    Item("1036px image", 1369),
    Item("1344px image", 2304),
    Item("video (64+ MiB)", 9400),
)
# ``ec-redis bench``: also an item of 4 MiB, a little over one chunk (issue 17's sizes: 1.8 MB,
# 4, 16 and 64 MiB).
BENCH_ITEMS = (ITEMS[0], Item("4 MiB", 585), *ITEMS[1:])
