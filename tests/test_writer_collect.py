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
