"""Pipelined GETs whose replies land straight in caller memory (one copy: kernel -> tensor).

redis-py's parser materialises every reply as a ``bytes`` object (hiredis: read into its own
buffer, then copied out), which the cache would then copy again into the tensor. For the
chunks of a large entry this reader sends the GETs on a pooled connection and ``recv_into``s
each reply into its slice of the destination (``read_into``); commands sent ahead of the GETs
in the same write (``prelude``: the TTL renewal script) have their small replies parsed and
returned. Entry heads are read the same way (``read_values``): a large one-value entry lands
in a buffer of its own (``codec/destination.fresh``: recycled, already faulted-in memory),
which the decoded tensor then uses as it is. A caller may follow the bytes as they land
(``landed``): it checksums each stretch while the next is still on the wire
(``codec/landing.py``). An error reply to one key's command (a key of another type:
``WRONGTYPE``) is returned in that key's place: it is one line, so the replies after it are
still read in step.

For any ``redis.Redis`` client whose pool makes our connections: one server (TCP/TLS/Unix), a
Sentinel-managed master, and each node of a Redis Cluster. Error replies become redis-py's
typed errors (``MovedError``, ``AskError``, ``NoScriptError`` ...); any surprise disconnects
the connection, so the pool never reuses one in an unknown state.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from ec_redis.codec import destination

_RECV = 64 * 1024
SMALL_VALUE = 64 * 1024  # up to this, a value is copied out of the read buffer as bytes


def supported(client: Any) -> bool:
    """A ``redis.Redis`` whose pool hands out our socket connections (``redis_conn``): one
    server, a Sentinel-managed master, a Cluster node's client; not test doubles."""
    from ec_redis.redis_conn import ZERO_COPY_CONNECTIONS

    if not isinstance(client, redis.Redis):  # first: a lazy cluster client must not build
        return False
    kind = getattr(client.connection_pool, "connection_class", None)
    return isinstance(kind, type) and issubclass(kind, ZERO_COPY_CONNECTIONS)


def _error(text: bytes) -> ResponseError:
    """An error reply as redis-py types it (``MOVED ...`` -> ``MovedError``). ``READONLY``
    (a Sentinel-managed master demoted under us) raises: the connection must go."""
    message = text.decode(errors="replace")
    if message.startswith("READONLY"):
        raise RedisConnectionError("the previous master is now a replica")
    error = BaseParser.parse_error(message)  # type: ignore[no-untyped-call]
    return error if isinstance(error, ResponseError) else ResponseError(message)


Reply = bytes | int | None | ResponseError | list[Any]
_MAX_SMALL_REPLY = 1 << 20


Value = bytes | memoryview | ResponseError | None
# (which value or target, its buffer, how many of its bytes have landed): called after every
# receive into a caller's or a fresh buffer, in order, with the count only growing.
Landed = Callable[[int, memoryview, int], None]


def read_into(
    client: Any,
    keys: Sequence[str],
    targets: Sequence[memoryview],
    prelude: Sequence[Sequence[Any]] = (),
    landed: Landed | None = None,
) -> tuple[list[Reply], list[int | ResponseError | None]]:
    """Send the ``prelude`` commands, then GET every key into its target. Returns the prelude's
    replies and, per key, ``None`` when the key is missing, else the value's length (read into
    the target only when it is exactly the target's length; otherwise skipped). An error reply
    is returned as a typed ``ResponseError``, not raised. ``landed(i, targets[i], count)``
    follows the bytes as they land in target ``i``."""
    commands = [*prelude, *(("GET", key) for key in keys)]
    with _connection(client, commands) as reader:
        replies = [reader.reply() for _ in prelude]
        return replies, [
            reader.bulk_into(target, _follow(landed, i, target)) for i, target in enumerate(targets)
        ]


