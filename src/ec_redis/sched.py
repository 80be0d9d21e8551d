"""Our background threads and writer processes never preempt an engine's thread on waking.

A writer process woken by a write handed over in ``save_caches`` (or a writer thread woken by
a queued one) became runnable on the core where the engine's thread was running the step's
hooks, and Linux let the thread that had slept preempt the one that had been running: with
the machine's other core busy, ``save_caches`` took 2.7-3.3 ms at the median instead of
0.25-0.5 ms, waiting for the child's copy of the item (``docs/benchmarks.md``, "Background
work under SCHED_BATCH").

``SCHED_BATCH`` (sched(7)) removes exactly that: a thread under it gets the same share of the
CPU as any other at its nice level, but its waking does not preempt the running thread; it
runs at once on an idle core, else when the running thread's slice ends. Any unprivileged
thread may move itself between it and ``SCHED_OTHER``, and Linux sets it per thread, so only
our threads and writer processes take it, never the engine's own threads (a thread or
process started by one of ours inherits it). A thread under any other policy (one an
operator chose: real-time, idle) is left as it is. While an engine's thread waits for our
work (``BackgroundWriter.wait_written``, ``flush``), that work must not wait for ticks: the
writer puts its threads back under ``SCHED_OTHER`` for the wait (``set_policy``).
"""

from __future__ import annotations

import os

from ec_redis.logutil import logger

_told = False  # a refusal is logged once per process


def as_background() -> bool:
    """Put the calling thread under ``SCHED_BATCH`` if it is under ``SCHED_OTHER``. False
    where it is under another policy, the system lacks it or refuses it (a seccomp filter,
    say): the thread then runs as it was, and a refusal is logged once."""
    if getattr(os, "SCHED_BATCH", None) is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            return False  # an operator's choice (real-time, idle, batch): not ours to change
    except OSError:
        return False
    return set_policy(0, background=True)


def set_policy(thread_id: int, *, background: bool) -> bool:
    """Put thread ``thread_id`` (a native thread id or a pid; 0: the calling thread) under
    ``SCHED_BATCH`` (``background``) or back under ``SCHED_OTHER``. Only for threads this
    module moved, while they are known to live: a reused id would be another's thread."""
    global _told
    policy = os.SCHED_BATCH if background else os.SCHED_OTHER
    try:
        os.sched_setscheduler(thread_id, policy, os.sched_param(0))
    except OSError as exc:
        if background and not _told:
            _told = True
            logger.warning(
                "ec_redis: background threads keep the default scheduling policy (SCHED_BATCH "
                "refused: %s); they may preempt the engine's thread when they wake",
                exc,
            )
        return False
    return True
