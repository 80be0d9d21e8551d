"""The end of a step (``build_connector_worker_meta``): a pure producer's saves are in Redis
before vLLM answers, and the scheduler half reports what the step did while processing its
output, without waiting for any timer."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis

from tests.conftest import BlockingSink, embedding
from tests.counters import count

pytestmark = [pytest.mark.vllm, pytest.mark.redis]
Make = Callable[..., Any]


def head_exists(redis_url: str, worker: Any, item: str) -> bool:
    client = redis.Redis.from_url(redis_url)
    try:
        return bool(client.exists(worker._cache.redis.keys.head(item)))
    finally:
        client.close()


def test_a_pure_producers_step_ends_once_its_saves_are_in_redis(
    make_connector: Make, redis_url: str
) -> None:
    """vLLM answers the encoder request right after this step, and the proxy sends it to PD
    at once: the write must have landed by then, however late the writer thread gets to it."""
    worker = make_connector("ec_producer", "worker")
    sink = BlockingSink(worker._cache)  # the writer thread is slow: the write waits
    worker.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
    assert sink.started.wait(10)
    releaser = threading.Timer(0.2, sink.release.set)
    releaser.start()
    worker.build_connector_worker_meta()  # the end of vLLM's step
    assert head_exists(redis_url, worker, "img")  # in Redis before the step returned
    releaser.join()
    assert count(worker.stats_snapshot(), "save_wait_timeouts") == 0


@pytest.mark.parametrize("role", ["ec_both", "ec_producer"])
def test_a_step_never_waits_for_its_writes_without_save_wait_s(
    make_connector: Make, redis_url: str, role: str
) -> None:
    """ec_both never waits; a producer with ``save_wait_s: 0`` neither."""
    worker = make_connector(role, "worker", extra={"save_wait_s": 0})
    sink = BlockingSink(worker._cache)
    worker.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
    assert sink.started.wait(10)
    worker.build_connector_worker_meta()  # returns while the write is still blocked
    assert not head_exists(redis_url, worker, "img")
    sink.release.set()
    assert worker._cache.flush(10) and head_exists(redis_url, worker, "img")


def test_a_save_that_outlasts_save_wait_s_is_counted_and_the_step_goes_on(
    make_connector: Make, redis_url: str
) -> None:
    worker = make_connector("ec_producer", "worker", extra={"save_wait_s": 0.05})
    sink = BlockingSink(worker._cache)
    worker.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
    worker.build_connector_worker_meta()  # gives up after save_wait_s
    assert not head_exists(redis_url, worker, "img")
    assert worker.stats_snapshot()["save_wait_timeouts"] == 1
    sink.release.set()
    assert worker._cache.flush(10) and head_exists(redis_url, worker, "img")


def step(scheduler: Any, worker: Any, work: Callable[[], None]) -> dict[str, Any]:
    """One engine step as vLLM drives both halves; returns the stats vLLM gets for it."""
    worker.bind_connector_metadata(scheduler.build_connector_meta(None))
    work()
    worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    stats = scheduler.get_ec_connector_stats()  # update_from_output, after the workers
    return stats.data if stats is not None else {}


def test_each_steps_saves_are_reported_in_that_step_however_fast_steps_come(
    make_connector: Make,
) -> None:
    """No timer stands between a step and its report: the last step before an engine goes
    idle (no further steps, no further reads) is reported too."""
    scheduler = make_connector("ec_producer")
    worker = make_connector("ec_producer", "worker")
    worker._publisher._stop.set()  # no background refresh: only each step's own publish
    worker._publisher._thread.join(5)
    for name in ("a", "b", "c"):
        tensor = embedding(16, 128)
        data = step(
            scheduler,
            worker,
            lambda name=name, tensor=tensor: worker.save_caches(
                encoder_cache={name: tensor}, mm_hash=name
            ),
        )
        assert data.get("saved_items") == 1, (name, data)
        assert len(data.get("save_seconds", [])) == 1
        assert data.get("saved_bytes") == 16 * 128 * 2
    assert count(step(scheduler, worker, lambda: None), "saved_items") == 0  # once only


def test_the_channel_file_keeps_only_observations_not_yet_reported(
    make_connector: Make,
) -> None:
    """The scheduler acknowledges what it read in the next step's metadata; the worker then
    drops it, so the file (rewritten every busy step) stays a few hundred bytes."""
    scheduler = make_connector("ec_producer")
    worker = make_connector("ec_producer", "worker")
    reported = 0
    for n in range(20):
        tensor = embedding(16, 128)
        data = step(
            scheduler,
            worker,
            lambda n=n, tensor=tensor: worker.save_caches(
                encoder_cache={f"img{n}": tensor}, mm_hash=f"img{n}"
            ),
        )
        reported += len(data.get("save_seconds", []))
        published = json.loads(worker._publisher.path.read_text())
        # This step's two observations (save_seconds, item_mb); the earlier ones are gone.
        assert len(published["observations"]) == 2, published["observations"]
    assert reported == 20
