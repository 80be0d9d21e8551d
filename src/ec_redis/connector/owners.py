"""Which files in a shared tmpfs belong to a live process.

Every process that writes files there (staged items, stats channels) holds an exclusive
``flock`` on its own lock file, ``<stem>.owner``, for its whole life, and names its files
``<stem>-...`` or ``<stem>.<ext>``. A file whose stem has no held lock was left by a process
that is gone. Unlike a pid check this holds across PID namespaces (containers sharing
``/dev/shm`` with ``--ipc=host``, where another engine's pid means nothing here) and never
mistakes a reused pid for the dead owner. The kernel drops the lock when its owner dies,
however it dies.

Only a lock proven free (its file opened and the ``flock`` granted) makes files removable.
A lock that cannot be opened — another uid's file we may not read (EACCES), no file
descriptor left (EMFILE), a file gone since the listing (ENOENT), anything else — proves
nothing, and its files stay for a later sweep: a sweep that removed a live engine's staged
files would make that engine's next load fail. Lock files are world-readable so that an
engine under another uid can still prove a dead owner's lock free (``flock`` needs only a
read-only descriptor); whether it may then remove the files is the folder's business (a
sticky ``/dev/shm`` lets only their owner's uid do it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from pathlib import Path

LOCK_SUFFIX = ".owner"
# A lock file is readable by other uids (they may prove it free, never take it from a live
# owner); it gets this mode only once its owner holds it.
LOCK_MODE = 0o644
# A ``.<stem>.owner`` file (a lock before it gets its name) older than this was left by a
# process that died while it started: a live one renames it microseconds after making it.
BUILDING_STALE_S = 60.0


class Owner:
    """Holds ``<directory>/<family><pid>-<nonce>.owner`` locked until ``close``; ``stem``
    names the files that belong to it."""

    def __init__(self, directory: Path, family: str) -> None:
        self.stem = f"{family}{os.getpid()}-{secrets.token_hex(4)}"
        self.path = directory / f"{self.stem}{LOCK_SUFFIX}"
        # Locked before it gets its name: a sweeper can never take the lock of an owner
        # that is still starting and declare it dead. Made 0600 and opened up only once
        # locked, so no other uid can take it in between either.
        building = directory / f".{self.stem}{LOCK_SUFFIX}"
        self._fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(self._fd, LOCK_MODE)
            os.rename(building, self.path)
        except OSError:
            os.close(self._fd)
            with contextlib.suppress(OSError):
                os.unlink(building)
            raise

    def close(self) -> None:
        """Give the files up (remove them first: after this they are anyone's to sweep)."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = -1


def free(lock_path: Path) -> bool:
    """Whether ``lock_path`` is proven free: its file opened and an exclusive ``flock``
    granted (no live process holds it). False whenever that cannot be shown: a held lock,
    and also a file that cannot be opened (another uid's we may not read, no descriptor
    left, a file gone since it was listed, ...), whose files must stay."""
    try:
        # Read-only is enough for flock and lets another uid open a LOCK_MODE file;
        # O_NONBLOCK: a FIFO planted under a lock's name must not hang a start-up.
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        # ENOENT too: the lock was listed, so its owner closed or another sweep proved it
        # free meanwhile; either way the sweep that comes next sees no lock and decides.
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held (EWOULDBLOCK), or cannot tell: keep its files
    finally:
        os.close(fd)  # also drops a lock taken just now
    return True


def remove_orphans(directory: Path, family: str) -> int:
    """Remove the files of ``family`` (and their lock files) whose owner is proven gone;
    how many files went."""
    try:
        # Files first, then locks: an owner locks before it writes, so every file listed
        # has its lock in the second listing while its owner lives.
        names = [p.name for p in directory.glob(f"{family}*") if p.suffix != LOCK_SUFFIX]
        stems = {p.name[: -len(LOCK_SUFFIX)] for p in directory.glob(f"{family}*{LOCK_SUFFIX}")}
        building = list(directory.glob(f".{family}*{LOCK_SUFFIX}"))
    except OSError:
        return 0
    dead = {stem for stem in stems if free(directory / f"{stem}{LOCK_SUFFIX}")}
    live = stems - dead  # held, or not proven free: the same to a sweep
    removed = 0
    for name in names:
        if any(_belongs(name, stem) for stem in live):
            continue
        with contextlib.suppress(OSError):
            os.unlink(directory / name)
            removed += 1
    for stem in dead:
        with contextlib.suppress(OSError):
            os.unlink(directory / f"{stem}{LOCK_SUFFIX}")
    for path in building:
        _remove_stale_building(path)
    return removed


def _remove_stale_building(path: Path) -> None:
    """Unlink a ``.<stem>.owner`` left by a process that died while it started. A young one
    may belong to an owner between making it and locking it: never opened, or the sweep
    could take its lock first and fail that owner's start."""
    with contextlib.suppress(OSError):
        if time.time() - path.stat().st_mtime > BUILDING_STALE_S and free(path):
            os.unlink(path)


def remove(path: str | Path) -> None:
    """Unlink an owned file; one already gone, or one that cannot go (the start-up sweep
    retries), is not an error."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def _belongs(name: str, stem: str) -> bool:
    return name.startswith(stem) and name[len(stem) : len(stem) + 1] in ("-", ".")
