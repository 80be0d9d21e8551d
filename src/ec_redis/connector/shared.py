"""One TieredCache per process and configuration, shared by the scheduler and worker halves.

With vLLM's single-process executor both halves live in the engine-core process; sharing one
cache lets items this instance saved be found locally and keeps one set of byte budgets.

The cache reads on the host, whichever half builds it: the scheduler half stages host
tensors and workers copy them onto their own device, so nothing reads through ``get`` onto a
GPU. Building it touches no CUDA, and only a worker's put of a device tensor ever does — on
that tensor's own device (the rank's), never ``config.device`` (``tiers/transfer.py``).
"""

from __future__ import annotations

import threading

import torch

from ec_redis.cache import TieredCache
from ec_redis.config import CacheConfig
from ec_redis.keys import ModelIdentity

HOST = torch.device("cpu")
_lock = threading.Lock()
_caches: dict[tuple[CacheConfig, ModelIdentity], tuple[TieredCache, int]] = {}


def acquire(config: CacheConfig, identity: ModelIdentity) -> TieredCache:
    """The process's cache for ``(config, identity)``, created on first use."""
    key = (config, identity)
    with _lock:
        cache, users = _caches.get(key, (None, 0))
        if cache is None:
            cache = TieredCache(config, identity=identity, device=HOST)
        _caches[key] = (cache, users + 1)
        return cache


def release(cache: TieredCache, timeout_s: float = 5.0) -> None:
    """Drop one user; the last one closes the cache (draining writes up to ``timeout_s``)."""
    with _lock:
        key = (cache.config, cache.identity)
        current, users = _caches.get(key, (None, 0))
        if current is not cache:
            closing = True
        elif users > 1:
            _caches[key] = (cache, users - 1)
            closing = False
        else:
            del _caches[key]
            closing = True
    if closing:
        cache.close(timeout_s)
