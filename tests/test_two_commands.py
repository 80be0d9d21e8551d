"""The README's two commands: ``bash scripts/run.sh`` (the main job) and ``bash scripts/test.sh``
(what CI runs).

Neither is run for real here: ``scripts/test.sh`` is the run these tests belong to, and
``scripts/run.sh`` installs into ``.venv/`` (which must not be rebuilt under a running test).
Each runs as documented in a copy of the repository's scripts, with every install step and
the ``ec-redis`` it ends in replaced by stubs that write down how they were called: so the
tests see what the command does, and ``tests/connector/test_demo.py`` runs that ``ec-redis
demo`` (and its ``--hooks-only`` walk) for real.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from tests.doc_commands import ROOT, doc_command

# A stand-in that writes down its name and arguments (and, for scripts/test.sh, where).
STUB = """#!/usr/bin/env bash
printf '%s\\n' "NAME${*:+ $*}" >> "$STUB_LOG"
"""


def stub(path: Path, name: str, text: str = STUB) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace("NAME", name))
    path.chmod(0o755)


def run_in_copy(
    command: str, tmp_path: Path, copied: str, env: dict[str, str] | None = None
) -> list[str]:
    """``command`` run by bash in ``tmp_path`` holding a copy of the repository's script
    ``copied`` and stubs for everything it may call; returns the calls, in order."""
    stub(tmp_path / "bin" / "python3", "python3")  # `python3 -m venv .venv`: no new venv
    stub(tmp_path / ".venv" / "bin" / "python", "venv-python")  # the pip installs
    stub(tmp_path / ".venv" / "bin" / "ec-redis", "ec-redis")
    stub(tmp_path / "scripts" / "install_vllm.sh", "install_vllm.sh")
    stub(tmp_path / "scripts" / "test.sh", "test.sh", STUB.replace("NAME", "NAME in $PWD"))
    (tmp_path / copied).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / copied, tmp_path / copied)
    log = tmp_path / "calls.log"
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("EC_REDIS_")}
    run_env = {
        **inherited,
        **(env or {}),
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "STUB_LOG": str(log),
    }
    done = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env=run_env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_ci_runs_exactly_the_documented_test_command(tmp_path: Path) -> None:
    command = doc_command("bash scripts/test.sh")
    lines = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[-1] == f"exec {command}", lines  # CI's last word is the README's command
    # and it runs it from the repository root, wherever CI starts it from
    ci = shlex.quote(str(tmp_path / ".ci" / "run"))
    calls = run_in_copy(f"cd / && {ci}", tmp_path, ".ci/run")
    assert calls == [f"test.sh in {tmp_path}"]


def test_the_main_job_installs_and_runs_the_demo(tmp_path: Path) -> None:
    command = doc_command("bash scripts/run.sh")
    calls = run_in_copy(command, tmp_path, "scripts/run.sh")
    assert calls[0] == "python3 -m venv .venv"
    installs = [c for c in calls if c.startswith("venv-python -m pip install")]
    assert any(c.endswith(" torch==2.13.0") for c in installs), calls  # the CPU pin
    assert any(c.endswith(" -e .") for c in installs), calls
    assert "install_vllm.sh .venv" in calls
    assert calls[-1] == "ec-redis demo", calls  # what test_demo.py runs: three vLLM engines


def test_the_main_job_without_vllm_runs_the_hooks_only_demo(tmp_path: Path) -> None:
    """The README's ``EC_REDIS_SKIP_VLLM=1 bash scripts/run.sh``: no vLLM install."""
    command = doc_command("bash scripts/run.sh")
    calls = run_in_copy(command, tmp_path, "scripts/run.sh", env={"EC_REDIS_SKIP_VLLM": "1"})
    assert not any(c.startswith("install_vllm.sh") for c in calls), calls
    assert calls[-1] == "ec-redis demo --hooks-only", calls
