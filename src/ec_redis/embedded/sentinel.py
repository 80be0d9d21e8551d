"""An embedded Sentinel set-up (a master, replicas and Sentinels watching them) for tests
that kill the master and watch a replica take over."""

from __future__ import annotations

from dataclasses import dataclass, field

from ec_redis.embedded.binary import Flavor, ServerBinary
from ec_redis.embedded.process import retry_start, stop_all, wait_until
from ec_redis.embedded.server import REPLICATION_ARGS, EmbeddedRedis


@dataclass
class EmbeddedSentinel:
    """A master, ``replicas`` replicas and ``sentinels`` Sentinels watching the master as
    ``service`` (quorum 2, down after 1000 ms, failover timeout 3000 ms, parallel-syncs 1),
    all of one ``flavor``: ``redis-server`` or ``valkey-server`` (``--sentinel``).

    Each Sentinel has its own directory and a config file it rewrites as it learns."""

    service: str
    flavor: Flavor | None = None
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
        flavor: Flavor | None = None,
        timeout_s: float = 30.0,
    ) -> EmbeddedSentinel:
        """Start the data servers (``extra_args`` go to each; ``flavor`` ``None``: Redis if
        installed, else Valkey), then the Sentinels, and wait until every Sentinel sees the
        master, all replicas and all other Sentinels.

        Any failure stops whatever was started and raises."""
        setup = cls(service, ServerBinary.require(flavor).flavor)

        def start(args: tuple[str, ...], config: str | None = None) -> EmbeddedRedis:
            role = "sentinel" if config is not None else "data server"
            return retry_start(
                lambda: EmbeddedRedis.start_server(
                    args, flavor=setup.flavor, config=config, role=role
                )
            )

        try:
            extra_args = (*REPLICATION_ARGS, *extra_args)
            master = start(extra_args)
            setup.servers.append(master)
            replica_args = ("--replicaof", "127.0.0.1", str(master.port), *extra_args)
            for _ in range(replicas):
                setup.servers.append(start(replica_args))
            wait_until(
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
                setup.sentinels.append(start(("--sentinel",), config))
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

        wait_until(ready, timeout_s, lambda: "; ".join(seen) or "the Sentinels")

    def stop(self) -> None:
        """Stop the Sentinels first (no failover while the servers go), then the servers."""
        stop_all([*self.sentinels, *self.servers])

    def __enter__(self) -> EmbeddedSentinel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
