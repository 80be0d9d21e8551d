"""Shared fixtures: real redis-server processes on free ports, fakeredis, small tensors and
the tiny LLaVA model."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import fakeredis
import pytest
import redis
import torch

from ec_redis.embedded import EmbeddedRedis

HAS_REDIS_SERVER = shutil.which("redis-server") is not None
HAS_CUDA = torch.cuda.is_available()
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "vllm" in item.keywords and not HAS_VLLM:
            if os.environ.get("EC_REDIS_REQUIRE_VLLM") == "1":
                raise pytest.UsageError("vLLM is required (scripts/install_vllm.sh installs it)")
            item.add_marker(pytest.mark.skip(reason="needs vLLM (scripts/install_vllm.sh)"))
        if "redis" in item.keywords and not HAS_REDIS_SERVER:
            if os.environ.get("EC_REDIS_REQUIRE_REDIS") == "1":
                raise pytest.UsageError("redis-server is required (scripts/test.sh installs it)")
            item.add_marker(pytest.mark.skip(reason="needs the redis-server binary"))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """One real redis-server for the session (tests flush it between uses)."""
    server = EmbeddedRedis.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """URL of the session's real Redis, emptied before each test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    """A real redis-server of this test's own, for tests that kill, pause or restart it."""
    server = EmbeddedRedis.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaVA model (seed 0), built once per session; needs transformers (vLLM's)."""
    from tests.e2e.tiny_model import build_tiny_llava

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
