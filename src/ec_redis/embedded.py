"""An embedded Redis for demos, benchmarks and tests: a real ``redis-server`` on a free port
(persistence off), or fakeredis's TCP server when no binary exists.

``EmbeddedCluster`` (a Redis Cluster of masters and replicas) and ``EmbeddedSentinel`` (a
master, replicas and three Sentinels) build production topologies out of the same servers,
for tests that kill nodes and watch failovers. Every process listens on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

_T = TypeVar("_T")


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
    config_file: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, *, prefer_fake: bool = False, extra_args: tuple[str, ...] = ()) -> EmbeddedRedis:
        binary = shutil.which("redis-server")
        if binary is None or prefer_fake:
            return cls._start_fake()
        return cls.start_server(extra_args)

    @classmethod
    def start_server(
        cls,
        extra_args: tuple[str, ...] = (),
        *,
        port: int | None = None,
        config: str | None = None,
        label: str = "redis-server",
    ) -> EmbeddedRedis:
        """A real ``redis-server`` (never fakeredis; ``RuntimeError`` without the binary) in a
        directory of its own, verified to be this process's child once it answers.

        ``config`` is the text of a configuration file written into that directory and
        passed before the command-line options (Sentinel needs a file it can rewrite).
        The directory and the process go away on ``stop()``, also when the start fails.
        """
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        server = cls(port=port or free_port(), kind=label, extra_args=extra_args)
        server.workdir = tempfile.mkdtemp(prefix="ec_redis-")
        try:
            if config is not None:
                server.config_file = os.path.join(server.workdir, "redis.conf")
                with open(server.config_file, "w") as f:
                    f.write(config)
            server.kind = f"{label} {_version(binary)} (embedded, port {server.port})"
            server._spawn(binary)
            _check_owner(server.port, server.process)
        except BaseException:
            server.stop()
            raise
        return server

    def _spawn(self, binary: str) -> None:
        args = [
            binary, *([self.config_file] if self.config_file else []),
            "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self.workdir or ".", "--protected-mode", "no",
            "--loglevel", "warning", *self.extra_args,
        ]  # fmt: skip
        log_path = os.path.join(self.workdir or ".", "redis.log")
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_for_port(self.port, self.process, log_path)
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
        return _call(self.port, *args, timeout_s=timeout_s)

    @classmethod
    def _start_fake(cls) -> EmbeddedRedis:
        from fakeredis import TcpFakeServer

        port = free_port()
        fake = TcpFakeServer(("127.0.0.1", port), server_type="redis")
        fake.RequestHandlerClass = _fake_handler()
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


CLUSTER_SLOTS = 16384
# Replicas sync at once (the default waits 5 s to batch replicas into one diskless sync).
_REPLICATION_ARGS = ("--repl-diskless-sync-delay", "0")


@dataclass
class EmbeddedCluster:
    """A Redis Cluster of ``masters`` masters with ``replicas_per_master`` replicas each, one
    ``redis-server`` per node, every node in its own directory (nodes.conf), persistence off.

    ``cluster-node-timeout`` is 1000 ms, so a killed master's replica takes over within a
    few seconds. Each node's cluster bus gets a free port of its own (``cluster-port``), so
    data ports need not stay below 55535.
    """

    servers: dict[int, EmbeddedRedis] = field(default_factory=dict)
    node_timeout_ms: int = 1000

    @classmethod
    def start(
        cls,
        masters: int = 3,
        replicas_per_master: int = 1,
        extra_args: tuple[str, ...] = (),
        *,
        node_timeout_ms: int = 1000,
        timeout_s: float = 30.0,
    ) -> EmbeddedCluster:
        """Start the nodes, create the cluster with ``redis-cli --cluster create`` and wait
        until every node reports ``cluster_state:ok`` and every replica is in sync.

        Any failure stops whatever was started and raises (``RuntimeError`` or
        ``TimeoutError`` with the state seen last)."""
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (apt-get install redis-tools)")
        cluster = cls(node_timeout_ms=node_timeout_ms)
        try:
            for _ in range(masters * (1 + replicas_per_master)):
                node = _retry_start(lambda: cluster._start_node(extra_args))
                cluster.servers[node.port] = node
            create = [
                cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.servers),
                "--cluster-replicas", str(replicas_per_master), "--cluster-yes",
            ]  # fmt: skip
            done = subprocess.run(create, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode != 0 or "[OK] All 16384 slots covered" not in done.stdout:
                raise RuntimeError(
                    f"redis-cli --cluster create failed (rc {done.returncode}): "
                    f"{(done.stdout + done.stderr).strip()[-2000:]}"
                )
            cluster.wait_ready(masters, masters * replicas_per_master, timeout_s=timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_node(self, extra_args: tuple[str, ...]) -> EmbeddedRedis:
        return EmbeddedRedis.start_server(
            (
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-port", str(free_port()), *_REPLICATION_ARGS, *extra_args,
            ),
            label="redis-server cluster node",
        )  # fmt: skip

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.servers)

    @property
    def nodes(self) -> dict[int, subprocess.Popen[bytes]]:
        """Port -> process of every node (killed ones included)."""
        return {p: s.process for p, s in self.servers.items() if s.process is not None}

    def live_ports(self) -> list[int]:
        """Ports of the nodes whose process still runs."""
        return [p for p, s in self.servers.items() if s.alive]

    def call(self, port: int, *args: str | int, timeout_s: float = 2.0) -> Any:
        """One command to one node (decoded reply)."""
        return _call(port, *args, timeout_s=timeout_s)

    def cluster_info(self, port: int) -> dict[str, str]:
        """``CLUSTER INFO`` of one node as a dict (``cluster_state``, ``cluster_slots_ok``...)."""
        reply = self.call(port, "CLUSTER", "INFO")
        if isinstance(reply, dict):
            return {str(k): str(v) for k, v in reply.items()}
        lines = (line.partition(":") for line in str(reply).splitlines())
        return {key: value.strip() for key, sep, value in lines if sep}

    def cluster_nodes(self, port: int | None = None) -> list[dict[str, Any]]:
        """``CLUSTER NODES`` as seen by ``port`` (default: the first live node), one dict per
        node: ``id``, ``port``, ``flags`` (a set), ``master_id`` (``None`` for masters),
        ``link`` and ``slots`` (how many slots it serves)."""
        if port is None:
            port = self.live_ports()[0]
        out = []
        for line in str(self.call(port, "CLUSTER", "NODES")).splitlines():
            fields = line.split()
            if len(fields) < 8:
                continue
            slots = 0
            for part in fields[8:]:
                if part.startswith("["):
                    continue  # a slot being migrated or imported, listed besides its range
                low, _, high = part.partition("-")
                slots += int(high or low) - int(low) + 1
            out.append({
                "id": fields[0], "port": int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                "flags": set(fields[2].split(",")),
                "master_id": None if fields[3] == "-" else fields[3],
                "link": fields[7], "slots": slots,
            })  # fmt: skip
        return out

    def masters(self, port: int | None = None) -> list[int]:
        """Ports of the current masters: serving slots, not marked failed, still running."""
        live = set(self.live_ports())
        return sorted(
            n["port"] for n in self.cluster_nodes(port)
            if "master" in n["flags"] and "fail" not in n["flags"] and n["slots"] > 0
            and n["port"] in live
        )  # fmt: skip

    def replicas_of(self, master_port: int, port: int | None = None) -> list[int]:
        """Ports of the running replicas of the master on ``master_port``."""
        nodes = self.cluster_nodes(port)
        ids = {n["port"]: n["id"] for n in nodes}
        live = set(self.live_ports())
        return sorted(
            n["port"] for n in nodes
            if n["master_id"] == ids.get(master_port) and n["port"] in live
        )  # fmt: skip

    def slot_owner(self, slot: int, port: int | None = None) -> int:
        """Port of the master serving ``slot`` (``CLUSTER SLOTS`` of ``port``)."""
        if port is None:
            port = self.live_ports()[0]
        for low, high, master, *_ in self.call(port, "CLUSTER", "SLOTS"):
            if int(low) <= slot <= int(high):
                return int(master[1])
        raise LookupError(f"no node serves slot {slot}")

    def key_owner(self, key: str) -> int:
        """Port of the master serving ``key``'s slot."""
        return self.slot_owner(int(self.call(self.live_ports()[0], "CLUSTER", "KEYSLOT", key)))

    def wait_ready(
        self, masters: int | None = None, replicas: int | None = None, timeout_s: float = 30.0
    ) -> None:
        """Wait until every running node reports ``cluster_state:ok`` and agrees on the same
        ``masters`` (default: any number) serving all 16384 slots, with ``replicas`` (default:
        any number) running replicas whose replication link is up."""
        seen: list[str] = []

        def ready() -> bool:
            seen.clear()
            views = []
            for port in self.live_ports():
                state = self.cluster_info(port).get("cluster_state")
                if state != "ok":
                    seen.append(f"{port}: cluster_state {state}")
                    return False
                views.append(self.masters(port))
            if any(view != views[0] for view in views):
                seen.append(f"masters disagree: {views}")
                return False
            covered = sum(n["slots"] for n in self.cluster_nodes() if n["port"] in views[0])
            seen.append(f"masters {views[0]} serving {covered} slots")
            if covered != CLUSTER_SLOTS or (masters is not None and len(views[0]) != masters):
                return False
            attached = [
                p for m in views[0] for p in self.replicas_of(m)
                if self.call(p, "INFO", "replication").get("master_link_status") == "up"
            ]  # fmt: skip
            seen.append(f"replicas in sync: {attached}")
            return replicas is None or len(attached) == replicas

        _wait_until(ready, timeout_s, lambda: f"a healthy cluster; {'; '.join(seen)}")

    def kill(self, port: int) -> None:
        """SIGKILL one node (no goodbye to the cluster: a crash)."""
        self.servers[port].kill()

    def stop(self) -> None:
        """Stop every node and delete their directories."""
        _stop_all(self.servers.values())

    def __enter__(self) -> EmbeddedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class EmbeddedSentinel:
    """A master, ``replicas`` replicas and ``sentinels`` Sentinels watching the master as
    ``service`` (quorum 2, down after 1000 ms, failover timeout 3000 ms, parallel-syncs 1).

    Each Sentinel has its own directory and a config file it rewrites as it learns."""

    service: str
    servers: list[EmbeddedRedis] = field(default_factory=list)
    sentinels: list[EmbeddedRedis] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        service: str = "ecmaster",
        *,
        replicas: int = 1,
        sentinels: int = 3,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        extra_args: tuple[str, ...] = (),
        timeout_s: float = 30.0,
    ) -> EmbeddedSentinel:
        """Start the data servers (``extra_args`` go to each), then the Sentinels, and wait
        until every Sentinel sees the master, all replicas and all other Sentinels.

        Any failure stops whatever was started and raises."""
        setup = cls(service)
        try:
            extra_args = (*_REPLICATION_ARGS, *extra_args)
            master = _retry_start(lambda: EmbeddedRedis.start_server(extra_args))
            setup.servers.append(master)
            replica_args = ("--replicaof", "127.0.0.1", str(master.port), *extra_args)
            for _ in range(replicas):
                setup.servers.append(_retry_start(lambda: EmbeddedRedis.start_server(replica_args)))
            _wait_until(
                lambda: all(
                    s.call("INFO", "replication").get("master_link_status") == "up"
                    for s in setup.servers[1:]
                ),
                timeout_s,
                lambda: "the replicas to sync with the master",
            )
            config = (
                f"sentinel monitor {service} 127.0.0.1 {master.port} {quorum}\n"
                f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                f"sentinel failover-timeout {service} {failover_timeout_ms}\n"
                f"sentinel parallel-syncs {service} 1\n"
            )
            for _ in range(sentinels):
                setup.sentinels.append(
                    _retry_start(
                        lambda: EmbeddedRedis.start_server(
                            ("--sentinel",), config=config, label="redis-sentinel"
                        )
                    )
                )
            setup.wait_ready(replicas, timeout_s=timeout_s)
        except BaseException:
            setup.stop()
            raise
        return setup

    @property
    def url(self) -> str:
        """``redis+sentinel://s1,s2,s3/service``."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def sentinel_master(self) -> dict[str, str]:
        """``SENTINEL MASTER <service>`` from the first Sentinel that answers."""
        last: Exception | None = None
        for sentinel in self.sentinels:
            if not sentinel.alive:
                continue
            try:
                reply = sentinel.call("SENTINEL", "MASTER", self.service)
            except Exception as exc:
                last = exc
                continue
            if isinstance(reply, dict):
                return {str(k): str(v) for k, v in reply.items()}
            return dict(zip(reply[::2], reply[1::2], strict=True))
        raise RuntimeError(f"no Sentinel answered (last error: {last})")

    def master_port(self) -> int:
        """The master's port according to a Sentinel."""
        return int(self.sentinel_master()["port"])

    def server(self, port: int) -> EmbeddedRedis:
        """The data server on ``port``."""
        for server in self.servers:
            if server.port == port:
                return server
        raise KeyError(port)

    def kill_master(self) -> int:
        """SIGKILL the current master; returns its port."""
        port = self.master_port()
        self.server(port).kill()
        return port

    def wait_ready(self, replicas: int, timeout_s: float = 30.0) -> None:
        """Wait until every running Sentinel agrees on a running master with ``replicas``
        replicas (links up) and knows all other running Sentinels."""
        seen: list[str] = []

        def ready() -> bool:
            seen.clear()
            live = [s for s in self.sentinels if s.alive]
            masters = set()
            for sentinel in live:
                state = sentinel.call("SENTINEL", "MASTER", self.service)
                if not isinstance(state, dict):
                    state = dict(zip(state[::2], state[1::2], strict=True))
                seen.append(
                    f"sentinel {sentinel.port}: master {state['port']} flags {state['flags']} "
                    f"replicas {state['num-slaves']} sentinels {state['num-other-sentinels']}"
                )
                if (
                    state["flags"] != "master"
                    or int(state["num-slaves"]) < replicas
                    or int(state["num-other-sentinels"]) < len(live) - 1
                ):
                    return False
                masters.add(int(state["port"]))
            if len(masters) != 1:
                return False
            (port,) = masters
            if not self.server(port).alive:
                return False
            role = self.server(port).call("INFO", "replication")
            return bool(role.get("role") == "master" and int(role["connected_slaves"]) >= replicas)

        _wait_until(ready, timeout_s, lambda: "; ".join(seen) or "the Sentinels")

    def stop(self) -> None:
        """Stop the Sentinels first (no failover while the servers go), then the servers."""
        _stop_all([*self.sentinels, *self.servers])

    def __enter__(self) -> EmbeddedSentinel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _call(port: int, *args: str | int, timeout_s: float = 2.0) -> Any:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s, decode_responses=True,
        retry=Retry(NoBackoff(), 0),  # one try: callers poll, and a dead node must fail fast
    )  # fmt: skip
    try:
        return client.execute_command(*args)  # type: ignore[no-untyped-call]
    finally:
        client.close()


