"""Builds the redis-py client for any topology: one server, Redis Cluster or Sentinel.

Every client gets: bounded connections, connect and socket timeouts, retry with exponential
backoff (a value passed in, not a flag), TLS from the config, and a zero-copy command packer
so large values go from tensor memory straight to the socket (on connections whose sockets
``tiers/bulk_read.py`` may read replies into tensors from). Building a client does no I/O: a
cluster client is built on first use (``cluster_client.LazyCluster``), a Sentinel-managed one
asks the Sentinels for the master when it first connects. ``check_connection`` tells a
configuration problem (bad credentials, TLS trust) from an outage.
"""

from __future__ import annotations

import ssl
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import (
    BlockingConnectionPool,
    Connection,
    PythonRespSerializer,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection, SentinelManagedSSLConnection

from ec_redis.cluster_client import LazyCluster
from ec_redis.config import CacheConfig
from ec_redis.errors import RedisSetupError
from ec_redis.redis_url import RedisTarget, parse_target

# Arguments above this size are sent as their own buffer, never copied into the command.
_BUFFER_CUTOFF = 64 * 1024


def _packer() -> PythonRespSerializer:
    # hiredis' packer copies every argument into one string (two copies of a 16 MB value);
    # redis-py's Python packer sends large bytes/memoryviews as separate buffers (none).
    return PythonRespSerializer(_BUFFER_CUTOFF, _encode)


class ZeroCopyConnection(Connection):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _packer())
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]


class ZeroCopySSLConnection(SSLConnection):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _packer())
        super().__init__(*args, **kwargs)


class ZeroCopyUnixConnection(UnixDomainSocketConnection):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _packer())
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]


class ZeroCopySentinelConnection(SentinelManagedConnection):
    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _packer())
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]


class ZeroCopySentinelSSLConnection(SentinelManagedSSLConnection):
    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _packer())
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]


# The connections whose sockets bulk_read may read replies from (all pack with _packer).
ZERO_COPY_CONNECTIONS: tuple[type, ...] = (
    ZeroCopyConnection,
    ZeroCopySSLConnection,
    ZeroCopyUnixConnection,
    ZeroCopySentinelConnection,
    ZeroCopySentinelSSLConnection,
)


