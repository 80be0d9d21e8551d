"""How staged bytes reach the workers: inline in the step metadata when the workers share the
scheduler's process, else as files in a host-local tmpfs (``/dev/shm``) that every rank
reads, so the metadata vLLM pickles to each worker every step carries ids and sizes only.

A staged file lives while its staging entry does, and while a load that names it is in
transit: until the output of that step comes back (every rank ran it by then: vLLM gathers
all ranks' outputs first), or ``in_transit_ttl_s`` as a backstop. Files are written with
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


class InlineTransport:
    """Workers in this process (or remote, under Ray): the tensor itself goes in the load."""

    name = "inline"

    def __init__(self, spare_bytes: int = 0, spares: Spares | None = None) -> None:
        self.counters = Counters()
        # Reads land in memory faulted in ahead of time (``spares.py``).
        self.spares = spares if spares is not None else Spares(None, spare_bytes)

    def stage(self, found: Found) -> Found:
        return found

    def lend(self, nbytes: int) -> torch.Tensor | None:
        """A buffer a lookup's read may land in (``codec/destination.py``); ``None``: any."""
        return self.spares.lend(nbytes)

    def discard(self, found: Found) -> None:
        """A staging entry died; its bytes go with it."""

    def load(self, item: str, found: Found, step: int) -> LoadItem:
        return LoadItem(item, found.rows, _dtype_name(found.dtype), found.shape, found.tensor)

    def step_done(self, step: int) -> None:
        """The output of ``step`` came back from every rank."""

    def live_files(self) -> int:
        return 0

    def spare_bytes(self) -> int:
        """Bytes held in spare buffers made ahead of time."""
        return self.spares.spare_bytes()

    def sweep(self) -> None:
        """Drop what outlived ``in_transit_ttl_s``."""

    def close(self) -> None:
        """Remove everything this transport still holds."""
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
        super().__init__(spares=Spares(self._dir, spare_bytes, self._owner.stem, room))
        self._seq = itertools.count()
        self._ttl_s = in_transit_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._refs: dict[str, int] = {}  # path -> holders (its staging entry, loads in transit)
        self._in_transit: deque[tuple[int, float, str]] = deque()  # (step, since, path)
        self._log = RateLimitedLog()

    def stage(self, found: Found) -> Found:
        """Move a fetched tensor into a file (on a lookup thread, off the scheduling path)."""
        tensor = found.tensor
        if tensor is None:
            return found
        path = str(self._dir / f"{self._prefix}{next(self._seq)}")
        if self._through_spare(tensor, found.nbytes, path):
            self.counters.inc("stage_spare_hits")
        elif not self._write_new(tensor, found.nbytes, path):
            self.counters.inc("stage_inline_fallbacks")  # inline is slower, never wrong
            return found
        with self._lock:
            self._refs[path] = 1
        self.counters.inc("staged_files")
        return Found(found.dtype, found.shape, path=path)

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

    def discard(self, found: Found) -> None:
        if found.path is not None:
            self._release(found.path)

    def load(self, item: str, found: Found, step: int) -> LoadItem:
        if found.path is None:
            return super().load(item, found, step)
        with self._lock:
            self._refs[found.path] = self._refs.get(found.path, 0) + 1
            self._in_transit.append((step, self._clock(), found.path))
        return LoadItem(item, found.rows, _dtype_name(found.dtype), found.shape, path=found.path)

    def step_done(self, step: int) -> None:
        self._drain(lambda done_step, _since: done_step <= step)

    def sweep(self) -> None:
        cutoff = self._clock() - self._ttl_s
        self._drain(lambda _step, since: since < cutoff)

    def _drain(self, finished: Callable[[int, float], bool]) -> None:
        done: list[str] = []
        with self._lock:
            while self._in_transit and finished(*self._in_transit[0][:2]):
                done.append(self._in_transit.popleft()[2])
        for path in done:
            self._release(path)

    def _release(self, path: str) -> None:
        with self._lock:
            holders = self._refs.get(path, 0) - 1
            if holders > 0:
                self._refs[path] = holders
                return
            self._refs.pop(path, None)
        owners.remove(path)

    def live_files(self) -> int:
        with self._lock:
            return len(self._refs)

    def close(self) -> None:
        with self._lock:
            paths = list(self._refs)
            self._refs.clear()
            self._in_transit.clear()
        for path in paths:
            owners.remove(path)
        self.spares.close()
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
