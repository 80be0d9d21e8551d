"""Fixtures for connector tests: vLLM configs mocked the way vLLM's own tests do, with a real
``ECTransferConfig``, and real vLLM requests carrying multimodal features."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest.mock import Mock

import pytest
import torch


def request(request_id: str, *items: tuple[str, int], media: bool = True) -> Any:
    """A real vLLM request (status WAITING) whose items (id, num_embeds) follow each other;
    ``media=False``: metadata-only items, which cannot be encoded locally."""
    from ec_redis.demo.drive import vllm_request

    return vllm_request(request_id, *items, media=media)


def vllm_config(
    role: str,
    extra: dict[str, Any],
    *,
    model: str = "tiny-llava",
    dtype: torch.dtype = torch.bfloat16,
    hidden: int = 128,
) -> Any:
    from vllm.config import ECTransferConfig, VllmConfig

    config = Mock(spec=VllmConfig)
    config.ec_transfer_config = ECTransferConfig(
        engine_id="ec-redis-test-engine",  # both halves of one instance share it (as in vLLM)
        ec_connector="ECRedisConnector",
        ec_connector_module_path="ec_redis.connector",
        ec_role=role,
        ec_connector_extra_config=extra,
    )
    model_config = Mock()
    model_config.model = model
    model_config.revision = None
    model_config.dtype = dtype
    model_config.get_hidden_size = Mock(return_value=hidden)
    config.model_config = model_config
    return config


@pytest.fixture
def make_connector(redis_url: str) -> Iterator[Callable[..., Any]]:
    """Build connectors against the test's real Redis; all are shut down afterwards."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ec_redis.connector import ECRedisConnector

    made: list[Any] = []

    def make(role: str, side: str = "scheduler", **kwargs: Any) -> Any:
        extra = {"redis_url": redis_url, "consumer_wait_s": 0.5, "recheck_s": 0.01}
        extra.update(kwargs.pop("extra", {}))
        which = ECConnectorRole.SCHEDULER if side == "scheduler" else ECConnectorRole.WORKER
        connector = ECRedisConnector(vllm_config(role, extra, **kwargs), which)
        made.append(connector)
        return connector

    yield make
    for connector in made:
        connector.shutdown()


def wait_ready(connector: Any, req: Any, timeout_s: float = 5.0) -> bool:
    """Call ensure_cache_available like the scheduler does, step after step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if connector.ensure_cache_available(req, 0):
            return True
        time.sleep(0.002)
    return False


def publish(
    make: Callable[..., Any],
    items: dict[str, torch.Tensor],
    role: str = "ec_producer",
    **kw: Any,
) -> None:
    """Save items the way a producer's worker does, wait until Redis has them, and shut the
    producer down so its in-process cache is gone: later reads must come from Redis."""
    worker = make(role, "worker", **kw)
    cache = dict(items)
    for mm_hash in items:
        worker.save_caches(encoder_cache=cache, mm_hash=mm_hash)
    assert worker._cache.flush(10)
    worker.shutdown()
