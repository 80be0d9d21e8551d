"""Seeded chaos against vLLM's real scheduler: the connector keeps every promise, holds bounded
state, and forgets everything once the requests are gone.

Each seed runs a few hundred engine steps (``scheduler_driver``) with random arrivals of
requests sharing images, aborts (also of requests still waiting for a fetch, and while a step
executes), preemption (few KV blocks), Redis ``FLUSHALL``, Redis killed and restarted, a tiny
CPU tier and a tiny staging budget; then drains. Lookups run on background threads, so what
happens differs from run to run: only invariants are asserted, never outcomes.

The connector's state comes from ``live_state()`` on its scheduler half (issue 8):
``requests``, ``items``, ``staged_bytes``, ``reserved_bytes`` and ``stage_bytes`` (the limit,
which staged plus reserved bytes never exceed).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ec_redis.demo.tiny_model import NUM_IMAGE_TOKENS
from ec_redis.embedded import EmbeddedRedis
from tests.connector.scheduler_driver import (
    EngineDriver,
    EngineShape,
    build_vllm_config,
    image_request,
    publish,
)
from tests.connector.simulated_worker import Failure

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

SHAPE = EngineShape()
WIDTH = 128  # the tiny LLaVA's hidden size
ITEM_BYTES = NUM_IMAGE_TOKENS * WIDTH * 2  # one bf16 image embedding: 4 KiB
STAGE_BYTES = 2 * ITEM_BYTES  # tiny staging: two items
SEEDS = range(24)
STATE_KEYS = (
    *("requests", "items", "staged_bytes", "reserved_bytes", "files"),  # zero once all end
    "stage_bytes",
)
DRAIN_STEPS = 4000  # generous: a drain takes well under 500 steps
EMPTY_STEP_SLEEP_S = 0.002  # a step that scheduled nothing lets background lookups run
END_STATE_WAIT_S = 2.0  # bounds in-flight lookups settling after the last request (ms)


@dataclass(frozen=True)
class Chaos:
    """Per-step probabilities and sizes of one seed's run."""

    num_requests: int = 30
    pool_size: int = 8  # distinct images; requests draw from it with repeats
    published: float = 0.6  # share of the pool in Redis before the run
    max_steps: int = 400  # chaos until every request arrived and ended, or this many steps
    p_arrival: float = 0.3
    p_abort: float = 0.06
    p_abort_waiting: float = 0.5  # share of aborts aimed at a waiting request
    p_abort_mid_step: float = 0.03
    p_flush: float = 0.02
    p_kill: float = 0.01
    down_steps: tuple[int, int] = (3, 25)
    max_tokens: tuple[int, int] = (1, 40)


def extra_config(redis_url: str, transport: str = "auto") -> dict[str, Any]:
    return {
        "redis_url": redis_url,
        "stage_transport": transport,
        "cpu_cache_bytes": 3 * ITEM_BYTES,  # tiny CPU tier: three items
        "stage_bytes": STAGE_BYTES,
        "consumer_wait_s": 0.05,
        "recheck_s": 0.01,
        "breaker_cooldown_s": 0.05,
        "breaker_max_cooldown_s": 0.2,
    }


@dataclass
class SeedRun:
    seed: int
    driver: EngineDriver
    flushes: int = 0
    kills: int = 0
    waiting_aborts: int = 0
    failures: list[Failure] = field(default_factory=list)

    def summary(self, role: str) -> str:
        s = self.driver.stats
        line = (
            f"{role} seed {self.seed:2d}: {s.steps} steps ({s.empty_steps} empty), "
            f"{s.loads} loads, {s.local_encodes} local encodes, {s.split_images} split images, "
            f"{s.preemptions} preemptions, "
            f"{s.aborts} aborts ({self.waiting_aborts} waiting), {s.finished} finished, "
            f"{self.flushes} flushes, {self.kills} kills"
        )
        return "\n    FAILED: ".join([line, *map(str, self.failures)])


