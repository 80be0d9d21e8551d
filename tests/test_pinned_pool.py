"""The pinned pool and its sub-allocator, on any machine: a fake host allocator and fake
events stand in for CUDA, so every rule about handing out and taking back blocks is tested
where CI runs."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_redis.tiers.arena import Arena
from ec_redis.tiers.pinned import HostAllocator, PinnedBlock, PinnedPool, slab_plan

KiB, MiB = 1 << 10, 1 << 20
GRANULE = 64 * KiB


class Allocator(HostAllocator):
    """Plain host tensors instead of pinned ones; records sizes; can be told to fail."""

    def __init__(self, fail: bool = False) -> None:
        self.pinned: list[int] = []
        self.fail = fail
        self.released = 0

    def pin(self, nbytes: int) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("CUDA error: out of memory (injected)")
        self.pinned.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    def release_cached(self) -> None:
        self.released += 1


class Event:
    """A CUDA event that completes when the test says so (or when waited on)."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def pool(capacity: int = 4 * MiB, **kwargs: object) -> tuple[PinnedPool, Allocator]:
    allocator = Allocator(**kwargs)  # type: ignore[arg-type]
    return PinnedPool(capacity, slab_bytes=1 * MiB, allocator=allocator), allocator


def span(block: PinnedBlock) -> tuple[int, int, int]:
    return block.slab, block.offset, block.offset + block.nbytes


# -- the arena ------------------------------------------------------------------------------


def test_arena_first_fit_splits_and_merges_both_neighbours() -> None:
    arena = Arena(100)
    a, b, c = arena.allocate(10), arena.allocate(20), arena.allocate(30)
    assert (a, b, c) == (0, 10, 30)
    arena.free(0, 10)
    arena.free(30, 30)
    assert arena.free_ranges() == [(0, 10), (30, 70)]
    assert arena.allocate(15) == 30  # first fit: the hole at 0 is too small
    arena.free(30, 15)
    arena.free(10, 20)  # joins the free range on its left and on its right
    assert arena.free_ranges() == [(0, 100)] and arena.free_bytes == 100


@pytest.mark.parametrize(("offset", "size"), [(0, 10), (5, 10), (95, 10), (-1, 2), (3, 0)])
def test_arena_refuses_double_frees_and_ranges_outside_it(offset: int, size: int) -> None:
    arena = Arena(100)
    assert arena.allocate(50) == 0
    arena.free(0, 10)
    with pytest.raises(ValueError):
        arena.free(offset, size)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=80))
def test_arena_never_hands_out_overlapping_or_outside_ranges(ops: list[tuple[bool, int]]) -> None:
    arena = Arena(256)
    live: list[tuple[int, int]] = []
    for allocate, size in ops:
        if allocate or not live:
            offset = arena.allocate(size)
            if offset is None:
                assert arena.largest_free() < size  # refused only when nothing fits
                continue
            assert offset >= 0 and offset + size <= 256
            assert all(offset + size <= o or o + s <= offset for o, s in live)
            live.append((offset, size))
        else:
            arena.free(*live.pop(size % len(live)))
        assert arena.free_bytes == 256 - sum(s for _, s in live)
    for offset, size in live:
        arena.free(offset, size)
    assert arena.free_ranges() == [(0, 256)]  # everything merged back


# -- the pool ---------------------------------------------------------------------------------


def test_slabs_are_powers_of_two_and_never_exceed_the_capacity() -> None:
    for capacity in (0, 1, MiB - 1, MiB, 3 * MiB + 5, 2 << 30, (1 << 30) + 300 * MiB):
        plan = slab_plan(capacity, 256 * MiB)
        assert sum(plan) <= capacity and capacity - sum(plan) < MiB
        assert all(size & (size - 1) == 0 for size in plan) and plan == sorted(plan, reverse=True)


def test_nothing_is_pinned_until_a_block_is_asked_for_and_then_one_slab_at_a_time() -> None:
    p, allocator = pool(3 * MiB)
    assert allocator.pinned == [] and p.stats()["pinned_bytes"] == 0
    first = p.acquire(100 * KiB)
    assert first is not None and allocator.pinned == [MiB]
    assert first.nbytes == 2 * GRANULE  # rounded up to the granule: what budgets count
    big = p.acquire(MiB)  # does not fit beside `first`: a second slab
    assert big is not None and allocator.pinned == [MiB, MiB]
    assert p.pinned_bytes == 2 * MiB <= p.capacity_bytes


