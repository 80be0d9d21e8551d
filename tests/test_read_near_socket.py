"""The Redis tier's read path near the socket (issue 17): checksums computed as the bytes land
(``codec/landing.py``) and recycled destination memory (``codec/destination.py``).

Neither may change what a read returns: a corrupt, truncated or foreign blob is still a miss
and a counter, and a buffer is never reused while any tensor or view made of it lives."""

from __future__ import annotations

import errno
import gc
import os
import signal
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import redis
import torch
import xxhash

from ec_redis.codec import decode_parts, destination, encode_parts, read_header
from ec_redis.codec.destination import PAGE, SLACK, Recycler
from ec_redis.codec.direct import direct_layout
from ec_redis.codec.format import HEADER_SIZE
from ec_redis.codec.landing import STEP, Landing, payload_start
from ec_redis.config import CacheConfig
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.redis_conn import make_client
from ec_redis.tiers import bulk_read
from ec_redis.tiers.layout import chunk_keys
from ec_redis.tiers.redis_tier import RedisTier
from ec_redis.tiers.transfer import HostCopy
from tests.conftest import bits
from tests.counters import count
from tests.test_redis_tier import make_tier  # noqa: F401 (the fixture near_tier uses)

KEYS = KeyBuilder("near", ModelIdentity("m"))
MiB = 1 << 20


def bf16(rows: int, seed: int, width: int = 1024) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen).to(torch.bfloat16)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the storages of ``a`` and ``b`` share any byte."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    a0, b0 = sa.data_ptr(), sb.data_ptr()
    return a0 < b0 + sb.nbytes() and b0 < a0 + sa.nbytes()


# -- the running checksum ---------------------------------------------------------------------


@pytest.mark.parametrize("steps", [[1], [7, 1 << 16, 3, STEP, STEP + 1, 5 * STEP + 11]])
def test_a_landing_digest_is_the_digest_of_the_bytes_in_any_steps(steps: list[int]) -> None:
    data = memoryview(os.urandom(6 * STEP + 12345))
    landing = Landing(data, 0, seed=b"prefix")
    count_ = 0
    for step in steps * 100:
        count_ = min(len(data), count_ + step)
        landing.landed(count_)
    landing.landed(len(data))
    assert landing.digest(0, len(data)) == xxhash.xxh3_64(b"prefix" + bytes(data)).intdigest()


def test_a_landing_covers_only_the_range_it_followed() -> None:
    data = memoryview(os.urandom(3 * STEP))
    whole = Landing(data, 0)
    whole.landed(len(data))
    assert whole.digest(1, len(data)) is None  # not where it started
    past = Landing(data, 0)
    past.landed(len(data))
    assert past.digest(0, STEP) is None  # it hashed beyond that end already
    once = Landing(data, 0)
    once.landed(len(data))
    assert once.digest(0, len(data)) is not None
    assert once.digest(0, len(data)) is None  # a second call would hash the tail twice


def test_a_gap_in_what_landed_ends_the_running_hash() -> None:
    """A chunk that did not land (a reply of the wrong length is skipped) leaves stale bytes
    in its stretch: the bytes after it must not make a digest."""
    data = memoryview(os.urandom(4 * STEP))
    landing = Landing(data, 0)
    landing.landed(STEP, 0)
    landing.landed(3 * STEP, 2 * STEP)  # [STEP, 2 STEP) never landed
    landing.landed(4 * STEP, 3 * STEP)
    assert landing.digest(0, len(data)) is None


