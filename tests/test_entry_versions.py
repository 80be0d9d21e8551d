"""Versioned entries against real redis-server processes: concurrent writers and readers of
one item, rewrites that shrink, writers that fail or die between chunks and head, readers that
meet a bad version while a newer one lands, and the same scripts on a 3-master Cluster.

What is pinned: every read is one writer's complete tensor or a miss; once a complete version
has landed, no reader misses because of another writer; keys no head names always carry a TTL
of at most ``orphan_grace_s`` and are gone after it; a reader deletes nothing newer than what
it read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from redis.crc import key_slot

from ec_redis.codec import encode_parts, read_header
from ec_redis.codec.format import new_write_id
from ec_redis.config import CacheConfig
from ec_redis.embedded import EmbeddedCluster, EmbeddedRedis
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.redis_conn import make_client
from ec_redis.tiers import bulk_read, entry_ops, scripts
from ec_redis.tiers.layout import chunk_keys
from ec_redis.tiers.redis_tier import RedisTier, RedisTierOptions
from tests.conftest import bit_exact, wait_for
from tests.counters import count

pytestmark = pytest.mark.redis

KEYS = KeyBuilder("v", ModelIdentity("versions"))
CHUNK = 64 * 1024
MiB = 1024 * 1024
# The grace must outlast what a test does between a write and its check that the orphans are
# still there (a killed child reaped, a read of the replaced version): 3 s on a loaded host.
GRACE_S = 3.0
# Orphans must be gone within the grace; the bound adds slack for a loaded 2-core box (Redis
# expires keys lazily and in 100 ms active cycles, so a key may outlive its TTL briefly).
EXPIRY_BOUND_S = GRACE_S + 15.0
SRC = Path(__file__).resolve().parents[1] / "src"


def bf16(rows: int, seed: int, width: int = 512) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen).to(torch.bfloat16)


@pytest.fixture
def make_tier(redis_url: str) -> Iterator[Callable[..., RedisTier]]:
    made: list[RedisTier] = []

    def make(plain: bool = False, **options: Any) -> RedisTier:
        """A tier on our client (direct chunk reads) or, ``plain``, on a plain redis-py
        client (the pipelined read path)."""
        options.setdefault("chunk_bytes", CHUNK)
        options.setdefault("orphan_grace_s", GRACE_S)
        client = (
            redis.Redis.from_url(redis_url)
            if plain
            else make_client(CacheConfig(redis_url=redis_url))
        )
        tier = RedisTier(client, KEYS, RedisTierOptions(**options))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def named(raw: Any, head: str) -> set[str]:
    """The head and the chunk keys it names (empty when there is no head)."""
    value = raw.get(head)
    if value is None:
        return set()
    return {head, *chunk_keys(head, read_header(value), len(value))}


def pttls(raw: Any, keys: Any) -> dict[str, int]:
    """PTTL per key, leaving out keys that expired since they were listed (PTTL -2)."""
    out = {k.decode() if isinstance(k, bytes) else k: raw.pttl(k) for k in keys}
    return {k: t for k, t in out.items() if t != -2}


def all_keys(raw: redis.Redis) -> set[str]:
    return {k.decode() for k in raw.keys("*")}


def assert_only_the_entry_lives_forever(raw: redis.Redis, head: str, grace_s: float) -> None:
    """Keys the head names have no TTL; every other key expires within the grace."""
    live = named(raw, head)
    ttls = pttls(raw, all_keys(raw))
    assert {k for k, t in ttls.items() if t == -1} == live, ttls
    others = {k: t for k, t in ttls.items() if k not in live}
    assert all(0 <= t <= grace_s * 1000 for t in others.values()), {
        k: t for k, t in others.items() if not 0 <= t <= grace_s * 1000
    }


# -- two writers, two readers ------------------------------------------------------------


@pytest.mark.parametrize("ttl_s", [0.0, 600.0], ids=["no-ttl", "sliding-ttl"])
def test_two_writers_two_readers_one_item(
    make_tier: Callable[..., RedisTier], raw: redis.Redis, ttl_s: float
) -> None:
    """Two producers rewrite one item with different bytes (and sizes: 5 and 7 chunks) for
    seconds while two readers (one per read path) read it: every read is one writer's whole
    tensor, and once the first write landed, no read misses. After both flushed, a fresh
    reader hits; only the current entry's keys live on, the rest expires within the grace."""
    grace_s = 4.0  # longer than any stall between a reader's two round trips here
    tensors = {"a": bf16(300, seed=1), "b": bf16(420, seed=2)}
    writers = {name: make_tier(ttl_s=ttl_s, orphan_grace_s=grace_s) for name in tensors}
    readers = [make_tier(ttl_s=ttl_s), make_tier(plain=True, ttl_s=ttl_s)]
    landed = threading.Event()
    stop = threading.Event()
    wrong: list[str] = []
    misses_after_landing: list[int] = []
    hits = [0, 0]
    escaped: list[BaseException] = []
    writes = {name: 0 for name in tensors}

    def write(name: str) -> None:
        try:
            while not stop.is_set():
                if writers[name].put("item", tensors[name]):
                    writes[name] += 1
                    landed.set()
        except BaseException as exc:
            escaped.append(exc)

    def read(index: int) -> None:
        try:
            while not stop.is_set():
                was_landed = landed.is_set()
                got = readers[index].get("item")
                if got is None:
                    if was_landed:
                        misses_after_landing.append(index)
                elif bit_exact(got, tensors["a"]) or bit_exact(got, tensors["b"]):
                    hits[index] += 1
                else:
                    wrong.append(f"reader {index}: shape {tuple(got.shape)}")
        except BaseException as exc:
            escaped.append(exc)

    threads = [threading.Thread(target=write, args=(name,)) for name in tensors]
    threads += [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert escaped == []
    assert wrong == []
    assert misses_after_landing == [], [sorted(r.stats().items()) for r in readers]
    assert all(writes.values()) and all(hits), (writes, hits)  # both writers and readers ran
    conflicts = sum(count(w.stats(), "write_conflict") for w in writers.values())
    assert conflicts <= sum(writes.values()) // 10  # racing writers mostly win their swap
    for tier in [*writers.values(), *readers]:
        s = tier.stats()
        assert count(s, "errors") == 0 and count(s, "internal_errors") == 0, s
        assert count(s, "bad_blobs") == 0 and count(s, "partial_entries") == 0, s

    fresh = make_tier(ttl_s=ttl_s)
    got = fresh.get("item")
    assert bit_exact(got, tensors["a"]) or bit_exact(got, tensors["b"])
    head = KEYS.head("item")
    live = named(raw, head)
    ttls = pttls(raw, all_keys(raw))
    if ttl_s:
        assert all(grace_s * 1000 < ttls[k] <= ttl_s * 1000 for k in live), ttls
    else:
        assert {k for k, t in ttls.items() if t == -1} == live, ttls
    # replaced versions: a TTL of at most the grace, which no reader prolonged
    others = {k: t for k, t in ttls.items() if k not in live}
    assert all(0 <= t <= grace_s * 1000 for t in others.values()), {
        k: t for k, t in others.items() if not 0 <= t <= grace_s * 1000
    }
    wait_for(
        lambda: all_keys(raw) == live,
        timeout_s=grace_s + 15,
        what="the replaced versions' chunks to expire",
    )
    assert bit_exact(fresh.get("item"), got)


# -- rewrites ----------------------------------------------------------------------------


def test_a_shrinking_rewrite_retires_the_old_chunks_within_the_grace(
    make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    """20 MiB (a 4 MiB head and five 4 MiB chunks), then 3 MiB (one value), with
    ``ttl_s: 0``: the old head's chunks get the grace TTL at the switch and are gone after
    it; nothing else lingers."""
    tier = make_tier(chunk_bytes=4 * MiB)
    big = torch.randn(20 * MiB // 2, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    small = bf16(3 * MiB // 1024, seed=4)
    head = KEYS.head("x")
    assert tier.put("x", big)
    first = named(raw, head)
    assert len(first) == 1 + 5
    assert {raw.pttl(k) for k in first} == {-1}

    assert tier.put("x", small)
    assert named(raw, head) == {head}  # now one value
    assert_only_the_entry_lives_forever(raw, head, GRACE_S)
    assert bit_exact(tier.get("x"), small)
    wait_for(lambda: all_keys(raw) == {head}, EXPIRY_BOUND_S, "the old chunks to expire")

    assert tier.put("x", big)  # growing again: new chunk keys, the head switches to them
    assert named(raw, head).isdisjoint(first - {head})
    assert bit_exact(tier.get("x"), big)
    assert_only_the_entry_lives_forever(raw, head, GRACE_S)


# -- writers that fail or die between chunks and head ------------------------------------


class _CutOff:
    """A client whose connection "drops" after the chunk pipeline: every command sent on
    its own (the swap script, the UNLINK of the chunks) fails like a lost connection."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("connection lost")

    def unlink(self, *names: str) -> Any:
        raise redis.ConnectionError("connection lost")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_a_write_whose_switch_fails_leaves_keys_that_expire(
    redis_url: str, make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    """The head step fails and the writer cannot clean up: its chunks expire within the grace;
    the version readers see is untouched meanwhile."""
    good = make_tier()
    assert good.put("item", bf16(300, seed=5))
    head = KEYS.head("item")
    before = named(raw, head)

    broken = RedisTier(
        _CutOff(redis.Redis.from_url(redis_url)),
        KEYS,
        RedisTierOptions(chunk_bytes=CHUNK, orphan_grace_s=GRACE_S),
    )
    assert broken.put("item", bf16(500, seed=6)) is False
    assert broken.stats()["write_errors"] == 1
    left = all_keys(raw) - before
    assert len(left) == 9  # the failed write's head value and eight chunks (500 rows)
    assert all(0 <= t <= GRACE_S * 1000 for t in pttls(raw, left).values())
    assert named(raw, head) == before and bit_exact(good.get("item"), bf16(300, seed=5))
    wait_for(lambda: all_keys(raw) == before, EXPIRY_BOUND_S, "the failed write's chunks")


_KILLED_WRITER = """
import sys, time, torch
from ec_redis.config import CacheConfig
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.redis_conn import make_client
from ec_redis.tiers import scripts
from ec_redis.tiers.redis_tier import RedisTier, RedisTierOptions

def hang(*args, **kwargs):  # the writer stalls between its chunks and the head switch
    print("chunks written", flush=True)
    time.sleep(600)

scripts.SWAP.run = hang
tier = RedisTier(
    make_client(CacheConfig(redis_url=sys.argv[1])),
    KeyBuilder("v", ModelIdentity("versions")),
    RedisTierOptions(chunk_bytes=64 * 1024, orphan_grace_s=float(sys.argv[2])),
)
gen = torch.Generator().manual_seed(7)
tier.put("item", torch.randn(600, 512, generator=gen).to(torch.bfloat16))
"""


def test_a_writer_killed_between_chunks_and_head_leaves_keys_that_expire(
    redis_url: str, make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    """A real process SIGKILLed after its chunks, before its head switch (``ttl_s: 0``): the
    current version keeps serving, the dead writer's chunks expire within the grace."""
    reader = make_tier()
    assert reader.put("item", bf16(300, seed=8))
    head = KEYS.head("item")
    before = named(raw, head)
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED_WRITER), redis_url, str(GRACE_S)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"chunks written"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    left = all_keys(raw) - before
    assert len(left) == 11  # the dead write's head value and ten 60 KiB chunks (600 rows)
    assert all(0 <= t <= GRACE_S * 1000 for t in pttls(raw, left).values())
    assert bit_exact(reader.get("item"), bf16(300, seed=8))
    wait_for(lambda: all_keys(raw) == before, EXPIRY_BOUND_S, "the dead writer's chunks")
    assert {raw.pttl(k) for k in before} == {-1}


# -- readers: a version replaced mid-read; compare-and-delete ----------------------------


@pytest.fixture
def between_round_trips(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[], None]], None]:
    """Run an action once, after a reader got the head and before it fetches the chunks."""

    def install(action: Callable[[], None]) -> None:
        real_send = bulk_read._Reader.send
        done: list[bool] = []

        def send(reader: Any, commands: Any) -> None:
            # the chunks' GETs go out once the head's header is in, its data still streaming
            if not done:
                done.append(True)
                action()
            real_send(reader, commands)

        monkeypatch.setattr(bulk_read._Reader, "send", send)

    return install


