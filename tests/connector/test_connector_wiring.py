"""How vLLM finds, drives and measures the connector: factory, plugin, runner call order,
stats and Prometheus metrics, cheap import."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any
from unittest.mock import patch

import pytest
import torch

from tests.conftest import embedding, wait_for
from tests.connector.conftest import request, vllm_config, wait_ready
from tests.counters import count

pytestmark = pytest.mark.vllm
Make = Callable[..., Any]


def test_factory_loads_the_class_from_the_module_path() -> None:
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from ec_redis.connector import ECRedisConnector

    config = vllm_config("ec_consumer", {}).ec_transfer_config
    assert ECConnectorFactory.get_connector_class(config) is ECRedisConnector


def test_general_plugin_registers_the_name_once() -> None:
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from ec_redis.connector import ECRedisConnector
    from ec_redis.connector.plugin import register

    register()
    register()  # vLLM loads plugins in several processes; a second call must not raise
    assert ECConnectorFactory._registry["ECRedisConnector"]() is ECRedisConnector
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [p for p in points if p.value == "ec_redis.connector.plugin:register"]
    assert len(ours) == 1 and ours[0].load() is register


def test_all_abstract_hooks_are_implemented() -> None:
    from ec_redis.connector import ECRedisConnector

    assert not ECRedisConnector.__abstractmethods__


@pytest.mark.redis
def test_vllms_own_runner_mixin_drives_the_worker_in_order(make_connector: Make) -> None:
    """vLLM's V1 model-runner context manager, driving our worker half for one step."""
    from vllm.v1.worker import ec_connector_model_runner_mixin as mixin

    from ec_redis.connector.metadata import ECRedisWorkerMetadata

    producer = make_connector("ec_producer", "worker")
    producer.save_caches(encoder_cache={"img": embedding(16, 128, seed=5)}, mm_hash="img")
    assert producer._cache.flush(5)
    producer.shutdown()

    scheduler = make_connector("ec_both")
    worker = make_connector("ec_both", "worker")
    req = request("r1", ("img", 16))
    assert wait_ready(scheduler, req) and scheduler.has_cache_item("img")
    scheduler.update_state_after_alloc(req, 0)

    class Output:
        ec_connector_metadata = scheduler.build_connector_meta(None)
        finished_req_ids: set[str] = set()

    encoder_cache: dict[str, torch.Tensor] = {}
    with (
        patch.object(mixin, "get_ec_transfer", return_value=worker),
        patch.object(mixin, "has_ec_transfer", return_value=True),
        mixin.ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(
            Output(), encoder_cache
        ) as output,
    ):
        assert torch.equal(encoder_cache["img"], embedding(16, 128, seed=5))  # before the body
    assert isinstance(output.ec_connector_worker_meta, ECRedisWorkerMetadata)
    assert worker._connector_metadata is None  # cleared on exit


@pytest.mark.redis
def test_ec_both_finds_its_own_saves_in_process_without_redis(make_connector: Make) -> None:
    scheduler = make_connector("ec_both")
    worker = make_connector("ec_both", "worker")
    worker.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
    req = request("r1", ("img", 16))
    assert wait_ready(scheduler, req) and scheduler.has_cache_item("img")
    snapshot = scheduler.stats_snapshot()
    assert snapshot["hits_gpu"] + snapshot["hits_cpu"] == 1
    assert snapshot["hits_redis"] == 0


def test_stats_aggregate_reduce_and_round_trip_through_a_plain_dict() -> None:
    from ec_redis.connector import ECRedisConnector
    from ec_redis.connector.stats import ECRedisStats

    # Seven looks found nothing (a waiting consumer re-looks) and one item was encoded locally:
    # the hit rate is per item (4 of 5 served), not per look.
    first = ECRedisStats(
        data={"hits_redis": 3, "misses": 7, "local_fallbacks": 1, "load_seconds": [0.002]}
    )
    second = ECRedisConnector.build_ec_connector_stats(
        {"hits_cpu": 1, "load_seconds": [0.004], "breaker_state": 1}
    )
    assert second is not None
    merged = first.aggregate(second)
    reduced = merged.reduce()
    assert reduced["hits_redis"] == 3 and reduced["hits_cpu"] == 1
    assert reduced["hit_rate"] == 0.8
    assert reduced["load_seconds_max"] == 0.004
    assert not merged.is_empty()
    merged.reset()
    assert merged.is_empty()


@pytest.mark.redis
def test_scheduler_stats_are_per_interval_deltas(make_connector: Make) -> None:
    scheduler = make_connector("ec_both")
    worker = make_connector("ec_both", "worker")
    worker.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
    assert wait_ready(scheduler, request("r1", ("img", 16)))
    first = scheduler.get_ec_connector_stats()
    assert first is not None and first.data["hits_cpu"] + count(first.data, "hits_gpu") == 1
    second = scheduler.get_ec_connector_stats()
    assert second is None or "hits_cpu" not in second.data


