"""Demo engines as subprocesses: start them side by side, relay their progress, give each its
turn, collect their results.

Each engine is ``python -m ec_redis.demo.engine`` in its own process group, with its files in
``<run_dir>/<name>/``: ``spec.json``, ``progress.log`` (relayed here as it grows),
``engine.log`` (everything the process printed: vLLM's own logging, a traceback on failure),
``out.json`` (the result) and ``turns/`` (see ``Runner``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ec_redis.demo.engine import WAITING_FOR_TURN

Say = Callable[[str], None]
LOG_TAIL_CHARS = 3000
QUIET_S = 20.0  # with no progress line for this long, say who is still working on what
POLL_S = 0.2


class EngineFailed(RuntimeError):
    """An engine exited with an error or ran past its deadline; the message names its log and
    ends with the log's tail."""


@dataclass
class Engine:
    """One running engine subprocess and its files."""

    name: str
    dir: Path
    process: subprocess.Popen[bytes]
    progress_seen: int = 0
    last_line: str = "starting"
    lines: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        """Up and waiting for its first turn."""
        return WAITING_FOR_TURN in self.lines

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def new_lines(self) -> list[str]:
        """Progress lines written since the last call (whole lines only)."""
        path = self.dir / "progress.log"
        if not path.exists():
            return []
        text = path.read_text(errors="replace")
        end = text.rfind("\n") + 1
        fresh = text[self.progress_seen : end].splitlines()
        self.progress_seen = end
        if fresh:
            self.last_line = fresh[-1]
            self.lines += fresh
        return fresh

    def failure(self, what: str) -> EngineFailed:
        log = self.dir / "engine.log"
        tail = log.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log.exists() else ""
        return EngineFailed(f"{self.name} engine {what}; its log: {log}\n{tail}")


def start(name: str, spec: dict[str, Any], run_dir: Path) -> Engine:
    """Start one engine; it loads the model, then waits for its turns (see ``Runner``)."""
    engine_dir = run_dir / name
    (engine_dir / "turns").mkdir(parents=True)
    spec = {**spec, "turns": str(engine_dir / "turns")}
    (engine_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    files = [str(engine_dir / f) for f in ("spec.json", "out.json", "progress.log")]
    with (engine_dir / "engine.log").open("wb") as log:
        # Own session: stop() ends the engine and anything it started.
        process = subprocess.Popen(
            [sys.executable, "-m", "ec_redis.demo.engine", *files],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Engine(name, engine_dir, process)


class Runner:
    """Decides who runs when: ``turn(name, step)`` lets one engine take one step (0 is its
    warm-up, k its k-th request) and waits until it is done; ``finish(name)`` lets it take
    all its remaining steps, waits for it to exit and returns its result. Progress is relayed
    while waiting; an engine that fails or misses the deadline raises ``EngineFailed``.
    Leaving the ``with`` block stops every engine still running."""

    def __init__(self, engines: list[Engine], say: Say, started: float, timeout_s: float):
        self.engines = {e.name: e for e in engines}
        self.say = say
        self.started = started
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self.engines.values())

    def wait_ready(self) -> None:
        self._wait(lambda: all(e.ready for e in self.engines.values()))

    def turn(self, name: str, step: int) -> None:
        turns = self.engines[name].dir / "turns"
        (turns / f"go-{step}").touch()
        self._wait(lambda: (turns / f"done-{step}").exists())

    def finish(self, name: str) -> dict[str, Any]:
        engine = self.engines[name]
        (engine.dir / "turns" / "go-all").touch()  # every remaining step, then exit
        self._wait(lambda: not engine.running)
        out = engine.dir / "out.json"
        if engine.process.returncode != 0 or not out.exists():
            raise engine.failure(f"exited with {engine.process.returncode}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result

    def _wait(self, done: Callable[[], bool]) -> None:
        last_said = time.monotonic()
        while True:
            if _relay(self.engines.values(), self.say, self.started):
                last_said = time.monotonic()
            if done():
                return
            for engine in self.engines.values():
                if not engine.running and not (engine.dir / "out.json").exists():
                    raise engine.failure(f"exited with {engine.process.returncode}")
            if time.monotonic() > self.deadline:
                running = [e for e in self.engines.values() if e.running]
                late = (running or list(self.engines.values()))[0]
                raise late.failure(f"was still at '{late.last_line}' after {self.timeout_s:.0f} s")
            if time.monotonic() - last_said > QUIET_S:
                busy = [e for e in self.engines.values() if e.running]
                self.say(stamp(self.started) + "still working: " + _who(busy))
                last_said = time.monotonic()
            time.sleep(POLL_S)


def stop(engines: Iterable[Engine], grace_s: float = 10.0) -> None:
    """End every engine still running: SIGTERM its process group, then SIGKILL."""
    running = [e for e in engines if e.running]
    for engine in running:
        _signal(engine.process.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for engine in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            engine.process.wait(timeout=max(0.0, end - time.monotonic()))
        _signal(engine.process.pid, signal.SIGKILL)
        engine.process.wait()


def _relay(engines: Iterable[Engine], say: Say, started: float) -> bool:
    said = False
    for engine in engines:
        for line in engine.new_lines():
            say(f"{stamp(started)}{engine.name}: {line}")
            said = True
    return said


def _who(engines: list[Engine]) -> str:
    return ", ".join(f"{e.name} ({e.last_line})" for e in engines) or "nobody"


def stamp(started: float) -> str:
    """The ``[  12.3 s] `` prefix of a progress line: seconds since ``started`` (monotonic)."""
    return f"[{time.monotonic() - started:6.1f} s] "


def _signal(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
