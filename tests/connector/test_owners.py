"""A start-up sweep removes only the files of owners proven gone (``owners.py``): a lock it
cannot open proves nothing, so another engine's live files stay whatever the reason."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ec_redis.connector import owners
from ec_redis.connector.owners import LOCK_SUFFIX, Owner, remove_orphans

FAMILY = "ec_redis-stage-"
NOBODY = 65534


def owned(directory: Path, stem: str, count: int = 2) -> list[Path]:
    """``count`` files named as ``stem``'s, the way a transport names its staged items."""
    paths = [directory / f"{stem}-{n}" for n in range(count)]
    for path in paths:
        path.write_bytes(b"staged")
    return paths


def dead_owner(directory: Path, nonce: str = "0badf00d") -> str:
    """A lock file nobody holds (its owner was killed), and the stem it names."""
    stem = f"{FAMILY}1-{nonce}"
    (directory / f"{stem}{LOCK_SUFFIX}").write_bytes(b"")
    return stem


def failing_open(monkeypatch: pytest.MonkeyPatch, error: int) -> None:
    """``os.open`` of any lock file fails with ``error`` from now on (other paths open)."""
    real = os.open

    def fake(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(LOCK_SUFFIX):
            raise OSError(error, os.strerror(error), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake)


@pytest.mark.parametrize(
    "error", [errno.EMFILE, errno.EACCES, errno.ENOENT, errno.EIO], ids=errno.errorcode.get
)
def test_a_lock_that_cannot_be_opened_keeps_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """Out of descriptors, another uid's lock, a lock gone since the listing, anything:
    nothing is proven, so nothing goes — neither a live owner's files nor a dead one's (the
    next sweep that can tell removes those)."""
    live = Owner(tmp_path, FAMILY)
    try:
        files = owned(tmp_path, live.stem) + owned(tmp_path, dead_owner(tmp_path))
        before = sorted(tmp_path.iterdir())
        failing_open(monkeypatch, error)
        assert remove_orphans(tmp_path, FAMILY) == 0
        assert sorted(tmp_path.iterdir()) == before
        monkeypatch.undo()
        assert remove_orphans(tmp_path, FAMILY) == 2  # now the dead owner is proven dead
        assert sorted(p for p in tmp_path.iterdir() if p.suffix != LOCK_SUFFIX) == files[:2]
        assert [p.name for p in tmp_path.glob(f"*{LOCK_SUFFIX}")] == [live.path.name]
    finally:
        live.close()


def test_a_lock_file_is_readable_by_other_uids_only_once_it_is_held(tmp_path: Path) -> None:
    """So an engine under another uid can prove a dead owner's lock free (a read-only
    descriptor is enough for flock), and can never take a starting owner's lock."""
    made: list[int] = []
    real = os.rename

    def rename(src: Any, dst: Any) -> None:
        made.append(os.stat(src).st_mode & 0o777)  # the building file, already locked
        real(src, dst)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "rename", rename)
        owner = Owner(tmp_path, FAMILY)
    try:
        assert made == [0o644] and owner.path.stat().st_mode & 0o777 == 0o644
        assert not owners.free(owner.path)
    finally:
        owner.close()


def test_a_stale_building_lock_goes_and_a_young_or_held_one_stays(tmp_path: Path) -> None:
    """``.<stem>.owner`` is a lock before it gets its name; one left by a process killed in
    that instant is removed once it is old and free, never while an owner may be starting."""
    old = time.time() - 3600  # far past owners.BUILDING_STALE_S
    stale = tmp_path / f".{FAMILY}1-0000dead{LOCK_SUFFIX}"
    young = tmp_path / f".{FAMILY}1-0000beef{LOCK_SUFFIX}"
    held = tmp_path / f".{FAMILY}1-0000cafe{LOCK_SUFFIX}"
    for path in (stale, young, held):
        path.write_bytes(b"")
    os.utime(stale, (old, old))
    os.utime(held, (old, old))
    import fcntl

    fd = os.open(held, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        remove_orphans(tmp_path, FAMILY)
        assert sorted(tmp_path.iterdir()) == sorted([young, held])
    finally:
        os.close(fd)


# -- engines under another uid ---------------------------------------------------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A world-writable folder without the sticky bit (any uid may unlink anything in it),
    that another uid can reach (pytest's tmp_path is under a 0700 folder)."""
    directory = Path(tempfile.mkdtemp(prefix="ec_redis-owners-", dir="/dev/shm"))
    directory.chmod(0o777)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def as_nobody(job: Callable[[], int]) -> int:
    """Run ``job`` in a forked child under uid/gid 65534 (vLLM's image has no such user to
    ``su`` to, and the venv's interpreter is under /root, which nobody can execute: fork,
    never exec); its result (< 256) comes back as the exit status."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        status = 255
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            status = job()
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), status
    return os.WEXITSTATUS(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to sweep as another uid")
@pytest.mark.parametrize("lock_mode", [0o644, 0o600], ids=["as-made", "0600"])
def test_an_engine_under_another_uid_never_removes_a_live_engines_files(
    shared_dir: Path, lock_mode: int
) -> None:
    """Root's engine holds its lock; another uid's engine starts in the same non-sticky
    folder. Whether it can open root's lock (as made) or not (a 0600 lock: EACCES), root's
    files and lock stay."""
    live = Owner(shared_dir, FAMILY)
    try:
        live.path.chmod(lock_mode)
        files = owned(shared_dir, live.stem)
        assert as_nobody(lambda: remove_orphans(shared_dir, FAMILY)) == 0
        assert sorted(shared_dir.iterdir()) == sorted([*files, live.path])
    finally:
        live.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to sweep as another uid")
def test_another_uid_removes_a_dead_engines_files_only_when_it_can_prove_it_dead(
    shared_dir: Path,
) -> None:
    """A dead root engine's lock as made is readable: another uid proves it free and, in a
    non-sticky folder, removes its files. A 0600 lock proves nothing to it: those files stay
    for root's next start (or an operator)."""
    readable = dead_owner(shared_dir, "0000aaaa")
    (shared_dir / f"{readable}{LOCK_SUFFIX}").chmod(0o644)  # as an Owner makes it
    private = dead_owner(shared_dir, "0000bbbb")
    (shared_dir / f"{private}{LOCK_SUFFIX}").chmod(0o600)
    owned(shared_dir, readable)
    kept = [*owned(shared_dir, private), shared_dir / f"{private}{LOCK_SUFFIX}"]
    assert as_nobody(lambda: remove_orphans(shared_dir, FAMILY)) == 2
    assert sorted(shared_dir.iterdir()) == sorted(kept)
    assert remove_orphans(shared_dir, FAMILY) == 2  # root can tell
    assert list(shared_dir.iterdir()) == []
