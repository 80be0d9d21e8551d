"""Reads back to back: where a Redis-tier get stands against the socket when nothing else
runs between reads (``ec-redis bench --loop``).

``ec-redis bench`` times each read once per run, after a write, an ``INFO`` and the other
reads of that run, so each read meets cold caches and whatever memory the others left. This
times ``rounds`` rounds in which each read of one item runs once, in an order that rotates
round by round, on one server, with nothing in between; every read fetches the same bytes:

* **raw socket GET** (the baseline): ``bench/raw_socket.py``'s one-value read into a buffer
  allocated and page-faulted once;
* **raw socket GETRANGE**: the same, but the bounded ``GETRANGE key 0 N`` a tier sends for an
  entry's head (the reader never asks for more than its limit: a foreign value of 1 GB
  must not be read whole), so the server's cost of that command shows apart from ours;
* **raw socket GET + xxh3**: the same GET with xxh3-64 fed each received stretch, the
  least a tier must add: it hands out no bytes it has not checked;
* **tier get**: ``RedisTier.get`` (raw blob, ``chunk_bytes`` 4 MiB), its tensor dropped
  before the next read;
* **redis-py GET**: ``redis.Redis.get`` (hiredis) of the one value.

Per read: wall and thread CPU time (medians), and the baseline's median wall time over this
read's. Unlike ``ec-redis bench``, whose ratio is to the faster of the one-value read and the
tier's pieces pipelined, the baseline here is the one-value read alone. Every timed read is
checked to have read the whole item (its length, digest or tensor), and every read is
compared byte for byte before and after the timing: a wrong one stops the bench. The keys
it writes carry a namespace of this run's own and are removed at the end.
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import redis
import torch
import xxhash

from ec_redis.bench.raw_socket import RawSocketClient, command, prefaulted, why_not_plain
from ec_redis.bench.workload import Item, activation_like
from ec_redis.config import CacheConfig
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.redis_conn import make_client
from ec_redis.redis_url import parse_target
from ec_redis.tiers.redis_tier import RedisTier, RedisTierOptions

# 1.8 MB (a 448px image), 4 MiB (a little over one chunk), 16 and 64 MiB: issue 17's sizes
LOOP_ITEMS = (Item("448px image", 256), Item("4 MiB", 585), Item("16 MiB", 2341),
              Item("64 MiB", 9363))  # fmt: skip
READS = ("raw socket GET", "raw socket GETRANGE", "raw socket GET + xxh3", "tier get",
         "redis-py GET")  # fmt: skip


@dataclass(frozen=True)
class LoopRow:
    server: str
    item: str
    mib: float
    read: str
    rounds: int
    wall_ms: float  # median
    cpu_ms: float  # median of the reading thread's CPU time
    baseline_over_this: float  # raw socket GET's median wall time / this read's


class _Reads(RawSocketClient):
    """The raw socket reads of one value: GET, GETRANGE and GET with its bytes hashed."""

    def getrange(self, key: bytes, into: memoryview) -> int:
        self._sock.sendall(command(b"GETRANGE", key, b"0", b"%d" % len(into)))
        return self._bulk_into(into)

    def hashed(self, key: bytes, into: memoryview) -> int:
        """``GET key`` into ``into``, hashed as it lands: the value's xxh3-64 (-1: missing)."""
        hasher = xxhash.xxh3_64()
        self._sock.sendall(command(b"GET", key))
        size = self._bulk_into(into, hasher.update)
        return hasher.intdigest() if size >= 0 else -1


def supported(url: str) -> str:
    """Why ``url`` cannot be measured here ("" when it can): one server, plain TCP, db 0."""
    if parse_target(url).kind != "standalone" or url.startswith("unix"):
        return "one server over TCP (not a Cluster, Sentinel or Unix socket URL)"
    why = why_not_plain(url)
    if why:
        return f"a server without {why} (the raw socket speaks plain TCP)"
    parts = urlsplit(url)
    dbs = {parts.path.strip("/") or "0", *parse_qs(parts.query).get("db", [])}
    if not all(db.isdigit() and int(db) == 0 for db in dbs):
        return "database 0"
    return ""


