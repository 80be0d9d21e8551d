"""Notices writer processes that die while no write is talking to them (the OOM killer picks
one between writes), so that none is left a zombie or counted alive until a write finds it.

It polls each child's ``pidfd``, which becomes readable only when the process exits: no
wake-up per write, only per death and per change of the pool. (Where the kernel has no
``pidfd_open``, before Linux 5.3, the pool finds dead idle children when it next takes one
or reports its stats.)
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable

from ec_redis.offload.process import WriterProcess


class DeathWatch:
    """A daemon thread polling the pidfds of the children ``children()`` lists (``None``
    once the pool is closed); hands each that exited to ``exited`` (on this thread), which
    must leave it out of the next ``children()``. ``changed()`` makes it look again."""

    def __init__(
        self,
        children: Callable[[], list[WriterProcess] | None],
        exited: Callable[[WriterProcess], None],
    ) -> None:
        self._children = children
        self._exited = exited
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._open = True  # the pipe: the thread closes it as it ends
        self._thread = threading.Thread(target=self._run, name="ec_redis-writer-watch", daemon=True)
        self._thread.start()

    def changed(self) -> None:
        """The pool gained or lost a child: look again."""
        with self._lock, contextlib.suppress(OSError):  # full: a wake-up is pending
            if self._open:
                os.write(self._wake_w, b"\0")

    def close(self, timeout_s: float) -> None:
        """(Once ``children()`` returns ``None``.) Stop the thread."""
        self.changed()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self._watch()
        finally:
            with self._lock:
                self._open = False
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _watch(self) -> None:
        while (children := self._children()) is not None:
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            by_fd = {child.pidfd: child for child in children if child.pidfd >= 0}
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                elif fd in by_fd:
                    self._exited(by_fd[fd])