def test_prometheus_metrics_are_exported_under_vllm_ec_redis_names() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from ec_redis.connector import ECRedisConnector
    from ec_redis.connector.stats import metric_names

    registry = CollectorRegistry()

    def bound(cls: Any) -> Any:
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.pop("multiprocess_mode", None)
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    metrics = ECRedisConnector.build_prom_metrics(
        vllm_config("ec_consumer", {}), types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    metrics.observe(
        {"hits_redis": 2, "misses": 1, "breaker_state": 1, "item_mb": [3.5, 20.0]}, engine_idx=0
    )
    text = generate_latest(registry).decode()
    assert 'vllm:ec_redis_hits_redis_total{engine="0",model_name="tiny"} 2.0' in text
    assert 'vllm:ec_redis_breaker_state{engine="0",model_name="tiny"} 1.0' in text
    assert 'vllm:ec_redis_item_mb_bucket{engine="0",le="4.0",model_name="tiny"} 1.0' in text
    for name in metric_names():
        assert name in text, name


def test_importing_the_connector_is_cheap_and_touches_nothing() -> None:
    """vLLM imports the class in its API server: no threads, sockets or CUDA at import."""
    code = (
        "import threading, time, torch\n"
        "import vllm.distributed.ec_transfer.ec_connector.base\n"
        "before = threading.active_count(); t = time.perf_counter()\n"
        "import ec_redis.connector\n"
        "spent = time.perf_counter() - t\n"
        "assert threading.active_count() == before, 'threads started at import'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised at import'\n"
        "print(spent)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # ~0.07 s on the 2-core development VM; 2 s only catches heavy work added at import
    assert float(out.stdout.strip().splitlines()[-1]) < 2.0


def test_the_core_never_imports_vllm() -> None:
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None\n"
        "import ec_redis, ec_redis.cache, ec_redis.codec, ec_redis.tiers, ec_redis.cli.main\n"
        "import ec_redis.bench.runner\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.redis
def test_worker_stats_reach_vllm_through_the_scheduler_half_exactly_once(
    make_connector: Make,
) -> None:
    """vLLM's V1 runner never asks a worker for stats (V2 does): the worker half publishes
    them on the stats channel and only the scheduler half reports them, each increment once,
    however often either side is asked."""
    scheduler = make_connector("ec_producer")
    worker = make_connector("ec_producer", "worker")
    reported: dict[str, Any] = {"saved_items": 0, "save_seconds": []}

    def collect() -> None:
        stats = scheduler.get_ec_connector_stats()
        data = stats.data if stats is not None else {}
        reported["saved_items"] += count(data, "saved_items")
        reported["save_seconds"] += data.get("save_seconds", [])
        assert worker.get_ec_connector_stats() is None  # the V2 path reports nothing

    for name in ("a", "b"):
        worker.save_caches(encoder_cache={name: embedding(16, 128)}, mm_hash=name)

    def saw(count: int) -> bool:
        collect()
        return reported["saved_items"] >= count

    wait_for(lambda: saw(2), 10, "two saves reported")
    worker.save_caches(encoder_cache={"c": embedding(16, 128)}, mm_hash="c")
    wait_for(lambda: saw(3), 10, "the third save reported")
    for _ in range(5):  # asked again and again: nothing is reported twice
        collect()
        time.sleep(0.1)
    assert reported["saved_items"] == 3 and len(reported["save_seconds"]) == 3
    assert scheduler.stats_snapshot()["saved_items"] == 3  # cumulative view for tools


def run_until_idle(scheduler: Any, max_steps: int = 100_000) -> dict[str, Any]:
    """vLLM's engine loop for an engine with no requests left: each step ends with
    ``update_from_output`` (connector stats taken), then ``has_requests`` decides whether
    to step again. Returns the summed counters reported."""
    reported: dict[str, Any] = {}
    for _ in range(max_steps):
        stats = scheduler.get_ec_connector_stats()
        for name, value in (stats.data if stats is not None else {}).items():
            if not isinstance(value, list):
                reported[name] = reported.get(name, 0) + value
        if not scheduler.has_pending_push_work():
            return reported
        time.sleep(0.001)  # vLLM's pause between steps that ran no model
    raise AssertionError("the engine never went idle")


@pytest.mark.redis
def test_the_step_that_saved_reports_its_save_before_the_engine_idles(
    make_connector: Make, tmp_path: Any
) -> None:
    """vLLM takes connector stats only from a step: the worker half publishes what a step
    did at the step's end, before vLLM hands the step's output to the scheduler half, so an
    encoder that goes idle right after its last save still reports it (the issue's
    "/metrics reported saved_items 0")."""
    from types import SimpleNamespace

    extra = {"extra": {"stage_dir": str(tmp_path)}}
    scheduler = make_connector("ec_producer", **extra)
    worker = make_connector("ec_producer", "worker", **extra)
    meta = scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=16))
    # The worker half runs that step: metadata bound, one save, its report at the end.
    worker.bind_connector_metadata(meta)
    worker.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
    worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    # update_from_output of that very step: the save is in it (no publisher tick needed).
    stats = scheduler.get_ec_connector_stats()
    assert stats is not None and stats.data.get("saved_items") == 1
    assert count(run_until_idle(scheduler), "saved_items") == 0  # reported once


@pytest.mark.redis
@pytest.mark.parametrize(("backend", "cpu_tier"), [("uni", True), ("mp", False)])
def test_a_worker_process_keeps_no_local_tier_nobody_reads(
    redis_url: str, backend: str, cpu_tier: bool
) -> None:
    """In vLLM's multiprocess layout lookups happen in the scheduler's process: a worker
    process's CPU tier would be memory nothing ever reads."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ec_redis.connector import ECRedisConnector

    config = vllm_config("ec_producer", {"redis_url": redis_url, "cpu_cache_bytes": "64MiB"})
    config.parallel_config.distributed_executor_backend = backend
    worker = ECRedisConnector(config, ECConnectorRole.WORKER)
    try:
        assert worker._cache.cpu.enabled is cpu_tier
        worker.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
        assert worker._cache.flush(10)  # the write queue still publishes
    finally:
        worker.shutdown()
