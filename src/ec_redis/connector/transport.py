"""How staged bytes reach the workers: inline in the step metadata when the workers share the
scheduler's process, else as files in a host-local tmpfs (``/dev/shm``) that every rank
reads, so the metadata vLLM pickles to each worker every step carries ids and sizes only.

Staged bytes (a file, or an inline tensor) live while their staging entry does, while a
promise made this step names them, and while a load that names them is in transit: until the
output of that step comes back (every rank ran it by then: vLLM gathers all ranks' outputs
first), or ``in_transit_ttl_s`` as a backstop. Bytes kept alive only by promises and loads
in transit (their entry is gone) are ``outside_bytes``: the stager counts them against
``stage_bytes`` too, so under async scheduling (steps in flight) the bound still holds for
every staged byte that exists. Files are written with
``write(2)``, or through a mapping only where ``posix_fallocate`` reserved every block first
(spare files), so a full tmpfs is an error (and the item falls back to inline) rather than a
SIGBUS. Files a killed process left behind are removed at start
(``owners.py``: a file belongs to a live process while that process holds its lock).

Staging costs almost nothing when a lookup's Redis read landed in a spare file
(``spares.py``: made ahead of time, pages already allocated): the file is renamed. Other
items are copied into a spare when one fits, else written into a new file.
"""

from __future__ import annotations

import functools
import itertools
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ec_redis.connector import owners
from ec_redis.connector.metadata import LoadItem
from ec_redis.connector.spares import Spares
from ec_redis.connector.staging import Found
from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters

FILE_PREFIX = "ec_redis-stage-"
TMPFS_HEADROOM_BYTES = 64 * 1024 * 1024  # never fill the tmpfs vLLM's own queues live on


@dataclass(eq=False)
class _Held:
    """Who keeps one staged buffer alive."""

    found: Found  # keeps an inline tensor (and so its id) alive
    nbytes: int
    entry: bool = False  # its staging entry
    others: int = 0  # promises made this step and loads in transit