@pytest.mark.parametrize("ttl_s", [0.0, 600.0], ids=["no-ttl", "sliding-ttl"])
def test_a_version_replaced_mid_read_is_still_read_whole(
    make_tier: Callable[..., RedisTier],
    raw: redis.Redis,
    between_round_trips: Callable[[Callable[[], None]], None],
    ttl_s: float,
) -> None:
    """...and the read does not prolong the replaced version: its chunks keep the grace TTL
    (a sliding-TTL read renews chunks only while their version is current)."""
    writer, reader = make_tier(ttl_s=ttl_s), make_tier(ttl_s=ttl_s)
    old, new = bf16(300, seed=9), bf16(300, seed=10)
    assert writer.put("item", old)
    head = KEYS.head("item")
    old_chunks = named(raw, head) - {head}
    between_round_trips(lambda: writer.put("item", new))
    assert bit_exact(reader.get("item"), old)  # the head it read named `old`'s chunks
    assert all(0 <= t <= GRACE_S * 1000 for t in pttls(raw, old_chunks).values())
    assert bit_exact(reader.get("item"), new)


@pytest.mark.parametrize("damage", ["corrupt", "evicted"])
def test_a_reader_meeting_a_bad_version_deletes_nothing_newer(
    make_tier: Callable[..., RedisTier],
    raw: redis.Redis,
    between_round_trips: Callable[[Callable[[], None]], None],
    damage: str,
) -> None:
    """The reader got version 1's head; before it fetched the chunks, version 2 landed and
    one of version 1's chunks was damaged. The reader rejects version 1 (a miss) and its
    compare-and-delete finds the head changed: version 2 stays whole."""
    writer, reader = make_tier(), make_tier()
    v1, v2 = bf16(300, seed=11), bf16(300, seed=12)
    assert writer.put("item", v1)
    head = KEYS.head("item")
    v1_chunks = sorted(named(raw, head) - {head})

    def newer_version_lands_and_v1_is_damaged() -> None:
        assert writer.put("item", v2)
        if damage == "corrupt":
            raw.setrange(v1_chunks[2], 100, b"\xff\x00\xff")
        else:
            raw.delete(v1_chunks[2])

    between_round_trips(newer_version_lands_and_v1_is_damaged)
    assert reader.get("item") is None
    s = reader.stats()
    assert count(s, "bad_blobs" if damage == "corrupt" else "partial_entries") == 1, s
    assert s["discards_skipped_newer"] == 1
    v2_keys = named(raw, head)
    assert len(v2_keys) == 6 and v2_keys.isdisjoint(v1_chunks)
    assert {raw.pttl(k) for k in v2_keys} == {-1}
    assert bit_exact(reader.get("item"), v2)


