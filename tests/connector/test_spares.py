"""Spare staging files: made ahead of time within their budget, lent to a lookup as the
buffer its Redis read lands in, staged by a rename (the very pages the read filled), removed
when nobody claims them, swept when their process dies."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ec_redis.codec import destination
from ec_redis.connector import owners
from ec_redis.connector.spares import SPARES, Spares, is_spare
from ec_redis.connector.staging import Found
from ec_redis.connector.transport import FILE_PREFIX, FileTransport, InlineTransport, read_staged
from tests.conftest import bit_exact, embedding
from tests.counters import count

pytestmark = pytest.mark.vllm  # the connector package imports vLLM
MiB = 1 << 20


def spare_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if is_spare(p.name))


def spare_sizes(directory: Path) -> list[int]:
    """Sizes of the spare files there now (the filler may remove one while we look)."""
    sizes = []
    for path in spare_files(directory):
        with contextlib.suppress(FileNotFoundError):
            sizes.append(path.stat().st_size)
    return sizes


def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Spares are made on a background thread; 10 s bounds what takes milliseconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def ready_spares(transport: FileTransport, nbytes: int) -> None:
    """Ask once for ``nbytes`` (nothing is made before that), then wait for the spares."""
    assert transport.lend(nbytes) is None  # none yet: the first ask only sizes them
    assert eventually(lambda: transport.spare_bytes() >= SPARES * nbytes)


def as_found(buffer: torch.Tensor, like: torch.Tensor) -> Found:
    """What a lookup returns when its read landed in ``buffer``: the tensor over it."""
    buffer.copy_(like.reshape(-1).view(torch.uint8))
    tensor = buffer.view(like.dtype).view(like.shape)
    return Found(tensor.dtype, tuple(tensor.shape), tensor)


def test_a_read_that_landed_in_a_spare_is_staged_by_renaming_that_file(tmp_path: Path) -> None:
    transport = FileTransport(str(tmp_path), spare_bytes=8 * MiB)
    item = embedding(1000, 1024, seed=3)  # 2,048,000 bytes: spares of 2 MiB
    nbytes = item.numel() * item.element_size()
    ready_spares(transport, nbytes)
    before = {p.stat().st_ino for p in spare_files(tmp_path)}
    buffer = transport.lend(nbytes)
    assert buffer is not None and buffer.numel() == nbytes
    staged = transport.stage(as_found(buffer, item))
    assert staged.tensor is None and staged.path is not None
    assert os.stat(staged.path).st_ino in before  # the spare itself: no copy, no new file
    assert os.path.getsize(staged.path) == nbytes  # cut from a whole MiB to the item
    assert bit_exact(read_staged(transport.load("img", staged, step=0)), item)
    assert transport.counters.snapshot()["stage_spare_hits"] == 1
    transport.discard(staged)
    transport.step_done(0)
    assert not Path(staged.path).exists()
    transport.close()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(FILE_PREFIX)] == []


def test_an_item_read_elsewhere_is_copied_into_a_spare(tmp_path: Path) -> None:
    transport = FileTransport(str(tmp_path), spare_bytes=8 * MiB)
    item = embedding(1000, 1024, seed=4)
    ready_spares(transport, item.numel() * item.element_size())
    staged = transport.stage(Found(item.dtype, tuple(item.shape), item))
    assert staged.path is not None
    assert bit_exact(read_staged(transport.load("img", staged, step=0)), item)
    assert transport.counters.snapshot()["stage_spare_hits"] == 1
    transport.close()


def test_a_lent_spare_nobody_claims_is_removed_with_its_last_view(tmp_path: Path) -> None:
    transport = FileTransport(str(tmp_path), spare_bytes=8 * MiB)
    ready_spares(transport, 2 * MiB)
    made = set(spare_files(tmp_path))
    buffer = transport.lend(2 * MiB)
    assert buffer is not None
    view = buffer[MiB:]  # a view keeps the mapping (and the file) alive
    del buffer
    gc.collect()
    assert made <= set(spare_files(tmp_path))
    del view  # the read failed: its file goes, and a new spare replaces it
    gc.collect()
    assert len(made & set(spare_files(tmp_path))) == SPARES - 1
    assert eventually(lambda: len(spare_files(tmp_path)) == SPARES)
    # A tensor that merely sits at some address is never mistaken for a lent one.
    stranger = embedding(16, 128)
    assert not transport.spares.claim(stranger, str(tmp_path / "x"))
    transport.close()
    assert spare_files(tmp_path) == []


@pytest.mark.parametrize(
    ("sizes", "targets"),
    [
        ([3 * MiB, 5 * MiB, 1 * MiB], [3 * MiB, 5 * MiB, 5 * MiB]),
        ([20 * MiB, 2 * MiB], [0, 2 * MiB]),  # two 20 MiB spares do not fit 12 MiB
    ],
)
def test_spares_stay_within_their_budget(
    tmp_path: Path, sizes: list[int], targets: list[int]
) -> None:
    """Spares take the size of the largest recent item of which two fit the budget; smaller
    ones make room; the pool never holds more than the budget."""
    budget = 12 * MiB
    spares = Spares(tmp_path, budget, "stem")

    def sized(target: int) -> bool:
        return sum(size >= target for size in spare_sizes(tmp_path)) >= SPARES

    try:
        for nbytes, target in zip(sizes, targets, strict=True):
            taken = spares.lend(nbytes)
            del taken
            gc.collect()
            if target:
                assert eventually(lambda t=target: sized(t))  # type: ignore[misc]
            else:
                time.sleep(0.2)  # what the filler would make, it makes in milliseconds
                assert spare_files(tmp_path) == []
            assert spares.spare_bytes() <= budget
            assert sum(spare_sizes(tmp_path)) <= budget
    finally:
        spares.close()
    assert spare_files(tmp_path) == []


def test_no_budget_or_no_room_means_no_spares(tmp_path: Path) -> None:
    off = Spares(tmp_path, 0, "off")
    full = Spares(tmp_path, 64 * MiB, "full", lambda _: False)
    for spares in (off, full):
        assert spares.lend(MiB) is None
    time.sleep(0.2)  # what a filler would make in this time, it would make in 1 ms
    assert spare_files(tmp_path) == [] and off.spare_bytes() == full.spare_bytes() == 0
    off.close()
    full.close()


def test_a_killed_owners_spares_are_swept_at_the_next_start(tmp_path: Path) -> None:
    code = (
        "import sys, time; from ec_redis.connector.transport import FileTransport\n"
        "t = FileTransport(sys.argv[1], spare_bytes=8 << 20); t.lend(1 << 20)\n"
        "while t.spare_bytes() < (2 << 20): time.sleep(0.01)\n"
        "print('ready', flush=True); time.sleep(120)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        assert len(spare_files(tmp_path)) == SPARES
        FileTransport(str(tmp_path)).close()  # its owner lives: its spares stay
        assert len(spare_files(tmp_path)) == SPARES
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    FileTransport(str(tmp_path)).close()
    assert spare_files(tmp_path) == [] and not list(tmp_path.glob(f"*{owners.LOCK_SUFFIX}"))


def test_a_corrupt_read_into_a_lent_buffer_is_a_miss_and_keeps_nothing(tmp_path: Path) -> None:
    """The codec checks a lent destination exactly as a fresh one."""
    from ec_redis.codec import decode_parts, encode_parts

    item = embedding(600, 1024, seed=5)
    parts = encode_parts(item, part_bytes=256 * 1024)
    assert len(parts) > 2
    lent: list[torch.Tensor] = []

    def lender(nbytes: int) -> torch.Tensor:
        lent.append(torch.empty(nbytes, dtype=torch.uint8))
        return lent[-1]

    with destination.lending(lender):
        good = decode_parts(parts)
        assert destination.is_lent(good) and good.data_ptr() == lent[-1].data_ptr()
        assert bit_exact(good, item)
        broken = [*parts[:-1], bytes(len(parts[-1]))]
        with pytest.raises(Exception, match="checksum"):
            decode_parts(broken)
    assert not destination.is_lent(good)  # outside the lookup it is just a tensor
    assert destination.buffer(16).data_ptr() not in {t.data_ptr() for t in lent}


@pytest.mark.redis
def test_a_scheduler_fetch_lands_in_a_spare_and_no_tier_keeps_it(
    redis_url: str, tmp_path: Path
) -> None:
    """Through a real Redis: a chunked raw entry's read lands in a spare file, which is then
    the staged file; the cache's CPU tier keeps no tmpfs-backed tensor."""
    from ec_redis.cache import TieredCache
    from ec_redis.config import CacheConfig

    item = embedding(2304, 1024, seed=6)  # 4.5 MiB: chunked
    nbytes = item.numel() * item.element_size()
    config = CacheConfig(redis_url=redis_url, namespace="spares", embed_width=1024)
    transport = FileTransport(str(tmp_path), spare_bytes=16 * MiB)
    with TieredCache(config) as writer:
        assert writer.redis is not None and writer.redis.put("img", item)
    with TieredCache(config) as cache:
        ready_spares(transport, nbytes)
        spares = {p.stat().st_ino for p in spare_files(tmp_path)}
        with destination.lending(transport.lend):
            got = cache.get_many(["img"], on_host=True)["img"]
            assert got is not None and destination.is_lent(got)
        assert not cache.cpu.contains("img")
        staged = transport.stage(Found(got.dtype, tuple(got.shape), got))
        assert staged.path is not None and os.stat(staged.path).st_ino in spares
        assert bit_exact(read_staged(transport.load("img", staged, step=0)), item)
    transport.close()


