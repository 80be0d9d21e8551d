"""compose.yaml, compose.gpu.yaml, compose.cpu.yaml and their .env files, checked without a
Docker engine (tests/test_compose_engine.py runs them under one).

1. A real Compose implementation (Debian's docker-compose 1.29.2, offline) validates the files
   each env file names (.env: compose.yaml + compose.gpu.yaml; .env.cpu: compose.yaml +
   compose.cpu.yaml) and resolves the services of every profile.
2. What the resolved files say: the vLLM services configure ec_redis only through
   --ec-transfer-config; GPU flags and devices only on a GPU, CPU flags only on a CPU; every
   port on 127.0.0.1 by default; Redis and Grafana refuse to run open without a password.
3. Every series the Grafana dashboard queries is one the connector exports, and Prometheus
   finds the running servers by their service names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ec_redis.connector.stats import metric_names

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_FILES = {"nvidia": REPO_ROOT / ".env", "cpu": REPO_ROOT / ".env.cpu"}
COMPOSE_FILES = {
    "nvidia": ["compose.yaml", "compose.gpu.yaml"],
    "cpu": ["compose.yaml", "compose.cpu.yaml"],
}
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "ec_redis.json"
DOCKER_COMPOSE = shutil.which("docker-compose")
EC_CONNECTOR = {
    "ec_connector": "ECRedisConnector",
    "ec_connector_module_path": "ec_redis.connector",
}
VLLM_SERVICES = ("encoder", "pd", "vllm", "cluster-encoder", "cluster-pd")
API_SERVER = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
ALL_PROFILES = "epd,single,cluster,monitoring,grafana"

pytestmark = pytest.mark.compose

# The services each profile brings up (docker compose up with these COMPOSE_PROFILES).
PROFILE_SERVICES = {
    "": {"redis", "encoder", "pd", "proxy"},  # nothing set: .env's COMPOSE_PROFILES=epd
    "single": {"redis", "vllm"},
    "cluster": {
        *(f"redis-node-{i}" for i in range(1, 7)),
        "redis-cluster-init",
        "cluster-encoder",
        "cluster-pd",
        "cluster-proxy",
    },
    "monitoring": {"prometheus"},
    "epd,monitoring": {"redis", "encoder", "pd", "proxy", "prometheus"},
    "epd,monitoring,grafana": {"redis", "encoder", "pd", "proxy", "prometheus", "grafana"},
}

_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|([A-Za-z_]\w*))")


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of an env file (comments on their own lines, as both Compose versions
    read them)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        env[key] = value
    return env


def _compose_env() -> dict[str, str]:
    """A clean environment: the shell's COMPOSE_* or .env-named variables cannot leak in."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/")}


requires_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None and os.environ.get("EC_REDIS_REQUIRE_COMPOSE") != "1",
    reason="needs docker-compose (apt-get install docker-compose; scripts/test.sh does)",
)


