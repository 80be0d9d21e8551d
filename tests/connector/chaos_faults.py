"""Faults a chaos run injects into the Redis a connector reads, each one verified to have
really happened: FLUSHALL, SIGKILL and restart, a stored value overwritten with garbage of
the same length, SIGSTOP for a while, a reply lost after the server executed the command
(``LossyProxy``), and an out-of-memory server (``maxmemory`` below what it uses, with
``noeviction``: every write is refused with ``OOM``, reads still work).

Everything here is driven between engine calls by the harness's seeded rng, so a seed's
faults hit the same commands run after run (the pause is sized so that every Redis call made
inside it times out, whatever the machine's speed: see ``RedisFaults.pause``).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError
from redis.retry import Retry

from ec_redis.embedded import EmbeddedRedis
from ec_redis.keys import KeyBuilder
from ec_redis.tiers.layout import PROBE_BYTES, named_chunks

_VERSIONED = re.compile(r":[0-9a-f]{16}:(c\d+|h)$")  # a write's chunk or pending head


@dataclass
class ProxyCounters:
    connections: int = 0
    armed: int = 0
    # connections whose replies were swallowed after the server answered (so it ran the
    # commands) until the client gave up
    dropped_after_reply: int = 0
    dropped_without_reply: int = 0  # the server never answered (it died or was paused)


class LossyProxy:
    """A TCP proxy on 127.0.0.1 in front of a Redis server. ``arm()`` makes it take the next
    connection that sends a command: everything that client sends still reaches the server,
    which executes it, but no reply ever goes back; the client times out
    (``redis_socket_timeout_s``) and drops the connection (a lost reply). Swallowing until
    the client gives up, rather than closing at the first reply, is what makes it repeatable:
    the client sends a whole pipeline before it reads, so the server always runs all of it
    (closing early would cut a pipelined write wherever the bytes happened to be).
    Each arm catches one connection; later connections pass."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.counters = ProxyCounters()
        self._lock = threading.Lock()
        self._armed = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="lossy-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def arm(self) -> None:
        with self._lock:
            self._armed += 1
            self.counters.armed += 1

    def disarm(self) -> int:
        """Forget arms no command used; how many there were."""
        with self._lock:
            left, self._armed = self._armed, 0
            return left

    def _take_arm(self) -> bool:
        with self._lock:
            if self._armed <= 0:
                return False
            self._armed -= 1
            return True

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), 2.0)
            except OSError:
                client.close()  # the server is down: so is the connection
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.counters.connections += 1
                self._sockets.update((client, upstream))
            threading.Thread(
                target=self._pump, args=(client, upstream), name="lossy-proxy-conn", daemon=True
            ).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        """Both directions of one connection on one thread (``select``), so the decision to
        swallow replies is taken before the command reaches the server."""
        swallowing = swallowed = False
        try:
            while not self._closed:
                readable, _, _ = select.select([client, upstream], [], [], 1.0)
                if client in readable:
                    data = client.recv(1 << 16)
                    if not data:
                        return  # the client gave up (or is done)
                    if not swallowing and self._take_arm():
                        swallowing = True
                    upstream.sendall(data)
                if upstream in readable:
                    reply = upstream.recv(1 << 16)
                    if not reply:
                        return
                    if not swallowing:
                        client.sendall(reply)
                    elif not swallowed:
                        swallowed = True  # the server answered: it ran the command
                        self._count(after_reply=True)
        except OSError:
            pass
        finally:
            if swallowing and not swallowed:
                self._count(after_reply=False)
            self._close(client, upstream)

    def _count(self, *, after_reply: bool) -> None:
        with self._lock:
            if after_reply:
                self.counters.dropped_after_reply += 1
            else:
                self.counters.dropped_without_reply += 1

    def _close(self, *sockets: socket.socket) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
            with self._lock:
                self._sockets.discard(sock)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        self._close(*sockets)
        self._thread.join(5)