def test_a_lender_that_fails_or_lends_the_wrong_size_costs_only_the_spare() -> None:
    from ec_redis.codec import decode_parts, encode_parts

    item = embedding(600, 1024, seed=7)
    parts = encode_parts(item, part_bytes=256 * 1024)

    def broken(nbytes: int) -> torch.Tensor:
        raise OSError("the tmpfs went away")

    def short(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes - 1, dtype=torch.uint8)

    for lender in (broken, short):
        with destination.lending(lender):
            got = decode_parts(parts)
            assert bit_exact(got, item) and not destination.is_lent(got)


def test_inline_staging_lends_private_memory_and_replaces_it_once_used() -> None:
    """Workers in this process: spares are memory faulted in ahead of time, no files; a
    lent one goes with its last tensor and a new one takes its place."""
    transport = InlineTransport(spare_bytes=8 * MiB)
    item = embedding(1000, 1024, seed=8)
    nbytes = item.numel() * item.element_size()
    assert transport.lend(nbytes) is None  # the first ask sizes them
    assert eventually(lambda: transport.spare_bytes() == SPARES * 2 * MiB)
    buffer = transport.lend(nbytes)
    assert buffer is not None and transport.spare_bytes() == 2 * MiB
    found = as_found(buffer, item)
    assert transport.stage(found) is found  # handed over as it is
    assert bit_exact(transport.load("img", found, step=0).tensor, item)  # type: ignore[arg-type]
    assert not transport.spares.claim(buffer, "/nonexistent/x")  # nothing to rename
    transport.discard(found)  # its staging entry died
    transport.step_done(0)  # and its load is done: the transport lets go of it
    assert transport.live_buffers() == 0
    del buffer, found
    gc.collect()
    assert eventually(lambda: transport.spare_bytes() == SPARES * 2 * MiB)
    transport.close()
    assert transport.spare_bytes() == 0 and transport.lend(nbytes) is None


