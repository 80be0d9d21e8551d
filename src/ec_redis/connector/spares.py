"""Staging buffers made ahead of time, so that a fetch does not pay for fresh pages.

Writing a 16 MiB item into a new tmpfs file costs ~6 ms on a small VM, almost all of it the
kernel allocating and zeroing pages; a read into fresh process memory pays ~4 ms of page
faults more. A background thread therefore keeps a few *spare* buffers, every page faulted
in. With file staging they are files: blocks reserved with ``posix_fallocate`` (a full
tmpfs is an error there, never a SIGBUS later), mapped shared. A lookup borrows one as the
buffer a Redis read lands in (``codec/destination.py``), and staging then only renames the
file: the bytes went from the socket straight into the page cache the workers map. With
inline staging they are private memory, lent the same way and handed over as they are.

A borrowed file's life::

    spare (in the pool) ──lend──► lent (its mapping is a tensor) ──claim──► a staged file
                                                          └─ tensor dropped ─► removed

A lent file nobody claims (the read failed, the item was refused) is removed when the last
view of its mapping dies (``weakref.finalize`` on the mapping). A file is lent once and
never rewritten, so no process ever sees its bytes change. Spare bytes are bounded by
``stage_spare_bytes``; killed processes' spares are swept like staged files (``owners.py``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

from ec_redis.connector import owners
from ec_redis.logutil import RateLimitedLog
from ec_redis.tiers.base import tensor_nbytes

SPARE_INFIX = "-spare-"  # in the names of spare files (after their owner's stem)
SPARES = 2  # spare files kept of the size recent items needed
GRAIN = 1 << 20  # spare sizes are whole MiB
SLACK = 4  # a spare of S bytes is lent only to an item of at least (S - GRAIN) / SLACK bytes
_RECENT = 16  # item sizes remembered to size the next spares
_RETRY_S = 1.0  # after a failed spare, the filler rests this long


@dataclass
class _Spare:
    path: str
    size: int
    mapping: mmap.mmap
    # Removes the file once the mapping is gone (every view of it dropped), unless claimed.
    remove: weakref.finalize[[str], mmap.mmap]


@dataclass(frozen=True)
class _Lent:
    path: str
    nbytes: int
    remove: weakref.finalize[[str], mmap.mmap]


class Spares:
    """Spare staging buffers, at most ``budget_bytes`` of them: files in ``directory`` named
    ``<stem>-spare-<n>`` (``stem``: their owner's, ``owners.py``; ``has_room(nbytes)`` says
    whether the filesystem may take more), or private memory when ``directory`` is None."""

    def __init__(
        self,
        directory: Path | None,
        budget_bytes: int,
        stem: str = "",
        has_room: Callable[[int], bool] = lambda _: True,
    ) -> None:
        self._dir = directory
        self._stem = stem
        self.budget_bytes = budget_bytes
        self._has_room = has_room
        self._cond = threading.Condition()
        self._spares: list[_Spare] = []
        self._lent: dict[int, _Lent] = {}  # mapping address -> the file it maps
        self._recent: deque[int] = deque(maxlen=_RECENT)
        self._seq = 0
        self._closed = False
        self._log = RateLimitedLog()
        self._thread: threading.Thread | None = None

    # -- lookups borrow, staging claims ----------------------------------------------------

    def lend(self, nbytes: int) -> torch.Tensor | None:
        """A writable ``nbytes`` uint8 tensor over a spare, or ``None`` (no spare that large
        yet: the next ones will be)."""
        if nbytes <= 0 or self.budget_bytes <= 0:
            return None
        with self._cond:
            if self._closed:
                return None
            self._recent.append(-(-nbytes // GRAIN) * GRAIN)
            self._start_locked()
            fitting = [s for s in self._spares if nbytes <= s.size <= SLACK * nbytes + GRAIN]
            if not fitting:
                self._cond.notify_all()
                return None
            spare = min(fitting, key=lambda s: s.size)
            self._spares.remove(spare)
            tensor = torch.frombuffer(spare.mapping, dtype=torch.uint8, count=nbytes)
            self._lent = {a: lent for a, lent in self._lent.items() if lent.remove.alive}
            self._lent[tensor.data_ptr()] = _Lent(spare.path, nbytes, spare.remove)
        if not spare.path:
            _release_tail(spare.mapping, nbytes)  # a file's tail goes when claim cuts it
        # Not replaced yet: making a spare now would compete with the read it serves.
        return tensor

    def claim(self, tensor: torch.Tensor, path: str) -> bool:
        """If ``tensor`` is exactly the bytes of a lent file, rename that file to ``path``
        (cut to its size) and return True: it is a staged file now, owned by the caller.
        False: not a lent file. ``OSError``: it was, but could not be renamed (the lent file
        then goes with its tensor)."""
        with self._cond:
            lent = self._lent.get(tensor.data_ptr())
            if (
                lent is None
                or not lent.path  # private memory: nothing to rename
                or not lent.remove.alive  # a stale address
                or not tensor.is_contiguous()
                or tensor_nbytes(tensor) != lent.nbytes
            ):
                return False  # not a lent file: the caller copies
            del self._lent[tensor.data_ptr()]
        os.truncate(lent.path, lent.nbytes)  # the spare was whole MiB; readers check size
        os.rename(lent.path, path)
        lent.remove.detach()  # ``path`` is the caller's to remove now
        with self._cond:
            self._cond.notify_all()  # the read it served is over: replace it
        return True

    # -- the filler thread ---------------------------------------------------------------

    def _start_locked(self) -> None:
        if self._thread is None:  # no memory held before the first item is looked for
            self._thread = threading.Thread(target=self._fill, name="ec_redis-spares", daemon=True)
            self._thread.start()

    def _target_locked(self) -> int:
        """The size of spares to make: the largest recent item size of which ``SPARES``
        files fit the budget (larger items are staged the slow way)."""
        fits = [size for size in self._recent if size * SPARES <= self.budget_bytes]
        return max(fits, default=0)

    def _next_locked(self, dropped: list[_Spare]) -> int:
        """Bytes of the next spare to make now, or 0; moves spares too small to be used into
        ``dropped`` (the caller lets go of them outside the lock: unmapping takes time)."""
        size = self._target_locked()
        if size == 0:
            return 0
        if sum(s.size >= size for s in self._spares) >= SPARES:
            return 0
        while self._spares and self.spare_bytes_locked() + size > self.budget_bytes:
            small = min(self._spares, key=lambda s: s.size)
            if small.size >= size:
                return 0
            self._spares.remove(small)  # its finalizer removes the file with the mapping
            dropped.append(small)
        return size if self.spare_bytes_locked() + size <= self.budget_bytes else 0

    def _fill(self) -> None:
        while True:
            dropped: list[_Spare] = []
            with self._cond:
                size = 0
                while not self._closed and (size := self._next_locked(dropped)) == 0:
                    self._cond.wait()
                if self._closed:
                    return
                self._seq += 1
                name = f"{self._stem}{SPARE_INFIX}{self._seq}"
            dropped.clear()
            try:
                spare = self._make(name, size) if self._dir is not None else self._private(size)
            except Exception as exc:  # spares are an optimisation: never let the thread die
                self._log.warning("spare", "ec_redis: cannot make a spare: %r", exc)
                spare = None
            with self._cond:
                if spare is not None and not self._closed:
                    self._spares.append(spare)
                    continue
            if spare is None:  # no room, or the directory is gone: try again later
                with self._cond:
                    self._cond.wait(_RETRY_S)

    def _make(self, name: str, size: int) -> _Spare | None:
        assert self._dir is not None
        path = str(self._dir / name)
        if not self._has_room(size):
            return None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            self._log.warning("spare", "ec_redis: cannot make a spare file: %r", exc)
            return None
        try:
            os.posix_fallocate(fd, 0, size)  # the blocks exist before anything is mapped
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            _touch(mapping)
        except BaseException:
            owners.remove(path)
            raise
        finally:
            os.close(fd)
        return _Spare(path, size, mapping, weakref.finalize(mapping, self._gone, path))

    def _private(self, size: int) -> _Spare:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # anonymous
        _touch(mapping)
        return _Spare("", size, mapping, weakref.finalize(mapping, self._gone, ""))

    def _gone(self, path: str) -> None:
        """A spare's mapping died unclaimed (a failed read, a smaller spare dropped)."""
        if path:
            owners.remove(path)
        with self._cond:  # reentrant: this may run inside this class's own locked code
            self._cond.notify_all()

    # -- introspection and lifecycle -----------------------------------------------------

    def spare_bytes_locked(self) -> int:
        return sum(s.size for s in self._spares)

    def spare_bytes(self) -> int:
        with self._cond:
            return self.spare_bytes_locked()

    def close(self) -> None:
        """Remove every spare file, lent ones included (their mappings stay valid)."""
        with self._cond:
            self._closed = True
            removers = [s.remove for s in self._spares] + [s.remove for s in self._lent.values()]
            self._spares, self._lent = [], {}
            self._cond.notify_all()
        for remove in removers:
            remove()
        if self._thread is not None:
            self._thread.join(5.0)


def _touch(mapping: mmap.mmap) -> None:
    """Fault every page of ``mapping`` in now, writable, on this thread: numpy's fill runs
    without the GIL (``MAP_POPULATE`` would hold it for the whole mapping, stalling the
    engine's own threads for milliseconds)."""
    view = numpy.frombuffer(mapping, dtype=numpy.uint8)
    view[:] = 0
    del view  # no export may outlive this: the mapping's lifetime is its tensors'


def _release_tail(mapping: mmap.mmap, nbytes: int) -> None:
    """Give back the pages of private memory past ``nbytes``: staging counts only those."""
    start = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    if start < len(mapping):
        with contextlib.suppress(OSError):  # only memory held a little longer
            mapping.madvise(mmap.MADV_DONTNEED, start, len(mapping) - start)


def is_spare(name: str) -> bool:
    """Whether a file name in a staging directory is a spare's (not a staged item's)."""
    return SPARE_INFIX in name
