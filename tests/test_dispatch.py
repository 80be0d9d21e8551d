"""Writes handed to a writer process by the engine's own thread (in ``put``, or at the end of
its step: ``cache.dispatch_writes``; ``offload/peek.py``): the child reads the item's bytes
out of this process's memory, so the step that saved it ends without waiting and no thread
here is needed for the write to land. Real redis-server processes; a child that dies, cannot
read, or a Redis that stops, costs neither a half-visible entry nor a lost write."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import torch

from ec_redis import TieredCache
from ec_redis.connector.worker import WorkerSide
from ec_redis.embedded.server import EmbeddedRedis
from ec_redis.offload import peek
from ec_redis.offload import process as process_module
from ec_redis.tiers.transfer import HostCopy
from tests.conftest import bit_exact, embedding, emptied, paused, wait_for
from tests.test_writer_process import settings as offload_settings

pytestmark = pytest.mark.redis


def settings(url: str, **more: Any) -> dict[str, Any]:
    return offload_settings(url, **{"namespace": "handed", **more})


def connected(url: str, **more: Any) -> TieredCache:
    """A cache whose writer process is up and has written once (connected to Redis)."""
    cache = TieredCache.from_config(settings(url, **more))
    assert cache.warm_writes(60), "the writer process never came up"
    assert cache.put("warm", embedding(8, 8)) and cache.flush(30)
    return cache


@pytest.fixture
def writing(redis_url: str) -> Iterator[TieredCache]:
    """A cache whose writer process is up and connected."""
    cache = connected(redis_url)
    yield cache
    cache.close()


def read_back(url: str, key: str) -> torch.Tensor | None:
    other = TieredCache.from_config(settings(url, writer_process=False))
    try:
        return other.get(key)
    finally:
        other.close()


def stat(cache: TieredCache, name: str) -> float:
    stats = cache.stats()["writer"]
    assert name in stats, f"{name} missing from {sorted(stats)}"
    return float(stats[name])


def arena_bytes(cache: TieredCache) -> int:
    sink = cache.process_sink
    assert sink is not None
    with sink._cond:
        return sum(c.arena.size for c in (*sink._idle, *sink._busy))


def test_a_handed_write_is_read_from_this_process_and_lands_whole(
    writing: TieredCache, redis_url: str
) -> None:
    """Every dtype the format carries, odd sizes and an empty tensor; the arena is never
    used (the child read the bytes where they were), and the tensor may be dropped by
    everyone else the moment it is handed over."""
    items = {
        "bf16": embedding(3000, 1024, seed=1),  # 6 MB: two chunks
        "odd": torch.arange(7 * 13, dtype=torch.int16).reshape(7, 13),
        "f32": torch.randn(5, 3, generator=torch.Generator().manual_seed(2)),
        "empty": torch.empty(0, 64, dtype=torch.bfloat16),
    }
    expected = {key: tensor.clone() for key, tensor in items.items()}
    for key, tensor in items.items():
        assert writing.put(key, tensor)
        assert writing.dispatch_writes([key, "never-saved"]) in ([key], [])  # [] once written
        assert writing.flush(30)
    del items, tensor
    gc.collect()
    assert stat(writing, "process_dispatched") == 5  # "warm", then these
    assert stat(writing, "process_fallback_writes") == 0
    assert stat(writing, "written") == 5
    assert arena_bytes(writing) == 0
    for key, tensor in expected.items():
        assert bit_exact(read_back(redis_url, key), tensor), key


def test_handing_over_never_waits_for_redis(private_redis: EmbeddedRedis) -> None:
    """Redis stopped (SIGSTOP): handing a write over returns at once and the write lands
    once Redis is back. Made on the writer thread instead, a write would block here until
    the server answers."""
    url = emptied(private_redis)
    cache = TieredCache.from_config(settings(url))
    try:
        assert cache.warm_writes(60)
        assert cache.put("warm", embedding(8, 8)) and cache.flush(30)  # connected
        item = embedding(4096, 1024, seed=3)
        with paused(private_redis):
            started = time.monotonic()
            assert cache.put("img", item)
            handed_s = time.monotonic() - started
            assert cache.dispatch_writes(["img"]) == ["img"]  # in flight through the child
            assert stat(cache, "process_dispatched") == 2  # "warm", then this one
            time.sleep(0.5)
            assert cache.writer is not None and cache.writer.pending("img") is not None
        assert handed_s < 1.0  # ~0.1 ms expected; the server stays stopped ≥ 0.5 s after
        assert cache.flush(60)
        assert bit_exact(read_back(url, "img"), item)
    finally:
        cache.close()


def test_a_child_killed_in_a_handed_write_is_replaced_and_the_write_lands_whole(
    private_redis: EmbeddedRedis,
) -> None:
    url = emptied(private_redis)
    cache = connected(url)
    try:
        sink = cache.process_sink
        assert sink is not None
        (pid,) = sink.pids()
        item = embedding(32768, 1024, seed=4)  # 64 MiB: the child blocks on the paused server
        with paused(private_redis):
            assert cache.put("big", item) and cache.dispatch_writes(["big"]) == ["big"]
            assert stat(cache, "process_dispatched") == 2
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: stat(cache, "process_deaths") == 1, 30, "the death seen")
        assert cache.flush(60)
        assert stat(cache, "process_retried_writes") == 1
        assert bit_exact(read_back(url, "big"), item)
        assert sink.pids() and sink.pids()[0] != pid
        assert cache.put("after", embedding(16, 16)) and cache.flush(30)  # engine unharmed
    finally:
        cache.close()


def test_a_child_that_cannot_read_this_process_takes_writes_through_the_arena(
    monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """Its probe reads back wrong (another uid, Yama ``ptrace_scope`` 2, a seccomp filter):
    nothing is handed over and the write takes the arena, as before."""
    real_spec = peek.Probe.spec
    monkeypatch.setattr(peek.Probe, "spec", lambda self: {**real_spec(self), "hex": "00" * 32})
    cache = TieredCache.from_config(settings(redis_url))
    try:
        assert cache.warm_writes(60)
        item = embedding(512, 256, seed=5)
        assert cache.put("img", item)
        assert cache.dispatch_writes(["img"]) == []
        assert cache.flush(30)
        assert stat(cache, "process_dispatched") == 0
        assert stat(cache, "written") == 1
        assert stat(cache, "process_fallback_writes") == 0  # the child wrote it, from its arena
        assert arena_bytes(cache) > 0
        assert bit_exact(read_back(redis_url, "img"), item)
    finally:
        cache.close()


def test_a_failed_read_falls_back_whole(
    monkeypatch: pytest.MonkeyPatch, writing: TieredCache, redis_url: str
) -> None:
    """The child's read of a handed item fails (an address this process never mapped; in
    life, another child took the Yama permission): it writes nothing and says so, the write
    is made the normal way, and that child is handed nothing more."""

    def wrong_address(self: Any, key: str, tensor: torch.Tensor) -> None:
        self.send(
            {"op": "peek", "key": key, "dtype": "bfloat16", "shape": list(tensor.shape),
             "nbytes": tensor.numel() * 2, "address": 4096},
            1.0,
        )  # fmt: skip

    item = embedding(256, 256, seed=6)
    monkeypatch.setattr(process_module.WriterProcess, "send_peek", wrong_address)
    assert writing.put("img", item)
    assert stat(writing, "process_dispatched") == 2  # "warm", then this one
    assert writing.flush(30)
    assert stat(writing, "process_peek_failures") == 1
    assert stat(writing, "process_deaths") == 0
    assert bit_exact(read_back(redis_url, "img"), item)
    assert writing.put("next", item) and writing.flush(30)
    assert stat(writing, "process_dispatched") == 2  # that child is handed nothing more
    assert bit_exact(read_back(redis_url, "next"), item)


def test_an_encoder_step_does_not_wait_for_a_handed_write(private_redis: EmbeddedRedis) -> None:
    """A pure producer's step ends once its saves are in Redis (``save_wait_s``) unless a
    writer process took them from the step itself. Redis stopped: the step that hands its
    save over ends at once; one that cannot (writer processes off) waits ``save_wait_s``."""
    url = emptied(private_redis)
    ended: dict[bool, float] = {}
    for offload in (True, False):
        cache = TieredCache.from_config(settings(url, writer_process=offload))
        try:
            worker = WorkerSide(
                cache, torch.device("cpu"), is_producer=True, saves=True, save_wait_s=2.0
            )
            assert cache.warm_writes(60)
            assert cache.put("warm", embedding(8, 8)) and cache.flush(30)
            item = embedding(2048, 1024, seed=7)
            with paused(private_redis):
                worker.save_caches({"mm-1": item}, "mm-1")
                started = time.monotonic()
                worker.worker_meta(None)
                ended[offload] = time.monotonic() - started
            assert cache.flush(60)
            assert bit_exact(read_back(url, "mm-1"), item)
            if offload:
                assert stat(cache, "process_dispatched") == 2  # "warm", then the save
            client_keys = cache.redis.client.keys("handed:*")  # type: ignore[union-attr]
            for key in client_keys:
                cache.redis.client.unlink(key)  # type: ignore[union-attr]
        finally:
            cache.close()
    assert ended[False] >= 1.9  # waited save_wait_s for the stopped server
    assert ended[True] < 0.4  # 5x under that, expected well under 10 ms


def where(writer: Any) -> str:
    """Where the writer threads are now (function names, innermost last)."""
    frames = sys._current_frames()
    out = []
    for thread in writer._threads:
        frame, names = frames.get(thread.ident), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        out.append(" > ".join(reversed(names[:6])))
    return f"threads at {out}; dispatched outstanding: {len(writer._dispatched)}"


class CopyEvent:
    """Stands in for the CUDA event of a device->host copy still running: ``query`` says not
    ready until ``done`` is set; ``synchronize`` (a writer thread's ``HostCopy.wait``) blocks
    until then and says it is waiting."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waiting = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.waiting.set()
        assert self.done.wait(30), "the test never finished the copy"


def test_a_write_handed_over_while_the_writer_thread_holds_a_queued_one_does_not_deadlock(
    redis_url: str,
) -> None:
    """A child holding a handed-over write is busy until its reply is collected, and the
    writer thread that collects it may itself be inside ``ProcessSink.__call__`` for a queued
    write, needing a child. With the default ``writer_threads: 1`` (one child) it once waited
    there forever: both writes hung, every later one queued behind them. Whoever waits for a
    child now collects a handed write's reply itself.

    Set-up: item "a" is queued because its host copy is not ready (a GPU item; here a stand-in
    event); the writer thread takes it and waits for the copy; meanwhile the step saves "b"
    (a CPU item), which ``submit`` hands to the idle child at once. Both land."""
    cache = connected(redis_url)
    try:
        writer = cache.writer
        assert writer is not None
        a, b = embedding(256, 256, seed=1), embedding(256, 256, seed=2)
        event = CopyEvent()
        assert writer.submit("a", HostCopy(a.clone(), event))  # type: ignore[arg-type]
        assert event.waiting.wait(10), "the writer thread never took the queued write"
        before = stat(cache, "process_dispatched")
        assert cache.put("b", b)
        assert stat(cache, "process_dispatched") == before + 1  # handed to the only child
        event.done.set()  # the copy of "a" ends: the writer thread now writes it
        landed = writer.wait_written(["a", "b"], 15)
        assert landed, (
            "deadlock: the writer thread waits in ProcessSink._take for the child that only "
            f"it could give back (the handed write's reply never collected): {where(writer)}"
        )
        assert bit_exact(read_back(redis_url, "a"), a)
        assert bit_exact(read_back(redis_url, "b"), b)
    finally:
        cache.close(2.0)  # closing the sink wakes the stuck _take


def test_an_encoder_step_is_not_stalled_by_a_write_handed_over_at_its_end(
    monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """The same through the worker half on a GPU (``_await_step_saves`` ->
    ``dispatch_writes``): a step saves "a" and "b", both device->host copies still running at
    ``put``. The writer thread takes "a" and waits for its copy; at the end of the step "b"'s
    copy is done and ``dispatch_writes`` hands it to the only child; then "a"'s copy ends and
    the writer thread waits in ``_take`` for that child forever. The step (``save_wait_s``
    for "a") and every later one stall for the full ``save_wait_s``, and no write landed.
    Now the step ends about when "a" lands (well under ``save_wait_s``), both land."""
    cache = TieredCache.from_config(settings(redis_url))
    try:
        worker = WorkerSide(
            cache, torch.device("cpu"), is_producer=True, saves=True, save_wait_s=10.0
        )
        assert cache.warm_writes(60)
        assert cache.put("warm", embedding(8, 8)) and cache.flush(30)
        events: dict[int, CopyEvent] = {}

        def to_host(tensor: torch.Tensor) -> HostCopy:
            event = events.setdefault(len(events), CopyEvent())
            return HostCopy(tensor.clone(), event)  # type: ignore[arg-type]

        monkeypatch.setattr(cache.transfer, "to_host", to_host)
        a, b = embedding(256, 256, seed=3), embedding(256, 256, seed=4)
        worker.save_caches({"mm-a": a}, "mm-a")
        assert events[0].waiting.wait(10), "the writer thread never took the queued write"
        worker.save_caches({"mm-b": b}, "mm-b")
        events[1].done.set()  # "b"'s copy ended before the step's end
        threading.Timer(0.3, events[0].done.set).start()  # "a"'s a little later
        started = time.monotonic()
        worker.worker_meta(None)
        step_s = time.monotonic() - started
        assert cache.writer is not None
        landed = cache.writer.wait_written(["mm-a", "mm-b"], 10)
        assert step_s < 5.0, f"the step stalled {step_s:.1f} s (save_wait_s=10)"
        assert landed, "the writes never landed (writer thread stuck in ProcessSink._take)"
        assert bit_exact(read_back(redis_url, "mm-a"), a)
        assert bit_exact(read_back(redis_url, "mm-b"), b)
    finally:
        cache.close(2.0)


def test_handing_over_wakes_no_thread_the_engines_thread_collects(
    writing: TieredCache, redis_url: str
) -> None:
    """A writer thread woken by the hand-over took the GIL in the middle of the engine's step
    (steps stalled by milliseconds on a busy machine). Now no thread here wakes for it: the
    write lands, and its outcome waits until the engine's thread collects it, never
    blocking (``collect_writes``, called at the end of every step)."""
    writer = writing.writer
    assert writer is not None
    writer._collect_after_s = 60.0  # no writer thread collects it meanwhile
    item = embedding(512, 256, seed=8)
    written = stat(writing, "written")
    assert writing.put("img", item)
    assert stat(writing, "process_dispatched") == 2  # "warm", then this one
    wait_for(lambda: bit_exact(read_back(redis_url, "img"), item), 30, "the write landing")
    time.sleep(0.3)  # a thread woken at the hand-over would have collected it by now
    assert writer.pending("img") is not None, "collected by a thread, not the engine's"
    assert stat(writing, "written") == written
    started = time.monotonic()
    assert writing.collect_writes() == 1
    assert time.monotonic() - started < 0.5  # no wait (~0.1 ms expected)
    assert writer.pending("img") is None
    assert stat(writing, "written") == written + 1  # counted once
    assert writing.collect_writes() == 0


def test_a_handed_write_nobody_collects_is_collected_by_a_writer_thread(
    writing: TieredCache,
) -> None:
    """An engine that goes idle after handing a write over never calls ``collect_writes``
    again: a writer thread collects the outcome after ``collect_after_s``, and ``flush``
    collects at once whatever the delay."""
    writer = writing.writer
    assert writer is not None
    written = stat(writing, "written")
    writer._collect_after_s = 0.2
    assert writing.put("a", embedding(64, 64, seed=9))
    wait_for(lambda: writer.pending("a") is None, 10, "a writer thread collecting it")
    assert stat(writing, "written") == written + 1
    writer._collect_after_s = 600.0
    assert writing.put("b", embedding(64, 64, seed=10))
    started = time.monotonic()
    assert writing.flush(30)
    assert time.monotonic() - started < 10  # not collect_after_s (600 s)
    assert stat(writing, "written") == written + 2


def test_the_engines_thread_never_frees_a_written_item(writing: TieredCache) -> None:
    """When the engine dropped its own reference first, the cache holds the item's last one,
    and freeing 16 MiB costs milliseconds (``munmap``, the GIL held). Collected on the
    engine's thread, the host copy is dropped by a writer thread instead."""
    writer = writing.writer
    assert writer is not None
    # A writer thread takes a handed write whose reply is not in by collect_after_s: 2 s
    # leaves a loaded host room to get the reply before, so that the engine's thread is
    # the one that collects it (the case under test).
    writer._collect_after_s = 2.0
    assert writing.put("img", embedding(4096, 2048, seed=11))  # 16 MiB, only the cache's
    host = writer.pending("img")
    assert host is not None
    freed_on: list[str] = []
    weakref.finalize(host, lambda: freed_on.append(threading.current_thread().name))
    del host
    wait_for(lambda: writer.collect() == 1, 30, "the engine's thread collecting it")
    assert freed_on == [], "freed on the engine's thread"
    wait_for(lambda: bool(freed_on), 20, "a writer thread dropping it")
    assert freed_on != [threading.main_thread().name]


def test_a_child_lost_with_a_handed_write_is_retried_off_the_engines_thread(
    private_redis: EmbeddedRedis,
) -> None:
    """The child dies with a handed write (SIGKILL, Redis stopped so it is mid-write): the
    engine's thread sees that without blocking and leaves the retry to a writer thread at
    once (not after ``collect_after_s``); the write lands whole."""
    url = emptied(private_redis)
    cache = connected(url)
    try:
        writer, sink = cache.writer, cache.process_sink
        assert writer is not None and sink is not None
        writer._collect_after_s = 600.0
        (pid,) = sink.pids()
        item = embedding(8192, 1024, seed=12)  # 16 MiB
        with paused(private_redis):
            assert cache.put("img", item)
            assert stat(cache, "process_dispatched") == 2
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            took: list[float] = []

            def step() -> int:  # an engine step's end: collect, never waiting
                started = time.monotonic()
                taken = cache.collect_writes()
                took.append(time.monotonic() - started)
                return taken

            # (The socket shows the death once every thread of the child has exited.)
            wait_for(lambda: step() == 0 and stat(cache, "process_retried_writes") == 1, 30)
            assert max(took) < 0.5  # never blocked (~0.1 ms expected; a retry waits for
            # a child's start, 1-3 s, and then for the stopped server)
            assert writer.pending("img") is not None  # the retry waits for the server
        wait_for(lambda: writer.pending("img") is None, 30, "the retry landing")
        assert stat(cache, "written") == 2  # "warm", then this one: counted once
        assert bit_exact(read_back(url, "img"), item)
    finally:
        cache.close()


def in_function(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is in ``function`` (near the top of its stack: waiting for a lock
    there, or in a Condition.wait called from it)."""
    frame = sys._current_frames().get(thread.ident or -1)
    return frame is not None and any(f.f_code.co_name == function for f in _stack(frame)[:4])


def _stack(frame: Any) -> list[Any]:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def test_a_writer_thread_that_looks_for_a_child_while_it_is_being_handed_a_write_is_not_stranded(
    monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """A writer thread (writer_threads: 1, one child) whose queued write's copy ends while
    the engine's thread is handing another write over looks for a child in ``_take``. It
    once slept there with nobody to wake it: ``dispatch`` took the idle child, sent the
    request, and only then registered it in ``_handed`` -- without notifying ``_cond``. Now
    the request is sent and registered under ``_cond`` (the send never blocks), with a
    notify, so the writer thread either finds the handed write to collect or is woken.

    Expected: both writes land while the engine's thread only waits."""
    cache = connected(redis_url)
    try:
        writer = cache.writer
        assert writer is not None
        (thread,) = writer._threads
        a, b = embedding(256, 256, seed=1), embedding(256, 256, seed=2)
        event = CopyEvent()
        assert writer.submit("a", HostCopy(a.clone(), event))  # type: ignore[arg-type]
        assert event.waiting.wait(10), "the writer thread never took the queued write"
        real = process_module.WriterProcess.send_peek

        def send_peek(self: Any, key: str, tensor: torch.Tensor) -> None:
            # The engine's thread holds the child (busy, not yet in _handed); the copy of
            # "a" ends now and the writer thread looks for a child.
            event.done.set()
            wait_for(lambda: in_function(thread, "_take"), 5, "the writer thread in _take")
            real(self, key, tensor)

        monkeypatch.setattr(process_module.WriterProcess, "send_peek", send_peek)
        assert cache.put("b", b)
        assert stat(cache, "process_dispatched") == 2  # "warm", then "b"
        monkeypatch.undo()
        landed = writer.wait_written(["a", "b"], 8)  # the engine's thread only waits
        assert landed, f"stranded: {where(writer)}"
        assert bit_exact(read_back(redis_url, "a"), a)
        assert bit_exact(read_back(redis_url, "b"), b)
    finally:
        cache.close(2.0)  # closing the sink wakes the stranded _take


def test_collect_never_kills_or_reaps_a_child_on_the_engines_thread(redis_url: str) -> None:
    """A handed write's child answers out of turn (a protocol break; here: the parent's
    request counter bumped so the real reply's id mismatches). ``collect`` on the engine's
    thread sees data on the socket (``answered``), collects it via ``_collect`` -> ``_ask``
    -> ChildGone -> ``_release`` -> ``child.stop`` -> ``kill``: SIGKILL then
    ``proc.wait(10.0)`` -- the engine's step blocks until the live child is dead and reaped
    (ms for a process with torch imported; up to 10 s for one in D state), then the
    arena is unmapped and a warning logged, all on the engine's thread. The same path runs
    for a child seen at end of stream. ``settle`` is documented as never blocking.

    Expected: the engine's thread leaves a broken/lost child to a writer thread. Current
    code: ``WriterProcess.kill`` runs on the main thread inside ``collect_writes``."""
    cache = connected(redis_url)
    killed_on: list[str] = []
    real_kill = process_module.WriterProcess.kill

    def kill(self: Any) -> None:
        killed_on.append(threading.current_thread().name)
        real_kill(self)

    try:
        writer = cache.writer
        assert writer is not None
        writer._collect_after_s = 600.0  # no writer thread collects it meanwhile
        item = embedding(512, 256, seed=3)
        assert cache.put("img", item)
        assert stat(cache, "process_dispatched") == 2
        (entry,) = list(writer._dispatched)
        child = entry.dispatched.child
        child._out[0] += 1  # the reply on its way is now out of turn
        wait_for(child.answered, 30, "the child's reply")
        process_module.WriterProcess.kill = kill  # type: ignore[method-assign]
        started = time.monotonic()
        cache.collect_writes()
        took_s = time.monotonic() - started
        assert threading.main_thread().name not in killed_on, (
            f"the engine's thread killed and reaped the child in collect ({took_s * 1e3:.1f} ms)"
        )
    finally:
        process_module.WriterProcess.kill = real_kill  # type: ignore[method-assign]
        cache.close(5.0)


@pytest.mark.parametrize("collect_after_s", [0.0, 0.002, 0.02])
def test_every_handed_write_is_counted_once_and_lands(
    redis_url: str, collect_after_s: float
) -> None:
    cache = TieredCache.from_config(settings(redis_url, writer_threads=2, write_queue_items=1000))
    try:
        assert cache.warm_writes(60)
        writer = cache.writer
        assert writer is not None
        assert cache.put("warm", embedding(8, 8)) and cache.flush(30)
        writer._collect_after_s = collect_after_s
        items = {f"k{i}": embedding(128, 512, seed=i) for i in range(80)}
        for n, (key, item) in enumerate(items.items()):
            assert cache.put(key, item)
            if n % 3 == 0:
                cache.dispatch_writes([key])
            cache.collect_writes()
        assert cache.flush(60)
        assert writer._dispatched == type(writer._dispatched)()
        written, failed = writer.counters.get("written"), writer.counters.get("failed")
        assert writer.counters.get("dropped") == 0
        assert written + failed == 81, (written, failed)
        assert failed == 0
        assert writer.depth() == (0, 0)
        for key, item in items.items():
            assert bit_exact(read_back(redis_url, key), item), key
    finally:
        cache.close()


@contextmanager
def child_stopped(cache: TieredCache) -> Iterator[int]:
    """The cache's one writer process stopped (SIGSTOP) for the block; SIGCONT always
    follows. Yields its pid."""
    sink = cache.process_sink
    assert sink is not None
    (pid,) = sink.pids()
    with child_stopped_pid(pid):
        yield pid


@contextmanager
def child_stopped_pid(pid: int) -> Iterator[int]:
    """Writer process ``pid`` stopped (SIGSTOP) for the block; SIGCONT always follows."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        with suppress(ProcessLookupError):  # killed and reaped meanwhile
            os.kill(pid, signal.SIGCONT)


def put_all(cache: TieredCache, items: dict[str, torch.Tensor]) -> float:
    """Save ``items`` (each accepted); the seconds it took."""
    started = time.monotonic()
    for key, item in items.items():
        assert cache.put(key, item)
    return time.monotonic() - started


def test_a_step_that_saved_several_items_hands_them_all_to_the_one_child(
    writing: TieredCache, redis_url: str
) -> None:
    """One child, busy with the first item of a step (here: stopped, so it stays busy):
    the step's other items join its pipe instead of waiting for the arena on a writer
    thread (where a producer's step then waited for them: ``save_wait_s``), and handing
    them over returns at once. Each lands whole, counted once."""
    items = {f"img{i}": embedding(1024, 256, seed=10 + i) for i in range(6)}
    with child_stopped(writing):
        handed_s = put_all(writing, items)
        assert stat(writing, "process_dispatched") == 1 + len(items)  # "warm", then these
        assert writing.writer is not None
        assert writing.writer.depth() == (len(items), 0)  # all in flight, none queued
    assert handed_s < 2.0  # ~1 ms expected; a send that waited for the child never returns
    assert writing.flush(30)
    assert stat(writing, "written") == 1 + len(items)
    assert stat(writing, "process_fallback_writes") == 0
    assert stat(writing, "process_deaths") == 0
    assert arena_bytes(writing) == 0  # every item read where it was
    for key, item in items.items():
        assert bit_exact(read_back(redis_url, key), item), key


def test_a_child_lost_with_several_handed_writes_is_counted_once_and_each_write_lands(
    private_redis: EmbeddedRedis,
) -> None:
    """The child dies (SIGKILL) with five handed writes out, none answered: it is reaped
    and counted once, and each of the five gets its one retry and lands whole."""
    url = emptied(private_redis)
    cache = connected(url)
    try:
        items = {f"img{i}": embedding(512, 256, seed=20 + i) for i in range(5)}
        with child_stopped(cache) as pid:
            for key, item in items.items():
                assert cache.put(key, item)
            assert stat(cache, "process_dispatched") == 1 + len(items)
            os.kill(pid, signal.SIGKILL)
        assert cache.flush(60)
        assert stat(cache, "process_deaths") == 1
        assert stat(cache, "process_retried_writes") == len(items)
        assert stat(cache, "written") == 1 + len(items)
        for key, item in items.items():
            assert bit_exact(read_back(url, key), item), key
        sink = cache.process_sink
        assert sink is not None and sink.pids() and sink.pids()[0] != pid
        assert cache.put("after", embedding(16, 16)) and cache.flush(30)  # engine unharmed
    finally:
        cache.close()


def test_handing_over_never_waits_for_room_in_the_childs_socket(redis_url: str) -> None:
    """A stopped child reads no request: once its socket is full (long item ids, ~60 KB a
    request, fill it in a few), a hand-over returns at once without handing anything and
    the write is queued for a writer thread; every write lands once the child runs again."""
    cache = connected(redis_url)
    try:
        long = "x" * 60_000
        items = {f"{long}{i}": embedding(64, 64, seed=30 + i) for i in range(12)}
        with child_stopped(cache):
            handed_s = put_all(cache, items)
            handed = stat(cache, "process_dispatched") - 1
        assert handed_s < 2.0  # ~10 ms expected; a send that waited for room never returns
        assert 1 < handed < len(items), handed  # some joined the pipe, then the socket filled
        assert cache.flush(60)
        assert stat(cache, "written") == 1 + len(items)
        assert stat(cache, "process_deaths") == 0
        for key, item in items.items():
            assert bit_exact(read_back(redis_url, key), item), key[-8:]
    finally:
        cache.close()


def test_handed_writes_count_towards_the_queues_bytes(redis_url: str) -> None:
    """Handed writes keep their host copies until answered, and those count towards
    ``write_queue_bytes`` with the queued ones (what the pinned pool is sized for): with the
    child stopped, no more than the budget is handed over, and the queue holds what is left
    of it (the write being queued may pass it, as an empty queue's always could)."""
    item_bytes = 256 * 256 * 2
    budget = 3 * item_bytes + 100
    cache = connected(redis_url, write_queue_bytes=budget)
    try:
        writer = cache.writer
        assert writer is not None
        items = {f"img{i}": embedding(256, 256, seed=40 + i) for i in range(6)}
        with child_stopped(cache):
            for key, item in items.items():
                assert cache.put(key, item)
                held = writer._handed_bytes + writer._queued_bytes
                assert held <= budget + item_bytes, (key, held)
            assert stat(cache, "process_dispatched") == 1 + 3
            dropped = writer.counters.get("dropped")
            assert dropped == 2  # the oldest queued ones made room, as in a full queue
        assert cache.flush(60)
        assert writer._handed_bytes == 0 and writer._handed_sizes == {}
        assert stat(cache, "written") == 1 + len(items) - dropped
        for key in ("img0", "img1", "img2", "img5"):  # handed, handed, handed, the newest
            assert bit_exact(read_back(redis_url, key), items[key]), key
    finally:
        cache.close()


def test_a_step_end_hands_over_a_queued_write_that_fills_the_budget_exactly(
    redis_url: str,
) -> None:
    """A write queued while no child could take it is handed over at the step's end: its
    own bytes, already counted in the queue, are not counted twice against the budget."""
    item_bytes = 256 * 256 * 2
    cache = connected(redis_url, write_queue_bytes=item_bytes)
    try:
        writer = cache.writer
        assert writer is not None
        item = embedding(256, 256, seed=50)
        with writer._cond:  # no writer thread takes the job meanwhile
            real, writer._dispatcher = writer._dispatcher, None
            try:
                assert writer.submit("img", HostCopy(item, None))  # queued, not handed
            finally:
                writer._dispatcher = real
            assert writer.dispatch(["img"]) == ["img"]
        assert cache.flush(30)
        assert bit_exact(read_back(redis_url, "img"), item)
    finally:
        cache.close()


@pytest.mark.parametrize("omp_bound", [True, False], ids=["openmp-bound", "operator-pinned"])
def test_a_writer_process_runs_beyond_the_cores_openmp_bound_the_workers_thread_to(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, omp_bound: bool
) -> None:
    """vLLM's CPU backend binds a worker's main thread to its compute cores through
    OpenMP's binding variables; a child that inherited that ran only when the worker's busy
    loop let it. With such a binding in the environment the child runs on the CPUs of the
    process that started this one too (the engine, as the operator placed it), and gets no
    OpenMP binding of its own. Without one, a narrower set is the operator's (``taskset``
    on this process alone) and the child keeps it."""
    engine_cpus = os.sched_getaffinity(os.getppid())
    if len(engine_cpus) < 2:
        pytest.skip(f"this process's parent may run on one CPU only ({engine_cpus})")
    bound = {min(engine_cpus)}
    for name in process_module.OMP_BINDING:
        monkeypatch.delenv(name, raising=False)
    if omp_bound:
        monkeypatch.setenv("GOMP_CPU_AFFINITY", str(min(bound)))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, bound)  # this thread only, as OpenMP binds a worker's
    try:
        cache = TieredCache.from_config(settings(redis_url))
        try:
            assert cache.warm_writes(60), "the writer process never came up"
            sink = cache.process_sink
            assert sink is not None
            (pid,) = sink.pids()
            want = engine_cpus | bound if omp_bound else bound
            assert os.sched_getaffinity(pid) == want
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"OMP_NUM_THREADS=1" in environ
            assert not [v for v in environ if v.startswith(b"GOMP_CPU_AFFINITY=")]
        finally:
            cache.close()
    finally:
        os.sched_setaffinity(0, before)


def test_a_write_goes_to_an_idle_child_before_joining_a_busy_ones_pipe(redis_url: str) -> None:
    """Two children (``writer_threads`` 2), the first stopped with a handed write: the next
    write is handed to the idle one and lands while the first is still stopped, not queued
    behind a child that may be hung."""
    cache = connected(redis_url, writer_threads=2)
    try:
        sink = cache.process_sink
        assert sink is not None
        with sink._cond:
            sink._start_async()  # the second child, as a busy pool would start it
        wait_for(lambda: len(sink.pids()) == 2, 60, "the second child up")
        first = embedding(64, 64, seed=60)
        with child_stopped_pid(sink.pids()[-1]):
            assert cache.put("first", first)  # handed to the last child given back
            assert stat(cache, "process_dispatched") == 2
            item = embedding(64, 64, seed=61)
            assert cache.put("second", item)
            assert stat(cache, "process_dispatched") == 3
            wait_for(lambda: read_back(redis_url, "second") is not None, 30, "second landed")
        assert cache.flush(30)
        assert bit_exact(read_back(redis_url, "first"), first)
        assert bit_exact(read_back(redis_url, "second"), item)
    finally:
        cache.close()


def test_an_error_here_while_joining_a_pipe_is_raised_and_the_pipes_writes_still_land(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in this process while a write joins a pipe (not the child's doing): the pipe
    is given up (its request may have gone out unnoted), the error is reported, not
    swallowed, the write is queued instead, and the pipe's write is retried."""
    cache = connected(redis_url)
    try:
        first, second = embedding(64, 64, seed=70), embedding(64, 64, seed=71)
        with child_stopped(cache):
            assert cache.put("first", first)
            assert stat(cache, "process_dispatched") == 2

            def broken(self: Any, key: str, tensor: torch.Tensor) -> None:
                raise RuntimeError("a bug here")

            monkeypatch.setattr(process_module.WriterProcess, "send_peek", broken)
            with caplog.at_level("WARNING", logger="ec_redis"):
                assert cache.put("second", second)
            monkeypatch.undo()
        assert "a bug here" in caplog.text
        assert cache.flush(60)
        assert stat(cache, "process_retried_writes") == 1
        assert bit_exact(read_back(redis_url, "first"), first)
        assert bit_exact(read_back(redis_url, "second"), second)
    finally:
        cache.close()