def resident(address: int, length: int) -> int:
    """Resident bytes of this process's memory in ``[address, address + length)``
    (``mincore(2)``; ``address`` page-aligned)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    rc = libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec)
    assert rc == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


def test_a_small_item_gets_no_large_spare_and_a_lent_one_keeps_only_its_own_pages() -> None:
    spares = Spares(None, 64 * MiB)
    assert spares.lend(16 * MiB) is None  # sizes the spares: 16 MiB
    assert eventually(lambda: spares.spare_bytes() == SPARES * 16 * MiB)
    assert spares.lend(1 * MiB) is None  # a 16 MiB spare for 1 MiB would idle 15 of them
    lent = spares.lend(5 * MiB)  # within a quarter (plus a MiB): lent, the rest handed back
    assert lent is not None
    assert resident(lent.data_ptr(), 5 * MiB) == 5 * MiB
    assert resident(lent.data_ptr() + 5 * MiB, 11 * MiB) == 0  # the spare's other 11 MiB
    spares.close()


def test_a_failed_rename_stages_the_item_by_writing_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = FileTransport(str(tmp_path), spare_bytes=8 * MiB)
    item = embedding(1000, 1024, seed=9)
    ready_spares(transport, item.numel() * item.element_size())
    renames: list[str] = []

    def gone(src: str, dst: str) -> None:
        renames.append(dst)
        raise OSError(2, "No such file or directory")

    monkeypatch.setattr(os, "rename", gone)
    staged = transport.stage(Found(item.dtype, tuple(item.shape), item))
    assert staged.path is not None and len(renames) == 1  # tried once, not once per spare
    assert bit_exact(read_staged(transport.load("img", staged, step=0)), item)
    assert count(transport.counters.snapshot(), "stage_spare_hits") == 0
    monkeypatch.undo()
    gc.collect()
    assert eventually(lambda: len(spare_files(tmp_path)) == SPARES)  # the failed one went
    transport.close()


def test_the_filler_survives_an_unexpected_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from ec_redis.connector import spares as module

    failures = [RuntimeError("a bug")]
    real_touch = module._touch

    def touch(mapping: Any) -> None:
        if failures:
            raise failures.pop()
        real_touch(mapping)

    monkeypatch.setattr(module, "_touch", touch)
    spares = Spares(None, 8 * MiB)
    assert spares.lend(MiB) is None
    assert eventually(lambda: spares.spare_bytes() == SPARES * MiB) and not failures
    spares.close()
