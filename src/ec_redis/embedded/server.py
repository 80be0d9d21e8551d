"""One embedded server: a ``redis-server`` or ``valkey-server`` process on a free loopback
port with persistence off (or fakeredis when no binary exists), started, killed, restarted
and stopped by this process. The cluster and Sentinel topologies are made of these."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ec_redis.embedded.binary import Flavor, ServerBinary
from ec_redis.embedded.fake import FakeServer
from ec_redis.embedded.process import call, check_owner, free_port, terminate, wait_for_port

# Replicas sync at once (the default waits 5 s to batch replicas into one diskless sync).
REPLICATION_ARGS = ("--repl-diskless-sync-delay", "0")


@dataclass
class EmbeddedRedis:
    """A server owned by this process. ``kind`` says which one, e.g. ``valkey-server 9.1.2
    (embedded, port 40001)`` or ``fakeredis TCP server ...``; ``binary`` is ``None`` for
    fakeredis."""

    port: int
    kind: str
    binary: ServerBinary | None = None
    process: subprocess.Popen[bytes] | None = None
    workdir: str | None = None
    extra_args: tuple[str, ...] = ()
    config_file: str | None = None
    _fake: FakeServer | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def flavor(self) -> Flavor | None:
        """``redis`` or ``valkey``; ``None`` for fakeredis."""
        return None if self.binary is None else self.binary.flavor

    @classmethod
    def start(
        cls,
        flavor: Flavor | None = None,
        *,
        prefer_fake: bool = False,
        extra_args: tuple[str, ...] = (),
    ) -> EmbeddedRedis:
        """A real server of ``flavor`` (``RuntimeError`` when its binary is missing: a caller
        who names a server gets that server). Without a flavor: the first binary found
        (Redis, then Valkey), else fakeredis; ``prefer_fake``: fakeredis regardless."""
        if prefer_fake or (flavor is None and ServerBinary.find_any() is None):
            fake = FakeServer()
            why = "" if prefer_fake else "; no redis-server or valkey-server found"
            kind = f"fakeredis TCP server (port {fake.port}{why})"
            return cls(port=fake.port, kind=kind, _fake=fake)
        return cls.start_server(extra_args, flavor=flavor)

    @classmethod
    def start_server(
        cls,
        extra_args: tuple[str, ...] = (),
        *,
        flavor: Flavor | None = None,
        port: int | None = None,
        config: str | None = None,
        role: str = "embedded",
    ) -> EmbeddedRedis:
        """A real server (never fakeredis; ``RuntimeError`` without the binary; ``flavor``
        ``None``: Redis, else Valkey) in a directory of its own, verified to be this
        process's child once it answers.

        ``config`` is the text of a configuration file written into that directory and
        passed before the command-line options (Sentinel needs a file it can rewrite).
        ``role`` goes into ``kind``. The directory and the process go away on ``stop()``,
        also when the start fails.
        """
        binary = ServerBinary.require(flavor)
        server = cls(port=port or free_port(), kind=binary.name, binary=binary,
                     extra_args=extra_args)  # fmt: skip
        server.workdir = tempfile.mkdtemp(prefix=f"ec_redis-{binary.flavor}-")
        try:
            if config is not None:
                server.config_file = os.path.join(server.workdir, "server.conf")
                with open(server.config_file, "w") as f:
                    f.write(config)
            server.kind = f"{binary.name} {binary.version} ({role}, port {server.port})"
            server._spawn()
            check_owner(server.port, server.process)
        except BaseException:
            server.stop()
            raise
        return server

    def _spawn(self) -> None:
        assert self.binary is not None
        args = [
            self.binary.path, *([self.config_file] if self.config_file else []),
            "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self.workdir or ".", "--protected-mode", "no",
            "--loglevel", "warning", *self.extra_args,
        ]  # fmt: skip
        log_path = os.path.join(self.workdir or ".", "server.log")
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_port(self.port, self.process, log_path, self.binary.name)
        except BaseException:
            self.kill()
            raise

    @property
    def alive(self) -> bool:
        """Whether the server process is running (a fakeredis server counts as running)."""
        if self.process is None:
            return self._fake is not None
        return self.process.poll() is None

    def call(self, *args: str | int, timeout_s: float = 2.0) -> Any:
        """Send one command on a fresh connection and return the decoded reply."""
        return call(self.port, *args, timeout_s=timeout_s)

    def restart(self) -> None:
        """Kill and start the same binary on the same port with the same options (data is
        lost: no persistence)."""
        assert self.binary is not None and self.process is not None, "fakeredis cannot restart"
        self.kill()
        self._spawn()

    def kill(self) -> None:
        """SIGKILL the process (a crash: no goodbye to clients, replicas or the cluster)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        """Terminate the process (kill it after 5 s) and delete its directory."""
        if self._fake is not None:
            self._fake.stop()
            self._fake = None
        if self.process is not None:
            terminate(self.process)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
