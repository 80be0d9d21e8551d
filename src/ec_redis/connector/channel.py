"""Worker-half metrics reach vLLM through the scheduler half, whatever the process layout.

vLLM's V1 model runner never reads a worker's connector stats, and its encoder-only path even
drops the worker metadata; V2 reads them, but only where it runs. So the worker half that
speaks for the instance (TP rank 0) publishes its cumulative counters and its recent
observations in a small file on the host's tmpfs, and the scheduler half of the same engine
(same ``engine_id`` and data-parallel rank) reads it and reports the increments — each
exactly once, with the worker in the scheduler's process or not, under V1 and V2. The worker
half's own ``get_ec_connector_stats`` therefore reports nothing.

The file is replaced atomically (write, then rename); a publisher thread refreshes it at most
every ``interval_s`` while something changed, so counters that move after the last step (a
Redis write draining) still arrive.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHANNEL_PREFIX = "ec_redis-stats-"
MAX_OBSERVATIONS = 1024  # per publisher; older ones are dropped if nobody reads in time


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
        self._last = ""
        self._thread = threading.Thread(target=self._run, name="ec_redis-stats", daemon=True)
        self._thread.start()

    def publish(self) -> None:
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

    def __init__(self, directory: str, key: str) -> None:
        self._dir = Path(directory)
        self._pattern = f"{CHANNEL_PREFIX}{key}-*.json"
        remove_orphans(self._dir)
        self._counters: dict[str, dict[str, float]] = {}  # per file: last cumulative values
        self._seen: dict[str, int] = {}  # per file: last observation number reported

    def take(self) -> tuple[dict[str, float], dict[str, float], dict[str, list[float]], int]:
        """``(counter increments, gauges, new observations, step)``: ``step`` is the last
        step whose counters a publisher has published (-1: none yet)."""
        increments: dict[str, float] = {}
        gauges: dict[str, float] = {}
        observed: dict[str, list[float]] = {}
        step = -1
        for path in sorted(self._dir.glob(self._pattern)):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # replaced under us, or gone: the next read sees it
            name = path.name
            step = max(step, int(data.get("step", -1)))
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
