"""RedisTier against a real redis-server: key layout, write order, partial and corrupt
entries, size limits, TTLs, model/tenant isolation and compression.

Versions, concurrent writers, orphans and compare-and-delete: tests/test_entry_versions.py."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
import redis
import torch
import xxhash
from redis.crc import key_slot

from ec_redis import TieredCache
from ec_redis.codec import read_header
from ec_redis.codec.format import (
    CHECKED_SIZE,
    CODEC_LZ4,
    CODEC_NONE,
    FORMAT_VERSION,
    HEADER,
    HEADER_SIZE,
    MAGIC,
)
from ec_redis.config import CacheConfig
from ec_redis.embedded import EmbeddedRedis
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.redis_conn import make_client
from ec_redis.tiers.layout import ALLOCATOR_SLACK, chunk_keys
from ec_redis.tiers.lease import Claim
from ec_redis.tiers.redis_tier import RedisTier, RedisTierOptions
from tests.conftest import bits
from tests.counters import count

pytestmark = pytest.mark.redis

CHUNK = 64 * 1024
KEYS = KeyBuilder("t", ModelIdentity("m"))


def bf16(rows: int, seed: int, width: int = 512) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen).to(torch.bfloat16)


def assert_bit_exact(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
    assert bits(got) == bits(want)


@pytest.fixture
def make_tier(redis_url: str) -> Iterator[Callable[..., RedisTier]]:
    made: list[RedisTier] = []

    def make(keys: KeyBuilder = KEYS, **options: Any) -> RedisTier:
        options.setdefault("chunk_bytes", CHUNK)
        tier = RedisTier(
            make_client(CacheConfig(redis_url=redis_url)), keys, RedisTierOptions(**options)
        )
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def all_keys(raw: redis.Redis) -> set[str]:
    return {k.decode() for k in raw.keys("*")}


def chunks_of(raw: redis.Redis, head: str) -> list[str]:
    """The chunk keys the stored head names (their names carry the head's write id)."""
    value = raw.get(head)
    assert value is not None, f"no head {head}"
    return chunk_keys(head, read_header(value), len(value))


def entry_keys(raw: redis.Redis, head: str, chunks: int) -> set[str]:
    """The head and its chunk keys, checking there are ``chunks`` of them."""
    named = chunks_of(raw, head)
    assert len(named) == chunks
    return {head, *named}


# -- layout ----------------------------------------------------------------------------------


class _RecordingPipeline:
    def __init__(self, pipe: Any, log: list[tuple[str, ...]]) -> None:
        self._pipe = pipe
        self._log = log

    def set(self, name: str, value: Any, **kwargs: Any) -> Any:
        self._log.append(("set", name, str(kwargs.get("px"))))
        return self._pipe.set(name, value, **kwargs)

    def execute_command(self, *args: Any) -> Any:
        self._log.append((str(args[0]), *(str(a) for a in args[3 : 3 + int(args[2])])))
        return self._pipe.execute_command(*args)

    def execute(self, **kwargs: Any) -> Any:
        self._log.append(("execute",))
        return self._pipe.execute(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


class _RecordingClient:
    """Wraps a client; records every pipelined SET, each pipeline's execute, and the
    commands sent on their own (the scripts)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.log: list[tuple[str, ...]] = []

    def pipeline(self, transaction: bool = True) -> _RecordingPipeline:
        self.log.append(("pipeline", str(transaction)))
        return _RecordingPipeline(self._client.pipeline(transaction=transaction), self.log)

    def execute_command(self, *args: Any) -> Any:
        self.log.append((str(args[0]), *(str(a) for a in args[3 : 3 + int(args[2])])))
        return self._client.execute_command(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_large_entry_is_chunked_under_one_hash_tag_and_switched_in_by_one_script(
    redis_url: str, raw: redis.Redis
) -> None:
    client = _RecordingClient(make_client(CacheConfig(redis_url=redis_url)))
    tier = RedisTier(client, KEYS, RedisTierOptions(chunk_bytes=CHUNK, orphan_grace_s=30))
    tensor = bf16(300, seed=1)  # 307200 bytes of tensor data
    raw.script_flush()  # the server does not know the script yet
    assert tier.put("item/1 ü", tensor)  # an id that needs escaping
    head = KEYS.head("item/1 ü")
    header = read_header(raw.get(head))
    chunks = [f"{head}:{header.write_id:016x}:c{i}" for i in range(1, 6)]

    # head + five chunks named by the write's id, and nothing else
    assert chunks_of(raw, head) == chunks
    assert all_keys(raw) == {head, *chunks}
    # parts stay ALLOCATOR_SLACK under chunk_bytes (Redis's allocator size classes); the head
    # is the blob's first part (its header, then the first data), the last chunk the rest
    part = CHUNK - ALLOCATOR_SLACK
    sizes = [raw.strlen(chunk) for chunk in chunks]
    head_len = raw.strlen(head)
    assert part - 2048 < head_len <= part and sizes[:4] == [part] * 4
    assert 0 < sizes[4] == header.total_len - head_len - 4 * part < part
    assert header.part_bytes == part
    assert raw.strlen(head) + sum(sizes) == header.total_len

    # one Cluster hash tag (and so one slot) for the whole entry
    tags = {k[k.index("{") + 1 : k.index("}")] for k in (head, *chunks)}
    assert tags == {f"{KEYS.fingerprint}.item%2F1%20%C3%BC"}
    assert len({key_slot(k.encode()) for k in (head, *chunks)}) == 1

    # one round trip: a non-transactional pipeline of the chunks in order, then the head value
    # under a key of the write's own, each under the grace TTL (no head names them yet), then
    # the script that renames that value onto the head key. The head key is never SET
    # directly, so no reader can see a head before its chunks. (The server did not know the
    # script yet: it answered NOSCRIPT, and the script went once more in full, EVAL.)
    pending = f"{head}:{header.write_id:016x}:h"
    expected: list[tuple[str, ...]] = [("pipeline", "False")]
    expected += [("set", chunk, "30000") for chunk in chunks]
    expected += [("set", pending, "30000"), ("EVALSHA", head, pending, *chunks), ("execute",)]
    expected += [("EVAL", head, pending, *chunks)]
    assert client.log == expected
    # the switch gave the chunks the entry's lifetime (none: ttl_s is 0)
    assert {raw.pttl(k) for k in (head, *chunks)} == {-1}
    assert_bit_exact(tier.get("item/1 ü"), tensor)

    client.log.clear()
    assert tier.put("item/1 ü", tensor)  # a rewrite; now the server knows the script
    new_chunks = chunks_of(raw, head)
    pending = f"{head}:{read_header(raw.get(head)).write_id:016x}:h"
    # the pipelined script found a chunked entry there (it assumes none) and answered with its
    # head; a second round retires that head's chunks
    assert client.log[-3:] == [
        ("EVALSHA", head, pending, *new_chunks),
        ("execute",),
        ("EVALSHA", head, pending, *new_chunks, *chunks),
    ]
    assert not set(new_chunks) & set(chunks)  # new keys; the old ones retire in the grace
    assert {raw.pttl(k) for k in (head, *new_chunks)} == {-1}
    assert all(0 < raw.pttl(k) <= 30_000 for k in chunks)
    tier.close()


def test_small_entry_is_a_single_key(make_tier: Callable[..., RedisTier], raw: redis.Redis) -> None:
    tier = make_tier()
    tensor = bf16(10, seed=2)
    assert tier.put("s", tensor)
    head = KEYS.head("s")
    assert all_keys(raw) == {head}
    assert read_header(raw.get(head)).part_bytes == 0


def test_delete_removes_head_and_every_chunk(
    make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    tier = make_tier()
    tier.put("a", bf16(300, 3))
    tier.put("b", bf16(8, 4))
    tier.delete("a")
    assert all_keys(raw) == {KEYS.head("b")}
    tier.delete("b")
    assert all_keys(raw) == set()


def test_delete_never_raises_on_a_head_declaring_tiny_parts(
    make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    """A head whose part size is below the tier's floor (forged, or from a misconfigured
    writer) is rejected on read; deleting it must not raise either."""
    forger = make_tier(chunk_bytes=1000)
    assert forger.put("f", torch.zeros(2000))
    assert len(all_keys(raw)) > 1
    tier = make_tier()
    tier.delete("f")  # must not raise
    assert KEYS.head("f") not in all_keys(raw)
    assert forger.put("g", torch.zeros(2000))
    assert tier.get("g") is None
    assert tier.stats()["bad_blobs"] == 1


# -- partial entries -------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [[1], [3], [5], [2, 4]], ids=str)
def test_a_missing_chunk_is_a_clean_miss_and_the_rest_is_unlinked(
    make_tier: Callable[..., RedisTier], raw: redis.Redis, missing: list[int]
) -> None:
    tier = make_tier()
    assert tier.put("p", bf16(300, 5))
    assert tier.put("other", bf16(300, 6))
    head = KEYS.head("p")
    chunks = chunks_of(raw, head)
    for i in missing:
        raw.delete(chunks[i - 1])  # as if Redis evicted it

    got = tier.get_many(["p", "other"])
    assert got["p"] is None
    assert_bit_exact(got["other"], bf16(300, 6))
    stats = tier.stats()
    assert stats["partial_entries"] == 1
    assert count(stats, "bad_blobs") == 0
    assert count(stats, "errors") == 0
    assert count(stats, "discards_skipped_newer") == 0  # it was still current: deleted
    assert all_keys(raw) == entry_keys(raw, KEYS.head("other"), 5)  # head and chunks gone
    assert tier.get("p") is None  # still a miss, and no error
    assert tier.put("p", bf16(300, 7))  # the key is usable again
    assert_bit_exact(tier.get("p"), bf16(300, 7))


@pytest.mark.parametrize("path", ["direct", "pipelined", "fakeredis"])
@pytest.mark.parametrize("missing", [1, 5], ids=["first-chunk", "last-chunk"])
def test_a_head_whose_chunk_is_gone_is_not_published(
    redis_url: str, raw: redis.Redis, path: str, missing: int
) -> None:
    """A pure producer asks ``describe_many`` whether an item is published and skips encoding
    it if so. A chunk evicted under ``allkeys-lru`` (its head stays) must make the answer "no",
    or that item is never encoded again; whole entries and one-value ones still say yes. One
    round trip, heads only: no value is read (and nothing is deleted: a reader cleans up)."""
    client: Any = {
        "direct": lambda: make_client(CacheConfig(redis_url=redis_url)),
        "pipelined": lambda: redis.Redis.from_url(redis_url),
        "fakeredis": fakeredis.FakeRedis,
    }[path]()
    tier = RedisTier(client, KEYS, RedisTierOptions(chunk_bytes=CHUNK))
    store: Any = raw if path != "fakeredis" else client
    assert tier.put("chunked", bf16(300, 40)) and tier.put("whole", bf16(300, 41))
    assert tier.put("small", bf16(4, 42))
    described = {
        "chunked": (torch.bfloat16, (300, 512)),
        "whole": (torch.bfloat16, (300, 512)),
        "small": (torch.bfloat16, (4, 512)),
        "absent": None,
    }
    assert tier.describe_many(list(described)) == described
    chunks = chunks_of(store, KEYS.head("chunked"))
    assert len(chunks) == 5
    store.delete(chunks[missing - 1])  # as if Redis evicted it
    if path != "fakeredis":
        raw.config_resetstat()
    assert tier.describe_many(list(described)) == {**described, "chunked": None}
    stats = tier.stats()
    assert stats["describe_incomplete"] == 1 and count(stats, "errors") == 0, stats
    assert store.exists(KEYS.head("chunked"))
    if path != "fakeredis":
        calls = raw.info("commandstats")
        assert "cmdstat_get" not in calls and "cmdstat_unlink" not in calls, calls
    tier.close()


# -- corrupt blobs ---------------------------------------------------------------------------


def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x40]) + data[offset + 1 :]


def _with_version(head: bytes, version: int) -> bytes:
    """The same blob re-stamped as another format version, header checksum made valid."""
    fields = list(HEADER.unpack_from(head, 0))
    fields[1] = version
    checked = HEADER.pack(*fields)[:CHECKED_SIZE]
    header = read_header(head)
    producer = head[HEADER_SIZE : header.payload_offset]
    header_sum = xxhash.xxh3_64(checked + producer).intdigest().to_bytes(8, "little")
    return checked + header_sum + head[HEADER_SIZE:]


def _next_version(head: bytes) -> bytes:
    return _with_version(head, FORMAT_VERSION + 1)


Corruptor = Callable[[redis.Redis, str], None]


def _set_head(transform: Callable[[bytes], bytes]) -> Corruptor:
    def corrupt(raw: redis.Redis, head: str) -> None:
        raw.set(head, transform(raw.get(head)))

    return corrupt


def _set_chunk(index: int, transform: Callable[[bytes], bytes]) -> Corruptor:
    def corrupt(raw: redis.Redis, head: str) -> None:
        key = chunks_of(raw, head)[index - 1]
        raw.set(key, transform(raw.get(key)))

    return corrupt


# (id, chunked entry?, corruption, whole entry removed afterwards?)
CORRUPTIONS: list[tuple[str, bool, Corruptor, bool]] = [
    ("garbage-head", False, _set_head(lambda b: os.urandom(len(b))), True),
    ("foreign-short-value", False, _set_head(lambda b: b"hello"), True),
    ("truncated-inside-header", False, _set_head(lambda b: b[:50]), True),
    ("truncated-inside-producer", False, _set_head(lambda b: b[: HEADER_SIZE + 4]), True),
    ("truncated-payload", False, _set_head(lambda b: b[:-1]), True),
    ("extra-trailing-byte", False, _set_head(lambda b: b + b"\0"), True),
    ("other-format-version", False, _set_head(_next_version), True),
    ("header-shape-bitflip", False, _set_head(lambda b: _flip(b, 16)), True),
    ("payload-bitflip", False, _set_head(lambda b: _flip(b, len(b) - 7)), True),
    ("chunk-garbage-same-length", True, _set_chunk(3, lambda b: os.urandom(len(b))), True),
    ("chunk-one-bitflip", True, _set_chunk(5, lambda b: _flip(b, 100)), True),
    ("chunk-longer", True, _set_chunk(5, lambda b: b + b"x"), True),
    ("chunk-shorter", True, _set_chunk(2, lambda b: b[:-8]), True),
    ("chunks-swapped", True, lambda r, h: _swap(r, h, 1, 2), True),
    # a garbage head says nothing about its chunks: the head goes, the chunks stay orphaned
    ("garbage-head-of-chunked", True, _set_head(lambda b: os.urandom(len(b))), False),
    ("head-bitflip-of-chunked", True, _set_head(lambda b: _flip(b, 60)), False),
]


def _swap(raw: redis.Redis, head: str, i: int, j: int) -> None:
    a, b = chunks_of(raw, head)[i - 1], chunks_of(raw, head)[j - 1]
    va, vb = raw.get(a), raw.get(b)
    raw.set(a, vb)
    raw.set(b, va)


@pytest.mark.parametrize(
    ("chunked", "corrupt", "whole_entry_removed"),
    [pytest.param(c, f, w, id=i) for i, c, f, w in CORRUPTIONS],
)
def test_a_corrupt_blob_is_a_miss_counted_and_deleted(
    make_tier: Callable[..., RedisTier],
    raw: redis.Redis,
    chunked: bool,
    corrupt: Corruptor,
    whole_entry_removed: bool,
) -> None:
    tier = make_tier()
    tensor = bf16(300 if chunked else 20, seed=8)
    neighbour = bf16(40, seed=9)
    assert tier.put("c", tensor)
    assert tier.put("n", neighbour)
    head = KEYS.head("c")
    corrupt(raw, head)

    got = tier.get_many(["c", "n"])
    assert got["c"] is None  # never a wrong tensor
    assert_bit_exact(got["n"], neighbour)
    stats = tier.stats()
    assert stats["bad_blobs"] == 1
    assert count(stats, "errors") == 0
    assert stats["breaker_state"] == 0  # bad data is not a Redis outage
    remaining = all_keys(raw) - {KEYS.head("n")}
    assert head not in remaining
    if whole_entry_removed:
        assert remaining == set()
    assert tier.get("c") is None
    assert tier.stats()["bad_blobs"] == 1  # gone, so not rejected twice
    assert tier.put("c", tensor)
    assert_bit_exact(tier.get("c"), tensor)


def test_corrupt_lz4_payload_is_a_miss(
    make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    tier = make_tier(compression="lz4")
    tensor = torch.arange(50_000, dtype=torch.int32).reshape(500, 100) % 7
    assert tier.put("z", tensor)
    head = KEYS.head("z")
    blob = raw.get(head)
    assert read_header(blob).codec == CODEC_LZ4
    raw.set(head, _flip(blob, len(blob) - 20))
    assert tier.get("z") is None
    assert tier.stats()["bad_blobs"] == 1
    assert all_keys(raw) == set()


# -- size limits -----------------------------------------------------------------------------


def test_put_above_max_blob_bytes_is_refused(
    make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    tier = make_tier(max_blob_bytes=100_000)
    assert tier.put("big", bf16(300, 10)) is False
    assert tier.stats()["write_rejected"] == 1
    assert all_keys(raw) == set()
    assert tier.put("ok", bf16(20, 11))  # smaller entries still go in


def test_entry_above_the_readers_max_blob_bytes_is_a_miss_but_stays(
    make_tier: Callable[..., RedisTier],
) -> None:
    writer = make_tier()
    tensor = bf16(300, 12)
    assert writer.put("big", tensor)
    reader = make_tier(max_blob_bytes=100_000)
    assert reader.get("big") is None
    assert reader.stats()["oversized"] == 1
    assert count(reader.stats(), "bad_blobs") == 0
    got = writer.get("big")  # valid for a reader with a larger limit: not deleted
    assert got is not None and torch.equal(got, tensor)


def test_forged_header_declaring_a_huge_blob_is_rejected_without_fetching_it(
    make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    """A valid-looking header (checksum right) that declares a 4 TiB tensor: a miss, at once.

    It is over this reader's limit, so it counts as oversized (a reader with a larger limit
    would judge it); nothing is allocated and no chunk is fetched."""
    shape = (1 << 20, 1 << 20, 0, 0)
    numel = shape[0] * shape[1]
    raw_len = 64 + numel * 4
    fields = [MAGIC, FORMAT_VERSION, CODEC_NONE, 0, 3, 2, 0, 0, *shape]
    fields += [raw_len, raw_len, 0, CHUNK, 1, 0]
    checked = HEADER.pack(*fields)[:CHECKED_SIZE]
    head = checked + xxhash.xxh3_64(checked).intdigest().to_bytes(8, "little")
    key = KEYS.head("forged")
    raw.set(key, head)
    tier = make_tier()
    assert tier.get("forged") is None
    assert tier.stats()["oversized"] == 1
    assert count(tier.stats(), "bad_blobs") == 0


@pytest.mark.parametrize("path", ["direct", "pipelined"])
def test_a_head_over_max_blob_bytes_is_refused_before_its_payload_is_received(
    redis_url: str, raw: redis.Redis, make_tier: Callable[..., RedisTier], path: str
) -> None:
    """A 2 MiB one-value entry (a writer with 4 MiB chunks) read by a tier that accepts at
    most 1 MiB: a miss counted as ``oversized``, decided from the head's first bytes. The
    server sends this reader at most about one of its chunks (64 KiB), not the 2 MiB; the
    batch's other item is served in the same round trip."""
    writer = make_tier(chunk_bytes=4 * 1024 * 1024)
    big = bf16(2048, 43)
    assert writer.put("big", big) and writer.put("ok", bf16(4, 44))
    assert raw.strlen(KEYS.head("big")) > 2 * 1024 * 1024  # the whole blob is its head
    client = (
        make_client(CacheConfig(redis_url=redis_url))
        if path == "direct"
        else redis.Redis.from_url(redis_url)
    )
    reader = RedisTier(client, KEYS, RedisTierOptions(chunk_bytes=CHUNK, max_blob_bytes=2**20))
    before = int(raw.info("stats")["total_net_output_bytes"])
    got = reader.get_many(["big", "ok"])
    sent = int(raw.info("stats")["total_net_output_bytes"]) - before
    assert got["big"] is None
    assert_bit_exact(got["ok"], bf16(4, 44))
    stats = reader.stats()
    assert stats["oversized"] == 1 and count(stats, "bad_blobs") == 0, stats
    assert sent < CHUNK + 32 * 1024, sent
    assert_bit_exact(writer.get("big"), big)  # kept for readers with a larger limit
    reader.close()