def test_live_blocks_never_overlap_and_pinned_bytes_never_exceed_capacity() -> None:
    p, allocator = pool(3 * MiB)
    live: list[PinnedBlock] = []
    sizes = [300 * KiB, 64 * KiB, 1, 700 * KiB, 200 * KiB, 512 * KiB, 1 * MiB, 900 * KiB]
    for round_ in range(4):
        for size in sizes:
            block = p.acquire(size)
            if block is not None:
                assert block.nbytes >= size and block.nbytes % GRANULE == 0
                live.append(block)
        spans = sorted(span(b) for b in live)
        for (s1, _, end), (s2, start, _) in itertools.pairwise(spans):
            assert s1 != s2 or end <= start  # no byte handed out twice
        assert p.pinned_bytes <= p.capacity_bytes and sum(allocator.pinned) == p.pinned_bytes
        assert p.in_use_bytes == sum(b.nbytes for b in live)
        for block in live[round_ % 2 :: 2]:
            p.release(block)
        live = [b for b in live if b.state == "live"]


def test_released_blocks_coalesce_into_one_range_again() -> None:
    p, _ = pool(MiB)
    blocks = [p.acquire(GRANULE) for _ in range(16)]  # the whole 1 MiB slab
    assert all(b is not None for b in blocks) and p.acquire(GRANULE) is None
    for block in blocks[::2] + blocks[1::2]:  # holes first, then what joins them
        assert block is not None
        p.release(block)
    whole = p.acquire(MiB)
    assert whole is not None and whole.offset == 0
    assert p.stats()["pinned_pageable_fallbacks"] == 1  # the one refused while full


def test_a_block_is_reused_only_after_the_event_of_its_last_copy() -> None:
    p, _ = pool(MiB)
    block = p.acquire(MiB // 2)
    assert block is not None
    copy = Event()
    p.add_event(block, copy)
    p.release(block)
    other = p.acquire(MiB // 2)  # the copy may still run: the other half, not this one
    assert other is not None and other.offset != block.offset
    assert copy.waited == 0
    copy.done = True
    again = p.acquire(MiB // 2)
    assert again is not None and again.offset == block.offset and copy.waited == 0


def test_a_full_pool_waits_for_a_retired_blocks_copy_rather_than_hand_it_out_early() -> None:
    p, _ = pool(MiB)
    block = p.acquire(MiB)
    assert block is not None
    copies = [Event(), Event()]
    for event in copies:
        p.add_event(block, event)
    p.release(block)
    again = p.acquire(MiB)
    assert again is not None and again.offset == 0
    assert all(event.waited == 1 for event in copies)  # waited on, before reuse
    assert p.stats()["pinned_event_waits"] == 2


def test_completed_events_are_forgotten_so_a_hot_block_holds_few() -> None:
    p, _ = pool(MiB)
    block = p.acquire(GRANULE)
    assert block is not None
    for _ in range(100):
        p.add_event(block, Event(done=True))
    assert len(block.events) == 1


def test_a_failed_pin_falls_back_to_pageable_and_leaves_the_counters_true() -> None:
    p, _ = pool(4 * MiB, fail=True)
    assert p.acquire(GRANULE) is None and p.acquire(GRANULE) is None
    stats = p.stats()
    assert stats["pinned_bytes"] == 0 and stats["pinned_in_use_bytes"] == 0
    assert stats["pinned_pin_failures"] == 1  # not retried on every copy
    assert stats["pinned_pageable_fallbacks"] == 2


def test_items_larger_than_a_slab_use_pageable_memory() -> None:
    p, allocator = pool(4 * MiB)
    assert p.acquire(MiB + 1) is None and allocator.pinned == []


def test_a_quarantined_block_is_never_handed_out_again() -> None:
    p, _ = pool(MiB)
    block = p.acquire(MiB)
    assert block is not None
    p.quarantine(block)
    p.release(block)  # e.g. from its host copy's finalizer: ignored
    assert p.acquire(GRANULE) is None
    assert p.stats()["pinned_quarantined_bytes"] == MiB and p.in_use_bytes == MiB


def test_a_double_release_never_hands_the_block_out_twice() -> None:
    p, _ = pool(MiB)
    block = p.acquire(MiB)
    assert block is not None
    p.release(block)
    p.release(block)
    first, second = p.acquire(MiB), p.acquire(MiB)
    assert first is not None and second is None


def test_a_host_copys_finalizer_returns_its_block() -> None:
    from ec_redis.tiers.transfer import HostCopy

    p, _ = pool(MiB)
    block = p.acquire(MiB)
    assert block is not None
    host = HostCopy(block.view(torch.uint8, (MiB,)), block=block, pool=p)
    assert host.pinned and host.nbytes == MiB
    del host
    gc.collect()
    assert p.acquire(MiB) is not None


def test_close_forgets_the_slabs_and_empties_torchs_host_cache_once() -> None:
    p, allocator = pool(MiB)
    block = p.acquire(GRANULE)
    assert block is not None
    p.close()
    p.close()
    assert allocator.released == 1 and p.acquire(GRANULE) is None
    p.release(block)  # after close: harmless
