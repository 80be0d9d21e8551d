"""The fallback single server when no server binary exists: fakeredis's TCP server on a free
port, in a daemon thread of this process (logic only: no persistence, no real network stack
behind it, but the same wire protocol)."""

from __future__ import annotations

import select
import socket
import threading
from typing import Any

from ec_redis.embedded.process import free_port, wait_for_port


class FakeServer:
    """fakeredis answering on 127.0.0.1:``port`` until ``stop()``."""

    def __init__(self) -> None:
        from fakeredis import TcpFakeServer

        self.port = free_port()
        self._server = TcpFakeServer(("127.0.0.1", self.port), server_type="redis")
        self._server.RequestHandlerClass = _handler()
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        wait_for_port(self.port, None, None, "fakeredis")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _BlockingSend:
    """Replies written to a non-blocking socket, waiting for room instead of failing."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            try:
                view = view[self._sock.send(view) :]
            except BlockingIOError:
                select.select([], [self._sock], [], 1.0)
        return len(data)

    def flush(self) -> None:
        """Nothing is buffered."""


def _handler() -> Any:
    """fakeredis's TCP handler puts its socket in non-blocking mode and then fails to send
    replies larger than the socket buffer (megabyte values); send those patiently."""
    from fakeredis._clients._tcp_server import TCPFakeRequestHandler

    class Handler(TCPFakeRequestHandler):
        def setup(self) -> None:
            super().setup()
            self.writer.writer = _BlockingSend(self.connection)  # type: ignore[assignment]

    return Handler
