"""Which files in a shared tmpfs belong to a live process.

Every process that writes files there (staged items, stats channels) holds an exclusive
``flock`` on its own lock file, ``<stem>.owner``, for its whole life, and names its files
``<stem>-...`` or ``<stem>.<ext>``. A file whose stem has no held lock was left by a process
that is gone. Unlike a pid check this holds across PID namespaces (containers sharing
``/dev/shm`` with ``--ipc=host``, where another engine's pid means nothing here) and never
mistakes a reused pid for the dead owner. The kernel drops the lock when its owner dies,
however it dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path

LOCK_SUFFIX = ".owner"


class Owner:
    """Holds ``<directory>/<family><pid>-<nonce>.owner`` locked until ``close``; ``stem``
    names the files that belong to it."""

    def __init__(self, directory: Path, family: str) -> None:
        self.stem = f"{family}{os.getpid()}-{secrets.token_hex(4)}"
        self.path = directory / f"{self.stem}{LOCK_SUFFIX}"
        # Locked before it gets its name: a sweeper can never take the lock of an owner
        # that is still starting and declare it dead.
        building = directory / f".{self.stem}{LOCK_SUFFIX}"
        self._fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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


def held(lock_path: Path) -> bool:
    """Whether a live process holds ``lock_path`` (a missing file: nobody does)."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True  # cannot tell: keep its files
    finally:
        os.close(fd)  # also drops a lock taken just now
    return False


def remove_orphans(directory: Path, family: str) -> int:
    """Remove the files of ``family`` (and their lock files) whose owner is gone; how many
    files went."""
    try:
        # Files first, then locks: an owner locks before it writes, so every file listed
        # has its lock in the second listing while its owner lives.
        names = [p.name for p in directory.glob(f"{family}*") if p.suffix != LOCK_SUFFIX]
        stems = {p.name[: -len(LOCK_SUFFIX)] for p in directory.glob(f"{family}*{LOCK_SUFFIX}")}
    except OSError:
        return 0
    live = {stem for stem in stems if held(directory / f"{stem}{LOCK_SUFFIX}")}
    removed = 0
    for name in names:
        if any(_belongs(name, stem) for stem in live):
            continue
        with contextlib.suppress(OSError):
            os.unlink(directory / name)
            removed += 1
    for stem in stems - live:
        with contextlib.suppress(OSError):
            os.unlink(directory / f"{stem}{LOCK_SUFFIX}")
    return removed


def remove(path: str | Path) -> None:
    """Unlink an owned file; one already gone, or one that cannot go (the start-up sweep
    retries), is not an error."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def _belongs(name: str, stem: str) -> bool:
    return name.startswith(stem) and name[len(stem) : len(stem) + 1] in ("-", ".")
