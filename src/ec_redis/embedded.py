"""An embedded Redis for demos, benchmarks and tests: a real ``redis-server`` on a free port
(persistence off), or fakeredis's TCP server when no binary exists."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class EmbeddedRedis:
    """A Redis server owned by this process; ``kind`` says which one ("redis-server ..." or
    "fakeredis")."""

    port: int
    kind: str
    process: subprocess.Popen[bytes] | None = None
    workdir: str | None = None
    _fake: Any = field(default=None, repr=False)
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, *, prefer_fake: bool = False, extra_args: tuple[str, ...] = ()) -> EmbeddedRedis:
        binary = shutil.which("redis-server")
        if binary is None or prefer_fake:
            return cls._start_fake()
        server = cls(port=free_port(), kind="redis-server", extra_args=extra_args)
        server.workdir = tempfile.mkdtemp(prefix="ec_redis-")
        server.kind = f"redis-server {_version(binary)} (embedded, port {server.port})"
        server._spawn(binary)
        return server

    def _spawn(self, binary: str) -> None:
        args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self.workdir or ".", "--protected-mode", "no",
            "--loglevel", "warning", *self.extra_args,
        ]  # fmt: skip
        log_path = os.path.join(self.workdir or ".", "redis.log")
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        _wait_for_port(self.port, self.process, log_path)

    @classmethod
    def _start_fake(cls) -> EmbeddedRedis:
        from fakeredis import TcpFakeServer

        port = free_port()
        fake = TcpFakeServer(("127.0.0.1", port), server_type="redis")
        thread = threading.Thread(target=fake.serve_forever, daemon=True)
        thread.start()
        _wait_for_port(port, None, None)
        return cls(port=port, kind=f"fakeredis TCP server (port {port}; no redis-server found)",
                   _fake=fake)  # fmt: skip

    def restart(self) -> None:
        """Stop and start the same server on the same port (data is lost: no persistence)."""
        binary = shutil.which("redis-server")
        assert binary is not None and self.process is not None, "restart needs redis-server"
        self.kill()
        self._spawn(binary)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self._fake is not None:
            self._fake.shutdown()
            self._fake.server_close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "?"
    for word in out.stdout.split():
        if word.startswith("v="):
            return word[2:]
    return "?"


def _wait_for_port(
    port: int, process: subprocess.Popen[bytes] | None, log_path: str | None, timeout_s: float = 10
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            with open(log_path or os.devnull, errors="replace") as log:
                raise RuntimeError(f"redis-server exited at start: {log.read().strip()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"no Redis answered on 127.0.0.1:{port} within {timeout_s}s")
