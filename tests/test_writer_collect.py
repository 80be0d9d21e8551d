"""The writer's side of handed writes (``writer.py``: ``collect`` on the engine's thread,
a writer thread for what is left), with a fake dispatcher: the races, deterministic."""

from __future__ import annotations

import threading
import time
import weakref

import torch

from ec_redis.tiers.transfer import HostCopy
from ec_redis.writer import BackgroundWriter
from tests.conftest import wait_for


class Handle:
    """A dispatcher handle that holds no reference to the host copy."""


class RacingDispatcher:
    """settle() (the engine's thread) runs while a writer thread collects the same write:
    it answers only after the writer thread has finished and forgotten it."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.writer: BackgroundWriter | None = None

    def dispatch(self, key: str, host: HostCopy) -> Handle:
        return Handle()

    def finish(self, key: str, dispatched: Handle) -> bool:
        self.finished.set()
        return True

    def settle(self, key: str, dispatched: Handle) -> str:
        assert self.finished.wait(10), "the writer thread never collected the write"
        assert self.writer is not None
        wait_for(lambda: self.writer.pending(key) is None, 10, "the writer thread's _done")
        time.sleep(0.1)  # its _one has returned: its locals are gone
        return "written"


def test_engine_thread_never_frees_a_host_copy_a_writer_thread_collected_meanwhile() -> None:
    """Interleaving: collect() snapshots self._dispatched (list of _Handed, each holding the
    HostCopy); a writer thread pops the same entry at its due time (_due), finishes it,
    _done()s it and drops its locals; collect() then finds the entry gone ("a writer thread
    took it meanwhile") and returns -- and its local lists ``handed``/``settled`` held the
    last reference: the 16 MiB host copy is freed on the engine's thread, in the middle of
    its step (the very cost ``_spend`` exists to avoid)."""
    dispatcher = RacingDispatcher()
    writer = BackgroundWriter(
        lambda key, host: True, 16, 1 << 30, threads=1, dispatcher=dispatcher,
        collect_after_s=0.05,
    )  # fmt: skip
    dispatcher.writer = writer
    freed_on: list[str] = []
    try:
        host = HostCopy(torch.zeros(4 << 20))  # 16 MiB, nobody else holds it
        weakref.finalize(host, lambda: freed_on.append(threading.current_thread().name))
        assert writer.submit("img", host)
        del host
        assert writer.collect() == 0  # the writer thread took it meanwhile: it counts it
        wait_for(lambda: bool(freed_on), 10, "the host copy freed")
        assert writer.counters.get("written") == 1  # counted once
        assert freed_on != [threading.main_thread().name], (
            "the engine's thread freed the written host copy (collect's snapshot held the "
            "last reference)"
        )
    finally:
        writer.close(2.0)


class HoldingDispatcher:
    """Takes the first write handed to it and holds its outcome until ``release``; refuses
    every later one (the queue and a writer thread take those)."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.taken = 0

    def dispatch(self, key: str, host: HostCopy) -> Handle | None:
        self.taken += 1
        return Handle() if self.taken == 1 else None

    def finish(self, key: str, dispatched: Handle) -> bool:
        assert self.released.wait(10), "never released"
        return True

    def settle(self, key: str, dispatched: Handle) -> str:
        return "written" if self.released.is_set() else "waiting"


def test_flush_waits_for_an_earlier_write_of_a_key_written_again_meanwhile() -> None:
    """A write of "img" is handed over and still in flight; a newer write of "img" is queued
    and done by a writer thread first. flush and wait_written must still wait for the
    earlier one (they returned as soon as the newer one was done: a flush that says "all
    written" while a write is in flight)."""
    dispatcher = HoldingDispatcher()
    written: list[str] = []
    writer = BackgroundWriter(
        lambda key, host: written.append(key) or True, 16, 1 << 30, threads=1,
        dispatcher=dispatcher, collect_after_s=30.0,
    )  # fmt: skip
    try:
        first, second = HostCopy(torch.zeros(16)), HostCopy(torch.ones(16))
        assert writer.submit("img", first) and dispatcher.taken == 1  # handed, held
        assert writer.submit("img", second)  # refused by the dispatcher: queued
        wait_for(lambda: written == ["img"], 10, "the newer write")
        assert writer.flush(0.3) is False  # the handed one is still in flight
        assert writer.wait_written(["img"], 0.3) is False
        assert writer.pending("img") is first and writer.depth()[0] == 1
        dispatcher.released.set()
        assert writer.flush(10.0) and writer.wait_written(["img"], 1.0)
        assert writer.pending("img") is None and writer.depth()[0] == 0
    finally:
        writer.close(2.0)


class GatedDispatcher:
    """Takes every write handed to it while ``open`` (their outcomes wait until a writer
    thread's ``finish``, which is held off: ``collect_after_s`` is long); refuses otherwise."""

    def __init__(self) -> None:
        self.open = True
        self.taken: list[str] = []

    def dispatch(self, key: str, host: HostCopy) -> Handle | None:
        if not self.open:
            return None
        self.taken.append(key)
        return Handle()

    def finish(self, key: str, dispatched: Handle) -> bool:
        return True

    def settle(self, key: str, dispatched: Handle) -> str:
        return "waiting"


def gated_writer(max_items: int) -> tuple[GatedDispatcher, BackgroundWriter]:
    """A writer (1 MiB of queue, one thread) handing over to a ``GatedDispatcher``, whose
    outcomes a writer thread collects only when asked to (``flush``)."""
    dispatcher = GatedDispatcher()
    writer = BackgroundWriter(
        lambda key, host: True, max_items, 1 << 20, threads=1, dispatcher=dispatcher,
        collect_after_s=600.0,
    )  # fmt: skip
    return dispatcher, writer


def test_a_queued_empty_write_handed_at_the_step_end_is_not_counted_twice() -> None:
    """``write_queue_items`` 2: one write handed over, one empty item (0 bytes, a legal
    shape) queued while no child could take it. At the step's end the queued one is handed
    over: it leaves the queue as it is handed, so it fits, though its bytes are 0."""
    dispatcher, writer = gated_writer(max_items=2)
    try:
        with writer._cond:  # no writer thread takes the queued job meanwhile
            assert writer.submit("a", HostCopy(torch.zeros(16)))
            dispatcher.open = False
            assert writer.submit("empty", HostCopy(torch.zeros(0, 8)))  # queued
            dispatcher.open = True
            assert writer.dispatch(["empty"]) == ["empty"]
        assert dispatcher.taken == ["a", "empty"]
    finally:
        writer.close(0.5)


def test_a_host_copy_is_never_handed_over_twice() -> None:
    """The same host copy submitted again while its first write is handed over (nothing in
    the cache does so; a caller of the writer could): the second write is queued, never
    handed, so the handed writes' accounting stays exact."""
    dispatcher, writer = gated_writer(max_items=8)
    try:
        host = HostCopy(torch.zeros(16))
        with writer._cond:
            assert writer.submit("a", host)
            assert writer.submit("b", host)
            assert dispatcher.taken == ["a"]
            assert list(writer._queue) == ["b"]
        assert writer.flush(10)  # a writer thread writes "b" and collects "a"
        assert writer._handed_bytes == 0 and writer._handed_sizes == {}
        assert writer.counters.get("written") == 2
    finally:
        writer.close(0.5)
