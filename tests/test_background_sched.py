"""Our background threads and writer processes run under SCHED_BATCH, the engine's threads
never do, and what an engine's thread waits for runs under SCHED_OTHER (``sched.py``)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from ec_redis import sched
from ec_redis.connector import channel
from ec_redis.tiers.transfer import HostCopy
from ec_redis.writer import BackgroundWriter
from tests.conftest import wait_for

if not hasattr(os, "SCHED_BATCH"):
    pytest.skip("SCHED_BATCH is Linux's", allow_module_level=True)

T = TypeVar("T")


def in_thread(call: Callable[[], T]) -> T:
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    thread.join(10)
    assert out, "the thread did not finish"
    return out[0]


def policy(native_id: int | None) -> int:
    assert native_id is not None, "the thread has not started"
    return os.sched_getscheduler(native_id)


@pytest.fixture
def engine_policy() -> int:
    """This (the engine's) thread's policy, which must not change; skips where a thread under
    it would not be moved (the runner already under another policy, or a refusing kernel)."""
    mine = os.sched_getscheduler(0)
    if mine != os.SCHED_OTHER:
        pytest.skip(f"the test runs under policy {mine}: our threads keep an operator's policy")
    if not in_thread(sched.as_background):
        pytest.skip("sched_setscheduler(SCHED_BATCH) is refused here")
    return mine


def test_only_the_thread_that_asks_is_moved(engine_policy: int) -> None:
    assert in_thread(lambda: (sched.as_background(), os.sched_getscheduler(0))) == (
        True,
        os.SCHED_BATCH,
    )
    assert os.sched_getscheduler(0) == engine_policy


@pytest.mark.parametrize("chosen", ["SCHED_IDLE", "SCHED_FIFO", "SCHED_RR"])
def test_a_policy_an_operator_chose_is_left_alone(chosen: str) -> None:
    """An engine started under ``chrt``: our threads inherit its policy and keep it (batch
    would drop a real-time thread below every real-time one, or lift an idle one)."""
    wanted = getattr(os, chosen)

    def run() -> tuple[bool, int] | None:
        try:
            os.sched_setscheduler(0, wanted, os.sched_param(0 if chosen == "SCHED_IDLE" else 1))
        except PermissionError:
            return None
        return sched.as_background(), os.sched_getscheduler(0)

    got = in_thread(run)
    if got is None:
        pytest.skip(f"{chosen} cannot be set here")
    assert got == (False, wanted)


def test_writer_threads_run_under_sched_batch(engine_policy: int) -> None:
    writer = BackgroundWriter(lambda key, host: True, 16, 1 << 30, threads=2)
    try:
        for thread in writer._threads:
            wait_for(lambda t=thread: policy(t.native_id) == os.SCHED_BATCH, 10, thread.name)
        assert os.sched_getscheduler(0) == engine_policy
    finally:
        writer.close()


def test_what_the_engine_waits_for_runs_under_sched_other(engine_policy: int) -> None:
    """A producer's step waits for its write (``save_wait_s``): the writer thread's wake-ups
    (Redis replies) are then on the step's path and must preempt as any thread's would, not
    wait for the running thread's tick; once nobody waits, back under SCHED_BATCH."""
    seen: list[int] = []
    writer: BackgroundWriter | None = None

    def sink(key: str, host: HostCopy) -> bool:
        assert writer is not None
        wait_for(lambda: writer._urgent > 0, 10, "the engine's thread waiting")
        with writer._cond:  # the waiter set the policies before it released the lock
            seen.append(os.sched_getscheduler(0))
        return True

    writer = BackgroundWriter(sink, 16, 1 << 30, threads=2)
    try:
        for thread in writer._threads:
            wait_for(lambda t=thread: policy(t.native_id) == os.SCHED_BATCH, 10, thread.name)
        assert writer.submit("a", HostCopy(torch.zeros(4)))
        assert writer.wait_written(["a"], 10)
        assert seen == [os.SCHED_OTHER]
        for thread in writer._threads:
            assert policy(thread.native_id) == os.SCHED_BATCH, thread.name
        assert os.sched_getscheduler(0) == engine_policy
    finally:
        writer.close()


def test_the_stats_thread_runs_under_sched_batch(engine_policy: int, tmp_path: Path) -> None:
    publisher = channel.Publisher(str(tmp_path), "k", lambda: {"counters": {}})
    try:
        thread = publisher._thread
        wait_for(lambda: policy(thread.native_id) == os.SCHED_BATCH, 10, "the stats thread")
        assert os.sched_getscheduler(0) == engine_policy
    finally:
        publisher.close()


def test_a_refused_policy_is_said_once_where_vllm_shows_it_and_the_writes_go_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A seccomp filter refusing sched_setscheduler costs nothing but the policy: the writer
    threads still write, and one WARNING says why (vLLM's logging shows ours from WARNING)."""

    def refuse(*_: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    monkeypatch.setattr(os, "sched_getscheduler", lambda _: os.SCHED_OTHER)
    monkeypatch.setattr(sched, "_told", False)
    written: list[str] = []
    caplog.set_level(logging.INFO, logger="ec_redis")
    writer = BackgroundWriter(lambda key, host: written.append(key) or True, 16, 1 << 30, threads=2)
    try:
        for key in ("a", "b", "c"):
            assert writer.submit(key, HostCopy(torch.zeros(16)))
        assert writer.flush(10)
        assert writer.wait_written(["a"], 10)
    finally:
        writer.close()
    assert sorted(written) == ["a", "b", "c"]
    said = [r for r in caplog.records if "SCHED_BATCH refused" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert said[0].levelno == logging.WARNING
    assert "Operation not permitted" in said[0].getMessage()