class StateChecker:
    """Reads ``live_state()`` after every scheduler call and checks the staging bound."""

    def __init__(self, driver: EngineDriver) -> None:
        self._driver = driver
        self._broken = False
        self._reported: set[str] = set()

    def __call__(self, phase: str) -> None:
        state = self.read(f"live_state after {phase}")
        if state is None:
            return
        held = state["staged_bytes"] + state["reserved_bytes"]
        if state["stage_bytes"] != STAGE_BYTES:
            self.fail("limits", f"after {phase}: stage_bytes is not the configured one: {state}")
        if held > STAGE_BYTES:
            self.fail("bound", f"after {phase}: staged + reserved = {held} > {STAGE_BYTES}")

    def read(self, where: str) -> dict[str, int] | None:
        if self._broken:
            return None
        live_state = getattr(self._driver.connector, "live_state", None)
        if not callable(live_state):
            self._broken = True
            self.fail("api", "the scheduler-side ECRedisConnector has no live_state() (issue 8)")
            return None
        try:
            state = dict(live_state())
        except Exception as exc:
            self._broken = True
            self.fail("api", f"{where}: live_state() raised {type(exc).__name__}: {exc}")
            return None
        absent = [key for key in STATE_KEYS if key not in state]
        if absent:
            self._broken = True
            self.fail("api", f"live_state() lacks {absent}: {state}")
            return None
        return state

    def fail(self, kind: str, message: str) -> None:
        if kind not in self._reported:  # the first of each kind per seed is enough
            self._reported.add(kind)
            self._driver.failures.append(Failure(self._driver.stats.steps, "live_state", message))

    def end_state(self) -> None:
        """After the last request: one more (empty) step, then nothing may be left."""
        deadline = time.monotonic() + END_STATE_WAIT_S
        while True:
            self._driver.step()
            state = self.read("live_state at the end")
            if state is None or not _leftovers(state) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if state is not None and _leftovers(state):
            self.fail("end", f"state left after all requests ended: {_leftovers(state)}")
        # Hooks never raise into vLLM: they count what went wrong inside them instead, so a
        # bug would hide behind a local encode. None may have happened.
        errors = self._driver.connector.stats_snapshot().get("internal_errors", 0)
        if errors:
            self.fail("internal", f"{errors} internal errors inside connector hooks")


def _leftovers(state: dict[str, int]) -> dict[str, int]:
    keys = ("requests", "items", "staged_bytes", "reserved_bytes", "files")
    return {key: state[key] for key in keys if state[key] != 0}


def run_seed(
    seed: int,
    config: VllmConfig,
    producer_config: VllmConfig,
    redis: EmbeddedRedis,
    chaos: Chaos,
) -> SeedRun:
    """One seed: fresh Redis contents, publish part of the pool, chaos, drain, end state."""
    rng = random.Random(seed)
    if not redis.alive:
        redis.restart()
    redis.call("FLUSHALL")
    pool = [f"img-{seed}-{i}" for i in range(chaos.pool_size)]
    in_redis = rng.sample(pool, round(chaos.published * len(pool)))
    publish(producer_config, {item: NUM_IMAGE_TOKENS for item in in_redis}, WIDTH)
    driver = EngineDriver(config, SHAPE)
    run = SeedRun(seed, driver, failures=driver.failures)
    checker = StateChecker(driver)
    driver.observers.append(checker)
    try:
        _chaos_phase(run, rng, pool, redis, chaos)
        if not redis.alive:
            redis.restart()
        _drain(driver)
        if driver.alive:
            checker.end_state()
    finally:
        try:
            driver.close()
        except Exception as exc:
            run.failures.append(Failure(driver.stats.steps, "shutdown", repr(exc)))
    return run


