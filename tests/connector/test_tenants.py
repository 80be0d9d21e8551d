"""Issue 14, point 7: vLLM's per-request ``cache_salt`` separates encoder-cache entries.

An ``ec_both`` instance (vLLM's real ``Scheduler``, its worker half as vLLM builds it) encodes
an image for a request salted "tenant-a" and publishes it; then a consumer instance, on the
same Redis (a new instance each time), gets the same image for requests salted "tenant-a",
"tenant-b" and unsalted, and for a request whose client uuid forges the salted id. Only
tenant-a's request loads it, also after Redis restarts from its own persistence.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ec_redis.connector.ids import SALT_MARK, cache_id
from ec_redis.embedded import EmbeddedRedis
from tests.connector.scheduler_driver import (
    EngineDriver,
    EngineShape,
    build_vllm_config,
    image_request,
)

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

SHAPE = EngineShape()


def salted(request_id: str, image: str, salt: str | None) -> Any:
    request = image_request(request_id, [image], [2, 3], max_tokens=1)
    request.cache_salt = salt
    return request


def run(config: Any, requests: list[Any]) -> tuple[int, int, dict[str, Any]]:
    """Serve ``requests`` one after another; (loads, local encodes, connector counters)."""
    driver = EngineDriver(config, SHAPE)
    try:
        for request in requests:
            driver.add_request(request)
            for _ in range(200):
                if not driver.alive or not driver.has_requests():
                    break
                if driver.step() == 0:
                    time.sleep(0.005)
        assert driver.failures == [], driver.failures
        assert not driver.has_requests()
        return driver.stats.loads, driver.stats.local_encodes, driver.connector.stats_snapshot()
    finally:
        driver.close()


def test_cache_salt_separates_entries_across_instances_and_restarts(
    tiny_model: Path, private_redis: EmbeddedRedis
) -> None:
    extra = {
        "redis_url": private_redis.url,
        "consumer_wait_s": 0.0,
        "recheck_s": 0.01,
        "cpu_cache_bytes": 0,  # every load comes from Redis
    }
    both = build_vllm_config(tiny_model, "ec_both", extra, SHAPE)
    loads, encodes, _ = run(both, [salted("e1", "img-t", "tenant-a")])
    assert (loads, encodes) == (0, 1)
    keys = [str(k) for k in private_redis.call("KEYS", "*")]
    assert any("%00" in k for k in keys), keys  # stored under tenant-a's cache id
    assert not any(k.endswith(".img-t}") for k in keys), keys  # never under the bare id

    consumer = build_vllm_config(tiny_model, "ec_consumer", extra, SHAPE)
    forged = cache_id("img-t", "tenant-a")
    assert forged is not None and forged.startswith(SALT_MARK)
    for restart in (False, True):
        if restart:
            private_redis.call("SAVE")
            private_redis.restart()  # the same data directory: entries survive
        # One consumer instance per request: vLLM's own encoder cache, inside one instance,
        # is shared across salts (docs/operating.md says so).
        cases = {"tenant-b": (0, 1), None: (0, 1), "forged": (0, 1), "tenant-a": (1, 0)}
        for salt, want in cases.items():
            image, request_salt = (forged, None) if salt == "forged" else ("img-t", salt)
            loads, encodes, counters = run(consumer, [salted(f"r{restart}", image, request_salt)])
            assert (loads, encodes) == want, (restart, salt, counters)
