"""Worker-half metrics reach vLLM through the scheduler half, whatever the process layout.

vLLM's V1 model runner never reads a worker's connector stats, and its encoder-only path even
drops the worker metadata; V2 reads them, but only where it runs. So the worker half that
speaks for the instance (TP rank 0) publishes its cumulative counters and its recent
observations in a small file on the host's tmpfs, and the scheduler half of the same engine
(same ``engine_id`` and data-parallel rank) reads it and reports the increments — each
exactly once, with the worker in the scheduler's process or not, under V1 and V2. The worker
half's own ``get_ec_connector_stats`` therefore reports nothing.

The file is replaced atomically (write, then rename) at the end of every step in which the
worker half did something, so the scheduler half reads it in that step's output; a publisher
thread also refreshes it every ``interval_s`` while something changed, so counters that move
after the last step (a Redis write draining) still arrive (a producer keeps stepping until the
queue depth it read says 0). The reader re-reads a file only when it changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHANNEL_PREFIX = "ec_redis-stats-"
MAX_OBSERVATIONS = 256  # per publisher; older ones are dropped if nobody reads in time
GLOB_EVERY_S = 1.0  # how often the reader looks for new publishers


def channel_key(engine_id: str, dp_rank: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:64]
    return f"{safe}-dp{dp_rank}"


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


class Publisher:
    """The worker half's side: keeps ``<dir>/ec_redis-stats-<key>-<pid>-<nonce>.json``
    current."""

    def __init__(
        self,
        directory: str,
        key: str,
        snapshot: Callable[[], dict[str, Any]],
        interval_s: float = 0.25,
    ) -> None:
        name = f"{CHANNEL_PREFIX}{key}-{os.getpid()}-{secrets.token_hex(4)}.json"
        self.path = Path(directory) / name
        self._snapshot = snapshot
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the step's publish and the thread's
        self._last = ""
        self._thread = threading.Thread(target=self._run, name="ec_redis-stats", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        with self._lock:
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
        while not self._stop.wait(self._interval_s):
            self.publish()

    def close(self) -> None:
        """Stop and remove the file (the engine is going away: nothing reads it any more)."""
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(OSError):
            self.path.unlink()


class Reader:
    """The scheduler half's side: increments of every publisher of this engine since the
    last read (counters as differences, observations not seen before)."""

    def __init__(
        self, directory: str, key: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._dir = Path(directory)
        self._pattern = f"{CHANNEL_PREFIX}{key}-*.json"
        self._clock = clock
        remove_orphans(self._dir)
        self._counters: dict[str, dict[str, float]] = {}  # per file: last cumulative values
        self._seen: dict[str, int] = {}  # per file: last observation number reported
        self._versions: dict[Path, tuple[int, int]] = {}  # per file: (mtime_ns, size) read
        self._steps: dict[Path, int] = {}  # per file: the last step it published
        self._paths: list[Path] = []
        self._next_glob = 0.0

    def _publishers(self) -> list[Path]:
        now = self._clock()
        if now >= self._next_glob:
            self._next_glob = now + GLOB_EVERY_S
            self._paths = sorted(self._dir.glob(self._pattern))
        return self._paths

    def take(self) -> tuple[dict[str, float], dict[str, float], dict[str, list[float]], int]:
        """``(counter increments, gauges, new observations, step)``: ``step`` is the last
        step whose counters a publisher has published (-1: none yet)."""
        increments: dict[str, float] = {}
        gauges: dict[str, float] = {}
        observed: dict[str, list[float]] = {}
        for path in self._publishers():
            try:
                stat = path.stat()
                version = (stat.st_mtime_ns, stat.st_size)
                if self._versions.get(path) == version:
                    continue  # unchanged since the last read
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # replaced under us, or gone: the next read sees it
            self._versions[path] = version
            name = path.name
            self._steps[path] = int(data.get("step", -1))
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
        step = max(self._steps.values(), default=-1)
        return increments, gauges, observed, step

    def remove_all(self) -> None:
        for path in self._dir.glob(self._pattern):
            with contextlib.suppress(OSError):
                path.unlink()


def remove_orphans(directory: Path) -> None:
    """Remove channel files whose publishing process is gone (it was killed)."""
    for path in directory.glob(f"{CHANNEL_PREFIX}*.json"):
        pid = path.name[: -len(".json")].rsplit("-", 2)[-2]
        if pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                path.unlink()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