def test_a_landing_finds_the_payload_of_a_whole_blob_and_ignores_foreign_bytes() -> None:
    tensor = bf16(300, seed=1)
    (blob,) = encode_parts(tensor, producer_id="p", model="m")
    header = read_header(blob)
    assert payload_start(blob) == header.payload_offset
    landing = Landing(memoryview(blob))
    for end in range(0, len(blob), 4099):
        landing.landed(end)
    landing.landed(len(blob))
    digest = landing.digest(header.payload_offset, len(blob))
    assert digest == header.checksum
    for foreign in (b"x" * 4096, os.urandom(HEADER_SIZE - 1), b"ECRB" + bytes(200)):
        assert payload_start(foreign) is None
        other = Landing(memoryview(foreign))
        other.landed(len(foreign))
        assert other.digest(HEADER_SIZE, len(foreign)) is None


def test_decode_takes_a_landing_digest_only_when_it_matches() -> None:
    """A wrong running digest is a rejected blob, never an accepted one."""
    from ec_redis.errors import BlobError

    tensor = bf16(300, seed=2)
    (blob,) = encode_parts(tensor)
    header = read_header(blob)
    good = Landing(memoryview(blob))
    good.landed(len(blob))
    assert bits(decode_parts([blob], header=header, landing=good)) == bits(tensor)
    seeded = Landing(memoryview(blob), header.payload_offset, seed=b"not the blob's")
    seeded.landed(len(blob))
    with pytest.raises(BlobError, match="checksum"):
        decode_parts([blob], header=header, landing=seeded)


# -- recycled destination memory ----------------------------------------------------------------


def test_a_recycled_block_is_never_in_two_live_tensors() -> None:
    recycler = Recycler(idle_bytes=64 * MiB)
    first = recycler.take(3 * MiB)
    view = first[100:200].view(torch.int16)
    array = first.numpy()
    second = recycler.take(3 * MiB)
    assert not overlaps(first, second)
    address = first.data_ptr()
    del first
    gc.collect()
    assert recycler.idle() == 0  # a view and a numpy array still hold it
    third = recycler.take(3 * MiB)
    assert not overlaps(third, view) and not overlaps(third, second)
    del view
    gc.collect()
    assert recycler.idle() == 0  # the numpy array still holds it
    del array
    gc.collect()
    assert recycler.idle() == 3 * MiB  # the block is free now
    fourth = recycler.take(3 * MiB - 5)  # about the same size: it fits
    assert fourth.data_ptr() == address and recycler.idle() == 0
    assert fourth.numel() == 3 * MiB - 5
    assert fourth.untyped_storage().nbytes() == 3 * MiB  # what a budget counts: the block
    for live in (second, third):
        assert not overlaps(fourth, live)


