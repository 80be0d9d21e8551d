"""Push, not poll: a writer announces every entry it stores on its model's Redis pub/sub
channel (the swap script PUBLISHes in the same atomic step that makes the entry current,
``tiers/scripts.py``); a waiting reader's subscriber thread hands each announced item id to a
callback. Polling stays the fallback: a lost message (a
reconnect, a Cluster node change) costs one recheck interval, never an item.

Plain PUBLISH/SUBSCRIBE works on one server, Sentinel, Valkey and Redis Cluster (where a
message reaches subscribers on every node). The payload is the item id as vLLM names it; the
channel carries the model fingerprint and tenant salt, so tenants never hear each other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters

RECONNECT_S = (0.05, 5.0)  # first and longest pause before a subscriber reconnects


class Subscription:
    """A daemon thread listening on ``channel``; ``close`` stops it within a second."""

    def __init__(
        self, client: Any, channel: str, on_item: Callable[[str], object], counters: Counters
    ) -> None:
        self._client = client
        self._channel = channel
        self._on_item = on_item
        self.counters = counters
        self._stop = threading.Event()
        self._log = RateLimitedLog()
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ec_redis-notify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pause = RECONNECT_S[0]
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self._channel)
                self.connected.set()
                pause = RECONNECT_S[0]
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None and message.get("type") == "message":
                        self._deliver(message["data"])
            except Exception as exc:  # a dropped connection: polling covers the gap
                self.connected.clear()
                self.counters.inc("notify_reconnects")
                self._log.warning(
                    "notify", "ec_redis: notification channel lost (%r); reconnecting", exc
                )
                self._stop.wait(pause)
                pause = min(pause * 2, RECONNECT_S[1])
            finally:
                if pubsub is not None:
                    _close(pubsub)

    def _deliver(self, data: Any) -> None:
        item = data.decode("utf-8", "surrogatepass") if isinstance(data, bytes) else str(data)
        self.counters.inc("notifications")
        try:
            self._on_item(item)
        except Exception as exc:  # a callback bug must not end the subscription
            self._log.warning("notify-callback", "ec_redis: notification handler: %r", exc)

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


def _close(pubsub: Any) -> None:
    with contextlib.suppress(Exception):  # closing a broken connection may raise; it is gone
        pubsub.close()
