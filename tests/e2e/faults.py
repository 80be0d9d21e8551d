"""Fault injection for engine runs (named by a spec's ``"patch"``; runs inside the engine
process before the engine starts)."""

from __future__ import annotations

from typing import Any

import redis


def flush_redis_after_first_hit(spec: dict[str, Any]) -> None:
    """Empty Redis the moment the scheduler first says "yes, load it": the entry vanishes
    between the scheduler's check and the worker's load."""
    from ec_redis.connector import ECRedisConnector

    url = spec["ec_transfer_config"]["ec_connector_extra_config"]["redis_url"]
    original = ECRedisConnector.has_cache_item
    fired: list[bool] = []

    def has_cache_item(self: ECRedisConnector, identifier: str) -> bool:
        found = original(self, identifier)
        if found and not fired:
            fired.append(True)
            client = redis.Redis.from_url(url)
            client.flushall()
            client.close()
        return found

    ECRedisConnector.has_cache_item = has_cache_item  # type: ignore[method-assign]