def test_a_head_longer_than_this_readers_chunks_is_read_whole_in_a_second_trip(
    make_tier: Callable[..., RedisTier],
) -> None:
    """A writer with larger chunks makes one-value heads longer than this reader's first read
    of a head: within the reader's limit, that head is read again whole (``long_heads``) and
    served; heads this reader's own writers make never take the second trip."""
    writer = make_tier(chunk_bytes=4 * 1024 * 1024)
    tensor = bf16(1024, 45)
    assert writer.put("long", tensor)
    reader = make_tier()  # 64 KiB chunks
    assert reader.put("own", bf16(300, 46))
    got = reader.get_many(["long", "own"])
    assert_bit_exact(got["long"], tensor)
    assert_bit_exact(got["own"], bf16(300, 46))
    assert reader.stats()["long_heads"] == 1
    assert writer.get("long") is not None and count(writer.stats(), "long_heads") == 0


def test_a_long_bad_head_never_makes_the_server_hold_a_copy_of_it(
    private_redis: EmbeddedRedis,
) -> None:
    """A 96 MiB foreign value under an entry's head key, read in a batch with 40 entries (and
    a single-flight claim) by the zero-copy reader, on a server with 32 MiB of ``maxmemory``
    headroom under ``allkeys-lru``: the server never holds more of the bad value for this
    reader than the cut head asks for (a ``GET`` of it, which redis-server 7.0 answers from a
    copy in the client's output buffer, would need 96 MiB more and evict other entries).
    Nothing is evicted; every entry is served; the bad head is rejected; the claim is made."""
    raw = redis.Redis.from_url(private_redis.url)
    tier = RedisTier(
        make_client(CacheConfig(redis_url=private_redis.url)),
        KEYS,
        RedisTierOptions(chunk_bytes=CHUNK),
    )
    items = [f"e{i}" for i in range(40)]
    for i, item in enumerate(items):
        assert tier.put(item, bf16(4, 100 + i))
    piece = b"not a blob, " * (1 << 16)
    for at in range(0, 96 << 20, len(piece)):
        raw.setrange(KEYS.head("bad"), at, piece)
    used = int(raw.info("memory")["used_memory"])
    raw.config_set("maxmemory", used + (32 << 20))
    raw.config_set("maxmemory-policy", "allkeys-lru")
    claim = Claim("tok", 5000, {"new": 16})
    evicted = int(raw.info("stats")["evicted_keys"])
    got = tier.get_many(["bad", *items, "new"], claim)
    assert int(raw.info("stats")["evicted_keys"]) == evicted
    assert [item for item in items if got[item] is None] == []
    assert got["bad"] is None and tier.stats()["bad_blobs"] == 1
    assert claim.results["new"].won
    tier.close()
    raw.close()


