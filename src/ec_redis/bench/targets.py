"""The servers one ``ec-redis bench`` run measures: the given URL, or embedded servers of each
topology and flavor (redis-server, valkey-server), started one after the other."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ec_redis.embedded import FLAVORS, EmbeddedCluster, EmbeddedRedis, Flavor, ServerBinary
from ec_redis.errors import ECRedisError


def targets(
    url: str | None, topology: str, server: str | None, say: Callable[[str], None]
) -> Iterator[tuple[str, str, str]]:
    """(URL, what it is, a short name) of each server to measure, each running while the
    caller measures it. ``topology``: standalone, cluster or both; ``server``: redis,
    valkey, both, or ``None`` for every flavor installed."""
    if url:
        yield url, f"{url} (given)", "given server"
        return
    chosen = flavors(server)
    if topology in ("standalone", "both"):
        for flavor in chosen:
            with EmbeddedRedis.start(flavor) as single:
                say(f"ec-redis: using {single.kind}")
                binary = single.binary
                name = f"{binary.name} {binary.version}" if binary else "fakeredis"
                yield single.url, single.kind, f"{name}, 1 node"
    if topology in ("cluster", "both"):
        for flavor in chosen:
            with EmbeddedCluster.start(flavor=flavor) as cluster:
                node = next(iter(cluster.servers.values())).binary
                assert node is not None
                name = f"{node.name} {node.version}"
                say(f"ec-redis: using an embedded 3-master cluster of {name} ({cluster.url})")
                what = f"embedded Redis Cluster of {name}, 3 masters + 3 replicas ({cluster.url})"
                yield cluster.url, what, f"{name}, cluster"


def flavors(server: str | None) -> list[Flavor | None]:
    """The flavors ``server`` names (``ECRedisError`` when one is not installed), or every
    one installed; ``[None]`` (fakeredis) when none is."""
    if server is None:
        return [f for f in FLAVORS if ServerBinary.find(f) is not None] or [None]
    wanted: list[Flavor | None] = [f for f in FLAVORS if server in (f, "both")]
    for flavor in wanted:
        try:
            ServerBinary.require(flavor)
        except RuntimeError as exc:
            raise ECRedisError(f"--server {server}: {exc}") from None
    return wanted
