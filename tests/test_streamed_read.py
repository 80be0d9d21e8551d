"""A chunked entry is read in one round trip (issue 17): its head is the blob's first part,
and the chunks' ``GET``s go out on the same connection as soon as the head's header is in,
while the rest of the head still streams (``tiers/bulk_read.read_streamed``).

What a read returns must not change: heads of the earlier layout (header and prefix only),
lz4 entries, batches mixing every kind of entry, a fault between the head and the chunks,
a version replaced meanwhile: each is the whole tensor or a clean miss, and no connection
goes back to the pool with replies unread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch

from ec_redis.codec import encode_parts, read_header
from ec_redis.codec.direct import direct_layout
from ec_redis.config import CacheConfig
from ec_redis.embedded import EmbeddedRedis
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.redis_conn import make_client
from ec_redis.tiers import bulk_read
from ec_redis.tiers.layout import part_size
from ec_redis.tiers.redis_tier import RedisTier, RedisTierOptions
from tests.conftest import bit_exact
from tests.counters import count
from tests.test_redis_tier import make_tier  # noqa: F401 (the fixture)

pytestmark = pytest.mark.redis

KEYS = KeyBuilder("st", ModelIdentity("streamed"))
CHUNK = 64 * 1024
PART = part_size(CHUNK)


def bf16(rows: int, seed: int, width: int = 512) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g).to(torch.bfloat16)


@pytest.fixture
def tier(make_tier: Callable[..., RedisTier]) -> RedisTier:  # noqa: F811
    return make_tier(KEYS)


def _connections(monkeypatch: pytest.MonkeyPatch, tier: RedisTier) -> list[Any]:
    """Every connection the tier's pool hands out from now on, and whether it came back
    connected (a connection with replies unread must be disconnected first)."""
    pool = tier._nodes.redirected().connection_pool  # one server: its one client
    taken: list[Any] = []
    real = pool.get_connection

    def get_connection(*args: Any, **kwargs: Any) -> Any:
        conn = real(*args, **kwargs)
        taken.append(conn)
        return conn

    monkeypatch.setattr(pool, "get_connection", get_connection)
    return taken


def test_a_chunked_read_is_one_connection_and_the_chunks_go_out_mid_head(
    tier: RedisTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensor = bf16(600, seed=1)  # 600 KiB: a 60 KiB head with data, and 10 chunks
    assert tier.put("x", tensor)
    taken = _connections(monkeypatch, tier)
    events: list[str] = []
    real_send, real_fill = bulk_read._Reader.send, bulk_read._Reader.fill_value

    def send(reader: Any, commands: Any) -> None:
        events.append(f"send {len(commands)}")
        real_send(reader, commands)

    def fill_value(reader: Any, target: memoryview, *args: Any) -> None:
        events.append(f"fill {len(target)}")
        real_fill(reader, target, *args)

    monkeypatch.setattr(bulk_read._Reader, "send", send)
    monkeypatch.setattr(bulk_read._Reader, "fill_value", fill_value)
    got = tier.get("x")
    assert bit_exact(got, tensor)
    assert len(taken) == 1  # heads and chunks: one connection, one round trip
    assert events[0] == "send 10"  # the ten chunks' GETs, before the head's data came in
    # the head's data: all of its part but the header, producer info and safetensors prefix
    assert events[1].startswith("fill ") and int(events[1].split()[1]) > PART - 2048
    assert count(tier.stats(), "direct_reads") == 1


def _store_old_layout(raw: redis.Redis, tensor: torch.Tensor, item: str, **options: Any) -> None:
    """Store ``tensor`` as an earlier release did: a head of the header (and, raw, the
    safetensors prefix) only, then the payload in whole parts."""
    parts = encode_parts(tensor, part_bytes=PART, **options)
    blob = b"".join(bytes(p) for p in parts)
    header = read_header(blob)
    layout = direct_layout(header, len(parts[0]))
    assert layout is not None
    head, rest = blob[: layout.lead], blob[layout.lead :]
    pieces = [rest[i : i + PART] for i in range(0, len(rest), PART)]
    key = KEYS.head(item)
    for i, piece in enumerate(pieces, start=1):
        raw.set(KeyBuilder.chunks(key, header.write_id, len(pieces))[i - 1], piece)
    raw.set(key, head)


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_heads_of_the_earlier_layout_are_read_whole(
    tier: RedisTier, raw: redis.Redis, compression: str
) -> None:
    tensor = bf16(500, seed=2)  # lz4 is forced: random bf16 barely shrinks, still chunked
    _store_old_layout(raw, tensor, "old", compression=compression)
    assert len(raw.get(KEYS.head("old")) or b"") < 1024  # the header (and prefix) only
    assert bit_exact(tier.get("old"), tensor)
    assert count(tier.stats(), "direct_reads") == 1


def test_an_lz4_entry_with_data_in_its_head_is_read_whole(
    make_tier: Callable[..., RedisTier],  # noqa: F811
    raw: redis.Redis,
) -> None:
    tier = make_tier(KEYS, compression="lz4")
    tensor = torch.arange(300 * 512, dtype=torch.float32).reshape(300, 512)
    assert tier.put("z", tensor)
    head = raw.get(KEYS.head("z"))
    assert head is not None and PART - 2048 < len(head) <= PART
    assert read_header(head).codec_name == "lz4"
    assert bit_exact(tier.get("z"), tensor)


def test_a_batch_of_every_kind_of_entry_reads_each_right(tier: RedisTier, raw: redis.Redis) -> None:
    """One value, chunked (new and earlier layout), missing, a key of another type, a chunk
    evicted, a chunk corrupted: each item its own answer, in one batch, twice."""
    tensors = {name: bf16(rows, seed=i) for i, (name, rows) in enumerate(
        [("one", 20), ("new", 400), ("evicted", 300), ("corrupt", 350), ("new2", 130)]
    )}  # fmt: skip
    for name, tensor in tensors.items():
        assert tier.put(name, tensor)
    old = bf16(250, seed=9)
    _store_old_layout(raw, old, "old")
    raw.hset(KEYS.head("hash"), "f", "v")
    evicted_head = raw.get(KEYS.head("evicted")) or b""
    evicted_chunks = KeyBuilder.chunks(KEYS.head("evicted"), read_header(evicted_head).write_id, 5)
    raw.delete(evicted_chunks[2])
    corrupt_head = KEYS.head("corrupt")
    raw.setrange(corrupt_head, PART - 5, b"\xff")  # a byte of the data in the head
    names = ["one", "new", "missing", "hash", "evicted", "old", "corrupt", "new2"]
    got = tier.get_many(names)
    assert bit_exact(got["one"], tensors["one"])
    assert bit_exact(got["new"], tensors["new"])
    assert bit_exact(got["new2"], tensors["new2"])
    assert bit_exact(got["old"], old)
    assert got["missing"] is None and got["hash"] is None
    assert got["evicted"] is None and got["corrupt"] is None
    stats = tier.stats()
    assert count(stats, "partial_entries") == 1 and count(stats, "bad_blobs") == 1
    assert raw.exists(KEYS.head("evicted"), corrupt_head) == 0  # both deleted (still current)
    again = tier.get_many(names)  # the connection came back in step: the same answers
    assert [n for n, t in again.items() if t is not None] == ["one", "new", "old", "new2"]
    assert bit_exact(again["new2"], tensors["new2"])


def test_a_fault_between_the_head_and_its_chunks_is_a_miss_and_the_next_read_is_whole(
    tier: RedisTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection fails as the chunks' GETs go out: that connection is dropped (replies
    unread), the read is a miss and an error, and the next read gets the tensor."""
    tensor = bf16(400, seed=3)
    assert tier.put("x", tensor)
    taken = _connections(monkeypatch, tier)
    real_send = bulk_read._Reader.send
    fired: list[bool] = []

    def send(reader: Any, commands: Any) -> None:
        if not fired:
            fired.append(True)
            raise redis.ConnectionError("reset mid-read")
        real_send(reader, commands)

    monkeypatch.setattr(bulk_read._Reader, "send", send)
    assert tier.get("x") is None
    assert fired and count(tier.stats(), "errors") >= 1
    assert taken[0]._sock is None  # disconnected, not pooled with the head's bytes unread
    tier.breaker.success()  # the fault opened nothing we test here
    assert bit_exact(tier.get("x"), tensor)


