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
(``codec/landing.py``). A caller may also look at a value's first bytes and decide, before
the rest has arrived, where the rest goes and which further reads to send at once on the same
connection (``read_streamed``: a chunked entry's head names its chunks, whose replies then
follow the head's without a second round trip). An error reply to one key's command (a key
of another type: ``WRONGTYPE``) is returned in that key's place: it is one line, so the
replies after it are still read in step.

For any ``redis.Redis`` client whose pool makes our connections: one server (TCP/TLS/Unix), a
Sentinel-managed master, and each node of a Redis Cluster. Error replies become redis-py's
typed errors (``MovedError``, ``AskError``, ``NoScriptError`` ...); any surprise disconnects
the connection, so the pool never reuses one in an unknown state.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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
    replies, values, after = read_streamed(client, commands, prelude, tail, None, landed)
    return replies, [v for v in values if not isinstance(v, Streamed)], after


@dataclass(frozen=True)
class Plan:
    """Where the rest of a value goes once a planner has read its first bytes (a chunked
    entry's head): its remaining bytes into ``target``; ``commands`` go out at once, on the
    same connection, while those bytes still stream in (their replies come after every reply
    asked for before them): the ``prelude``'s small replies, then each key's ``GET`` into its
    ``targets`` slot. ``landed(i, buffer, count)`` follows ``target`` as 0 and ``targets[j]``
    as ``j + 1``."""

    target: memoryview
    prelude: Sequence[Sequence[Any]]
    keys: Sequence[str]
    targets: Sequence[memoryview]
    landed: Landed | None = None


@dataclass(frozen=True)
class Streamed:
    """What a planned value's commands answered: the prelude's replies and, per key, what
    ``read_into`` says of it (its length, ``None`` when missing, or the error)."""

    prelude: list[Reply]
    sizes: list[int | ResponseError | None]


# (which value, take(n): up to n more of its first bytes, its length) -> where the rest of
# it goes, or None: it is received as a plain value (with the bytes already taken)
Planner = Callable[[int, Callable[[int], bytes], int], Plan | None]


def read_streamed(
    client: Any,
    commands: Sequence[Sequence[Any]],
    prelude: Sequence[Sequence[Any]] = (),
    tail: Sequence[Sequence[Any]] = (),
    planner: Planner | None = None,
    landed: Landed | None = None,
) -> tuple[list[Reply], list[Value | Streamed], list[Reply]]:
    """``read_values``, where ``planner`` may look at each value's first bytes and say where
    the rest of it goes and which further reads to send now (``Plan``): a value so planned is
    answered by ``Streamed`` once those reads are in, in one round trip in all."""
    with _connection(client, [*prelude, *commands, *tail]) as reader:
        replies = [reader.reply() for _ in prelude]
        values: list[Value | Streamed] = []
        plans: list[tuple[int, Plan]] = []
        for i in range(len(commands)):
            size = reader.bulk_size()
            if not isinstance(size, int):
                values.append(size)
                continue
            start = _Start(reader, size)
            plan = None if planner is None else planner(i, start.take, size)
            if plan is None:
                values.append(reader.rest_of_value(size, start.taken, landed, i))
                continue
            if len(plan.target) != size - len(start.taken) or len(plan.keys) != len(plan.targets):
                raise ValueError("a plan must place exactly the rest of its value")
            reader.send([*plan.prelude, *(("GET", key) for key in plan.keys)])
            reader.fill_value(plan.target, _follow(plan.landed, 0, plan.target))
            plans.append((i, plan))
            values.append(Streamed([], []))  # its place; answered below
        after = [reader.reply() for _ in tail]
        for i, plan in plans:
            values[i] = Streamed(
                [reader.reply() for _ in plan.prelude],
                [
                    reader.bulk_into(target, _follow(plan.landed, j + 1, target))
                    for j, target in enumerate(plan.targets)
                ],
            )
        return replies, values, after


class _Start:
    """The first bytes of a value of ``size`` bytes, taken off the stream on demand."""

    def __init__(self, reader: _Reader, size: int) -> None:
        self._reader = reader
        self._size = size
        self.taken = b""

    def take(self, count: int) -> bytes:
        count = max(min(count, self._size - len(self.taken)), 0)
        out = self._reader.take(count) if count else b""
        self.taken += out
        return out


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
        yield _Reader(conn)
        clean = True
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)


class _Reader:
    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._sock: socket.socket = conn._sock
        self._buf = bytearray()

    def send(self, commands: Sequence[Sequence[Any]]) -> None:
        """Send more commands while replies are still being read (no health check: its PING
        would answer in the middle of them)."""
        if commands:
            self._conn.send_packed_command(self._conn.pack_commands(commands), check_health=False)

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
        self.fill_value(target, landed)
        return size

    def value(self, landed: Landed | None = None, index: int = 0) -> Value:
        """One string reply (or nil, or an error), small ones as bytes, larger ones received in
        place (followed by ``landed`` as value ``index``)."""
        size = self.bulk_size()
        return size if not isinstance(size, int) else self.rest_of_value(size, b"", landed, index)

    def bulk_size(self) -> int | Value:
        """The length of the string reply that follows, or the whole reply when it is no
        bulk string (nil, an error, a simple string)."""
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
        return None if size < 0 else size

    def rest_of_value(
        self, size: int, taken: bytes, landed: Landed | None = None, index: int = 0
    ) -> Value:
        """The value of ``size`` bytes whose first bytes ``taken`` were already read."""
        if size <= SMALL_VALUE:
            return taken + self._take(size - len(taken) + 2)[:-2]
        target = destination.fresh(size).numpy().data  # no zero-fill: every byte is received
        target[: len(taken)] = taken
        follow = _follow(landed, index, target)
        if follow is not None and taken:
            follow(len(taken))
        self.fill_value(target, follow, len(taken))
        return target

    def fill_value(
        self, target: memoryview, landed: Callable[[int], None] | None = None, have: int = 0
    ) -> None:
        """Receive the rest of a value into ``target[have:]``, then its CRLF."""
        self._fill(target, landed, have)
        if self._take(2) != b"\r\n":
            raise RedisConnectionError("malformed bulk reply")

    def take(self, count: int) -> bytes:
        """The next ``count`` bytes of the stream."""
        return self._take(count)

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

    def _fill(
        self, target: memoryview, landed: Callable[[int], None] | None = None, have: int = 0
    ) -> None:
        moved = min(len(self._buf), len(target) - have)
        target[have : have + moved] = self._buf[:moved]
        del self._buf[:moved]
        have += moved
        if landed is not None and moved:
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
