"""Which Redis node serves each entry: a batch's keys grouped per node, each group with a
plain client of that node.

One server (or one Sentinel-managed master) is one node. On Redis Cluster an entry's keys share
one hash tag, so one entry never spans nodes: each head key goes to the master serving its slot
in the client's slot map, and each group runs on that master's own ``redis.Redis`` client
(plain pipelines: no cross-node pipeline that fails as a whole, no per-command routing). A
reply that says the slot lives elsewhere (``MOVED``/``ASK``/``TRYAGAIN``) sends the group
through the cluster client instead (``redirected``), which follows redirections; that reply,
and a node that does not answer, also refresh the slot map in the background, so a failover
is seen without any call waiting for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, TryAgainError

from ec_redis.cluster_client import LazyCluster
from ec_redis.tiers.guard import REDIS_ERRORS

# Replies that name another node (MovedError is an AskError) or a slot in migration.
REDIRECTS: tuple[type[Exception], ...] = (AskError, TryAgainError)
CLUSTER = "cluster"  # the group of keys no node is known for yet: the cluster client decides
SERVER = "server"  # the one node of a single-server or Sentinel client


@dataclass(frozen=True)
class Node:
    """``address`` names the node's circuit breaker; ``client`` reaches that node."""

    address: str
    client: Any


Group = tuple[Node, list[int]]  # a node and the indices of the keys it serves


class Nodes(Protocol):
    default_address: str

    def split(self, keys: Sequence[str]) -> list[Group]:
        """The keys' indices grouped by the node serving them (no I/O, but for building a
        cluster client on first use)."""
        ...

    def redirected(self) -> Any:
        """The client that follows redirections, after a node said a slot lives elsewhere."""
        ...

    def unreachable(self, address: str) -> None:
        """A node did not answer (its slots may have moved)."""
        ...

    def addresses(self) -> set[str] | None:
        """The addresses calls may go to now (``None``: any; one server has one)."""
        ...


class OneNode:
    """Every key on one server: the client itself."""

    default_address = SERVER

    def __init__(self, client: Any) -> None:
        self._node = Node(SERVER, client)

    def split(self, keys: Sequence[str]) -> list[Group]:
        return [(self._node, list(range(len(keys))))] if keys else []

    def redirected(self) -> Any:
        return self._node.client

    def unreachable(self, address: str) -> None:
        pass

    def addresses(self) -> set[str] | None:
        return None


class ClusterNodes:
    """Keys grouped by the master serving their slot; keys whose slot no master serves in
    the slot map (or all, before the cluster client could be built) go to the ``CLUSTER``
    group, run through the cluster client. ``refresh_interval_s`` bounds slot-map refreshes."""

    default_address = CLUSTER

    def __init__(self, cluster: LazyCluster, refresh_interval_s: float = 1.0) -> None:
        self._cluster = cluster
        self._whole = Node(CLUSTER, cluster)
        self._refresh_interval_s = refresh_interval_s
        self._lock = threading.Lock()
        self._refreshing = False
        self._refreshed_at = float("-inf")
        self.refreshes = 0

    def split(self, keys: Sequence[str]) -> list[Group]:
        if not keys:
            return []
        try:  # built on first use (reading the slot map), so even a first batch goes per node
            client = self._cluster.built or self._cluster.cluster()
        except REDIS_ERRORS:  # no seed answers: the group's breaker hears it on the call
            return [(self._whole, list(range(len(keys))))]
        groups: dict[str, Group] = {}
        for index, key in enumerate(keys):
            node = self._node(client, key)
            groups.setdefault(node.address, (node, []))[1].append(index)
        return list(groups.values())

    def _node(self, client: RedisCluster, key: str) -> Node:
        try:
            owner = client.nodes_manager.get_node_from_slot(key_slot(key.encode()))
            return Node(owner.name, client.get_redis_connection(owner))
        except REDIS_ERRORS:  # SlotNotCoveredError: let the cluster client find (or say) why
            return self._whole

    def redirected(self) -> Any:
        self.refresh()
        return self._cluster

    def unreachable(self, address: str) -> None:
        self.refresh()

    def addresses(self) -> set[str] | None:
        """The masters in the slot map (a master whose replica took over is not one), and
        ``CLUSTER``; ``None`` before the client is built."""
        client = self._cluster.built
        if client is None:
            return None
        primaries = client.get_primaries()  # type: ignore[no-untyped-call]
        return {CLUSTER, *(node.name for node in primaries)}

    def refresh(self) -> None:
        """Re-read the slot map on a background thread: one at a time, at most one per
        ``refresh_interval_s``; nobody waits for it."""
        client = self._cluster.built
        now = time.monotonic()
        with self._lock:
            if client is None or self._refreshing:
                return
            if now - self._refreshed_at < self._refresh_interval_s:
                return
            self._refreshing = True
            self._refreshed_at = now
        threading.Thread(
            target=self._refresh, args=(client,), name="ec_redis-slots", daemon=True
        ).start()

    def _refresh(self, client: RedisCluster) -> None:
        try:
            client.nodes_manager.initialize()
            self.refreshes += 1
        except REDIS_ERRORS:
            pass  # every seed down: the next failure asks again
        finally:
            with self._lock:
                self._refreshing = False


def nodes_for(client: Any) -> Nodes:
    """The routing for a client ``redis_conn.make_client`` built (or any other)."""
    if isinstance(client, LazyCluster):
        return ClusterNodes(client)
    if isinstance(client, RedisCluster):
        return ClusterNodes(LazyCluster.of(client))
    return OneNode(client)