def read_values(
    client: Any,
    commands: Sequence[Sequence[Any]],
    prelude: Sequence[Sequence[Any]] = (),
    tail: Sequence[Sequence[Any]] = (),
    landed: Landed | None = None,
) -> tuple[list[Reply], list[Value], list[Reply]]:
    """Send the ``prelude`` commands, then ``commands`` (each answered by one string or nil:
    ``GET``, ``GETRANGE``), then the ``tail`` commands, in one write. Returns the prelude's
    replies, the values (one up to ``SMALL_VALUE`` bytes as ``bytes``, a larger one in a buffer
    of its own that the socket was read straight into: one copy where redis-py makes two) and
    the tail's replies. An error reply is returned as a typed ``ResponseError``, not raised.
    ``landed(i, buffer, count)`` follows the bytes of value ``i`` as they land, for each value
    received in a buffer of its own."""
    with _connection(client, [*prelude, *commands, *tail]) as reader:
        replies = [reader.reply() for _ in prelude]
        values = [reader.value(landed, i) for i in range(len(commands))]
        return replies, values, [reader.reply() for _ in tail]


def _follow(landed: Landed | None, index: int, buffer: memoryview) -> Callable[[int], None] | None:
    if landed is None:
        return None
    return lambda count: landed(index, buffer, count)


@contextmanager
def _connection(client: Any, commands: Sequence[Sequence[Any]]) -> Iterator[_Reader]:
    """A pooled connection with ``commands`` sent on it, and a reader of its replies; the
    connection is dropped unless every reply was read."""
    pool = client.connection_pool
    conn = pool.get_connection()
    clean = False
    try:
        conn.send_packed_command(conn.pack_commands(commands))
        yield _Reader(conn._sock)
        clean = True
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def bulk_into(
        self, target: memoryview, landed: Callable[[int], None] | None = None
    ) -> int | ResponseError | None:
        line = self._line()
        if line[:1] == b"-":
            return _error(line[1:])
        if line == b"_":  # RESP3's null (RESP2 says "$-1")
            return None
        if line[:1] == b"+":  # fakeredis sends values without CR/LF as simple strings
            if len(line) - 1 == len(target):
                target[:] = line[1:]
            return len(line) - 1
        if line[:1] != b"$":
            raise RedisConnectionError(f"unexpected reply {line[:32]!r} to GET")
        size = int(line[1:])
        if size < 0:
            return None
        if size != len(target):
            self._skip(size + 2)
            return size
        self._fill(target, landed)
        if self._take(2) != b"\r\n":
            raise RedisConnectionError("malformed bulk reply")
        return size

    def value(self, landed: Landed | None = None, index: int = 0) -> Value:
        """One string reply (or nil, or an error), small ones as bytes, larger ones received in
        place (followed by ``landed`` as value ``index``)."""
        line = self._line()
        if line[:1] == b"-":
            return _error(line[1:])
        if line == b"_":
            return None
        if line[:1] == b"+":  # fakeredis sends values without CR/LF as simple strings
            return line[1:]
        if line[:1] != b"$":
            raise RedisConnectionError(f"unexpected reply {line[:32]!r} to a string command")
        size = int(line[1:])
        if size < 0:
            return None
        if size <= SMALL_VALUE:
            return self._take(size + 2)[:-2]
        target = destination.fresh(size).numpy().data  # no zero-fill: every byte is received
        self._fill(target, _follow(landed, index, target))
        if self._take(2) != b"\r\n":
            raise RedisConnectionError("malformed bulk reply")
        return target

    def reply(self) -> Reply:
        """One small reply of any RESP2 type (and RESP3's null)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return _error(rest)
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

    def _fill(self, target: memoryview, landed: Callable[[int], None] | None = None) -> None:
        have = min(len(self._buf), len(target))
        target[:have] = self._buf[:have]
        del self._buf[:have]
        if landed is not None and have:
            landed(have)
        while have < len(target):
            got = self._sock.recv_into(target[have:])
            if got == 0:
                raise RedisConnectionError("Redis closed the connection mid-reply")
            have += got
            if landed is not None:
                landed(have)

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
