"""The smallest end-to-end round trip through a real Redis."""

from __future__ import annotations

import pytest
import torch

from ec_redis import TieredCache
from tests.conftest import embedding


@pytest.mark.redis
def test_put_then_get_from_a_second_cache_comes_from_redis(redis_url: str) -> None:
    tensor = embedding(300, 256)
    with TieredCache.from_config({"redis_url": redis_url}) as producer:
        producer.put("item-1", tensor)
        assert producer.flush(10)
    with TieredCache.from_config({"redis_url": redis_url}) as consumer:
        got = consumer.get("item-1")
        assert got is not None and torch.equal(got, tensor)
        assert consumer.stats()["redis"]["hits"] == 1
