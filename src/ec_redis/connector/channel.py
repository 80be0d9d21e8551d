"""Worker-half metrics reach vLLM through the scheduler half, whatever the process layout.

vLLM's V1 model runner never reads a worker's connector stats, and its encoder-only path even
drops the worker metadata; V2 reads them, but only where it runs. So the worker half that
speaks for the instance (rank 0 of TP, PP and PCP) publishes its cumulative counters and its
recent observations in a small file on the host's tmpfs, and the scheduler half of the same engine
(same ``engine_id`` and data-parallel rank) reads it and reports the increments — each
exactly once, with the worker in the scheduler's process or not, under V1 and V2. The worker
half's own ``get_ec_connector_stats`` therefore reports nothing.

The file is replaced atomically (write, then rename). The worker half rewrites it at the end
of every step in which something changed, before vLLM hands the step's output to the
scheduler, which reads it while processing that output: a step's saves and loads are
reported in the same step, even the last one before the engine goes idle. A publisher thread
also refreshes it at most every ``interval_s`` while something changed, so counters that move
after the last step (a Redis write draining) still arrive. The scheduler half acknowledges the
observations it has read through the step metadata, and the worker half drops them, so the
file stays small.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ec_redis import sched
from ec_redis.connector import owners

CHANNEL_PREFIX = "ec_redis-stats-"
MAX_OBSERVATIONS = 1024  # per publisher; older ones are dropped if nobody reads in time


def channel_key(engine_id: str, dp_rank: int) -> str:
    """Names one engine's channel: a digest of its whole id (ids that differ anywhere, even
    only in punctuation or past any length, never share a channel) and its DP rank."""
    digest = hashlib.sha256(engine_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    return f"{digest}-dp{dp_rank}"


class Observations:
    """A bounded, numbered log of (name, value) observations."""

    def __init__(self, maxlen: int = MAX_OBSERVATIONS) -> None:
        self._items: deque[tuple[int, str, float]] = deque(maxlen=maxlen)
        self._seq = 0
        self._lock = threading.Lock()

    def add(self, name: str, value: float) -> None:
        with self._lock:
            self._seq += 1
            self._items.append((self._seq, name, value))

    def snapshot(self) -> list[tuple[int, str, float]]:
        with self._lock:
            return list(self._items)

    def trim(self, upto: int) -> None:
        """Forget observations numbered ``upto`` or lower (the reader has them)."""
        with self._lock:
            while self._items and self._items[0][0] <= upto:
                self._items.popleft()


class Publisher:
    """The worker half's side: keeps ``<dir>/ec_redis-stats-<key>-<pid>-<nonce>.json``
    current, and holds its owner lock (``owners.py``) while it lives."""

    def __init__(
        self,
        directory: str,
        key: str,
        snapshot: Callable[[], dict[str, Any]],
        interval_s: float = 0.25,
    ) -> None:
        self._owner = owners.Owner(Path(directory), f"{CHANNEL_PREFIX}{key}-")
        self.name = f"{self._owner.stem}.json"
        self.path = Path(directory) / self.name
        self._snapshot = snapshot
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the step's publish and the thread's share one file
        self._closed = False
        self._last = ""
        self._thread = threading.Thread(target=self._run, name="ec_redis-stats", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        """Rewrite the file if the snapshot changed (a few tens of microseconds if not)."""
        with self._lock:
            if self._closed:
                return  # the file is gone for good
            text = json.dumps(self._snapshot(), separators=(",", ":"))
            if text == self._last:
                return
            temporary = self.path.with_suffix(".tmp")
            try:
                temporary.write_text(text)
                os.replace(temporary, self.path)
                self._last = text
            except OSError:
                pass  # metrics are best effort; the next round tries again

    def _run(self) -> None:
        sched.as_background()  # its 4 wake-ups a second never preempt the engine's thread
        while not self._stop.wait(self._interval_s):
            self.publish()

    def close(self) -> None:
        """Stop and remove the file (the engine is going away: nothing reads it any more)."""
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            self._closed = True
            with contextlib.suppress(OSError):
                self.path.unlink()
            self._owner.close()


class Reader:
    """The scheduler half's side: increments of every publisher of this engine since the
    last read (counters as differences, observations not seen before).

    Cheap enough for every step: the folder is listed at most every ``rescan_s`` (a
    publisher's file appears once, at start-up) and a file is read only when its inode, size
    or mtime changed (each publish renames a new file into place), about 4 µs per file."""

    def __init__(
        self,
        directory: str,
        key: str,
        rescan_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dir = Path(directory)
        self._pattern = f"{CHANNEL_PREFIX}{key}-*.json"
        owners.remove_orphans(self._dir, CHANNEL_PREFIX)
        self._rescan_s = rescan_s
        self._clock = clock
        self._paths: list[Path] = []
        self._next_scan = 0.0
        self._stamps: dict[str, tuple[int, int, int]] = {}  # per file: as last read
        self._counters: dict[str, dict[str, float]] = {}  # per file: last cumulative values
        self._seen: dict[str, int] = {}  # per file: last observation number reported

    def _files(self) -> list[Path]:
        now = self._clock()
        if not self._paths or now >= self._next_scan:
            self._paths = sorted(self._dir.glob(self._pattern))
            self._next_scan = now + self._rescan_s
        return self._paths

    def _changed(self, path: Path) -> bool:
        try:
            stat = path.stat()
        except OSError:
            return False  # gone: the next scan forgets it
        stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if self._stamps.get(path.name) == stamp:
            return False
        self._stamps[path.name] = stamp
        return True

    def take(self) -> tuple[dict[str, float], dict[str, float], dict[str, list[float]]]:
        """``(counter increments, gauges, new observations)``."""
        increments: dict[str, float] = {}
        gauges: dict[str, float] = {}
        observed: dict[str, list[float]] = {}
        for path in self._files():
            if not self._changed(path):
                continue
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                self._stamps.pop(path.name, None)  # replaced under us: read it again
                continue
            name = path.name
            last = self._counters.setdefault(name, {})
            for counter, value in data.get("counters", {}).items():
                change = value - last.get(counter, 0)
                last[counter] = value
                if change:
                    increments[counter] = increments.get(counter, 0) + change
            gauges.update(data.get("gauges", {}))
            seen = self._seen.get(name, 0)
            for seq, series, value in data.get("observations", []):
                if seq > seen:
                    observed.setdefault(series, []).append(value)
                    self._seen[name] = max(self._seen.get(name, 0), seq)
        return increments, gauges, observed

    def acks(self) -> dict[str, int]:
        """Per publisher file: the last observation number read (sent back to the workers
        in the step metadata, so they can drop what was read)."""
        return dict(self._seen)

    def remove_all(self) -> None:
        for path in self._dir.glob(self._pattern):
            with contextlib.suppress(OSError):
                path.unlink()
