"""The benchmark's socket-level baseline: the fastest plain-Python read of a value off a Redis
socket, to measure the Redis tier's ``get`` against.

A minimal RESP client on one TCP connection: ``GET``s sent in one write, each reply's bulk
header parsed, its bytes ``recv_into`` a buffer that was allocated and touched (page-faulted)
once, up front, and is reused for every read. Nothing is checked, copied, decoded or
allocated per read: what the tier does on top of this is its cost. Read either one key
holding the whole value (``read_one``) or the same bytes as the tier's pieces, every ``GET``
pipelined (``read_pieces``). A benchmark helper, not a client: no errors beyond a clean
``ConnectionError``, no reconnects, no auth or TLS.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from urllib.parse import parse_qs, urlsplit

_SCRATCH = 64 * 1024
_PAGE = 4096


def why_not_plain(url: str) -> str:
    """Why the minimal client cannot read from the server(s) of ``url``, or "" if it can:
    it speaks plain TCP, without credentials (in the URL or its query)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if parts.scheme.startswith("rediss") or {"ssl", "ssl_cert_reqs"} & set(query):
        return "TLS"
    if parts.username or parts.password or {"username", "password"} & set(query):
        return "credentials"
    if parts.scheme == "unix":
        return "a Unix socket URL"
    return ""


def prefaulted(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` whose every page has been written once (a read into it
    takes no page faults)."""
    buf = bytearray(nbytes)  # calloc: large sizes come as untouched zero pages
    pages = len(range(0, nbytes, _PAGE))
    buf[::_PAGE] = b"\x01" * pages
    return memoryview(buf)


def command(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out += [b"$%d\r\n" % len(arg), arg, b"\r\n"]
    return b"".join(out)


class RawSocketClient:
    """One connection to ``host:port`` (no auth, no TLS, RESP2)."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._scratch = bytearray(_SCRATCH)
        self._view = memoryview(self._scratch)
        self._start = 0  # unread bytes of the scratch buffer: [start, end)
        self._end = 0

    def read_one(self, key: bytes, into: memoryview) -> int:
        """``GET key`` into the start of ``into``; the value's length (``-1``: missing)."""
        self._sock.sendall(command(b"GET", key))
        return self._bulk_into(into)

    def read_pieces(self, keys: Sequence[bytes], into: memoryview) -> int:
        """Every ``GET`` sent at once; the values land one after the other in ``into``.
        The bytes read in all (``-1``: a key is missing)."""
        self._sock.sendall(b"".join(command(b"GET", key) for key in keys))
        at, missing = 0, False
        for _ in keys:
            size = self._bulk_into(into[at:])
            missing = missing or size < 0
            at += max(size, 0)
        return -1 if missing else at

    def close(self) -> None:
        self._sock.close()

    def _bulk_into(
        self, into: memoryview, feed: Callable[[memoryview], object] | None = None
    ) -> int:
        """One bulk reply into the start of ``into``; ``feed`` (if any) gets each stretch of
        it as it lands, in order."""
        line = self._line()
        if line[:1] != b"$":
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        size = int(line[1:])
        if size < 0:
            return size
        if size > len(into):
            raise ConnectionError(f"a value of {size} bytes does not fit {len(into)}")
        have = min(self._end - self._start, size)
        into[:have] = self._view[self._start : self._start + have]
        self._start += have
        if feed is not None:
            feed(into[:have])
        while have < size:
            got = self._sock.recv_into(into[have:size])
            if not got:
                raise ConnectionError("the server closed the connection")
            if feed is not None:
                feed(into[have : have + got])
            have += got
        self._line()  # the value's CRLF
        return size

    def _line(self) -> bytes:
        while True:
            end = self._scratch.find(b"\r\n", self._start, self._end)
            if end >= 0:
                line = bytes(self._view[self._start : end])
                self._start = end + 2
                return line
            if self._start:  # keep the partial line at the front
                left = self._end - self._start
                self._view[:left] = self._view[self._start : self._end]
                self._start, self._end = 0, left
            got = self._sock.recv_into(self._view[self._end :])
            if not got:
                raise ConnectionError("the server closed the connection")
            self._end += got