# -- what Redis holds for one read ---------------------------------------------------------

MiB = 1 << 20


def _big(seed: int) -> torch.Tensor:
    return bf16(4096, seed=seed, width=1024)  # 8 MiB: 8 parts at 1 MiB chunks


def _private_tier(server: EmbeddedRedis) -> RedisTier:
    return RedisTier(
        make_client(CacheConfig(redis_url=server.url)), KEYS, RedisTierOptions(chunk_bytes=MiB)
    )


def test_a_batch_read_under_an_output_buffer_limit_is_served(
    private_redis: EmbeddedRedis,
) -> None:
    """Chunks asked for mid-head wait in Redis's output buffer for this connection until the
    heads before them are read: a batch plans its first chunked entry and a bounded amount
    more, not every entry's chunks at once (a ``client-output-buffer-limit`` of 4 entries
    kills the connection otherwise: the whole batch a miss)."""
    raw = redis.Redis.from_url(private_redis.url)
    tier = _private_tier(private_redis)
    try:
        names = [f"e{i}" for i in range(8)]
        for i, name in enumerate(names):
            assert tier.put(name, _big(i))
        raw.config_set("client-output-buffer-limit", "normal 32mb 0 0")
        got = tier.get_many(names)
        assert all(bit_exact(got[n], _big(i)) for i, n in enumerate(names)), tier.stats()
        assert count(tier.stats(), "direct_reads") == 8
    finally:
        tier.close()
        raw.close()


def test_a_batch_read_evicts_no_other_entry(private_redis: EmbeddedRedis) -> None:
    """Output buffers count towards ``maxmemory``: a batch read with 3 entries of headroom
    evicts nothing under ``allkeys-lru`` (every entry's chunks at once would)."""
    raw = redis.Redis.from_url(private_redis.url)
    tier = _private_tier(private_redis)
    try:
        for i in range(20):
            assert tier.put(f"e{i}", _big(i))
        used = int(raw.info("memory")["used_memory"])
        raw.config_set("maxmemory-policy", "allkeys-lru")
        raw.config_set("maxmemory", used + 24 * MiB)
        got = tier.get_many([f"e{i}" for i in range(12, 20)])
        raw.config_set("maxmemory", 0)
        assert all(t is not None for t in got.values())
        assert int(raw.info("stats")["evicted_keys"]) == 0
        others = tier.get_many([f"e{i}" for i in range(12)])
        assert all(bit_exact(others[f"e{i}"], _big(i)) for i in range(12))
    finally:
        tier.close()
        raw.close()
