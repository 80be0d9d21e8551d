"""An embedded Redis Cluster (masters and replicas, one server process each) for tests that
kill nodes and watch failovers, formed with CLUSTER commands so no ``redis-cli`` is needed."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ec_redis.embedded.binary import Flavor, ServerBinary
from ec_redis.embedded.process import call, free_port, retry_start, stop_all, wait_until
from ec_redis.embedded.server import REPLICATION_ARGS, EmbeddedRedis

CLUSTER_SLOTS = 16384


@dataclass
class EmbeddedCluster:
    """A cluster of ``masters`` masters with ``replicas_per_master`` replicas each, one
    ``redis-server`` or ``valkey-server`` per node (``flavor``), every node in its own
    directory (nodes.conf), persistence off.

    ``cluster-node-timeout`` is 1000 ms, so a killed master's replica takes over within a
    few seconds. Each node's cluster bus gets a free port of its own (``cluster-port``), so
    data ports need not stay below 55535.
    """

    servers: dict[int, EmbeddedRedis] = field(default_factory=dict)
    node_timeout_ms: int = 1000
    flavor: Flavor | None = None
    bus_ports: dict[int, int] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        masters: int = 3,
        replicas_per_master: int = 1,
        extra_args: tuple[str, ...] = (),
        *,
        flavor: Flavor | None = None,
        node_timeout_ms: int = 1000,
        timeout_s: float = 30.0,
    ) -> EmbeddedCluster:
        """Start the nodes (``flavor`` ``None``: Redis if installed, else Valkey), give the
        masters equal slot ranges, introduce the nodes, attach the replicas, and wait until
        every node reports ``cluster_state:ok`` and every replica is in sync.

        Any failure stops whatever was started and raises (``RuntimeError`` or
        ``TimeoutError`` with the state seen last)."""
        if masters < 3:
            raise ValueError("a cluster that survives a master's failure needs 3+ masters")
        flavor = ServerBinary.require(flavor).flavor  # every node runs the same binary
        cluster = cls(node_timeout_ms=node_timeout_ms, flavor=flavor)
        try:
            for _ in range(masters * (1 + replicas_per_master)):
                node = retry_start(lambda: cluster._start_node(extra_args))
                cluster.servers[node.port] = node
            cluster._form(masters, timeout_s)
            cluster.wait_ready(masters, masters * replicas_per_master, timeout_s=timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_node(self, extra_args: tuple[str, ...]) -> EmbeddedRedis:
        bus_port = free_port()
        node = EmbeddedRedis.start_server(
            (
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-port", str(bus_port), *REPLICATION_ARGS, *extra_args,
            ),
            flavor=self.flavor,
            role="cluster node",
        )  # fmt: skip
        self.bus_ports[node.port] = bus_port
        return node

    def _form(self, masters: int, timeout_s: float) -> None:
        """What ``redis-cli --cluster create`` does: slots to the first ``masters`` nodes,
        distinct config epochs, MEET, then each other node replicates a master in turn."""
        ports = list(self.servers)
        primaries, followers = ports[:masters], ports[masters:]
        for i, port in enumerate(primaries):
            low, high = i * CLUSTER_SLOTS // masters, (i + 1) * CLUSTER_SLOTS // masters - 1
            self.call(port, "CLUSTER", "ADDSLOTSRANGE", low, high)
        for epoch, port in enumerate(ports, start=1):
            self.call(port, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
        seed = ports[0]
        for port in ports[1:]:
            self.call(port, "CLUSTER", "MEET", "127.0.0.1", seed, self.bus_ports[seed])

        def everyone_known() -> bool:
            return all(_complete(self.cluster_nodes(port), len(ports)) for port in ports)

        wait_until(everyone_known, timeout_s, lambda: "every node to know every other node")
        ids = {port: str(self.call(port, "CLUSTER", "MYID")) for port in primaries}
        for i, port in enumerate(followers):
            self.call(port, "CLUSTER", "REPLICATE", ids[primaries[i % masters]])

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
        return call(port, *args, timeout_s=timeout_s)

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

        wait_until(ready, timeout_s, lambda: f"a healthy cluster; {'; '.join(seen)}")

    def kill(self, port: int) -> None:
        """SIGKILL one node (no goodbye to the cluster: a crash)."""
        self.servers[port].kill()

    def stop(self) -> None:
        """Stop every node and delete their directories."""
        stop_all(self.servers.values())

    def __enter__(self) -> EmbeddedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _complete(nodes: Iterable[dict[str, Any]], expected: int) -> bool:
    """Whether a node's view lists ``expected`` nodes, none of them still being introduced."""
    listed = list(nodes)
    handshaking = any(n["flags"] & {"handshake", "noaddr"} for n in listed)
    return len(listed) == expected and not handshaking