class _LostReplies:
    """A client whose every script call (outside a pipeline) runs twice on the server and
    answers with the second reply: what a lost reply plus redis-py's retry does."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client

    def pipeline(self, **kwargs: Any) -> Any:
        return self._client.pipeline(**kwargs)

    def execute_command(self, *args: Any) -> Any:
        if args[0] in ("EVAL", "EVALSHA"):
            self._client.execute_command(*args)  # switched in; the reply never arrives
        return self._client.execute_command(*args)

    def unlink(self, *keys: str) -> Any:
        return self._client.unlink(*keys)


@pytest.mark.parametrize("case", ["replacing-a-version", "script-unknown"])
def test_a_swap_retried_after_its_reply_was_lost_keeps_the_entry_whole(
    make_tier: Callable[..., RedisTier], raw: redis.Redis, case: str
) -> None:
    """The retried swap finds its own write current: "stored", the entry whole and without a
    TTL, not another writer's version whose chunks it then unlinks."""
    tier = make_tier()
    if case == "replacing-a-version":
        assert tier.put("item", bf16(400, seed=20))  # a second round goes outside the pipeline
    else:
        raw.script_flush()  # the pipelined EVALSHA fails: EVAL goes outside the pipeline
    head = KEYS.head("item")
    tensor = bf16(300, seed=21)
    parts = encode_parts(tensor, part_bytes=CHUNK, write_id=(write_id := new_write_id()))
    client = _LostReplies(raw)
    outcome = entry_ops.write_entry(client, head, parts, write_id, None, int(GRACE_S * 1000))
    assert outcome == entry_ops.STORED
    current = named(raw, head)
    assert len(current) == len(parts)  # the head and every chunk it names
    assert set(pttls(raw, current).values()) == {-1}
    time.sleep(GRACE_S + 0.5)
    assert bit_exact(tier.get("item"), tensor)
    assert count(tier.stats(), "bad_blobs") == 0


