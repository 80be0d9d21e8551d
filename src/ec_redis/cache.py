"""TieredCache: GPU -> CPU -> Redis lookups with promotion; puts that never wait on Redis."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ec_redis.breaker import CircuitBreaker
from ec_redis.codec import destination
from ec_redis.codec.format import BY_TORCH, MAX_NDIM
from ec_redis.config import CacheConfig
from ec_redis.errors import ConfigError, TensorError
from ec_redis.keys import KeyBuilder, ModelIdentity
from ec_redis.logutil import RateLimitedLog
from ec_redis.offload import handshake
from ec_redis.offload.sink import ProcessSink
from ec_redis.stats import Counters
from ec_redis.tiers import notify
from ec_redis.tiers.cpu import HostTier
from ec_redis.tiers.gpu import DeviceTier
from ec_redis.tiers.lease import Claim
from ec_redis.tiers.pinned import PinnedPool
from ec_redis.tiers.redis_tier import RedisTier, RedisTierOptions
from ec_redis.tiers.transfer import HostCopy, Transfer
from ec_redis.writer import BackgroundWriter

Shape = tuple[int, ...]


class TieredCache:
    """Item id -> tensor, served from the fastest tier that has it.

    ``get`` walks GPU -> CPU -> Redis and promotes hits into the faster tiers. ``put`` stores
    locally and queues the Redis write. Tensors handed out are shared with the cache: treat
    them as read-only. Redis problems become misses and counters, never exceptions.

    ``device`` (default: ``config.device``) is where ``get`` returns tensors. Puts copy from
    wherever the tensor lives, so a cache built with ``device=torch.device("cpu")`` that is
    only given host tensors never touches CUDA.
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        identity: ModelIdentity | None = None,
        redis_client: Any = None,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.identity = identity or ModelIdentity(
            config.model_name,
            config.model_revision,
            config.model_dtype,
            config.embed_width,
            config.model_fingerprint,
        )
        # Where get() returns tensors; an explicit ``device`` skips even asking CUDA whether
        # it exists. Nothing here touches CUDA: streams and pinned slabs are made by the first
        # copy that needs them, on the device of the tensor being copied.
        self.device = _resolve_device(config.device) if device is None else device
        self.transfer = Transfer(
            self.device, PinnedPool(config.cpu_cache_bytes + config.write_queue_bytes)
        )
        self.cpu = HostTier(config.cpu_cache_bytes, self.transfer)
        self.gpu = DeviceTier(config.gpu_cache_bytes, on_evict=self._spill)
        self.counters = Counters()
        self._log = RateLimitedLog()
        self.redis: RedisTier | None = None
        self.writer: BackgroundWriter | None = None
        self.process_sink: ProcessSink | None = None
        check = redis_client is None and config.redis_check_on_start
        own_client = redis_client is None and bool(config.redis_url)  # a child can rebuild it
        if own_client:
            from ec_redis.redis_conn import make_client

            redis_client = make_client(config)
        if redis_client is not None:
            self.redis = redis_tier(config, self.identity, redis_client)
            if check:
                self._check_redis(redis_client)
            self.process_sink = self._process_sink() if own_client else None
            self.writer = BackgroundWriter(
                self.process_sink or self._write_to_redis,
                config.write_queue_items,
                config.write_queue_bytes,
                config.writer_threads,
                on_lost=self._write_lost,
                dispatcher=self.process_sink,
            )
        self._closed = False

    def _process_sink(self) -> ProcessSink | None:
        """Writer processes for this cache's Redis writes (``offload/``), unless configured
        off or the platform has no ``memfd``."""
        if not self.config.writer_process or not hasattr(os, "memfd_create"):
            return None
        assert self.redis is not None
        config = self.config
        try:  # a configuration the child cannot rebuild fails here, naming its key
            spec = handshake.setup_message(config, self.identity, producer_id(config))
        except ConfigError:
            self.redis.close()
            raise
        per_call = config.redis_connect_timeout_s + config.redis_socket_timeout_s
        return ProcessSink(
            spec,
            self.redis.counters,
            self._write_to_redis,
            arena_limit=config.write_queue_bytes,
            max_children=config.writer_threads,
            # far beyond what the child's own timeouts allow a write (it then answers False)
            reply_timeout_s=60.0 + 8 * (config.redis_retries + 1) * per_call,
        )

    def warm_writes(self, wait_s: float = 0.0) -> bool:
        """Start a writer process now (a saving engine's start-up), not at the first write
        (writes run on the writer thread until one is up); ``wait_s``: wait that long for it.
        True if one is up (or none is configured)."""
        if self.process_sink is None:
            return True
        self.process_sink.warm()
        return wait_s <= 0 or self.process_sink.wait_ready(wait_s)

    def _check_redis(self, client: Any) -> None:
        """Fail start-up on a configuration problem; only warn about an outage."""
        from ec_redis.redis_conn import check_connection

        assert self.redis is not None
        try:
            outage = check_connection(client)
        except Exception:
            self.redis.close()
            raise
        if outage is not None:
            self.redis.counters.inc("errors")
            self.redis.breaker.failure()
            self._log.warning(
                "start", "ec_redis: Redis %s unreachable at start (%s); serving local tiers "
                "until it answers", self.config.describe()["redis_url"], outage,
            )  # fmt: skip

    @classmethod
    def from_config(
        cls, raw: Mapping[str, Any] | CacheConfig | None = None, **kwargs: Any
    ) -> TieredCache:
        """Build from a plain dict (validated; ``ConfigError`` on bad keys) or a config."""
        config = raw if isinstance(raw, CacheConfig) else CacheConfig.from_dict(raw)
        return cls(config, **kwargs)

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: str) -> torch.Tensor | None:
        """The tensor for ``key`` on ``self.device``, or ``None``."""
        return self.get_many([key])[key]

    def get_many(
        self, keys: Iterable[str], *, on_host: bool = False, claim: Claim | None = None
    ) -> dict[str, torch.Tensor | None]:
        """Look up several ids; the Redis misses of local tiers go in one pipelined batch.

        ``on_host=True`` returns host tensors that own their memory (never pooled pinned
        buffers, which return to their pool) and promotes nothing to the GPU tier: for
        handing items to another process or to code that copies them itself. A read that
        landed in a buffer the caller lent (``codec/destination.py``) is not kept in the CPU
        tier either: those bytes are the caller's. ``claim``: single-flight claims for the
        items Redis is asked about (``tiers/lease.py``); an item a local tier holds is not.
        """
        out: dict[str, torch.Tensor | None] = {}
        remote: list[str] = []
        for key in dict.fromkeys(map(_check_key, keys)):
            out[key] = self._get_local(key, on_host)
            if out[key] is None:
                remote.append(key)
        if remote and self.redis is not None and not self._closed:
            for key, host_tensor in self._redis_get_many(remote, claim).items():
                if host_tensor is None:
                    continue
                if not destination.is_lent(host_tensor):
                    out[key] = self._promote(key, HostCopy(host_tensor), on_host)
                elif on_host:  # the caller's buffer: not ours to keep in a tier
                    out[key] = host_tensor
                else:
                    out[key] = self.transfer.to_device(HostCopy(host_tensor))
        hits = sum(v is not None for v in out.values())
        self.counters.inc("hits", hits)
        self.counters.inc("misses", len(out) - hits)
        return out

    def _redis_get_many(
        self, keys: list[str], claim: Claim | None = None
    ) -> dict[str, torch.Tensor | None]:
        """Redis lookups; the tier turns Redis faults into misses, this guards against bugs."""
        assert self.redis is not None
        try:
            return self.redis.get_many(keys, claim)
        except Exception as exc:  # a cache read must never take a vLLM step down with it
            self._internal_error("a Redis read", exc)
            return {}

    def _get_local(self, key: str, on_host: bool = False) -> torch.Tensor | None:
        tensor = self.gpu.get(key) if self.gpu.enabled else None
        if tensor is not None:
            return _owned_host(tensor) if on_host else tensor
        if on_host:
            host = self.cpu.get_host_copy(key) if self.cpu.enabled else None
            if host is not None:
                return host.owned()
        else:
            tensor = self.cpu.get(key) if self.cpu.enabled else None
            if tensor is not None:
                self._gpu_put(key, tensor)
                return tensor
        if self.writer is not None:
            pending = self.writer.pending(key)  # put but not yet in Redis: read your writes
            if pending is not None:
                self.counters.inc("pending_write_hits")
                return self._promote(key, pending, on_host)
        return None

    def _promote(self, key: str, host: HostCopy, on_host: bool = False) -> torch.Tensor:
        self.cpu.put_host(key, host)
        if on_host:
            return host.owned()
        tensor = self.transfer.to_device(host)
        self._gpu_put(key, tensor)
        return tensor

    def contains(self, key: str) -> bool:
        """Whether any tier has ``key`` (one Redis EXISTS when the local tiers miss)."""
        if self.gpu.contains(key) or self.cpu.contains(key):
            return True
        if self.writer is not None and self.writer.pending(key) is not None:
            return True
        return self.redis is not None and self.redis.contains(key)

    def describe_many(
        self, keys: Iterable[str], claim: Claim | None = None
    ) -> dict[str, tuple[torch.dtype, Shape] | None]:
        """dtype and shape of entries published to Redis: whole there (the head and every
        chunk it names), read without moving tensor bytes. ``None``: not published. A write
        still queued or in flight is not published: the queue may yet drop it (full, breaker
        open, refused), and a producer told "published" would never encode the item again.
        ``claim``: as ``get_many``'s (an item whose write is still queued is not claimed)."""
        out: dict[str, tuple[torch.dtype, Shape] | None] = dict.fromkeys(map(_check_key, keys))
        if out and self.redis is not None and not self._closed:
            try:
                if claim is not None and self.writer is not None:  # ours: being written
                    claim.rows = {k: v for k, v in claim.rows.items() if not self._writing(k)}
                out.update(self.redis.describe_many(list(out), claim))
            except Exception as exc:  # never take a vLLM step down with a cache read
                self._internal_error("a head read", exc)
        return out

    def _writing(self, key: str) -> bool:
        return self.writer is not None and self.writer.pending(key) is not None

    def release_lease(self, key: str, claim_value: bytes) -> None:
        """Give up a single-flight lease this process claimed and will not fulfil."""
        if self.redis is not None and not self._closed:
            try:
                self.redis.release(key, claim_value)
            except Exception as exc:  # best effort: the lease expires by itself
                self._internal_error("a lease release", exc)

    def _write_lost(self, key: str) -> bool:
        """The queue dropped the write of ``key``: end its single-flight lease (a writer
        thread), so instances waiting for it encode it now. False: Redis did not take it.
        With writer processes, a child ends it: its breaker, not this tier's, saw the writes."""
        if self.redis is None or self._closed:
            return False
        ended = self.process_sink.end_lease(key) if self.process_sink is not None else None
        return self.redis.end_lease(key) if ended is None else ended

    # -- writes --------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Cache ``tensor`` under ``key``; returns at once (the Redis write is queued).

        Raises ``TensorError`` for tensors the format cannot hold (a caller bug). Returns
        False when no tier took it (too large for every one, or a closed cache). Anything
        else that fails — a CUDA OOM in the GPU tier's compacting clone, a failed copy —
        costs this entry, is counted (``internal_errors``) and logged, and returns False
        instead of raising.
        """
        _check_key(key)
        _check_tensor(tensor)
        if self._closed:
            return False
        try:
            return self._store(key, tensor.detach())
        except Exception as exc:  # a put costs sharing on failure, never the caller's step
            self._internal_error("a put", exc)
            return False

    def _store(self, key: str, tensor: torch.Tensor) -> bool:
        """Whether some tier took it (a queued Redis write counts)."""
        on_gpu = self._gpu_put(key, tensor)
        if on_gpu:
            self.cpu.delete(key)  # an older CPU copy would outlive it: spills skip such keys
        if on_gpu and self.writer is None:
            return True
        host = self.transfer.to_host(tensor)
        kept = on_gpu or self.cpu.put_host(key, host)
        queued = self.writer is not None and self.writer.submit(key, host)
        return kept or queued

    def delete(self, key: str) -> None:
        """Remove ``key`` from every tier (UNLINK in Redis)."""
        self.gpu.delete(key)
        self.cpu.delete(key)
        if self.writer is not None:
            self.writer.discard(key)  # a queued write would serve and then resurrect it
        if self.redis is not None:
            self.redis.delete(key)

    def _gpu_put(self, key: str, tensor: torch.Tensor) -> bool:
        """The GPU tier's put, for tensors on the reads device only: anything else could not
        be served without a copy, and would be read later on another thread's stream,
        unordered with its producer's. (The connector's host-reads cache therefore keeps no
        device tensors: no GPU memory held behind vLLM's back.) A failure — a CUDA OOM in the
        compacting clone — costs only the GPU copy, and drops an older GPU copy of ``key``
        so it is never served instead."""
        if not self.gpu.enabled:
            return False
        if not _on(tensor, self.device):
            self.gpu.delete(key)  # an older GPU copy must not be served over this put
            return False
        try:
            return self.gpu.put(key, tensor)
        except Exception as exc:
            self.gpu.delete(key)
            self._internal_error("a GPU-tier put", exc)
            return False

    def _spill(self, key: str, tensor: torch.Tensor) -> None:
        """GPU eviction: keep a host copy unless the CPU tier already has one. Runs inside the
        GPU tier's put, so a failed copy is counted here and lets the other evictions spill."""
        if self.cpu.contains(key):
            return
        try:
            self.cpu.put(key, tensor)
        except Exception as exc:
            self._internal_error("a spill", exc)
            return
        self.counters.inc("spills")

    def _internal_error(self, what: str, exc: Exception) -> None:
        self.counters.inc("internal_errors")
        self._log.warning("internal", "ec_redis: unexpected error in %s: %r", what, exc)

    def _write_to_redis(self, key: str, host: HostCopy) -> bool:
        assert self.redis is not None
        return self.redis.put(key, host.tensor)  # announced by the switch itself

    def subscribe(self, on_item: Callable[[str], object]) -> notify.Subscription | None:
        """Call ``on_item(item)`` for every entry any writer announces from now on (on a
        thread); ``None`` without Redis."""
        if self.redis is None:
            return None
        return notify.Subscription(
            self.redis.client, self.redis.keys.channel(), on_item, self.counters
        )

    # -- lifecycle -----------------------------------------------------------------------

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait for pending Redis writes; False if ``timeout_s`` passed first."""
        return self.writer.flush(timeout_s) if self.writer is not None else True

    def dispatch_writes(self, keys: Iterable[str]) -> list[str]:
        """Hand the queued Redis writes of ``keys`` to writer processes now, from this (the
        engine's) thread, without blocking: each one handed over lands with no thread of
        this process needed (``offload/peek.py``). The keys handed over; none without writer
        processes that read items where they are."""
        return self.writer.dispatch(keys) if self.writer is not None else []

    def collect_writes(self) -> int:
        """Take the outcomes of writes handed to writer processes that are done, on this (the
        engine's) thread, without blocking (``writer.py``: handing over wakes no thread);
        how many."""
        return self.writer.collect() if self.writer is not None else 0

    def wait_written(self, keys: Iterable[str], timeout_s: float) -> bool:
        """Wait until the Redis writes of ``keys`` are done (stored, failed or dropped); False
        if ``timeout_s`` passed first."""
        return self.writer.wait_written(keys, timeout_s) if self.writer is not None else True

    def close(self, timeout_s: float = 5.0) -> None:
        """Drain writes (bounded by ``timeout_s``), stop threads, release memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.writer is not None:
            self.writer.close(timeout_s)
        if self.process_sink is not None:
            self.process_sink.close(timeout_s)
        if self.redis is not None:
            self.redis.close()
        self.gpu.close()
        self.cpu.close()
        self.transfer.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """Hits/misses per tier, bytes, evictions, errors and the write queue."""
        out: dict[str, Any] = self.counters.snapshot()
        out["gpu"] = self.gpu.stats()
        out["cpu"] = self.cpu.stats()
        if self.redis is not None:
            out["redis"] = self.redis.stats()
        if self.writer is not None:
            out["writer"] = self.writer.stats()
            if self.process_sink is not None:
                out["writer"].update(self.process_sink.stats())
        return out


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` lives on ``device`` (a bare ``cuda`` matches any CUDA index)."""
    index: int | None = device.index  # typed int by torch's stubs, None for a bare "cuda"
    return tensor.device.type == device.type and index in (None, tensor.device.index)


def _owned_host(tensor: torch.Tensor) -> torch.Tensor:
    """A GPU-tier tensor as a host tensor that owns its memory: device tensors are copied
    down, host tensors are kept (the GPU tier never holds pool memory)."""
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu")


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"an item id must be a non-empty string, got {key!r}")
    return key


def _check_tensor(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TensorError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TensorError(f"dense tensors only, got layout {tensor.layout}")
    if tensor.dtype not in BY_TORCH:
        raise TensorError(f"dtype {tensor.dtype} is not supported")
    if not 1 <= tensor.dim() <= MAX_NDIM:
        raise TensorError(f"tensors of rank 1..{MAX_NDIM} are supported, got {tensor.dim()}")


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        from ec_redis.errors import ConfigError

        raise ConfigError(
            f"ec_redis config key 'device': {name!r} but CUDA is unavailable; "
            "example: {'device': 'auto'}"
        )
    return device


def redis_tier(config: CacheConfig, identity: ModelIdentity, client: Any) -> RedisTier:
    """The Redis tier ``config`` describes, over ``client`` (also the writer process's)."""
    return RedisTier(
        client,
        KeyBuilder(config.namespace, identity, config.tenant_salt),
        _tier_options(config, identity),
        CircuitBreaker(
            config.breaker_failures, config.breaker_cooldown_s, config.breaker_max_cooldown_s
        ),
    )


def producer_id(config: CacheConfig) -> str:
    """What this process's blobs name as their writer (its writer process names the same)."""
    return config.producer_id or f"{socket.gethostname()}:{os.getpid()}"


def _tier_options(config: CacheConfig, identity: ModelIdentity) -> RedisTierOptions:
    return RedisTierOptions(
        chunk_bytes=config.chunk_bytes,
        max_blob_bytes=config.max_blob_bytes,
        ttl_s=config.ttl_s,
        ttl_sliding=config.ttl_sliding,
        orphan_grace_s=config.orphan_grace_s,
        compression=config.compression,
        compression_min_ratio=config.compression_min_ratio,
        byte_shuffle=config.byte_shuffle,
        producer_id=producer_id(config),
        model=identity.label(),
        announce=config.announce_writes,
    )