@dataclass
class FaultCounters:
    """What was injected, and the evidence that it took effect."""

    flushes: int = 0
    kills: int = 0
    garbage_writes: int = 0  # values overwritten in place (same length, checked by STRLEN)
    garbage_chunks: int = 0  # of which chunks of a chunked entry
    pauses: int = 0
    pauses_verified: int = 0  # a PING during the pause timed out
    paused_lookups: int = 0  # lookups run while the server was stopped
    lost_replies_armed: int = 0
    oom_windows: int = 0
    oom_verified: int = 0  # a SET of ours was refused with OOM
    oom_refusals: int = 0  # OOM errors the producer's writes got (its cache's counter)
    problems: list[str] = field(default_factory=list)  # a fault that did not take effect


class RedisFaults:
    """The faults of one run against ``server`` (the consumer may reach it through
    ``proxy``). Calls are synchronous: each returns once the fault is in place."""

    def __init__(self, server: EmbeddedRedis, proxy: LossyProxy | None = None) -> None:
        self.server = server
        self.proxy = proxy
        self.counters = FaultCounters()
        self._client = redis.Redis(
            host="127.0.0.1", port=server.port, socket_timeout=2.0, socket_connect_timeout=2.0
        )
        self.oom = False
        self.last_heads: list[str] = []  # the items stored when garbage last picked one
        self._dropped_before = proxy.counters.dropped_after_reply if proxy else 0
        self._dropped_at_close: int | None = None

    @property
    def lost_replies(self) -> int:
        """Replies the proxy swallowed after the server answered, since this run began."""
        if self.proxy is None:
            return 0
        now = self._dropped_at_close
        if now is None:
            now = self.proxy.counters.dropped_after_reply
        return now - self._dropped_before

    @property
    def alive(self) -> bool:
        return self.server.alive

    def flushall(self, *, count: bool = True) -> None:
        self._client.flushall()
        self.counters.flushes += int(count)

    def named_chunks(self, head: str) -> list[str] | None:
        """The chunk keys the stored head ``head`` names ([] for a one-value entry); None
        when no such head is stored."""
        prefix = self._bytes(head, 0, PROBE_BYTES - 1)
        if not prefix:
            return None
        return named_chunks(head, prefix, int(self._client.strlen(head)))

    def _bytes(self, key: str, start: int, end: int) -> bytes:
        """GETRANGE (the client returns bytes: no ``decode_responses``)."""
        value = self._client.getrange(key, start, end)
        assert isinstance(value, bytes)
        return value

    def kill(self) -> None:
        self.oom = False  # a restarted server starts without the limit
        self.server.kill()
        self.counters.kills += 1

    def restart(self) -> None:
        self.server.restart()
        self.oom = False
        self._client.connection_pool.disconnect()

    def garbage(self, rng: random.Random, keys: KeyBuilder) -> str | None:
        """Overwrite part of one stored value of the model (a head, or a chunk a head names)
        with random bytes, keeping its length. Which one: a seeded choice among the heads
        (sorted) and their named chunks (in order), never among write ids (random per write:
        they differ from run to run). Returns what was hit, or None if nothing is stored."""
        heads = self._heads(keys)
        self.last_heads = [_item_of(name) for name in heads]
        if not heads:
            return None
        head = rng.choice(heads)
        prefix = self._bytes(head, 0, PROBE_BYTES - 1)
        length = int(self._client.strlen(head))
        chunks = named_chunks(head, prefix, length) if prefix else []
        index = rng.randrange(len(chunks) + 1)
        target = head if index == 0 else chunks[index - 1]
        size = int(self._client.strlen(target))
        if size == 0:
            return None
        span = min(size, rng.randint(1, 64))
        offset = rng.randrange(size - span + 1)
        before = self._bytes(target, offset, offset + span - 1)
        garbage = bytes(b ^ 0xFF for b in before) if rng.random() < 0.5 else rng.randbytes(span)
        if garbage == before:  # random bytes equal to what was there: flip one bit
            garbage = bytes([garbage[0] ^ 1]) + garbage[1:]
        self._client.setrange(target, offset, garbage)
        after = int(self._client.strlen(target))
        if after != size:
            self.counters.problems.append(f"garbage changed {target}'s length {size}->{after}")
        self.counters.garbage_writes += 1
        self.counters.garbage_chunks += int(index > 0)
        where = "head" if index == 0 else f"chunk {index}/{len(chunks)}"
        return f"{where} of {head.rsplit('.', 1)[-1]} at {offset}+{span}"

    def _heads(self, keys: KeyBuilder) -> list[str]:
        # KEYS, not SCAN: SCAN may return a key twice (while the table rehashes, on Redis's
        # own timing), and a seeded choice among them would differ from run to run.
        found = self._client.keys(keys.pattern())
        names = {k.decode() if isinstance(k, bytes) else str(k) for k in found}
        return sorted(name for name in names if not _VERSIONED.search(name))

    def stored_items(self, keys: KeyBuilder) -> tuple[str, ...] | None:
        """The items whose head is stored now (None while the server is down)."""
        if not self.server.alive:
            return None
        return tuple(_item_of(name) for name in self._heads(keys))

    def pause(self, seconds: float, during: Callable[[], int]) -> None:
        """SIGSTOP the server for ``seconds``; prove it with a PING that must time out, run
        ``during`` (Redis calls that must each time out: the caller sizes them to fit, e.g.
        one lookup with socket timeouts well under ``seconds``), then SIGCONT."""
        process = self.server.process
        assert process is not None, "only a real server can be paused"
        started = time.monotonic()
        os.kill(process.pid, signal.SIGSTOP)
        self.counters.pauses += 1
        try:
            probe = redis.Redis(
                host="127.0.0.1", port=self.server.port, socket_timeout=0.2,
                socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0),
            )  # fmt: skip
            try:
                probe.ping()
                self.counters.problems.append("a PING was answered while the server was stopped")
            except (redis.TimeoutError, redis.ConnectionError):
                self.counters.pauses_verified += 1
            finally:
                probe.close()
            self.counters.paused_lookups += during()
            elapsed = time.monotonic() - started
            if elapsed >= seconds:
                self.counters.problems.append(
                    f"the work inside a {seconds}s pause took {elapsed:.2f}s: calls made "
                    "after the pause ended may not have timed out"
                )
            time.sleep(max(0.0, seconds - elapsed))
        finally:
            os.kill(process.pid, signal.SIGCONT)

    def oom_on(self) -> None:
        """``maxmemory`` at half what the server uses (``noeviction``): every write is refused
        with ``OOM`` from now on, reads work. (Just under the usage would be more realistic,
        but memory freed lazily a moment later, e.g. an UNLINKed blob, would let writes
        through again, and not in every run alike.) Proven with a write of our own."""
        used = int(self._info("memory")["used_memory"])
        self._client.config_set("maxmemory-policy", "noeviction")
        self._client.config_set("maxmemory", str(max(1, used // 2)))
        self.oom = True
        self.counters.oom_windows += 1
        try:
            self._client.set("ec-redis-chaos:oom-probe", b"x")
            self.counters.problems.append(f"a SET was accepted under maxmemory {used // 2}")
        except redis.ResponseError as exc:
            if "OOM" in str(exc) or isinstance(exc, OutOfMemoryError):
                self.counters.oom_verified += 1
            else:
                self.counters.problems.append(f"a SET under OOM failed otherwise: {exc!r}")

    def oom_off(self) -> None:
        if self.server.alive:
            self._client.config_set("maxmemory", "0")
        self.oom = False

    def arm_lost_reply(self) -> None:
        assert self.proxy is not None
        self.proxy.arm()
        self.counters.lost_replies_armed += 1

    def restore(self) -> None:
        """Everything back to normal: the server up, no limit, no armed drop."""
        if not self.server.alive:
            self.restart()
        if self.oom:
            self.oom_off()
        if self.proxy is not None:
            self.proxy.disarm()

    def _info(self, section: str) -> dict[str, Any]:
        info: dict[str, Any] = self._client.info(section)
        return info

    def close(self) -> None:
        if self.proxy is not None:
            self._dropped_at_close = self.proxy.counters.dropped_after_reply
        self._client.close()


def _item_of(head: str) -> str:
    """The (escaped) item id a head key names."""
    return head.rsplit(".", 1)[-1].rstrip("}")
