"""Builds the redis-py client: one bounded blocking pool, timeouts, retry with backoff,
and a zero-copy command packer so large values are sent straight from tensor memory."""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.connection import BlockingConnectionPool, PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from ec_redis.config import CacheConfig

# Arguments above this size are sent as their own buffer, never copied into the command.
_BUFFER_CUTOFF = 64 * 1024


def make_client(config: CacheConfig) -> redis.Redis:
    """A client for ``config.redis_url``; connecting is lazy (no I/O happens here)."""
    assert config.redis_url is not None
    retry = Retry(
        ExponentialBackoff(cap=max(config.redis_backoff_s * 8, 0.001), base=config.redis_backoff_s),
        retries=config.redis_retries,
        supported_errors=(RedisConnectionError, RedisTimeoutError, OSError),
    )
    # hiredis' packer copies every argument into one string (two copies of a 16 MB value);
    # redis-py's Python packer sends large bytes/memoryviews as separate buffers (none).
    packer = PythonRespSerializer(_BUFFER_CUTOFF, _encode)
    pool = BlockingConnectionPool.from_url(
        config.redis_url,
        max_connections=config.redis_max_connections,
        timeout=config.redis_socket_timeout_s,  # wait for a free connection at most this long
        socket_timeout=config.redis_socket_timeout_s,
        socket_connect_timeout=config.redis_connect_timeout_s,
        socket_keepalive=True,
        health_check_interval=30,
        retry=retry,
        command_packer=packer,
        client_name="ec_redis",
    )
    return redis.Redis(connection_pool=pool)


def _encode(value: object) -> bytes | memoryview:
    if isinstance(value, (bytes, memoryview)):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        raise TypeError("booleans are not valid Redis arguments")
    if isinstance(value, (int, float)):
        return repr(value).encode()
    raise TypeError(f"cannot send {type(value).__name__} to Redis")
