"""The servers one ``ec-redis bench`` run measures: the given URL, or embedded servers of each
topology and flavor (redis-server, valkey-server), started one after the other."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ec_redis.embedded import FLAVORS, EmbeddedCluster, EmbeddedRedis, Flavor, ServerBinary
from ec_redis.errors import ECRedisError


def targets(
    url: str | None,
    topology: str,
    server: str | None,
    say: Callable[[str], None],
    io_threads: int = 0,
) -> Iterator[tuple[str, str, str]]:
    """(URL, what it is, a short name) of each server to measure, each running while the
    caller measures it. ``topology``: standalone, cluster or both; ``server``: redis,
    valkey, both, or ``None`` for every flavor installed. ``io_threads`` > 1: each Valkey is
    measured twice, the second time started with ``--io-threads io_threads``."""
    if url:
        yield url, f"{url} (given)", "given server"
        return
    runs = _runs(flavors(server), io_threads)
    if topology in ("standalone", "both"):
        for flavor, args, suffix in runs:
            with EmbeddedRedis.start(flavor, extra_args=args) as single:
                say(f"ec-redis: using {single.kind}{suffix}")
                binary = single.binary
                name = f"{binary.name} {binary.version}" if binary else "fakeredis"
                yield single.url, single.kind + suffix, f"{name}{suffix}, 1 node"
    if topology in ("cluster", "both"):
        for flavor, args, suffix in runs:
            with EmbeddedCluster.start(flavor=flavor, extra_args=args) as cluster:
                node = next(iter(cluster.servers.values())).binary
                assert node is not None
                name = f"{node.name} {node.version}{suffix}"
                say(f"ec-redis: using an embedded 3-master cluster of {name} ({cluster.url})")
                what = f"embedded Redis Cluster of {name}, 3 masters + 3 replicas ({cluster.url})"
                yield cluster.url, what, f"{name}, cluster"


def _runs(
    chosen: list[Flavor | None], io_threads: int
) -> list[tuple[Flavor | None, tuple[str, ...], str]]:
    """(flavor, extra server arguments, a suffix for its name) of each server to start."""
    runs: list[tuple[Flavor | None, tuple[str, ...], str]] = []
    for flavor in chosen:
        runs.append((flavor, (), ""))
        if flavor == "valkey" and io_threads > 1:
            runs.append((flavor, ("--io-threads", str(io_threads)), f" io-threads {io_threads}"))
    return runs


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