def test_a_retried_write_refused_after_its_first_send_landed_keeps_the_entry_whole(
    private_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py re-sends a pipeline whose reply was lost (our client's ``Retry``). Here the
    first send switched the entry in, then Redis filled up (``noeviction``): the re-sent SETs
    are refused. Those keys are the current version's now; the write must not unlink them (the
    entry would be a head naming missing chunks). The script in the re-sent pipeline sees its
    own head current, so the write is stored, whole and without a TTL."""
    raw = redis.Redis.from_url(private_redis.url)
    client = make_client(CacheConfig(redis_url=private_redis.url, redis_retries=1))
    tier = RedisTier(client, KEYS, RedisTierOptions(chunk_bytes=CHUNK, orphan_grace_s=GRACE_S))
    assert tier.put("warm-up", bf16(4, seed=31))  # the server knows the swap script now
    real = redis.client.Pipeline._execute_pipeline
    sends: list[list[Any]] = []

    def reply_lost_then_full(self: Any, connection: Any, commands: Any, raise_on_error: Any) -> Any:
        replies = real(self, connection, commands, raise_on_error)  # the server ran it all
        sends.append(replies)
        if len(sends) == 1:
            raw.config_set("maxmemory-policy", "noeviction")
            raw.config_set("maxmemory", 1)  # any write that allocates is refused (OOM)
            raise redis.ConnectionError("the reply was lost")
        return replies

    tensor = bf16(300, seed=30)
    monkeypatch.setattr(redis.client.Pipeline, "_execute_pipeline", reply_lost_then_full)
    try:
        stored = tier.put("item", tensor)
    finally:
        monkeypatch.undo()
        raw.config_set("maxmemory", 0)
    assert len(sends) == 2  # the retry ran, and its SETs were refused
    # Each send: the SETs, the swap, then the UNLINK of the entry's single-flight lease.
    assert all(isinstance(r, redis.exceptions.OutOfMemoryError) for r in sends[1][:-2])
    assert sends[0][-2] == sends[1][-2] == [scripts.SWAPPED]  # switched in by the first send
    head = KEYS.head("item")
    current = named(raw, head)
    assert len(current) == 6 and raw.exists(*current) == 6  # the head and its five chunks
    assert set(pttls(raw, current).values()) == {-1}
    assert bit_exact(tier.get("item"), tensor)
    assert stored
    raw.close()
    tier.close()


def test_compare_and_delete_takes_only_the_version_it_was_given(
    make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    tier = make_tier()
    assert tier.put("item", bf16(300, seed=13))
    head = KEYS.head("item")
    v1 = raw.get(head)
    v1_keys = named(raw, head)
    assert tier.put("item", bf16(300, seed=14))
    v2_keys = named(raw, head)
    assert not entry_ops.discard(tier.client, head, v1, sorted(v1_keys - {head}))
    assert named(raw, head) == v2_keys and all(raw.exists(k) for k in v2_keys)
    v2 = raw.get(head)
    assert entry_ops.discard(tier.client, head, v2, sorted(v2_keys - {head}))
    assert not any(raw.exists(k) for k in v2_keys)


def test_delete_removes_the_current_version_whole_and_leaves_replaced_ones_to_expire(
    make_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    tier = make_tier()
    assert tier.put("item", bf16(300, seed=15))
    assert tier.put("item", bf16(400, seed=16))
    head = KEYS.head("item")
    current = named(raw, head)
    tier.delete("item")
    left = all_keys(raw)
    assert left.isdisjoint(current)
    assert len(left) == 5 and all(0 <= t <= GRACE_S * 1000 for t in pttls(raw, left).values())
    assert tier.get("item") is None
    wait_for(lambda: not all_keys(raw), EXPIRY_BOUND_S, "the replaced version to expire")


# -- Redis Cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster.start(masters=3, replicas_per_master=0) as started:
        yield started


def test_the_scripts_run_on_a_three_master_cluster(cluster: EmbeddedCluster) -> None:
    """Entries on every master: each entry's head and chunks (of every version) share one
    slot on one node; writes, sliding-TTL reads, rewrites, deletes and compare-and-delete all
    run there as single-slot scripts."""
    client = make_client(CacheConfig(redis_url=cluster.url))
    tier = RedisTier(
        client,
        KEYS,
        RedisTierOptions(chunk_bytes=CHUNK, ttl_s=600, orphan_grace_s=GRACE_S),
    )
    try:
        items = {f"item-{i}": bf16(200 + 10 * i, seed=20 + i) for i in range(12)}
        for key, tensor in items.items():
            assert tier.put(key, tensor)
        got = tier.get_many(list(items))
        assert all(bit_exact(got[k], t) for k, t in items.items())
        described = tier.describe_many(list(items))  # builds the chunk keys in its node's slot
        assert described == {k: (t.dtype, tuple(t.shape)) for k, t in items.items()}
        owners = {cluster.key_owner(KEYS.head(k)) for k in items}
        assert len(owners) == 3  # the entries spread over every master

        head = KEYS.head("item-0")
        node = redis.Redis(host="127.0.0.1", port=cluster.key_owner(head))
        try:
            first = named(node, head)
            assert len({key_slot(k.encode()) for k in first}) == 1
            assert tier.put("item-0", bf16(100, seed=40))  # shrink: retire the old chunks
            second = named(node, head)
            keys_now = {k.decode() for k in node.scan_iter(match=head + "*")}
            assert keys_now == first | second  # old version still there, on the same node
            assert len({key_slot(k.encode()) for k in keys_now}) == 1
            assert all(0 <= t <= GRACE_S * 1000 for t in pttls(node, first - second).values())
            assert all(t > 500_000 for t in pttls(node, second).values())
            for key in second:
                node.pexpire(key, 10_000)
            assert bit_exact(tier.get("item-0"), bf16(100, seed=40))
            assert all(t > 500_000 for t in pttls(node, second).values())  # renewed

            stale = node.get(head)
            assert tier.put("item-0", bf16(300, seed=41))
            assert not entry_ops.discard(client, head, stale, sorted(second - {head}))
            assert bit_exact(tier.get("item-0"), bf16(300, seed=41))
            tier.delete("item-0")
            assert not named(node, head) and tier.get("item-0") is None
        finally:
            node.close()
        s = tier.stats()
        assert count(s, "errors") == 0 and count(s, "internal_errors") == 0, s
    finally:
        tier.close()
