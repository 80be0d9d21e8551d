"""The end of a step (``build_connector_worker_meta``): a pure producer's saves are in Redis
before vLLM answers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis

from tests.conftest import BlockingSink, embedding

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
    assert worker.stats_snapshot().get("save_wait_timeouts", 0) == 0


def test_an_ec_both_step_never_waits_for_its_writes(make_connector: Make, redis_url: str) -> None:
    worker = make_connector("ec_both", "worker")
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
