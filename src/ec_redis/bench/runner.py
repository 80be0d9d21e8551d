"""Runs the benchmark: every tier's put/get next to raw redis-py SET/GET of the same bytes,
interleaved run by run against the same server so both see the same machine noise."""

from __future__ import annotations

import contextlib
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import redis
import torch

from ec_redis.bench.raw_socket import RawSocketClient, prefaulted, why_not_plain
from ec_redis.bench.results import CodecRow, Report, Row, SocketRow, make_row
from ec_redis.bench.timing import Timing, measure
from ec_redis.bench.workload import BENCH_ITEMS, QUICK_ITEMS, Item, activation_like
from ec_redis.cache import TieredCache
from ec_redis.codec import decode_blob, destination, encode_blob
from ec_redis.config import CacheConfig
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.redis_conn import make_client
from ec_redis.redis_url import parse_target
from ec_redis.tiers.layout import part_size
from ec_redis.tiers.redis_tier import RedisTier, RedisTierOptions

Progress = Callable[[str], None]

T = TypeVar("T")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(
    url: str,
    server: str,
    *,
    name: str = "",
    quick: bool = False,
    repeat: int = 5,
    chunk_bytes: int = 4 * 1024 * 1024,
    codecs: bool = True,
    progress: Progress = _stderr,
) -> Report:
    report = Report(server=server, machine=_machine(), name=name or server)
    items = QUICK_ITEMS if quick else BENCH_ITEMS
    raw = raw_client(url)
    # This run's own keys: on a shared server, nobody else's key is touched (not even one
    # named bench...), nor a second run's.
    namespace = f"bench-{secrets.token_hex(6)}"
    config = CacheConfig(redis_url=url, compression="none", chunk_bytes=chunk_bytes)
    tier = RedisTier(
        make_client(config),
        KeyBuilder(namespace, ModelIdentity("bench-model")),
        RedisTierOptions(chunk_bytes=chunk_bytes, compression="none"),
    )
    socket = Sockets(url, report.notes)
    steps = len(items) * (2 + (1 if codecs else 0))
    step = 0
    try:
        for item in items:
            tensor = activation_like(item.rows)
            runs = max(2, repeat if item.nbytes < 32 << 20 else repeat // 2 + 1)
            step += 1
            progress(f"[{step}/{steps}] Redis tier vs raw redis-py, {_label(item)} x{runs}")
            rows, sockets = _redis_rows(item, tensor, raw, tier, runs, socket)
            report.rows += rows
            report.sockets += [sockets] if sockets is not None else []
            step += 1
            progress(f"[{step}/{steps}] local tiers, {_label(item)}")
            report.rows += _local_rows(item, tensor, runs, url, namespace)
            if codecs:
                step += 1
                progress(f"[{step}/{steps}] codecs, {_label(item)}")
                report.codecs += _codec_rows(item, tensor, runs)
        if torch.cuda.is_available():
            progress("CUDA: spill and load bandwidth vs tensor.copy_ of pinned memory")
            from ec_redis.bench.cuda import cuda_rows

            report.rows += cuda_rows(items, repeat)
        else:
            report.notes.append("No CUDA device: GPU-tier rows hold CPU tensors; no CUDA rows.")
    finally:
        with contextlib.suppress(redis.RedisError):  # a server gone: the first error is told
            for key in raw.scan_iter(f"{namespace}*", count=1000):
                raw.unlink(key)
        raw.close()
        tier.close()
    return report


def _redis_rows(
    item: Item, tensor: torch.Tensor, raw: Any, tier: RedisTier, runs: int, socket: Sockets
) -> tuple[list[Row], SocketRow | None]:
    payload = tensor.view(-1).view(torch.uint8).numpy().tobytes()  # the same number of bytes
    head = tier.keys.head("item")
    raw_key = f"{tier.keys.namespace}:raw" + head[head.index("{") :]  # its hash tag: same master
    part = part_size(tier.options.chunk_bytes)  # the tier's pieces: the same bytes as N keys
    piece_keys = [f"{raw_key}:piece:{i}" for i in range(-(-len(payload) // part))]
    sock = socket.client(raw, raw_key)
    one_key, piece_names = raw_key.encode(), [k.encode() for k in piece_keys]  # not timed
    into = prefaulted(len(payload)) if sock is not None else None

    def clear() -> None:
        for key in [raw_key, *piece_keys, *raw.scan_iter(head + "*")]:
            raw.unlink(key)  # one key per call: a cluster refuses cross-slot UNLINKs

    def raw_set() -> None:
        samples["raw_set"].append(_time(lambda: raw.set(raw_key, payload)))
        if sock is not None:  # untimed: the pieces the pipelined socket read fetches
            view = memoryview(payload)
            for i, key in enumerate(piece_keys):
                raw.set(key, view[i * part : (i + 1) * part])

    def put() -> None:
        samples["put"].append(_time(lambda: tier.put("item", tensor)))

    def raw_get() -> None:
        samples["raw_get"].append(_time(lambda: raw.get(raw_key)))

    def timed(name: str, read: Callable[[], T]) -> T:
        """``read()``, its wall time into ``samples[name]`` and this thread's CPU time into
        ``samples[name + "_cpu"]``."""
        start, cpu = time.perf_counter(), time.thread_time()
        out = read()
        samples[name].append(time.perf_counter() - start)
        samples[f"{name}_cpu"].append(time.thread_time() - cpu)
        return out

    def get() -> None:  # steady state: each read's tensor is dropped before the next read
        check(tier.get("item"))  # untimed, and dropped (as a connector does once the tensor
        check(timed("get", lambda: tier.get("item")))  # is on the GPU): its memory is free

    def get_kept() -> None:  # every tensor kept: each read lands in memory never used before
        destination.RECYCLER.clear()
        start = time.perf_counter()
        kept.append(tier.get("item"))
        samples["get_kept"].append(time.perf_counter() - start)
        check(kept[-1])

    expected = tensor.view(-1).view(torch.uint8).numpy()
    equal = np.empty(len(expected), dtype=bool)  # faulted in once, reused by every check

    def same(got: Any) -> bool:
        # Byte for byte on this thread, into memory allocated once: ``torch.equal`` ran on
        # torch's OpenMP pool, whose workers then spin for milliseconds on the other core
        # (this VM has 2 cores, and the server needs one); ``np.array_equal`` allocates and
        # frees a result as large as the item per check, which slowed the read timed next
        # by 0.3-0.8 ms at 4 MiB. Every read, the tier's and the baselines', is checked so.
        got = np.frombuffer(got, dtype=np.uint8)
        return len(got) == len(expected) and bool(np.equal(got, expected, out=equal).all())

    def check(read: torch.Tensor | None) -> None:
        if read is None or read.shape != tensor.shape or read.dtype != tensor.dtype:
            raise RuntimeError("benchmark read back a wrong tensor: refusing to report")
        if not same(read.contiguous().view(-1).view(torch.uint8).numpy()):
            raise RuntimeError("benchmark read back a wrong tensor: refusing to report")

    def sock_one() -> None:
        assert sock is not None and into is not None
        size = timed("sock_one", lambda: sock.read_one(one_key, into))
        if size != len(payload) or not same(into):
            raise RuntimeError("the socket baseline read back wrong bytes: refusing to report")

    def sock_pieces() -> None:
        assert sock is not None and into is not None
        size = timed("sock_pieces", lambda: sock.read_pieces(piece_names, into))
        if size != len(payload) or not same(into):
            raise RuntimeError("the socket baseline read back wrong bytes: refusing to report")

    samples: dict[str, list[float]] = {
        "raw_set": [], "put": [], "raw_get": [], "get": [], "get_kept": [], "sock_one": [],
        "sock_pieces": [], "get_cpu": [], "sock_one_cpu": [], "sock_pieces_cpu": [],
    }  # fmt: skip
    kept: list[torch.Tensor | None] = []
    reads = [raw_get, get, *([get_kept, sock_one, sock_pieces] if sock is not None else [])]
    try:
        for run in range(runs):  # interleaved: both sides see the same noise ...
            clear()
            settle(raw)
            # ... and go first in turn; a write's replication is over before anything else runs
            writes = (raw_set, put) if run % 2 else (put, raw_set)
            turn = run % len(reads)
            for step in (*writes, *reads[turn:], *reads[:turn]):
                step()
                settle(raw)
    finally:
        if sock is not None:
            sock.close()
        kept.clear()
    t = {k: Timing(tuple(v)) for k, v in samples.items() if v}
    rows = [
        make_row(item, "redis put (encode+SET)", t["put"], "raw SET", t["raw_set"]),
        make_row(item, "redis get (GET+verify)", t["get"], "raw GET", t["raw_get"]),
    ]
    if sock is None:
        return rows, None
    one, pieces = t["sock_one"], t["sock_pieces"]
    faster = "raw socket, one value" if one.median_s <= pieces.median_s else (
        f"raw socket, {len(piece_keys)} piece{'s' if len(piece_keys) > 1 else ''} pipelined"
    )  # fmt: skip
    best = one if one.median_s <= pieces.median_s else pieces
    rows.append(make_row(item, "redis get vs socket", t["get"], faster, best))
    ms = {k: v.median_s * 1e3 for k, v in t.items()}
    return rows, SocketRow(
        item=item.label,
        mib=item.nbytes / 2**20,
        get_ms=ms["get"],
        kept_ms=ms["get_kept"],
        one_ms=ms["sock_one"],
        pieces_ms=ms["sock_pieces"],
        pieces=len(piece_keys),
        redis_py_ms=ms["raw_get"],
        get_cpu_ms=ms["get_cpu"],
        one_cpu_ms=ms["sock_one_cpu"],
        pieces_cpu_ms=ms["sock_pieces_cpu"],
    )


class Sockets:
    """Opens the socket-level baseline's connection (``bench/raw_socket.py``) to the server
    holding a key: plain TCP without credentials only; ``None`` (and a note) otherwise."""

    def __init__(self, url: str, notes: list[str]) -> None:
        self._why = why_not_plain(url)
        if not self._why and parse_target(url).kind == "sentinel":
            self._why = "a Sentinel URL"
        self._notes = notes

    def client(self, raw: Any, key: str) -> RawSocketClient | None:
        if self._why:
            note = f"No raw-socket baseline for {self._why}: the minimal client speaks plain TCP."
            if note not in self._notes:
                self._notes.append(note)
            return None
        from redis.cluster import RedisCluster

        if isinstance(raw, RedisCluster):
            node = raw.get_node_from_key(key)  # type: ignore[no-untyped-call]
            host, port = node.host, node.port
        else:
            kwargs = raw.connection_pool.connection_kwargs
            if kwargs.get("db", 0):
                self._why = "a database other than 0"
                return self.client(raw, key)
            host, port = kwargs.get("host", "localhost"), kwargs.get("port", 6379)
        return RawSocketClient(host, int(port))


def settle(raw: Any) -> None:
    """Wait (untimed) until every master's replicas have what it was sent: on one machine, a
    replica applying the last write would slow whatever is measured next."""
    from redis.cluster import RedisCluster

    servers = (
        [raw.get_redis_connection(node) for node in raw.get_primaries()]  # type: ignore[no-untyped-call]
        if isinstance(raw, RedisCluster)
        else [raw]
    )
    for server in servers:
        replicas = int(server.info("replication").get("connected_slaves", 0))
        if replicas:
            server.execute_command("WAIT", replicas, 10_000)


def _local_rows(item: Item, tensor: torch.Tensor, runs: int, url: str, namespace: str) -> list[Row]:
    budget = item.nbytes * 2
    with TieredCache(CacheConfig(gpu_cache_bytes=budget, cpu_cache_bytes=budget)) as cache:
        cache.put("x", tensor)
        gpu = measure(lambda: cache.get("x"), runs * 20)
        cache.gpu.delete("x")
        cpu = measure(lambda: cache.cpu.get("x"), runs * 20)
    clone = measure(lambda: tensor.clone(), runs * 2)
    config = CacheConfig(redis_url=url, namespace=namespace, compression="none")
    with TieredCache(config) as cache:
        put = measure(lambda: cache.put("y", tensor), runs, setup=lambda: cache.flush(30))
    kind = "cuda" if torch.cuda.is_available() else "no CUDA: CPU tensors"
    return [
        make_row(item, f"gpu tier hit ({kind})", gpu),
        make_row(item, "cpu tier hit", cpu, "tensor.clone()", clone),
        make_row(item, "TieredCache.put returns", put),
    ]


def _codec_rows(item: Item, tensor: torch.Tensor, runs: int) -> list[CodecRow]:
    rows = []
    nbytes = item.nbytes
    for name, options in (
        ("none", {"compression": "none"}),
        ("lz4", {"compression": "lz4"}),
        ("shuffle+lz4", {"compression": "lz4", "byte_shuffle": True}),
        ("auto", {"compression": "auto"}),
        ("auto+shuffle", {"compression": "auto", "byte_shuffle": True}),
    ):
        blob = encode_blob(tensor, **options)
        enc = measure(lambda o=options: encode_blob(tensor, **o), runs)  # type: ignore[misc]
        dec = measure(lambda b=blob: decode_blob(b), runs)  # type: ignore[misc]
        rows.append(CodecRow(item.label, name, nbytes / len(blob), enc.median_s * 1e3,
                             dec.median_s * 1e3))  # fmt: skip
    return rows


def raw_client(url: str) -> Any:
    """The baseline: a default redis-py client (hiredis) for the same server or cluster."""
    target = parse_target(url)
    if target.kind == "cluster":
        from redis.cluster import ClusterNode, RedisCluster

        nodes = [ClusterNode(host, port) for host, port in target.nodes]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes, username=target.username, password=target.password)
    return redis.Redis.from_url(url)


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _label(item: Item) -> str:
    return f"{item.label} {item.rows}x{item.width} bf16 ({item.nbytes / 2**20:.1f} MiB)"


def _machine() -> str:
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    return (f"{os.cpu_count()} cores {cpu}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, redis-py {redis.__version__}")  # fmt: skip