def resolved(kind: str, profiles: str = ALL_PROFILES) -> dict[str, Any]:
    """``docker-compose --env-file ENV config``: the files that env file names, merged and
    interpolated by Compose itself, exactly what ``up`` would run."""
    assert DOCKER_COMPOSE is not None, "EC_REDIS_REQUIRE_COMPOSE=1 but docker-compose is missing"
    done = subprocess.run(
        [DOCKER_COMPOSE, "--env-file", ENV_FILES[kind].name, "config"],
        cwd=REPO_ROOT,
        env={**_compose_env(), "COMPOSE_PROFILES": profiles},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "is not set" not in done.stderr, done.stderr  # every variable has a value
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


def ec_transfer_config(service: dict[str, Any]) -> dict[str, Any]:
    args = service["command"]
    config: dict[str, Any] = json.loads(args[args.index("--ec-transfer-config") + 1])
    return config


# -- the env files -----------------------------------------------------------------------------


def test_env_files_define_every_variable_with_the_compose_defaults() -> None:
    """Every ${VAR} of the compose files is set in .env and .env.cpu (the same keys in both),
    and every default written in a compose file is .env's value."""
    gpu, cpu = (read_env_file(ENV_FILES[k]) for k in ("nvidia", "cpu"))
    assert gpu["COMPOSE_FILE"] == ":".join(COMPOSE_FILES["nvidia"])
    assert cpu["COMPOSE_FILE"] == ":".join(COMPOSE_FILES["cpu"])
    assert gpu["COMPOSE_PROFILES"] == cpu["COMPOSE_PROFILES"] == "epd"
    assert set(gpu) == set(cpu), set(gpu) ^ set(cpu)
    used = set()
    for name in ("compose.yaml", "compose.gpu.yaml", "compose.cpu.yaml"):
        for m in _VARIABLE.finditer((REPO_ROOT / name).read_text()):
            var = m.group(2) or m.group(5)
            if var is None:
                continue
            used.add(var)
            assert var in gpu, f"${{{var}}} is used in {name} but not set in .env"
            if m.group(3) is not None:
                assert gpu[var] == m.group(4), f"{name}: {var} default {m.group(4)!r} != .env"
    unused = set(gpu) - used - {"COMPOSE_PROFILES", "COMPOSE_PROJECT_NAME", "COMPOSE_FILE"}
    assert not unused, f".env sets variables no compose file uses: {sorted(unused)}"


@requires_compose
def test_every_port_binds_to_loopback_and_nothing_opens_without_a_password() -> None:
    for kind in ENV_FILES:
        env = read_env_file(ENV_FILES[kind])
        assert env["PUBLISH_ADDRESS"] == env["REDIS_PUBLISH_ADDRESS"] == "127.0.0.1"
        assert env["REDIS_PASSWORD"] == env["GRAFANA_ADMIN_PASSWORD"] == ""
        services = resolved(kind)["services"]
        published = {name: port for name, s in services.items() for port in s.get("ports", [])}
        assert set(published) >= {"redis", "encoder", "pd", "proxy", "vllm", "prometheus"}
        for name, port in published.items():
            text = port if isinstance(port, str) else f"{port.get('host_ip')}:{port}"
            assert text.startswith("127.0.0.1:"), f"{kind}: {name} publishes {port}"
        # Redis beyond loopback without a password, and Grafana without one, refuse to start
        # (their scripts say which key to set); no default admin login.
        redis_script = services["redis"]["command"][0]
        assert "REDIS_PASSWORD" in redis_script and "exit 78" in redis_script
        assert "--protected-mode no" in redis_script  # other containers reach it on any image
        assert "--requirepass" in redis_script
        grafana = services["grafana"]
        assert grafana["profiles"] == ["grafana"]  # monitoring alone never needs its image
        assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == ""
        assert "GRAFANA_ADMIN_PASSWORD" in grafana["command"][0]
        assert "exit 78" in grafana["command"][0]


@requires_compose
@pytest.mark.parametrize("kind", list(ENV_FILES))
def test_vllm_services_use_only_the_ec_transfer_config(kind: str) -> None:
    services = resolved(kind)["services"]
    env = read_env_file(ENV_FILES[kind])
    urls = {}
    for name in VLLM_SERVICES:
        service = services[name]
        entry = service["entrypoint"]
        assert entry[:3] == API_SERVER  # never `vllm serve`: a CPU build's script fails
        if kind == "nvidia":
            assert entry[3:5] == ["--gpu-memory-utilization", "0.9"]
            devices = service["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["driver"] == "nvidia" and len(devices[0]["device_ids"]) == 1
            assert "VLLM_CPU_KVCACHE_SPACE" not in service["environment"]
        else:
            # No devices, no GPU share of host RAM, eager (no compiler in the image).
            assert "deploy" not in service, name
            assert "--gpu-memory-utilization" not in entry + service["command"]
            assert "--enforce-eager" in entry
            assert service["environment"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
            assert any(v.endswith(":/models:ro") for v in service["volumes"])
        config = ec_transfer_config(service)
        assert {k: config[k] for k in EC_CONNECTOR} == EC_CONNECTOR
        urls[name] = config["ec_connector_extra_config"]["redis_url"]
        assert service["command"][service["command"].index("--model") + 1] == env["MODEL"]
        # nothing leaves the machine: vLLM's usage statistics are off
        assert service["environment"]["VLLM_NO_USAGE_STATS"] == "1"
        # ec_redis is configured through the JSON only, never through the environment.
        assert not any(k.upper().startswith("EC_REDIS") for k in service.get("environment", {}))
        assert "/health" in " ".join(service["healthcheck"]["test"])
    roles = {name: ec_transfer_config(services[name])["ec_role"] for name in VLLM_SERVICES}
    assert roles == {
        "encoder": "ec_producer",
        "pd": "ec_consumer",
        "vllm": "ec_both",
        "cluster-encoder": "ec_producer",
        "cluster-pd": "ec_consumer",
    }
    # The password (empty by default: none is sent) travels in the URL.
    assert urls["encoder"] == urls["pd"] == urls["vllm"] == "redis://:@redis:6379/0"
    nodes = ",".join(f"redis-node-{i}:6379" for i in range(1, 7))
    assert urls["cluster-encoder"] == urls["cluster-pd"] == f"redis+cluster://{nodes}"
    # vLLM's recommended encoder flags.
    for name in ("encoder", "cluster-encoder"):
        args = services[name]["command"]
        assert {"--enforce-eager", "--no-enable-prefix-caching"} <= set(args)
        batched = args[args.index("--max-num-batched-tokens") + 1]
        assert batched == env["ENCODER_MAX_NUM_BATCHED_TOKENS"]
    for name in ("proxy", "cluster-proxy"):
        conditions = {k: v["condition"] for k, v in services[name]["depends_on"].items()}
        assert set(conditions.values()) == {"service_healthy"} and len(conditions) == 2
    for name in ("cluster-encoder", "cluster-pd"):
        assert services[name]["depends_on"] == {
            "redis-cluster-init": {"condition": "service_completed_successfully"}
        }
    redis_script = services["redis"]["command"][0]
    assert '--maxmemory-policy "allkeys-lru"' in redis_script
    assert '--save ""' in redis_script  # persistence off by default
    assert '--appendonly "no"' in redis_script
    for i in range(1, 7):
        assert "--protected-mode" in services[f"redis-node-{i}"]["command"]


# -- Prometheus and the dashboard ----------------------------------------------------------------


def test_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = set(metric_names())
    histograms = {n.removesuffix("_bucket") for n in exported if n.endswith("_bucket")}
    queried: set[str] = set()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]  # rows only group panels
    assert len(panels) >= 10
    for panel in panels:
        exprs = [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
        assert exprs, f"panel {panel['title']!r} has no target"
        assert panel["datasource"]["uid"] == "prometheus"
        for expr in exprs:
            queried.update(re.findall(r"vllm:ec_redis_[a-z_]+", expr))
    for name in sorted(queried):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in exported or base in histograms, f"the dashboard queries {name}, not exported"
    # What the dashboard must show: hits per tier, bytes, latency quantiles, write queue
    # and drops, breaker state, bad blobs / rejected items / local fallbacks.
    required = {
        "vllm:ec_redis_hits_gpu_total",
        "vllm:ec_redis_hits_cpu_total",
        "vllm:ec_redis_hits_redis_total",
        "vllm:ec_redis_misses_total",
        "vllm:ec_redis_loaded_bytes_total",
        "vllm:ec_redis_saved_bytes_total",
        "vllm:ec_redis_redis_written_bytes_total",
        "vllm:ec_redis_fetch_seconds_bucket",
        "vllm:ec_redis_load_seconds_bucket",
        "vllm:ec_redis_save_seconds_bucket",
        "vllm:ec_redis_write_queue_depth",
        "vllm:ec_redis_write_drops_total",
        "vllm:ec_redis_breaker_state",
        "vllm:ec_redis_bad_blobs_total",
        "vllm:ec_redis_rejected_items_total",
        "vllm:ec_redis_local_fallbacks_total",
    }
    assert required <= queried, f"missing from the dashboard: {sorted(required - queried)}"
    text = DASHBOARD.read_text()
    quantile = "histogram_quantile(0.95, sum by (le, role) (rate(vllm:ec_redis_fetch_seconds_bucket"
    assert quantile in text  # per role: PD's fetches and an encoder's head checks differ


def test_prometheus_finds_the_running_servers_by_service_name() -> None:
    """DNS discovery of every vLLM service: one that is not running resolves to nothing,
    so it is no target (a static list would show the other profiles' servers as down)."""
    config = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert "static_configs" not in job
    (dns,) = job["dns_sd_configs"]
    # fully qualified (a trailing dot): never completed with the host's search domains
    assert dns["names"] == [f"{name}." for name in VLLM_SERVICES] and dns["port"] == 8000
    datasource = yaml.safe_load(
        (REPO_ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"][0]
    assert datasource["uid"] == "prometheus" and datasource["url"] == "http://prometheus:9090"


# -- docker-compose v1: validation and profile resolution ---------------------------------------

# Runs inside docker-compose's own Python: resolves the services `up` would start, with the
# same calls (the env file, its COMPOSE_FILE, --profile/COMPOSE_PROFILES,
# Project.get_services with dependencies) and a client stub instead of a Docker engine.
_RESOLVE = """
import json, sys
import docker.errors
from compose.cli.command import get_config_path_from_options, get_profiles_from_options
from compose.config import config
from compose.config.environment import Environment
from compose.project import Project

class Offline:
    def __getattr__(self, name):
        def call(*args, **kwargs):
            raise docker.errors.NotFound("no Docker engine: " + name)
        return call

environment = Environment.from_env_file(".", sys.argv[1])
files = get_config_path_from_options({}, environment)
details = config.find(".", files, environment)
data = config.load(details, interpolate=True)
profiles = get_profiles_from_options({"--profile": sys.argv[2:]}, environment)
project = Project.from_config("ec-redis", data, Offline(), enabled_profiles=profiles)
services = [s.name for s in project.get_services(include_deps=True)]
print(json.dumps({"files": files, "services": services}))
"""


def _resolve(kind: str, profiles: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    assert DOCKER_COMPOSE is not None, "EC_REDIS_REQUIRE_COMPOSE=1 but docker-compose is missing"
    interpreter = Path(DOCKER_COMPOSE).read_text().splitlines()[0].removeprefix("#!").split()
    done = subprocess.run(
        [*interpreter, "-c", _RESOLVE, ENV_FILES[kind].name, *profiles],
        cwd=REPO_ROOT,
        env={**_compose_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@requires_compose
@pytest.mark.parametrize("kind", list(ENV_FILES))
@pytest.mark.parametrize("profiles", list(PROFILE_SERVICES), ids=lambda p: p or "default")
def test_docker_compose_validates_and_resolves_the_profile(kind: str, profiles: str) -> None:
    flags = [arg for p in profiles.split(",") if p for arg in ("--profile", p)]
    done = subprocess.run(
        [DOCKER_COMPOSE or "docker-compose", "--env-file", ENV_FILES[kind].name, *flags, "config"],
        cwd=REPO_ROOT,
        env=_compose_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "is not set" not in done.stderr, done.stderr
    rendered = yaml.safe_load(done.stdout)
    # v1 prints every service whatever the profile; the profiles are in the output.
    assert set(rendered["services"]) == set().union(*PROFILE_SERVICES.values())
    # The services `up` starts for these profiles, resolved by docker-compose's own code,
    # from the files the env file names.
    result = _resolve(kind, [p for p in profiles.split(",") if p])
    assert [Path(f).name for f in result["files"]] == COMPOSE_FILES[kind]
    assert set(result["services"]) == PROFILE_SERVICES[profiles]


@requires_compose
def test_docker_compose_default_profile_comes_from_the_env_variable() -> None:
    """COMPOSE_PROFILES in the shell wins over .env's (the documented way to switch)."""
    result = _resolve("nvidia", [], {"COMPOSE_PROFILES": "single,monitoring"})
    assert set(result["services"]) == {"redis", "vllm", "prometheus"}


# -- the guards, run ---------------------------------------------------------------------------


def _run_script(
    script: str, tmp_path: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """A service's ``sh -c`` script as the container runs it (``config`` prints ``$$`` for
    ``$``), with stub binaries first on PATH that print their arguments."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name in ("redis-server", "grafana-run"):
        stub = stubs / name
        stub.write_text('#!/bin/sh\necho "RAN $0 $*"\n')
        stub.chmod(0o755)
    text = script.replace("$$", "$").replace("exec /run.sh", f"exec {stubs / 'grafana-run'}")
    return subprocess.run(
        ["sh", "-c", text],
        env={"PATH": f"{stubs}:/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


@requires_compose
@pytest.mark.parametrize(
    ("address", "password", "runs"),
    [
        ("127.0.0.1", "", True),
        ("[::1]", "", True),
        ("0.0.0.0", "", False),  # open to the network without a password
        ("192.0.2.7", "", False),
        ("0.0.0.0", "d41d8cd98f00b204e9800998ecf8427e", True),
        ("127.0.0.1", "ab/cd+ef", False),  # would break the engines' Redis URL
        ("127.0.0.1", 'q"uote', False),  # would break their JSON config
        ("0.0.0.0", "a%41b", False),  # would be decoded to another password
    ],
)
def test_redis_refuses_to_start_open_or_with_a_password_its_clients_cannot_send(
    tmp_path: Path, address: str, password: str, runs: bool
) -> None:
    script = resolved("cpu")["services"]["redis"]["command"][0]
    done = _run_script(script, tmp_path, {"PUBLISHED_ON": address, "REDIS_PASSWORD": password})
    if runs:
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("RAN ") and "--protected-mode no" in done.stdout
        assert ("--requirepass " + password in done.stdout) == bool(password), done.stdout
    else:
        assert done.returncode == 78 and "RAN" not in done.stdout, (done.stdout, done.stderr)
        assert "REDIS_PASSWORD" in done.stderr  # names the key to set


@requires_compose
@pytest.mark.parametrize(("password", "runs"), [("", False), ("s3cret-enough", True)])
def test_grafana_refuses_to_start_without_a_password(
    tmp_path: Path, password: str, runs: bool
) -> None:
    script = resolved("cpu")["services"]["grafana"]["command"][0]
    done = _run_script(script, tmp_path, {"GF_SECURITY_ADMIN_PASSWORD": password})
    assert (done.returncode == 0 and "RAN" in done.stdout) == runs, (done.stdout, done.stderr)
    if not runs:
        assert done.returncode == 78 and "GRAFANA_ADMIN_PASSWORD" in done.stderr