def run(url: str, server: str, rounds: int, items: tuple[Item, ...] = LOOP_ITEMS,
        progress: Callable[[str], None] = lambda _: None,
        chunk_bytes: int = 4 * 1024 * 1024) -> list[LoopRow]:  # fmt: skip
    """Every read of each item, ``rounds`` rounds; ``ValueError`` when ``url`` is not a
    server this can measure (``supported``), ``RuntimeError`` when a read is wrong."""
    why = supported(url)
    if why:
        raise ValueError(f"--loop measures {why}")
    where = urlsplit(url)
    # This run's own keys: a second run, or anyone's bench-loop keys, are never touched.
    namespace = f"bench-loop-{secrets.token_hex(6)}"
    raw = redis.Redis.from_url(url)
    tier = RedisTier(
        make_client(CacheConfig(redis_url=url, compression="none", chunk_bytes=chunk_bytes)),
        KeyBuilder(namespace, ModelIdentity("bench-model")),
        RedisTierOptions(compression="none", chunk_bytes=chunk_bytes),
    )
    sock: _Reads | None = None
    rows: list[LoopRow] = []
    try:
        sock = _Reads(where.hostname or "localhost", where.port or 6379)
        for item in items:
            progress(f"{server}: {item.label}, {rounds} rounds")
            rows += _item(server, item, rounds, raw, tier, sock, namespace)
    finally:
        try:
            for key in raw.scan_iter(f"{namespace}*", count=1000):
                raw.unlink(key)
        except redis.RedisError:  # the server is gone: what went wrong first is reported
            pass
        if sock is not None:
            sock.close()
        raw.close()
        tier.close()
    return rows


def _item(server: str, item: Item, rounds: int, raw: redis.Redis, tier: RedisTier,
          sock: _Reads, namespace: str) -> list[LoopRow]:  # fmt: skip
    tensor = activation_like(item.rows)
    payload = tensor.view(-1).view(torch.uint8).numpy().tobytes()
    size, digest = len(payload), xxhash.xxh3_64_intdigest(payload)
    raw_key = f"{namespace}:raw:{item.label}"
    raw.set(raw_key, payload)
    if not tier.put("item", tensor):
        raise RuntimeError("the tier refused the benchmark's item")
    key, into = raw_key.encode(), prefaulted(size)

    def tier_get() -> torch.Tensor | None:
        got = tier.get("item")
        return got if got is not None and got.shape == tensor.shape else None

    def redis_py_get() -> bytes | None:
        got = raw.get(raw_key)
        return got if isinstance(got, bytes) else None

    # Each read, and what it gives when it read the whole item (checked after each timed read
    # without touching the bytes: a vanished key or an open breaker is not a fast read).
    reads: dict[str, tuple[Callable[[], object], Callable[[object], bool]]] = {
        READS[0]: (lambda: sock.read_one(key, into), lambda got: got == size),
        READS[1]: (lambda: sock.getrange(key, into), lambda got: got == size),
        READS[2]: (lambda: sock.hashed(key, into), lambda got: got == digest),
        READS[3]: (tier_get, lambda got: got is not None),
        READS[4]: (redis_py_get, lambda got: isinstance(got, bytes) and len(got) == size),
    }

    def verify() -> None:  # each read once, untimed, byte for byte
        for name, (read, _) in reads.items():
            into[:] = bytes(size)
            got = read()
            if isinstance(got, torch.Tensor):
                if got.dtype != tensor.dtype:
                    got = None
                else:
                    got = got.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            elif isinstance(got, int):
                whole = got == (digest if name == READS[2] else size)
                got = into.tobytes() if whole else None
            if got != payload:
                raise RuntimeError(f"{name} read back wrong bytes: refusing to report")

    verify()  # before the timing (the connections warm) ...
    wall: dict[str, list[float]] = {name: [] for name in reads}
    cpu: dict[str, list[float]] = {name: [] for name in reads}
    order = list(reads)
    for r in range(max(rounds, 1)):
        turn = r % len(order)
        for name in order[turn:] + order[:turn]:
            read, whole = reads[name]
            start, thread = time.perf_counter(), time.thread_time()
            got = read()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - thread)
            if not whole(got):
                raise RuntimeError(f"{name} did not read the whole item: refusing to report")
            del got
    verify()  # ... and after it
    base = statistics.median(wall[READS[0]])
    return [
        LoopRow(
            server=server,
            item=item.label,
            mib=round(size / 2**20, 1),
            read=name,
            rounds=len(wall[name]),
            wall_ms=statistics.median(wall[name]) * 1e3,
            cpu_ms=statistics.median(cpu[name]) * 1e3,
            baseline_over_this=base / statistics.median(wall[name]),
        )
        for name in order
    ]


def render(rows: list[LoopRow]) -> str:
    lines = [
        "| server | item | MiB | read | wall p50 ms | CPU p50 ms | raw socket GET / this |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.server} | {r.item} | {r.mib:.1f} | {r.read} | {r.wall_ms:.3f} "
            f"| {r.cpu_ms:.3f} | {r.baseline_over_this:.2f} |"
        )
    return "\n".join(lines)