def _check_owner(port: int, process: subprocess.Popen[bytes] | None) -> None:
    """Fail when the server answering on ``port`` is not ``process`` (a port race lost to
    another program that bound the "free" port first)."""
    if process is None:
        return
    import redis

    try:
        pid = int(_call(port, "INFO", "server").get("process_id", -1))
    except (redis.AuthenticationError, redis.ResponseError):
        return  # a Redis that wants credentials (--requirepass, ACLs): it cannot be asked
    except Exception as exc:  # not Redis, or not answering: not ours either way
        raise RuntimeError(f"port {port} is served by another process ({exc!r})") from None
    if pid != process.pid:
        raise RuntimeError(f"port {port} is served by another process (pid {pid})")


def _retry_start(start: Callable[[], _T], attempts: int = 3) -> _T:
    """Run ``start`` again (fresh free ports) when a port was taken between pick and bind."""
    for attempt in range(attempts):
        try:
            return start()
        except RuntimeError as exc:
            lost_race = "already in use" in str(exc) or "another process" in str(exc)
            if not lost_race or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _wait_until(
    check: Callable[[], bool], timeout_s: float, what: Callable[[], str], interval_s: float = 0.05
) -> None:
    """Poll ``check`` (errors count as "not yet") until it holds; ``TimeoutError`` naming
    ``what()`` (the state seen last) when ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    last_error = ""
    while True:
        try:
            if check():
                return
            last_error = ""
        except Exception as exc:  # a node still starting or just killed: keep polling
            last_error = f" (last error: {type(exc).__name__}: {exc})"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"after {timeout_s:.1f}s still waiting for {what()}{last_error}")
        time.sleep(interval_s)


def _stop_all(servers: Iterable[EmbeddedRedis]) -> None:
    """Stop every server, even when stopping one of them fails; re-raise the first error."""
    first: BaseException | None = None
    for server in servers:
        try:
            server.stop()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first


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


def _fake_handler() -> Any:
    """fakeredis's TCP handler puts its socket in non-blocking mode and then fails to send
    replies larger than the socket buffer (megabyte values); send those patiently."""
    from fakeredis._clients._tcp_server import TCPFakeRequestHandler

    class Handler(TCPFakeRequestHandler):
        def setup(self) -> None:
            super().setup()
            self.writer.writer = _BlockingSend(self.connection)  # type: ignore[assignment]

    return Handler


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