@pytest.mark.parametrize("path", ["direct", "pipelined"])
@pytest.mark.parametrize("foreign", ["head", "chunk"])
def test_a_key_of_another_type_costs_only_its_own_item(
    redis_url: str, raw: redis.Redis, path: str, foreign: str
) -> None:
    """Someone's list under one item's head (or chunk) key: that item is a miss (and not
    published), the batch's other two items are hits; counted as ``foreign_keys``, not an
    outage (the breaker stays closed), and the list is left alone."""
    client = (
        make_client(CacheConfig(redis_url=redis_url))
        if path == "direct"
        else redis.Redis.from_url(redis_url)
    )
    tier = RedisTier(client, KEYS, RedisTierOptions(chunk_bytes=CHUNK, ttl_s=600))
    tensors = {"a": bf16(300, 47), "b": bf16(4, 48), "c": bf16(300, 49)}
    for key, tensor in tensors.items():
        assert tier.put(key, tensor)
    victim = "b" if foreign == "head" else "c"
    key = KEYS.head(victim) if foreign == "head" else chunks_of(raw, KEYS.head(victim))[1]
    raw.delete(key)
    raw.rpush(key, "not", "ours")
    got = tier.get_many(list(tensors))
    assert got[victim] is None
    for item in set(tensors) - {victim}:
        assert_bit_exact(got[item], tensors[item])
    described = tier.describe_many(list(tensors))
    assert described[victim] is None
    assert all(described[item] is not None for item in set(tensors) - {victim})
    stats = tier.stats()
    assert stats["foreign_keys"] == (2 if foreign == "head" else 1), stats
    assert count(stats, "describe_incomplete") == (1 if foreign == "chunk" else 0), stats
    assert stats["breaker_state"] == 0 and count(stats, "errors") == 0, stats
    assert raw.type(key) == b"list"
    tier.close()