def _chaos_phase(
    run: SeedRun, rng: random.Random, pool: list[str], redis: EmbeddedRedis, chaos: Chaos
) -> None:
    driver = run.driver
    arrived, down_until = 0, -1
    for step in range(chaos.max_steps):
        if not driver.alive or (arrived == chaos.num_requests and not driver.has_requests()):
            return
        while arrived < chaos.num_requests and rng.random() < chaos.p_arrival:
            driver.add_request(_random_request(f"r{run.seed}-{arrived}", rng, pool, chaos))
            arrived += 1
        if rng.random() < chaos.p_abort:
            victim = _pick_victim(driver, rng, chaos.p_abort_waiting)
            if victim is not None:
                run.waiting_aborts += int(victim in _waiting_ids(driver))
                driver.abort([victim])
        if rng.random() < chaos.p_flush and redis.alive:
            redis.call("FLUSHALL")
            run.flushes += 1
        if step == down_until:
            redis.restart()
        elif rng.random() < chaos.p_kill and redis.alive:
            redis.kill()
            run.kills += 1
            down_until = step + rng.randint(*chaos.down_steps)
        mid_step = rng.random() < chaos.p_abort_mid_step
        if driver.step(_mid_step_victim(rng) if mid_step else None) == 0:
            time.sleep(EMPTY_STEP_SLEEP_S)


def _drain(driver: EngineDriver) -> None:
    for _ in range(DRAIN_STEPS):
        if not driver.alive or not driver.has_requests():
            return
        if driver.step() == 0:
            time.sleep(EMPTY_STEP_SLEEP_S)
    left = {r.request_id: r.status.name for r in driver.scheduler.requests.values()}
    driver.failures.append(
        Failure(driver.stats.steps, "drain", f"{len(left)} requests never ended: {left}")
    )


def _random_request(request_id: str, rng: random.Random, pool: list[str], chaos: Chaos) -> Request:
    images = rng.choices(pool, k=rng.randint(1, SHAPE.max_images_per_prompt))
    text = [rng.randint(0, 20) for _ in range(len(images) + 1)]
    text[-1] = max(text[-1], 1)
    return image_request(request_id, images, text, rng.randint(*chaos.max_tokens))


def _waiting_ids(driver: EngineDriver) -> set[str]:
    from vllm.v1.request import RequestStatus

    requests = driver.scheduler.requests.values()
    return {r.request_id for r in requests if r.status == RequestStatus.WAITING}


def _pick_victim(driver: EngineDriver, rng: random.Random, p_waiting: float) -> str | None:
    waiting = sorted(_waiting_ids(driver))
    if waiting and rng.random() < p_waiting:
        return rng.choice(waiting)
    live = sorted(driver.scheduler.requests)
    return rng.choice(live) if live else None


def _mid_step_victim(rng: random.Random) -> Callable[[SchedulerOutput], Iterable[str]]:
    def pick(scheduler_output: SchedulerOutput) -> Iterable[str]:
        scheduled = sorted(scheduler_output.num_scheduled_tokens)
        return [rng.choice(scheduled)] if scheduled else []

    return pick


@pytest.mark.parametrize(
    ("role", "transport"),
    [("ec_consumer", "auto"), ("ec_both", "auto"), ("ec_consumer", "file")],
    ids=["ec_consumer", "ec_both", "ec_consumer-files"],
)
def test_chaos_keeps_promises_bounds_state_and_forgets(
    role: str, transport: str, tiny_model: Path, private_redis: EmbeddedRedis
) -> None:
    """``auto`` stages inline here (the worker shares the scheduler's process); ``file``
    sends every staged item through a tmpfs file, as vLLM's multiprocess layout does."""
    extra = extra_config(private_redis.url, transport)
    config = build_vllm_config(tiny_model, role, extra, SHAPE)
    producer_config = build_vllm_config(tiny_model, "ec_producer", extra, SHAPE)
    chaos = Chaos()
    runs = [run_seed(seed, config, producer_config, private_redis, chaos) for seed in SEEDS]
    for run in runs:
        print(run.summary(role))
    problems = [f"seed {run.seed}: {f}" for run in runs for f in run.failures]
    totals = {
        name: sum(getattr(run.driver.stats, name) for run in runs)
        for name in ("loads", "local_encodes", "split_images", "preemptions", "aborts")
    }
    problems += [f"the chaos never produced any {name}" for name, n in totals.items() if n == 0]
    failed = sorted({run.seed for run in runs if run.failures})
    assert not problems, (
        f"{role}: {len(failed)} of {len(runs)} seeds failed {failed}:\n" + "\n".join(problems)
    )