class SentinelMasterClient(redis.Redis):
    """The Sentinel-managed master's client; ``close()`` also closes the connections to the
    Sentinels that its master lookups opened (redis-py leaves them to the garbage collector)."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            pool: Any = self.connection_pool  # a SentinelConnectionPool (master_for made it)
            # what Sentinel.close() does from redis-py 8.1 on (older ones have no such method)
            first: Exception | None = None
            for sentinel in pool.sentinel_manager.sentinels:
                try:
                    sentinel.close()
                except Exception as exc:  # close the others anyway
                    first = first or exc
            if first is not None:
                raise first


def make_client(config: CacheConfig) -> Any:
    """A client for ``config.redis_url``; connecting is lazy (no I/O happens here)."""
    assert config.redis_url is not None
    config.check_files()
    target = parse_target(config.redis_url)
    common = _common_kwargs(config)
    if target.kind == "cluster":
        return LazyCluster(lambda: _cluster(config, target, common))
    if target.kind == "sentinel":
        sentinel_kwargs: dict[str, Any] = {
            "socket_timeout": config.redis_socket_timeout_s,
            "socket_connect_timeout": config.redis_connect_timeout_s,
            # our retry policy, not redis-py's default of 10 retries with up to 1 s backoff:
            # that spent ~5 s on each unreachable Sentinel in every master lookup
            "retry": _common_kwargs(config)["retry"],
            **_tls_kwargs(config, target.tls),
        }
        if config.sentinel_password:
            sentinel_kwargs["password"] = config.sentinel_password
        sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call, unused-ignore]
        return sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
            target.service,
            redis_class=SentinelMasterClient,
            max_connections=config.redis_max_connections,  # bounded: extra calls fail fast
            username=target.username,
            password=target.password,
            db=target.db,
            # our class instead of redis-py's choice by ``ssl=``: the same, plus our packer
            connection_class=(
                ZeroCopySentinelSSLConnection if target.tls else ZeroCopySentinelConnection
            ),
            **_tls_kwargs(config, target.tls),
            **common,
        )
    unix = config.redis_url.startswith("unix://")
    if unix:  # a Unix socket has no TCP keepalive (redis-py's Unix connection refuses it)
        common = {k: v for k, v in common.items() if k != "socket_keepalive"}
        # nor a host for redis-py 8.0's maintenance notifications, which then fail the connect
        common["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    connection_class = (
        ZeroCopyUnixConnection
        if unix
        else ZeroCopySSLConnection
        if target.tls
        else ZeroCopyConnection
    )
    pool = BlockingConnectionPool.from_url(
        config.redis_url,
        max_connections=config.redis_max_connections,
        timeout=config.redis_socket_timeout_s,  # wait for a free connection at most this long
        connection_class=connection_class,
        **_tls_kwargs(config, target.tls),
        **common,
    )
    client = redis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # close() disconnects the pool (as from_pool())
    return client


def _cluster(config: CacheConfig, target: RedisTarget, common: dict[str, Any]) -> RedisCluster:
    """The ``RedisCluster``: its constructor asks a seed node for the slot map, so it raises
    (``RedisClusterException``) while none answers."""
    # redis-py hands our connection class to a cluster's node clients only on its
    # from_url path: otherwise it calls redis.Redis(connection_class=...), which raises
    # TypeError, reported as "Redis Cluster cannot be connected". So the first node goes
    # as a plain redis:// URL (no credentials: those and TLS go as keywords; rediss://
    # would replace our class with SSLConnection), the others as startup nodes.
    (host, port), *others = target.nodes
    return RedisCluster(
        url=f"redis://[{host}]:{port}" if ":" in host else f"redis://{host}:{port}",
        startup_nodes=[ClusterNode(h, p) for h, p in others],  # type: ignore[no-untyped-call]
        username=target.username,
        password=target.password,
        connection_class=ZeroCopySSLConnection if target.tls else ZeroCopyConnection,
        max_connections=config.redis_max_connections,  # per node
        # Keep using the slots that are up; the servers need cluster-require-full-coverage
        # no for that too (otherwise every master answers CLUSTERDOWN during a failover).
        require_full_coverage=False,
        **_tls_kwargs(config, target.tls),
        **common,
    )


def _common_kwargs(config: CacheConfig) -> dict[str, Any]:
    retry = Retry(
        ExponentialBackoff(cap=max(config.redis_backoff_s * 8, 0.001), base=config.redis_backoff_s),
        retries=config.redis_retries,
        supported_errors=(RedisConnectionError, RedisTimeoutError, OSError),
    )
    return {
        "socket_timeout": config.redis_socket_timeout_s,
        "socket_connect_timeout": config.redis_connect_timeout_s,
        "socket_keepalive": True,
        "health_check_interval": 30,
        "retry": retry,
        "client_name": "ec_redis",
    }


def _tls_kwargs(config: CacheConfig, tls: bool) -> dict[str, Any]:
    if not tls:
        return {}
    return {
        "ssl_ca_certs": config.tls_ca_file or None,
        "ssl_certfile": config.tls_cert_file or None,
        "ssl_keyfile": config.tls_key_file or None,
        "ssl_cert_reqs": "required" if config.tls_verify == "required" else "none",
        "ssl_check_hostname": config.tls_check_hostname and config.tls_verify == "required",
    }


def check_connection(client: Any) -> str | None:
    """PING once. Raises ``RedisSetupError`` for problems that are configuration (wrong
    password, missing ACL rights, TLS trust); returns a description for an outage (refused,
    timed out), which the cache survives; ``None`` when Redis answered."""
    try:
        client.ping()
    except AuthenticationError as exc:
        raise RedisSetupError(
            f"Redis rejected the credentials ({exc}); fix the user:password in redis_url, "
            "e.g. redis://cache-user:secret@host:6379/0"
        ) from None
    except ResponseError as exc:
        # redis-py strips the NOPERM code from the text into the class NoPermissionError
        text = str(exc)
        if isinstance(exc, NoPermissionError) or any(
            code in text for code in ("NOAUTH", "NOPERM", "WRONGPASS")
        ):
            raise RedisSetupError(
                f"Redis refused this client ({exc}); give redis_url a user and password with "
                "rights on the cache's keys, e.g. redis://cache-user:secret@host:6379/0"
            ) from None
        raise
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        if "CERTIFICATE_REQUIRED" in _chain_text(exc):
            raise RedisSetupError(
                f"the Redis server requires a client certificate ({exc}); set tls_cert_file "
                "and tls_key_file to a certificate its CA trusts"
            ) from None
        if _tls_trust_problem(exc):
            raise RedisSetupError(
                f"TLS handshake with Redis failed ({exc}); set tls_ca_file to the CA that "
                "signed the server's certificate (and tls_cert_file/tls_key_file if the "
                "server requires client certificates)"
            ) from None
        return f"{type(exc).__name__}: {exc}"
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and everything it was raised from or during."""
    out: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None:
        out.append(seen)
        seen = seen.__cause__ or seen.__context__
    return out


def _chain_text(exc: BaseException) -> str:
    return " | ".join(str(e) for e in _chain(exc))


def _tls_trust_problem(exc: BaseException) -> bool:
    for seen in _chain(exc):
        if isinstance(seen, ssl.SSLError):
            return True
        text = str(seen)
        if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
            return True
        if "SSL" in text and ("alert" in text or "handshake" in text):
            return True
    return False


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
