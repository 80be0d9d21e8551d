"""``ec-redis demo``: the README's first command, on an embedded Redis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.redis]


def test_demo_runs_encoder_to_pd_through_the_connector_on_an_embedded_redis() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ec_redis.cli.main", "demo", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["mode"] == "connector"
    assert len(report["items"]) == 2
    assert report["pd_counters"]["hits_redis"] == 2  # the PD side read both from Redis
    assert "embedded" in out.stderr  # it said which server it used
