"""A ``unix://`` Redis URL (docs/operating.md's topology table promises it) on a real server."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ec_redis.cli.main import main as cli_main
from ec_redis.config import CacheConfig
from ec_redis.redis_conn import make_client

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


@pytest.fixture
def socket_url(tmp_path: Path) -> str:
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly",
         "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.05)
        assert sock.exists(), "redis-server made no socket"
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_unix_socket_url_connects_stores_and_passes_doctor(
    socket_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ec_redis.cache import TieredCache

    client = make_client(CacheConfig.from_dict({"redis_url": socket_url}))
    assert client.ping() is True  # was: TypeError (socket_keepalive) before any I/O
    client.close()
    cache = TieredCache(CacheConfig.from_dict({"redis_url": socket_url, "namespace": "ux"}))
    try:
        x = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32).to(torch.bfloat16)
        cache.put("item", x)
        assert cache.flush()
        assert cache.redis is not None
        got = cache.redis.get("item")  # from Redis itself, not a local tier
        assert got is not None and torch.equal(got, x)
    finally:
        cache.close()
    assert cli_main(["doctor", "--redis-url", socket_url]) == 0, capsys.readouterr()