# -- TTL -------------------------------------------------------------------------------------


def _pttls(raw: redis.Redis, keys: set[str]) -> dict[str, int]:
    return {k: raw.pttl(k) for k in keys}


def test_ttl_applies_to_head_and_chunks(
    make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    tier = make_tier(ttl_s=30)
    tier.put("t", bf16(300, 13))
    keys = entry_keys(raw, KEYS.head("t"), 5)
    assert all_keys(raw) == keys
    for key, pttl in _pttls(raw, keys).items():
        assert 0 < pttl <= 30_000, key


def test_without_ttl_entries_never_expire(
    make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    tier = make_tier()
    tier.put("t", bf16(300, 14))
    tier.get("t")
    keys = entry_keys(raw, KEYS.head("t"), 5)
    assert set(_pttls(raw, keys).values()) == {-1}


@pytest.mark.parametrize("sliding", [True, False])
def test_sliding_ttl_is_renewed_by_reads(
    make_tier: Callable[..., RedisTier], raw: redis.Redis, sliding: bool
) -> None:
    """Age the keys by shortening their TTL (no sleeping), then read: a sliding TTL jumps
    back to ttl_s on the head and every chunk; a fixed one keeps running down."""
    tier = make_tier(ttl_s=100, ttl_sliding=sliding)
    tensor = bf16(300, 15)
    tier.put("t", tensor)
    keys = entry_keys(raw, KEYS.head("t"), 5)
    for key in keys:
        raw.pexpire(key, 5_000)
    assert_bit_exact(tier.get("t"), tensor)
    pttls = _pttls(raw, keys)
    if sliding:
        assert all(90_000 < p <= 100_000 for p in pttls.values()), pttls
    else:
        assert all(0 < p <= 5_000 for p in pttls.values()), pttls


def test_sliding_ttl_in_real_time(make_tier: Callable[..., RedisTier], raw: redis.Redis) -> None:
    """The same with the clock: 2 s TTL, read once it has visibly run down, back near 2 s."""
    tier = make_tier(ttl_s=2)
    tier.put("t", bf16(300, 16))
    head = KEYS.head("t")
    deadline = time.monotonic() + 5
    while raw.pttl(head) > 1_200:  # wait (bounded) until at least 0.8 s have passed
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert tier.get("t") is not None
    for key, pttl in _pttls(raw, entry_keys(raw, head, 5)).items():
        assert 1_300 < pttl <= 2_000, key  # not renewed would be <= 1200


# -- isolation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "values"),
    [
        ("model_name", ("model-a", "model-b")),
        ("model_revision", ("r1", "r2")),
        ("model_dtype", ("bfloat16", "float16")),
        ("embed_width", (1024, 2048)),
        ("tenant_salt", ("tenant-1", "tenant-2")),
        ("namespace", ("ns1", "ns2")),
    ],
)
def test_models_and_tenants_never_see_each_others_entries(
    redis_url: str, raw: redis.Redis, field: str, values: tuple[Any, Any]
) -> None:
    base = {"redis_url": redis_url, "device": "cpu", "cpu_cache_bytes": 0}
    configs = [{**base, field: v} for v in values]
    tensors = [bf16(40, seed=20), bf16(40, seed=21)]
    for config, tensor in zip(configs, tensors, strict=True):
        with TieredCache.from_config(config) as producer:
            producer.put("same-item", tensor)
            assert producer.flush(10)
    assert len(all_keys(raw)) == 2  # two entries, not one overwritten
    for config, tensor in zip(configs, tensors, strict=True):
        with TieredCache.from_config(config) as consumer:
            assert_bit_exact(consumer.get("same-item"), tensor)
            assert consumer.stats()["redis"]["hits"] == 1
    other = {**base, "model_name": "model-c", "tenant_salt": "x"}
    with TieredCache.from_config(other) as stranger:
        assert stranger.get("same-item") is None


# -- compression -----------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_lz4_entries_round_trip_chunked(
    make_tier: Callable[..., RedisTier], raw: redis.Redis, shuffle: bool
) -> None:
    tier = make_tier(compression="lz4", byte_shuffle=shuffle)
    noisy = bf16(300, 17)
    smooth = (torch.arange(300 * 512, dtype=torch.float32) // 64).reshape(300, 512)
    for key, tensor in (("noisy", noisy), ("smooth", smooth)):
        assert tier.put(key, tensor)
        header = read_header(raw.get(KEYS.head(key)))
        assert header.codec == CODEC_LZ4
        assert header.shuffled is shuffle
        assert_bit_exact(tier.get(key), tensor)
    header = read_header(raw.get(KEYS.head("noisy")))
    assert header.part_bytes == CHUNK - ALLOCATOR_SLACK  # chunked lz4 payload
    stored_smooth = sum(raw.strlen(k) for k in all_keys(raw) if ".smooth}" in k)
    assert stored_smooth < smooth.numel() * 4 // 5


def test_auto_compression_stores_random_bf16_raw_and_redundant_data_compressed(
    make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    tier = make_tier(compression="auto")
    noisy = bf16(300, 18)
    zeros = torch.zeros(300, 512, dtype=torch.bfloat16)
    tier.put("noisy", noisy)
    tier.put("zeros", zeros)
    assert read_header(raw.get(KEYS.head("noisy"))).codec == CODEC_NONE
    assert read_header(raw.get(KEYS.head("zeros"))).codec == CODEC_LZ4
    assert_bit_exact(tier.get("noisy"), noisy)
    assert_bit_exact(tier.get("zeros"), zeros)


def test_cache_default_auto_compression_keeps_random_bf16_raw(
    redis_url: str, raw: redis.Redis
) -> None:
    tensor = bf16(64, 19)
    with TieredCache.from_config({"redis_url": redis_url, "device": "cpu"}) as cache:
        assert cache.config.compression == "auto"
        cache.put("e", tensor)
        assert cache.flush(10)
        head = cache.redis.keys.head("e") if cache.redis else ""
    header = read_header(raw.get(head))
    assert header.codec_name == "none"
    assert header.dtype.torch_dtype == torch.bfloat16 and header.shape == (64, 512)


@pytest.mark.parametrize("ttl_s", [0.0, 30.0])
@pytest.mark.parametrize("path", ["direct", "pipelined"])
def test_large_entries_are_read_and_renewed_on_both_read_paths(
    redis_url: str, raw: redis.Redis, ttl_s: float, path: str
) -> None:
    """The one-copy path (chunks recv_into'd into the tensor) is the one our clients take;
    other clients take the pipelined one. With a sliding TTL both renew the head (GETEX) and
    every chunk (the renew script, sent ahead of the chunk GETs) -- also right after the
    server forgot its scripts (NOSCRIPT: the script is sent again)."""
    client = (
        make_client(CacheConfig(redis_url=redis_url))
        if path == "direct"
        else redis.Redis.from_url(redis_url)
    )
    tier = RedisTier(client, KEYS, RedisTierOptions(chunk_bytes=CHUNK, ttl_s=ttl_s))
    tensor = bf16(300, seed=21)
    assert tier.put("direct", tensor)
    head = KEYS.head("direct")
    keys = entry_keys(raw, head, 5)
    for flush in (False, True):
        if flush:
            raw.script_flush()
        if ttl_s:
            for key in keys:
                raw.pexpire(key, 5_000)
        assert_bit_exact(tier.get("direct"), tensor)
        if ttl_s:
            assert all(raw.pttl(key) > 20_000 for key in keys), _pttls(raw, keys)
        else:
            assert all(raw.pttl(key) == -1 for key in keys)
    assert count(tier.stats(), "direct_reads") == (2 if path == "direct" else 0)
    assert count(tier.stats(), "renew_errors") == 0
    tier.close()


def test_fakeredis_with_lua_serves_the_whole_protocol() -> None:
    """The embedded fallback server (fakeredis, with lupa for Lua) runs the entry scripts."""
    fake = RedisTier(fakeredis.FakeRedis(), KEYS, RedisTierOptions(chunk_bytes=CHUNK, ttl_s=60))
    tensor = bf16(300, seed=22)
    assert fake.put("p", tensor)
    assert_bit_exact(fake.get("p"), tensor)
    assert fake.put("p", bf16(10, seed=23))  # a shrinking rewrite
    assert_bit_exact(fake.get("p"), bf16(10, seed=23))
    fake.delete("p")
    assert fake.get("p") is None
    stats = fake.stats()
    assert "direct_reads" not in stats and count(stats, "errors") == 0, stats
