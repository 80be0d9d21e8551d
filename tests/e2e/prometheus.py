"""A real Prometheus for tests: Debian's ``prometheus`` binary run directly (never the system
service) with its own config and a temporary TSDB, and its HTTP query API.

``scripts/test.sh`` installs the binary (apt) when missing; ``EC_REDIS_REQUIRE_PROMETHEUS=1``
(set there) turns a missing binary into a failure instead of a skip.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import requests
import yaml

from tests.e2e.harness import REPO_ROOT, CommandServer, stop_servers

PROMETHEUS = shutil.which("prometheus")
REQUIRED = os.environ.get("EC_REDIS_REQUIRE_PROMETHEUS") == "1"
INSTALL_HINT = "apt-get install prometheus; scripts/test.sh does"
DEPLOY_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "ec_redis.json"


# What deploy/prometheus/prometheus.yml's relabelling makes of each compose service.
SERVICES = {
    "encoder": ("encoder", "epd"),
    "pd": ("pd", "epd"),
    "vllm": ("single", "single"),
    "cluster-encoder": ("encoder", "cluster"),
    "cluster-pd": ("pd", "cluster"),
}


def scrape_config(targets: dict[str, str], profile: str, scrape_interval_s: int) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with ``profile``'s role -> ``host:port`` as static
    targets instead of Docker's DNS: each carries the ``__meta_dns_name`` the DNS discovery
    would give it, so the deployment's own relabelling makes its labels (the dashboard's
    ``role`` included), and a faster scrape interval."""
    config: dict[str, Any] = yaml.safe_load(DEPLOY_CONFIG.read_text())
    config["global"]["scrape_interval"] = f"{scrape_interval_s}s"
    config["global"]["evaluation_interval"] = f"{scrape_interval_s}s"
    (job,) = config["scrape_configs"]
    (dns,) = job.pop("dns_sd_configs")
    assert {n.rstrip(".") for n in dns["names"]} == set(SERVICES), "deploy/ scrapes others"
    static = []
    for service, (role, in_profile) in SERVICES.items():
        if in_profile == profile and role in targets:
            labels = {"__meta_dns_name": f"{service}."}  # as the DNS discovery names it
            static.append({"targets": [targets[role]], "labels": labels})
    assert len(static) == len(targets), "roles missing from deploy/"
    job["static_configs"] = static
    return config


class Prometheus:
    """One ``prometheus`` process on a free port; ``stop`` ends it."""

    def __init__(self, config: dict[str, Any], work_dir: Path) -> None:
        from ec_redis.embedded import free_port

        assert PROMETHEUS is not None, f"no prometheus binary ({INSTALL_HINT})"
        work_dir.mkdir(parents=True, exist_ok=True)
        config_path = work_dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = CommandServer(
            "prometheus",
            [
                PROMETHEUS,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={work_dir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            self.port,
            work_dir,
        )

    def wait_ready(self, timeout_s: float = 60) -> None:
        """Until GET /-/ready answers 200 (Prometheus has no /health)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.server.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited\n{self.server.log_tail()}")
            try:
                if requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready\n{self.server.log_tail()}")
            time.sleep(0.2)

    def _api(self, path: str, **params: Any) -> list[dict[str, Any]]:
        response = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (
            f"{path} {params}: {response.status_code} {body}"
        )
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        """An instant query: ``[{"metric": {...}, "value": [t, "v"]}, ...]``."""
        return self._api("query", query=expr, time=at)

    def query_range(
        self, expr: str, start: float, end: float, step_s: float
    ) -> list[dict[str, Any]]:
        """A range query, as Grafana runs a time-series panel: ``[{"metric", "values"}]``."""
        return self._api("query_range", query=expr, start=start, end=end, step=step_s)

    def stop(self) -> None:
        stop_servers([self.server])


def values(result: list[dict[str, Any]]) -> list[float]:
    """Every sample value of a query result (instant or range), NaNs included."""
    out: list[float] = []
    for series in result:
        samples = series.get("values") or [series["value"]]
        out += [float(v) for _, v in samples]
    return out


def finite(result: list[dict[str, Any]]) -> list[float]:
    return [v for v in values(result) if math.isfinite(v)]


def dashboard_targets() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``(panel title, panel, target)`` for every query of the Grafana dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], panel, target)
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def grafana_expr(expr: str, range_s: int, scrape_s: int) -> str:
    """The expression as Grafana sends it with every template variable on "All" (allValue
    ".*"), a ``range_s`` time range and a step of one scrape: ``$__rate_interval`` is then 4
    scrape intervals (Grafana's floor for it)."""
    return (
        expr.replace("$__rate_interval", f"{4 * scrape_s}s")
        .replace("$__range", f"{range_s}s")
        .replace("$role", ".*")
        .replace("$instance", ".*")
    )