class InlineTransport:
    """Workers in this process (or remote, under Ray): the tensor itself goes in the load."""

    name = "inline"

    def __init__(
        self,
        spare_bytes: int = 0,
        spares: Spares | None = None,
        *,
        in_transit_ttl_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counters = Counters()
        # Reads land in memory faulted in ahead of time (``spares.py``).
        self.spares = spares if spares is not None else Spares(None, spare_bytes)
        self._ttl_s = in_transit_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[object, _Held] = {}  # path, or id of an inline tensor
        self._in_transit: deque[tuple[int, float, object]] = deque()  # (step, since, key)
        self._outside = 0  # bytes held by promises and loads only (their entry is gone)

    def stage(self, found: Found) -> Found:
        self._take(found, entry=True)
        return found

    def lend(self, nbytes: int) -> torch.Tensor | None:
        """A buffer a lookup's read may land in (``codec/destination.py``); ``None``: any."""
        return self.spares.lend(nbytes)

    def discard(self, found: Found) -> None:
        """A staging entry died; its bytes go once no promise or load holds them."""
        self._let_go(found, entry=True)

    def hold(self, found: Found) -> None:
        """A promise made this step holds ``found``'s bytes until ``unhold`` (the end of
        the step), whatever happens to its staging entry meanwhile."""
        self._take(found, entry=False)

    def unhold(self, found: Found) -> None:
        self._let_go(found, entry=False)

    def load(self, item: str, found: Found, step: int) -> LoadItem:
        """The load of ``found`` in ``step``: its bytes stay until that step is done."""
        key = self._take(found, entry=False)
        if key is not None:
            with self._lock:
                self._in_transit.append((step, self._clock(), key))
        if found.path is not None:
            return LoadItem(
                item, found.rows, _dtype_name(found.dtype), found.shape, path=found.path
            )
        return LoadItem(item, found.rows, _dtype_name(found.dtype), found.shape, found.tensor)

    def step_done(self, step: int) -> None:
        """The output of ``step`` came back from every rank."""
        self._drain(lambda done_step, _since: done_step <= step)

    def sweep(self) -> None:
        """Drop what outlived ``in_transit_ttl_s``."""
        cutoff = self._clock() - self._ttl_s
        self._drain(lambda _step, since: since < cutoff)

    def _drain(self, finished: Callable[[int, float], bool]) -> None:
        done: list[object] = []
        with self._lock:
            while self._in_transit and finished(*self._in_transit[0][:2]):
                done.append(self._in_transit.popleft()[2])
        for key in done:
            self._release(key, entry=False)

    # -- who holds what ----------------------------------------------------------------------

    @staticmethod
    def _key(found: Found) -> object | None:
        if found.path is not None:
            return found.path
        return None if found.tensor is None else id(found.tensor)

    def _take(self, found: Found, *, entry: bool) -> object | None:
        key = self._key(found)
        if key is None:
            return None
        with self._lock:
            held = self._held.get(key)
            if held is None:
                held = self._held[key] = _Held(found, found.nbytes)
                if not entry:
                    self._outside += held.nbytes
            if entry and not held.entry:
                held.entry = True
                if held.others:
                    self._outside -= held.nbytes
            elif not entry:
                held.others += 1
        return key

    def _let_go(self, found: Found, *, entry: bool) -> None:
        key = self._key(found)
        if key is not None:
            self._release(key, entry=entry)

    def _release(self, key: object, *, entry: bool) -> None:
        with self._lock:
            held = self._held.get(key)
            if held is None:
                return
            if entry:
                if not held.entry:
                    return
                held.entry = False
                if held.others:
                    self._outside += held.nbytes
            else:
                held.others -= 1
                if held.others == 0 and not held.entry:
                    self._outside -= held.nbytes
            if held.entry or held.others > 0:
                return
            del self._held[key]
        self._free(held.found)

    def _free(self, found: Found) -> None:
        """Nothing holds ``found`` any more (an inline tensor is freed with its last
        reference)."""

    def outside_bytes(self) -> int:
        """Bytes that promises and loads in transit keep alive after their entry died."""
        return self._outside

    def live_files(self) -> int:
        return 0

    def live_buffers(self) -> int:
        with self._lock:
            return len(self._held)

    def spare_bytes(self) -> int:
        """Bytes held in spare buffers made ahead of time."""
        return self.spares.spare_bytes()

    def close(self) -> None:
        """Remove everything this transport still holds."""
        with self._lock:
            held = list(self._held.values())
            self._held.clear()
            self._in_transit.clear()
            self._outside = 0
        for record in held:
            self._free(record.found)
        self.spares.close()


class FileTransport(InlineTransport):
    """Workers in other processes on this host: staged bytes in files they read by name."""

    name = "file"

    def __init__(
        self,
        directory: str,
        *,
        spare_bytes: int = 0,
        in_transit_ttl_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dir = Path(directory)
        owners.remove_orphans(self._dir, FILE_PREFIX)
        self._owner = owners.Owner(self._dir, FILE_PREFIX)
        self._prefix = f"{self._owner.stem}-"
        room = functools.partial(_has_room, self._dir)
        super().__init__(
            spares=Spares(self._dir, spare_bytes, self._owner.stem, room),
            in_transit_ttl_s=in_transit_ttl_s,
            clock=clock,
        )
        self._seq = itertools.count()
        self._log = RateLimitedLog()

    def stage(self, found: Found) -> Found:
        """Move a fetched tensor into a file (on a lookup thread, off the scheduling path)."""
        tensor = found.tensor
        if tensor is None:
            return super().stage(found)
        path = str(self._dir / f"{self._prefix}{next(self._seq)}")
        if self._through_spare(tensor, found.nbytes, path):
            self.counters.inc("stage_spare_hits")
        elif not self._write_new(tensor, found.nbytes, path):
            self.counters.inc("stage_inline_fallbacks")  # inline is slower, never wrong
            return super().stage(found)
        self.counters.inc("staged_files")
        return super().stage(Found(found.dtype, found.shape, path=path))

    def _through_spare(self, tensor: torch.Tensor, nbytes: int, path: str) -> bool:
        """Stage ``tensor`` as ``path`` through a spare file: the one its read landed in
        (a rename), else a free one (a copy into pages allocated ahead of time)."""
        try:
            if self.spares.claim(tensor, path):
                return True
            spare = self.spares.lend(nbytes)
            if spare is None:
                return False
            spare.copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
            return self.spares.claim(spare, path)  # our mapping of it goes with ``spare``
        except OSError as exc:  # the directory went away: a new file is tried instead
            self._log.warning("spare-claim", "ec_redis: cannot stage a spare file: %r", exc)
            return False

    def _write_new(self, tensor: torch.Tensor, nbytes: int, path: str) -> bool:
        """Stage ``tensor`` as a new file ``path``; False if the tmpfs is full or gone."""
        if not _has_room(self._dir, nbytes):
            return False
        try:
            _write_file(path, tensor)
        except OSError as exc:
            self._log.warning("stage-file", "ec_redis: cannot stage to %s: %r", path, exc)
            owners.remove(path)
            return False
        return True

    def _free(self, found: Found) -> None:
        if found.path is not None:
            owners.remove(found.path)

    def live_files(self) -> int:
        with self._lock:
            return sum(1 for key in self._held if isinstance(key, str))

    def close(self) -> None:
        super().close()
        self._owner.close()


def workers_in_other_processes(vllm_config: Any) -> bool:
    """Whether vLLM runs the workers outside the engine core's process (any executor but
    ``uni`` and ``external_launcher``)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    backend = getattr(parallel, "distributed_executor_backend", None)
    return isinstance(backend, str) and backend not in ("uni", "external_launcher")


def choose(vllm_config: Any, setting: str, directory: str, spare_bytes: int = 0) -> InlineTransport:
    """``auto``: files when vLLM runs the workers in other processes of this host (its
    ``mp`` executor on one node), inline otherwise (one process, or Ray across hosts)."""
    if setting == "auto":
        parallel = getattr(vllm_config, "parallel_config", None)
        backend = getattr(parallel, "distributed_executor_backend", None)
        nnodes = getattr(parallel, "nnodes", 1)
        setting = "file" if backend == "mp" and nnodes == 1 else "inline"
    if setting == "file":
        return FileTransport(directory or default_directory(), spare_bytes=spare_bytes)
    return InlineTransport(spare_bytes)


def default_directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def read_staged(load: LoadItem) -> torch.Tensor:
    """The tensor a load names: its own (inline), or its staged file mapped copy-on-write into
    this process (no copy: the pages are the file's until someone writes, and they outlive
    the file's removal for as long as the tensor lives)."""
    if load.tensor is not None:
        return load.tensor
    assert load.path is not None, "a load names a tensor or a file"
    dtype = getattr(torch, load.dtype)
    numel = 1
    for dim in load.shape:
        numel *= dim
    if numel == 0:
        return torch.empty(load.shape, dtype=dtype)
    if os.path.getsize(load.path) < numel * dtype.itemsize:  # a short mapping would SIGBUS
        raise OSError(f"staged file {load.path} is shorter than its load")
    return torch.from_file(load.path, shared=False, size=numel, dtype=dtype).view(load.shape)


def _has_room(directory: Path, nbytes: int) -> bool:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize >= nbytes + TMPFS_HEADROOM_BYTES


def _write_file(path: str, tensor: torch.Tensor) -> None:
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
    finally:
        os.close(fd)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
