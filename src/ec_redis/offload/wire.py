"""Messages between the parent and its writer process: one JSON object per datagram of a
private ``SOCK_SEQPACKET`` socket pair (message boundaries kept, nothing to frame, no pickle).
"""

from __future__ import annotations

import json
import socket
from typing import Any

import torch

from ec_redis.codec.format import BY_TORCH

MAX_MESSAGE = 1 << 20  # a message names a key, a dtype, a shape and counters: far less


DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in BY_TORCH}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WireError(Exception):
    """The other side is gone, answered out of turn, or sent something unreadable."""


def pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise WireError(f"a message of {len(data)} bytes")
    try:
        sock.sendall(data)
    except OSError as exc:
        raise WireError(f"send failed: {exc!r}") from exc


def receive(sock: socket.socket) -> dict[str, Any]:
    """The next message; ``WireError`` on end of stream, a timeout or garbage."""
    try:
        data = sock.recv(MAX_MESSAGE)
    except OSError as exc:  # socket.timeout included
        raise WireError(f"receive failed: {exc!r}") from exc
    if not data:
        raise WireError("end of stream")
    try:
        message = json.loads(data)
    except ValueError as exc:
        raise WireError(f"unreadable message: {exc}") from exc
    if not isinstance(message, dict):
        raise WireError("a message must be an object")
    return message
