"""Pipelined GETs whose replies land straight in caller memory (one copy: kernel -> tensor).

redis-py's parser materialises every reply as a ``bytes`` object, which the cache would then
copy again into the tensor. For the chunks of a large entry this reader sends the GETs on a
pooled connection and ``recv_into``s each reply into its slice of the destination. Commands
sent ahead of the GETs in the same write (``prelude``: the TTL renewal script) have their small
replies parsed and returned. Only for a plain ``redis.Redis`` client (one server, TCP/TLS/Unix);
any surprise disconnects the connection, so the pool never reuses one in an unknown state.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

_RECV = 64 * 1024


def supported(client: Any) -> bool:
    """A single-server client built by ``redis_conn.make_client`` (its pool hands out our
    socket connections); not clusters, Sentinel-managed pools or test doubles."""
    from ec_redis.redis_conn import (
        ZeroCopyConnection,
        ZeroCopySSLConnection,
        ZeroCopyUnixConnection,
    )

    pool = getattr(client, "connection_pool", None)
    kind = getattr(pool, "connection_class", None)
    ours = (ZeroCopyConnection, ZeroCopySSLConnection, ZeroCopyUnixConnection)
    return isinstance(client, redis.Redis) and isinstance(kind, type) and issubclass(kind, ours)


Reply = bytes | int | None | ResponseError | list[Any]
_MAX_SMALL_REPLY = 1 << 20


def read_into(
    client: Any,
    keys: Sequence[str],
    targets: Sequence[memoryview],
    prelude: Sequence[Sequence[Any]] = (),
) -> tuple[list[Reply], list[int | None]]:
    """Send the ``prelude`` commands, then GET every key into its target. Returns the prelude's
    replies (an error reply is returned as a ``ResponseError``, not raised) and, per key,
    ``None`` when the key is missing, else the value's length (read into the target only when
    it is exactly the target's length; otherwise skipped). A GET's error reply raises."""
    pool = client.connection_pool
    conn = pool.get_connection()
    clean = False
    try:
        commands = [*prelude, *(("GET", key) for key in keys)]
        conn.send_packed_command(conn.pack_commands(commands))
        reader = _Reader(conn._sock)
        replies = [reader.reply() for _ in prelude]
        found = [reader.bulk_into(target) for target in targets]
        clean = True
        return replies, found
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def bulk_into(self, target: memoryview) -> int | None:
        line = self._line()
        if line[:1] == b"-":
            raise ResponseError(line[1:].decode(errors="replace"))
        if line == b"_":  # RESP3's null (RESP2 says "$-1")
            return None
        if line[:1] != b"$":
            raise RedisConnectionError(f"unexpected reply {line[:32]!r} to GET")
        size = int(line[1:])
        if size < 0:
            return None
        if size != len(target):
            self._skip(size + 2)
            return size
        self._fill(target)
        if self._take(2) != b"\r\n":
            raise RedisConnectionError("malformed bulk reply")
        return size

    def reply(self) -> Reply:
        """One small reply of any RESP2 type (and RESP3's null)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return ResponseError(rest.decode(errors="replace"))
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"_":
            return None
        if kind in (b"$", b"*") and int(rest) < 0:
            return None
        if kind == b"$" and int(rest) <= _MAX_SMALL_REPLY:
            data = self._take(int(rest) + 2)
            return data[:-2]
        if kind == b"*" and int(rest) <= _MAX_SMALL_REPLY:
            return [self.reply() for _ in range(int(rest))]
        raise RedisConnectionError(f"unexpected reply {line[:32]!r}")

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._more()
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def _fill(self, target: memoryview) -> None:
        have = min(len(self._buf), len(target))
        target[:have] = self._buf[:have]
        del self._buf[:have]
        while have < len(target):
            got = self._sock.recv_into(target[have:])
            if got == 0:
                raise RedisConnectionError("Redis closed the connection mid-reply")
            have += got

    def _take(self, count: int) -> bytes:
        while len(self._buf) < count:
            self._more()
        out = bytes(self._buf[:count])
        del self._buf[:count]
        return out

    def _skip(self, count: int) -> None:
        while count > 0:
            if not self._buf:
                self._more()
            step = min(count, len(self._buf))
            del self._buf[:step]
            count -= step

    def _more(self) -> None:
        chunk = self._sock.recv(_RECV)
        if not chunk:
            raise RedisConnectionError("Redis closed the connection mid-reply")
        self._buf += chunk