def test_recycled_memory_is_bounded_and_sized_by_class() -> None:
    recycler = Recycler(idle_bytes=8 * MiB)
    tensors = [recycler.take(2 * MiB) for _ in range(6)]
    big = recycler.take(20 * MiB)  # larger than everything kept: never held
    del tensors, big
    gc.collect()
    assert recycler.idle() == 8 * MiB  # 4 of the 6 blocks; the oldest went
    larger = recycler.take(2 * MiB + 1)  # larger than each: a new block
    assert larger.numel() == 2 * MiB + 1 and recycler.idle() == 8 * MiB
    small = recycler.take(2 * MiB - 2 * MiB // (SLACK + 1) - PAGE)  # far smaller: a new one
    assert recycler.idle() == 8 * MiB and small.untyped_storage().nbytes() < 2 * MiB
    fits = recycler.take(2 * MiB - 2 * MiB // (SLACK + 1) + PAGE)  # within the slack
    assert recycler.idle() == 6 * MiB and fits.untyped_storage().nbytes() == 2 * MiB
    recycler.clear()
    assert recycler.idle() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_never_writes_into_its_parents_tensors() -> None:
    """vLLM forks its workers. A tensor alive at fork() and dropped in the child gives its
    block to the child's free list; the child's next read lands in it. That block must be the
    child's own copy: were it shared memory (Python's default for an anonymous ``mmap``), the
    child's read would overwrite the parent's live tensor after its checksum passed."""
    recycler = Recycler(idle_bytes=64 * MiB)
    tensor = recycler.take(3 * MiB)
    tensor.fill_(1)
    pid = os.fork()
    if pid == 0:  # the child: drop the inherited tensor, read into the freed block
        code = 1
        try:
            del tensor
            gc.collect()
            reread = recycler.take(3 * MiB)
            reread.numpy()[:] = 2  # numpy, not torch: torch's thread pool is not fork-safe
            code = 0 if recycler.reused == 1 else 3  # it did land in the inherited block
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if waited[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(waited[1]) == 0  # the child reused the block, as in life
    assert bool((tensor == 1).all())


def test_a_block_given_back_while_the_recycler_is_busy_does_not_deadlock() -> None:
    """The garbage collector frees a tensor (and runs its give-back) wherever an allocation
    starts a collection, including while this thread is inside the recycler itself. Simulated
    by dropping a tensor with the recycler's lock held: a plain lock would hang the thread,
    and with it a vLLM step, forever."""
    import threading

    recycler = Recycler(idle_bytes=64 * MiB)
    done = threading.Event()

    def drop_inside() -> None:
        tensor = recycler.take(2 * MiB)
        with recycler._lock:
            del tensor  # the finalizer runs now, in this thread, under the lock
        assert recycler.take(2 * MiB).numel() == 2 * MiB  # the block, taken again
        done.set()

    worker = threading.Thread(target=drop_inside, daemon=True)
    worker.start()
    assert done.wait(30), "giving a block back under the recycler's lock deadlocked"
    assert recycler.reused == 1


def test_fresh_memory_of_small_reads_is_torchs() -> None:
    small = destination.fresh(destination.RECYCLE_MIN_BYTES - 1)
    assert small.numel() == destination.RECYCLE_MIN_BYTES - 1 and small.dtype == torch.uint8
    large = destination.fresh(destination.RECYCLE_MIN_BYTES)
    assert large.numel() == destination.RECYCLE_MIN_BYTES
    assert large.data_ptr() % PAGE == 0  # the start of a block of whole pages


# -- against a real server ----------------------------------------------------------------------


@pytest.fixture
def near_tier(make_tier: Callable[..., RedisTier]) -> Callable[..., RedisTier]:  # noqa: F811
    """Redis tiers of this module's keys, 1 MiB chunks unless told (closed after the test)."""
    return lambda **options: make_tier(KEYS, **{"chunk_bytes": 1 * MiB, **options})


def _value(raw: redis.Redis, key: str) -> bytes:
    value = raw.get(key)
    assert isinstance(value, bytes)
    return value


def _flip_at(raw: redis.Redis, key: str, offset: int) -> None:
    raw.setrange(key, offset, bytes([_value(raw, key)[offset] ^ 0x20]))


def _chunks(raw: redis.Redis, head: str) -> list[str]:
    value = _value(raw, head)
    return chunk_keys(head, read_header(value), len(value))


@pytest.mark.redis
def test_reads_land_checked_in_recycled_memory_and_never_alias(
    near_tier: Callable[..., RedisTier], raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both read paths (a one-value entry received in place, a chunked one straight into the
    tensor) hash as the bytes land: no second pass over them. A tensor kept while the same
    sizes are read again is never overwritten; one dropped lends its memory to the next."""
    from ec_redis.codec import direct

    tier = near_tier()
    one = {k: bf16(200, seed=k) for k in (1, 2)}  # 400 KB: one value, received in place
    chunked = {k: bf16(2000, seed=k) for k in (3, 4)}  # 4 MB: a 1 MiB head and 3 chunks
    for key, tensor in (one | chunked).items():
        assert tier.put(f"e{key}", tensor)

    def no_second_pass(*_: Any, **__: Any) -> Any:
        raise AssertionError("the payload was hashed again after it landed")

    import ec_redis.codec as codec

    # finish_direct's and decode_parts' own passes (the header checksum still runs)
    monkeypatch.setattr(direct, "xxhash", SimpleNamespace(xxh3_64=no_second_pass))
    monkeypatch.setattr(
        codec, "xxhash", SimpleNamespace(xxh3_64=xxhash.xxh3_64, xxh3_64_intdigest=no_second_pass)
    )

    def get(key: int) -> torch.Tensor:
        got = tier.get(f"e{key}")
        assert got is not None
        return got

    kept = {key: get(key) for key in (1, 3)}
    again = {key: get(key) for key in (2, 4)}  # same sizes, the others kept
    assert all(bits(got) == bits((one | chunked)[key]) for key, got in (kept | again).items())
    assert not overlaps(kept[1], again[2]) and not overlaps(kept[3], again[4])
    assert count(tier.stats(), "direct_reads") == 2
    address = again[4].data_ptr()
    del again
    gc.collect()
    reread = get(3)
    assert bits(reread) == bits(chunked[3])
    assert reread.data_ptr() == address  # the dropped tensor's memory, reused
    assert bits(kept[3]) == bits(chunked[3]) and bits(kept[1]) == bits(one[1])


@pytest.mark.redis
@pytest.mark.parametrize("where", ["first", "at-step", "last"])
def test_a_corrupt_byte_is_caught_as_it_lands(
    near_tier: Callable[..., RedisTier], raw: redis.Redis, where: str
) -> None:
    """A flipped byte in a stretch hashed early, at a stretch's edge, or in the tail hashed
    last, in a one-value entry received in place or in a chunked one (the head's data, its
    chunk): a miss and ``bad_blobs``."""
    tier = near_tier(chunk_bytes=4 * MiB)
    small = bf16(600, seed=5)  # 1.2 MB: one value
    large = bf16(3000, seed=6)  # 6 MB: a head of 4 MiB with the first data, and one chunk
    assert tier.put("one", small) and tier.put("big", large)
    head_one, head_big = KEYS.head("one"), KEYS.head("big")
    length = raw.strlen(head_one)
    offset = {"first": HEADER_SIZE + 300, "at-step": STEP, "last": length - 1}[where]
    _flip_at(raw, head_one, offset)
    layout = direct_layout(read_header(_value(raw, head_big)), raw.strlen(head_big))
    assert layout is not None and layout.in_head > 0 and len(layout.chunks) == 1
    (chunk,) = _chunks(raw, head_big)
    if where == "first":
        _flip_at(raw, head_big, layout.lead + 10)
    else:
        _flip_at(raw, chunk, {"at-step": STEP - 1, "last": raw.strlen(chunk) - 1}[where])
    got = tier.get_many(["one", "big"])
    assert got == {"one": None, "big": None}
    stats = tier.stats()
    assert stats["bad_blobs"] == 2 and count(stats, "errors") == 0
    assert raw.exists(head_one, head_big) == 0  # both rejected versions deleted


@pytest.mark.redis
def test_a_truncated_chunk_after_a_whole_one_is_a_miss(
    near_tier: Callable[..., RedisTier], raw: redis.Redis
) -> None:
    """A chunk of the wrong length is skipped, not received: the running hash stops there and
    the entry is a bad blob (its bytes are never half-accepted)."""
    tier = near_tier()
    tensor = bf16(2000, seed=7)
    assert tier.put("t", tensor)
    keys = _chunks(raw, KEYS.head("t"))
    raw.set(keys[1], _value(raw, keys[1])[:-3])
    assert tier.get("t") is None
    assert tier.stats()["bad_blobs"] == 1
    assert tier.put("t", tensor)
    got = tier.get("t")
    assert got is not None and bits(got) == bits(tensor)


@pytest.mark.redis
def test_bulk_reads_report_every_landing_in_order(redis_url: str, raw: redis.Redis) -> None:
    value = os.urandom(3 * MiB + 17)
    raw.set("near:landing", value)
    client = make_client(CacheConfig(redis_url=redis_url))
    try:
        seen: list[tuple[int, int]] = []
        target = np.empty(len(value), dtype=np.uint8)
        _, sizes = bulk_read.read_into(
            client,
            ["near:landing", "near:missing"],
            [target.data, np.empty(5, dtype=np.uint8).data],
            landed=lambda i, buf, n: seen.append((i, n)),
        )
        assert sizes == [len(value), None]
        assert target.tobytes() == value
        counts = [n for i, n in seen if i == 0]
        assert counts == sorted(counts) and counts[-1] == len(value)
        assert all(i == 0 for i, _ in seen)
        seen.clear()
        _, values, _ = bulk_read.read_values(
            client, [("GET", "near:landing")], landed=lambda i, buf, n: seen.append((i, n))
        )
        assert bytes(values[0]) == value and seen[-1] == (0, len(value))  # type: ignore[arg-type]
    finally:
        client.close()
        raw.delete("near:landing")


@pytest.mark.redis
@pytest.mark.parametrize("chunk_bytes", [8 * MiB, 1 * MiB], ids=["one-value", "chunked-direct"])
def test_the_cpu_budget_counts_the_memory_a_read_tensor_really_pins(
    near_tier: Callable[..., RedisTier], chunk_bytes: int
) -> None:
    """What the CPU tier's budget counts of a read tensor (``HostCopy.nbytes``: its
    storage's bytes) is what it keeps resident. A recycled block was once rounded up to whole
    2 MiB huge pages while the tensor's storage covered only its own bytes: a tier of items
    just over 1 MiB held about twice its budget. Blocks are whole 4 KiB pages now, and a
    storage is its whole block (a reused block may be up to ``1/SLACK`` larger: counted)."""
    tier = near_tier(chunk_bytes=chunk_bytes)
    tensor = bf16(540, seed=1)  # 1,105,920 bytes: just over 1 MiB
    n = 32
    for k in range(n):
        assert tier.put(f"e{k}", tensor)
    destination.RECYCLER.clear()
    gc.collect()
    kept = []
    for k in range(n):
        got = tier.get(f"e{k}")
        assert got is not None and bits(got) == bits(tensor)
        kept.append(got)
    counted = sum(HostCopy(t).nbytes for t in kept)
    before_drop = rss_bytes()
    del kept, got
    gc.collect()
    destination.RECYCLER.clear()  # the free list would keep what the tensors pinned
    gc.collect()
    pinned = before_drop - rss_bytes()
    assert pinned <= 1.25 * counted, (
        f"{n} kept tensors pinned {pinned / MiB:.1f} MiB of resident memory, "
        f"the CPU tier's budget counted {counted / MiB:.1f} MiB"
    )


@pytest.mark.redis
def test_a_refused_memory_mapping_is_not_a_redis_outage_nor_the_batchs_miss(
    near_tier: Callable[..., RedisTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recycled block is an anonymous ``mmap``, which the kernel may refuse (``ENOMEM``:
    ``vm.max_map_count`` reached, an overcommit limit). Then torch's allocator serves the
    buffer: the refusal is not a Redis fault (it would count ``errors``, feed the breaker and
    drop the connection) and no item of the batch is a miss for it."""
    tier = near_tier(chunk_bytes=8 * MiB)
    big, small = bf16(1000, seed=2), bf16(8, seed=3)  # 2 MB one-value entry, a 16 KB one
    assert tier.put("big", big) and tier.put("small", small)
    destination.RECYCLER.clear()

    def refuse(size: int) -> Any:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(destination, "_new_block", refuse)
    got = tier.get_many(["big", "small"])
    stats = tier.stats()
    assert got["small"] is not None and bits(got["small"]) == bits(small)
    assert got["big"] is not None and bits(got["big"]) == bits(big)
    assert count(stats, "errors") == 0 and count(stats, "hits") == 2
