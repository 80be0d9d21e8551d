"""Rate-limited logging: one line per problem kind per interval, with a suppressed count."""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("ec_redis")


class RateLimitedLog:
    """Logs a warning per ``kind`` at most once every ``interval_s`` seconds."""

    def __init__(self, interval_s: float = 10.0, log: logging.Logger = logger) -> None:
        self._interval_s = interval_s
        self._log = log
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        suffix = f" ({suppressed} similar suppressed)" if suppressed else ""
        self._log.warning(message + suffix, *args)
