"""Messages between the parent and its writer process: one JSON object per datagram of a
private ``SOCK_SEQPACKET`` socket pair (message boundaries kept, nothing to frame, no pickle).

A datagram travels whole or not at all, and the kernel refuses one larger than the sending
socket's buffer (``EMSGSIZE``, about 208 KiB by default): a request naming a very long item id
is such a message. ``TooLarge`` says so before anything is sent, so the other side never
sees any of it and stays usable.
"""

from __future__ import annotations

import errno
import json
import socket
from typing import Any

import torch

from ec_redis.codec.format import BY_TORCH

MAX_MESSAGE = 1 << 20  # what a receiver reads at most; a longer datagram is refused
_SEND_MARGIN = 1024  # the kernel refuses a datagram over its socket's buffer minus 32 bytes


DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in BY_TORCH}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WireError(Exception):
    """The other side is gone, answered out of turn, or sent something unreadable."""


class TooLarge(WireError):
    """A message this socket cannot carry in one datagram; nothing of it was sent."""


class Full(TooLarge):
    """No room for the message in the socket now (``send_now``); nothing of it was sent."""


def pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def capacity(sock: socket.socket) -> int:
    """The longest message ``sock`` can send (its send buffer bounds one datagram)."""
    sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    return max(0, min(MAX_MESSAGE, sndbuf - _SEND_MARGIN))


def encode(message: dict[str, Any], limit: int = MAX_MESSAGE) -> bytes:
    """``message`` as one datagram; ``TooLarge`` if it is longer than ``limit``."""
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > limit:
        raise TooLarge(f"a message of {len(data)} bytes (at most {limit} cross this socket)")
    return data


def send_bytes(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:
        if exc.errno == errno.EMSGSIZE:  # refused whole: not a byte of it went out
            raise TooLarge(f"a message of {len(data)} bytes: {exc!r}") from exc
        raise WireError(f"send failed: {exc!r}") from exc


def send_now(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` without waiting (``sock`` is non-blocking): a datagram goes whole or not
    at all, so ``Full`` means nothing went out."""
    try:
        sent = sock.send(data)
    except BlockingIOError as exc:
        raise Full(f"no room for a message of {len(data)} bytes now") from exc
    except OSError as exc:
        if exc.errno == errno.EMSGSIZE:
            raise TooLarge(f"a message of {len(data)} bytes: {exc!r}") from exc
        raise WireError(f"send failed: {exc!r}") from exc
    if sent != len(data):  # never for a datagram; a stream would need the rest sent
        raise WireError(f"sent {sent} of {len(data)} bytes")


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    send_bytes(sock, encode(message))


def receive(sock: socket.socket) -> dict[str, Any]:
    """The next message; ``WireError`` on end of stream, a timeout or garbage."""
    try:
        data = sock.recv(MAX_MESSAGE + 1)
    except OSError as exc:  # socket.timeout included
        raise WireError(f"receive failed: {exc!r}") from exc
    if not data:
        raise WireError("end of stream")
    if len(data) > MAX_MESSAGE:  # the kernel dropped the rest of it
        raise WireError(f"a message over {MAX_MESSAGE} bytes")
    try:
        message = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise WireError(f"unreadable message: {exc}") from exc
    if not isinstance(message, dict):
        raise WireError("a message must be an object")
    return message
