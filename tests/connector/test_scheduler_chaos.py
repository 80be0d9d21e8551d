"""Seeded chaos against vLLM's real scheduler: the connector keeps every promise, holds bounded
state, and forgets everything once the requests are gone.

Each seed runs a few hundred engine steps (``scheduler_driver``, synchronous or vLLM's async
scheduling) with random arrivals of requests sharing images of mixed sizes (small ones beside
4-12 MiB ones, which Redis stores chunked), client ids reused for items of other sizes
(within a request and across requests), requests without media (``data=None``, a proxy's
metadata-only rewrite), aborts (also of requests still waiting for a fetch, and while a step
executes), preemption, a producer publishing throughout, and Redis faults (``chaos_faults``):
FLUSHALL, SIGKILL and restart, values overwritten with garbage, SIGSTOP, lost replies, OOM;
a small CPU tier and a small staging budget; then it drains. ``SCENARIOS`` crosses roles,
transports, sync/async scheduling, ``on_missing`` and two worlds (``MIXED``: big items;
``TINY``: vLLM's limits squeezed so its encoder cache and KV blocks churn); each scenario has
its own seeds, and each seed is verified to have produced every fault it injected.

A seed replays exactly (``test_a_seed_replays_exactly``): the scheduler half's lookups run on
a stepped executor at seeded points between and inside engine steps, and the connector's
clock is a fake one that moves a fixed amount per step (``stepped``); push notifications are
off and Redis writes are awaited after each step. ``EC_REDIS_CHAOS_SEEDS=703`` runs only the
seeds given (the failure messages name scenario, seed, step, request and item).

Invariants, checked after every scheduler and connector call: no engine death (an escaped
exception, an encoder-cache miss, an item without media scheduled for a local encode), every
tensor the model reads is ``truth(id, rows)`` for the rows the reading request needs, staged
plus reserved bytes and the bytes of staged files on disk within ``stage_bytes``, and after
the last request nothing left (``live_state()``: ``requests``, ``items``, ``staged_bytes``,
``reserved_bytes``, ``files``; no staged file on disk; ``internal_errors`` present and 0)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ec_redis.embedded import EmbeddedRedis
from ec_redis.keys import KeyBuilder
from tests.connector.chaos_faults import LossyProxy, RedisFaults
from tests.connector.scheduler_driver import (
    EngineDriver,
    EngineShape,
    Item,
    Producer,
    build_vllm_config,
    flush_writes,
    image_request,
)
from tests.connector.simulated_worker import Failure
from tests.connector.stepped import Determinism, SteppedExecutor, deterministic_connector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

WIDTH = 128  # the tiny LLaVA's hidden size
ROW_BYTES = WIDTH * 2  # bf16
MiB = 1024 * 1024
CHUNK_BYTES = 4 * MiB  # the default, spelled out: items above it are stored chunked
BIG_ROWS = (4 * MiB // ROW_BYTES, 12 * MiB // ROW_BYTES)  # 4-12 MiB items (16384-49152 rows)


@dataclass(frozen=True)
class Sizes:
    """A world: the engine's limits, the connector's budgets, the items' rows."""

    shape: EngineShape
    stage_bytes: int
    cpu_cache_bytes: int
    small_rows: tuple[int, int]
    big_rows: tuple[int, int] | None = None  # None: no big items


# Small items beside 4-12 MiB ones (Redis stores those chunked); room for one big item in
# staging, none in the CPU tier (big items always come from Redis).
MIXED = Sizes(
    EngineShape(
        max_num_seqs=4,
        max_num_batched_tokens=2048,  # a 12 MiB item is split over 24 steps
        block_size=16,
        num_kv_blocks=3125,  # 50000 tokens: beside a 12 MiB item's request, anything preempts
        max_model_len=BIG_ROWS[1] + 1024,  # one big item per request, a few small ones, text
        max_images_per_prompt=3,
        encoder_cache_tokens=64 * 1024,
        encoder_compute_tokens=64 * 1024,
        reserve_full_isl=False,  # admitted on its first chunk, a prefill may be preempted
    ),
    stage_bytes=14 * MiB,
    cpu_cache_bytes=6 * MiB,
    small_rows=(4, 300),  # 1-75 KiB
    big_rows=BIG_ROWS,
)
# vLLM's limits squeezed: 48 tokens a step, a 48-token encoder cache (items leave it soon
# after use, so an id reused at other rows later in a prompt is asked about again), 12 KV
# blocks (decodes preempt), vLLM's default admission; staging holds two items.
TINY = Sizes(
    EngineShape(),
    stage_bytes=2 * 24 * ROW_BYTES,
    cpu_cache_bytes=3 * 24 * ROW_BYTES,
    small_rows=(8, 24),
)
STATE_KEYS = (
    *("requests", "items", "staged_bytes", "reserved_bytes", "files"),  # zero once all end
    "stage_bytes",
)
STAGE_FILE_PREFIX = "ec_redis-stage-"
STEP_S = 0.005  # fake time per engine step: consumer_wait_s 0.05 = 10 steps
PAUSE_S = 1.5
SOCKET_TIMEOUT_S = 0.4  # a lookup inside a pause times out twice (1 retry) well within it
DRAIN_STEPS = 4000
END_STEPS = 200  # steps after the last request for in-flight lookups and files to settle


@dataclass(frozen=True)
class Chaos:
    """Per-step probabilities and sizes of one seed's run."""

    num_requests: int = 32
    small_items: int = 8
    big_items: int = 2
    aliases: int = 2  # pool ids reused with another row count
    published: float = 0.5  # share of the pool in Redis before the run
    max_steps: int = 500  # chaos until every request arrived and ended, or this many steps
    p_arrival: float = 0.3
    p_big: float = 0.2  # per image
    p_reuse_in_request: float = 0.12  # an image repeats an id earlier in its request
    p_other_size: float = 0.7  # ... at another row count, where the pool has one
    p_lookups_in_step: float = 0.3  # lookups return while a step is in flight
    p_media_less: float = 0.0  # requests whose items carry no media (data=None)
    p_abort: float = 0.05
    p_abort_waiting: float = 0.5  # share of aborts aimed at a waiting request
    p_abort_mid_step: float = 0.03
    p_publish: float = 0.12
    p_flush: float = 0.012
    p_kill: float = 0.006
    down_steps: tuple[int, int] = (3, 25)
    p_garbage: float = 0.04
    pause_steps: tuple[int, int] = (5, 100)  # even seeds pause once (PAUSE_S of real time)
    p_lost_reply: float = 0.015  # each costs the client its socket timeout
    p_oom: float = 0.01
    oom_steps: tuple[int, int] = (2, 10)
    max_tokens: tuple[int, int] = (1, 30)


@dataclass(frozen=True)
class Scenario:
    role: str
    # inline: the tensor travels in the step metadata; file: through a file in stage_dir.
    # (``auto`` would pick file here: vLLM's default backend for this config is ``mp``.)
    transport: str = "inline"
    async_scheduling: bool = False
    on_missing: str = "encode"
    chaos: Chaos = Chaos()
    sizes: Sizes = MIXED


# More ids reused at other sizes, in one prompt and across prompts.
TINY_CHAOS = Chaos(aliases=4, p_reuse_in_request=0.25)
SEEDS_PER_SCENARIO = 6
SCENARIOS = {
    "ec_consumer": Scenario("ec_consumer"),
    "ec_both": Scenario("ec_both"),
    "ec_consumer-files": Scenario("ec_consumer", "file"),
    # A pure consumer that must fail a request it cannot serve instead of encoding it; most
    # of its requests come without media, as a proxy's metadata-only rewrite sends them,
    # and most items are published (else nearly every request fails at once).
    "ec_consumer-fail-medialess": Scenario(
        "ec_consumer",
        "file",
        on_missing="fail",
        chaos=Chaos(num_requests=40, p_media_less=0.6, published=0.8, p_publish=0.3, p_big=0.3),
    ),
    "ec_consumer-async": Scenario("ec_consumer", async_scheduling=True),
    "ec_consumer-files-async": Scenario("ec_consumer", "file", async_scheduling=True),
    "ec_both-files-async": Scenario("ec_both", "file", async_scheduling=True),
    "ec_consumer-tiny": Scenario("ec_consumer", sizes=TINY, chaos=TINY_CHAOS),
    "ec_consumer-tiny-files-async": Scenario(
        "ec_consumer", "file", async_scheduling=True, sizes=TINY, chaos=TINY_CHAOS
    ),
}


def seeds_of(name: str) -> list[int]:
    """Each scenario its own seeds (a transport changes no decision: scenarios that differ
    only in it would otherwise replay the same runs); ``EC_REDIS_CHAOS_SEEDS=601,602`` runs
    those instead (to replay a failure)."""
    chosen = os.environ.get("EC_REDIS_CHAOS_SEEDS", "")
    if chosen:
        return [int(seed) for seed in chosen.split(",")]
    first = 100 * list(SCENARIOS).index(name)
    return list(range(first, first + SEEDS_PER_SCENARIO))


# Scenarios and seeds replayed twice. Between them every fault: async scheduling with a kill,
# a pause, garbage in chunks, a lost reply and 12 MiB loads; the synchronous loop, media-less
# requests under on_missing fail, with a kill, a pause, a lost reply and OOM.
REPLAYS = [("ec_both-files-async", 602), ("ec_consumer-fail-medialess", 302)]


def extra_config(
    redis_url: str, stage_dir: Path, scenario: Scenario, producer_id: str = ""
) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "redis_url": redis_url,
        "stage_transport": scenario.transport,
        "stage_dir": str(stage_dir),
        "stage_spare_bytes": 0,  # the staged-file bound is then exactly stage_bytes
        "cpu_cache_bytes": scenario.sizes.cpu_cache_bytes,
        "stage_bytes": scenario.sizes.stage_bytes,
        "chunk_bytes": CHUNK_BYTES,
        "on_missing": scenario.on_missing,
        "consumer_wait_s": 0.05,
        "recheck_s": 0.01,
        "breaker_cooldown_s": 0.05,
        "breaker_max_cooldown_s": 0.2,
        "push_notifications": False,  # a subscriber thread would race the steps
        # writes on the writer thread, as a replay needs: whether a write ran in a writer
        # process or (while it started) here would differ between runs (tests/test_writer_process)
        "writer_process": False,
        "lookup_wait_s": 0,  # lookups run when the harness says: never wait for one
        "redis_socket_timeout_s": SOCKET_TIMEOUT_S,
        "redis_connect_timeout_s": SOCKET_TIMEOUT_S,
    }
    if producer_id:  # a cache of its own (shared.py shares one per configuration)
        extra.update(producer_id=producer_id, cpu_cache_bytes=0)
    return extra


# -- one seed's world ------------------------------------------------------------------------


@dataclass
class Pool:
    """The items requests draw from: (id, rows). ``aliases`` reuse an id of ``small`` or
    ``big`` with another row count (a client uuid reused for other content)."""

    small: list[tuple[str, int]]
    big: list[tuple[str, int]]
    aliases: list[tuple[str, int]]

    @property
    def entries(self) -> list[tuple[str, int]]:
        return self.small + self.big + self.aliases

    @staticmethod
    def make(seed: int, rng: random.Random, chaos: Chaos, sizes: Sizes) -> Pool:
        small_rows, big_rows = sizes.small_rows, sizes.big_rows
        small = [(f"img-{seed}-s{i}", rng.randint(*small_rows)) for i in range(chaos.small_items)]
        big: list[tuple[str, int]] = []
        if big_rows is not None:
            # The first big item nearly fills the KV cache alone: beside it, anything preempts.
            big = [
                (
                    f"img-{seed}-b{i}",
                    big_rows[1] - rng.randint(0, 256) if i == 0 else rng.randint(*big_rows),
                )
                for i in range(chaos.big_items)
            ]
        aliases: list[tuple[str, int]] = []
        for _ in range(chaos.aliases):
            identifier, rows = rng.choice(small + big)
            other = rows
            while other == rows:  # a big id may come back small, a small one bigger
                span = small_rows if big_rows is None or rng.random() < 0.8 else big_rows
                other = rng.randint(*span)
            aliases.append((identifier, other))
        return Pool(small, big, aliases)

    def versions(self, identifier: str) -> list[tuple[str, int]]:
        return [entry for entry in self.entries if entry[0] == identifier]


@dataclass
class SeedRun:
    seed: int
    scenario: Scenario
    driver: EngineDriver
    executor: SteppedExecutor
    producer: Producer
    faults: RedisFaults
    keys: KeyBuilder
    stage_dir: Path
    clock: Callable[[float], None]
    failures: list[Failure]
    waiting_aborts: int = 0
    publishes: int = 0
    chunked_published: int = 0
    lookups: int = 0
    media_less: set[str] = field(default_factory=set)
    checker: Callable[[str], None] = lambda phase: None
    reused_sizes: int = 0  # requests holding an id another request or item has at other rows

    @property
    def trace(self) -> list[tuple[object, ...]]:
        return self.driver.trace

    def summary(self, name: str) -> str:
        s, f = self.driver.stats, self.faults.counters
        media_less_errors = sum(
            self.driver.finish_reasons.get(r) == "ERROR" for r in self.media_less
        )
        line = (
            f"{name} seed {self.seed}: {s.steps} steps ({s.empty_steps} empty), "
            f"{s.loads} loads ({s.big_loads} big, {s.loaded_bytes / MiB:.0f} MiB), "
            f"{s.local_encodes} local encodes, {s.split_images} split images, "
            f"{s.preemptions} preemptions, {s.aborts} aborts ({self.waiting_aborts} waiting), "
            f"{s.finished} finished ({s.errored} errors), {self.lookups} lookups, "
            f"{self.publishes} publishes ({self.chunked_published} chunked), "
            f"{self.reused_sizes} reused-size requests, "
            f"{len(self.media_less)} media-less ({s.media_less_loaded} items loaded, "
            f"{media_less_errors} failed); faults: {f.flushes} flushes, {f.kills} kills, "
            f"{f.garbage_writes} garbage ({f.garbage_chunks} chunks), "
            f"{f.pauses_verified}/{f.pauses} pauses, "
            f"{self.faults.lost_replies}/{f.lost_replies_armed} lost replies, "
            f"{f.oom_verified}/{f.oom_windows} OOM ({f.oom_refusals} producer writes refused)"
        )
        return "\n    FAILED: ".join([line, *map(str, self.failures)])


class StateChecker:
    """Reads ``live_state()`` after every scheduler and connector call; checks the staging
    bounds (in memory and on disk) and that the stepped executor and the stager agree."""

    def __init__(self, run: SeedRun) -> None:
        self._run = run
        self._broken = False
        self._reported: set[str] = set()

    def __call__(self, phase: str) -> None:
        driver, run = self._run.driver, self._run
        for error in run.executor.errors:
            self.fail("lookup", f"after {phase}: a lookup raised out of the stager: {error}")
        state = self.read(f"live_state after {phase}")
        if state is None:
            return
        where = f"after {phase} (step {driver.stats.steps})"
        held = state["staged_bytes"] + state["reserved_bytes"]
        stage_bytes = run.scenario.sizes.stage_bytes
        if state["stage_bytes"] != stage_bytes:
            self.fail("limits", f"{where}: stage_bytes is not the configured one: {state}")
        if held > stage_bytes:
            self.fail("bound", f"{where}: staged + reserved = {held} > stage_bytes {stage_bytes}")
        count, nbytes = stage_files(run.stage_dir)
        if nbytes > stage_bytes:
            self.fail(
                "file-bound",
                f"{where}: {count} staged files hold {nbytes} bytes on disk > stage_bytes "
                f"{stage_bytes} (+ 0 spare bytes); live_state: {state}",
            )
        if count > state["files"]:
            self.fail(
                "file-leak",
                f"{where}: {count} staged files on disk, live_state counts {state['files']}",
            )
        in_flight = state.get("lookups_in_flight")
        if in_flight is not None and in_flight != run.executor.pending:
            self.fail(
                "in-flight",
                f"{where}: live_state says {in_flight} lookups in flight, "
                f"{run.executor.pending} are queued",
            )

    def read(self, where: str) -> dict[str, int] | None:
        if self._broken:
            return None
        live_state = getattr(self._run.driver.connector, "live_state", None)
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
            self._run.failures.append(Failure(self._run.driver.stats.steps, "invariant", message))

    def end_state(self) -> None:
        """After the last request: let in-flight lookups return and the steps run that
        release what they held; then nothing may be left."""
        driver, run = self._run.driver, self._run
        state = None
        for _ in range(END_STEPS):
            run.lookups += len(run.executor.run_all())
            self(phase="the end's lookups")
            driver.step()
            run.clock(STEP_S)
            state = self.read("live_state at the end")
            if state is None or not driver.alive:
                break
            count, _ = stage_files(run.stage_dir)
            if not _leftovers(state) and count == 0 and run.executor.pending == 0:
                break
        if state is not None and driver.alive:
            count, nbytes = stage_files(run.stage_dir)
            if _leftovers(state) or count:
                self.fail(
                    "end",
                    f"state left {END_STEPS} steps after all requests ended: "
                    f"{_leftovers(state)}, {count} staged files ({nbytes} bytes) on disk",
                )
        # Hooks never raise into vLLM: they count what went wrong inside them instead, so a
        # bug would hide behind a local encode. None may have happened, and the count must
        # exist (a missing metric is not a zero).
        snapshot = driver.connector.stats_snapshot()
        if "internal_errors" not in snapshot:
            self.fail(
                "internal",
                "stats_snapshot() has no internal_errors counter (a missing metric is not a "
                f"zero); it has {sorted(snapshot)}",
            )
        elif snapshot["internal_errors"]:
            self.fail("internal", f"{snapshot['internal_errors']} internal errors inside hooks")


def stage_files(stage_dir: Path) -> tuple[int, int]:
    """Staged files in ``stage_dir`` (``ec_redis-stage-*``, lock files aside): count, bytes."""
    count = nbytes = 0
    for path in stage_dir.glob(f"{STAGE_FILE_PREFIX}*"):
        if path.name.endswith(".owner"):
            continue
        try:
            nbytes += path.stat().st_size
        except FileNotFoundError:
            continue
        count += 1
    return count, nbytes


def _leftovers(state: dict[str, int]) -> dict[str, int]:
    keys = ("requests", "items", "staged_bytes", "reserved_bytes", "files")
    return {key: state[key] for key in keys if state[key] != 0}


# -- running a seed --------------------------------------------------------------------------


@dataclass
class World:
    """What every seed of one test shares: configs, the server, the deterministic hooks."""

    scenario: Scenario
    config: VllmConfig
    producer_config: VllmConfig
    redis: EmbeddedRedis
    det: Determinism
    stage_dir: Path


def run_seed(seed: int, world: World, proxy: LossyProxy) -> SeedRun:
    """One seed: fresh Redis contents, publish part of the pool, chaos, drain, end state."""
    scenario, chaos = world.scenario, world.scenario.chaos
    rng = random.Random(seed)
    world.det.clock.now = 1000.0
    faults = RedisFaults(world.redis, proxy)
    faults.restore()
    faults.flushall(count=False)
    pool = Pool.make(seed, rng, chaos, scenario.sizes)
    producer = Producer(world.producer_config, WIDTH)
    made = len(world.det.executors)
    driver = EngineDriver(
        world.config, scenario.sizes.shape, async_scheduling=scenario.async_scheduling
    )
    executors = world.det.executors[made:]
    assert len(executors) == 1, f"expected one stager executor, got {len(executors)}"
    assert not world.det.problems, world.det.problems
    run = SeedRun(
        seed,
        scenario,
        driver,
        executors[0],
        producer,
        faults,
        KeyBuilder("ecr", driver.connector.identity),
        world.stage_dir,
        world.det.clock.advance,
        driver.failures,
    )
    checker = StateChecker(run)
    run.checker = checker
    driver.observers.append(checker)
    try:
        initial = rng.sample(pool.entries, round(chaos.published * len(pool.entries)))
        _publish(run, initial)
        _chaos_phase(run, rng, pool, chaos, checker)
        faults.restore()
        _drain(run, rng, checker)
        if driver.alive:
            checker.end_state()
    finally:
        for close in (driver.close, producer.close, faults.close):
            try:
                close()
            except Exception as exc:
                run.failures.append(Failure(driver.stats.steps, "shutdown", repr(exc)))
        count, nbytes = stage_files(world.stage_dir)
        if count:
            run.failures.append(
                Failure(
                    driver.stats.steps,
                    "shutdown",
                    f"{count} staged files ({nbytes} bytes) left in stage_dir after shutdown",
                )
            )
    return run


def _chaos_phase(
    run: SeedRun, rng: random.Random, pool: Pool, chaos: Chaos, checker: StateChecker
) -> None:
    driver = run.driver
    arrived, down_until, oom_until = 0, -1, -1
    pause_step = rng.randint(*chaos.pause_steps)
    if run.seed % 2:
        pause_step = -1
    for step in range(chaos.max_steps):
        if not driver.alive or (arrived == chaos.num_requests and not driver.has_requests()):
            return
        actions: list[str] = []
        while arrived + actions.count("arrive") < chaos.num_requests and (
            rng.random() < chaos.p_arrival
        ):
            actions.append("arrive")
        for name, p in (
            ("abort", chaos.p_abort),
            ("publish", chaos.p_publish),
            ("flush", chaos.p_flush),
            ("garbage", chaos.p_garbage),
            ("lost_reply", chaos.p_lost_reply),
        ):
            if rng.random() < p:
                actions.append(name)
        if step == down_until:
            actions.append("restart")
        elif rng.random() < chaos.p_kill and down_until < step:
            actions.append("kill")
            down_until = step + rng.randint(*chaos.down_steps)
        if step == oom_until:
            actions.append("oom_off")
        elif rng.random() < chaos.p_oom and oom_until < step:
            actions.append("oom_on")
            oom_until = step + rng.randint(*chaos.oom_steps)
        if step == pause_step:
            actions.append("pause")
        actions.append("lookups")
        rng.shuffle(actions)
        for action in actions:
            if action == "arrive":
                driver.add_request(_random_request(run, f"r{run.seed}-{arrived}", rng, pool, chaos))
                arrived += 1
                continue
            _act(run, action, rng, pool)
            run.trace.append(("act", step, action))
            checker(f"{action} before step {driver.stats.steps + 1}")
        mid_step = rng.random() < chaos.p_abort_mid_step
        driver.step(_mid_step_victim(rng) if mid_step else None, _meanwhile(run, rng, chaos))
        _after_step(run)


def _act(run: SeedRun, action: str, rng: random.Random, pool: Pool) -> None:
    driver, faults = run.driver, run.faults
    if action == "abort":
        victim = _pick_victim(driver, rng, run.scenario.chaos.p_abort_waiting)
        if victim is not None:
            run.waiting_aborts += int(victim in _waiting_ids(driver))
            driver.abort([victim])
    elif action == "publish":
        _publish(run, rng.sample(pool.entries, rng.randint(1, 2)))
    elif action == "flush" and faults.alive:
        faults.flushall()
    elif action == "kill" and faults.alive:
        faults.kill()
    elif action == "restart" and not faults.alive:
        faults.restart()
    elif action == "garbage" and faults.alive and not faults.oom:
        hit = faults.garbage(rng, run.keys)
        run.trace.append(("garbage", hit, tuple(faults.last_heads)))
    elif action == "lost_reply":
        faults.arm_lost_reply()
    elif action == "oom_on" and faults.alive and not faults.oom:
        faults.oom_on()
        _check_oom(run, rng, pool)
    elif action == "oom_off" and faults.oom:
        faults.oom_off()
    elif action == "pause" and faults.alive:
        faults.pause(PAUSE_S, lambda: _paused_lookups(run, rng))
    elif action == "lookups":
        ran = run.executor.run_some(rng)
        run.lookups += len(ran)
        run.trace.extend(("lookup", job) for job in ran)


def _meanwhile(run: SeedRun, rng: random.Random, chaos: Chaos) -> Callable[[str], None]:
    """Lookup threads run while a step is in flight too: between ``schedule`` and the
    worker's step, and before its output is processed (seeded)."""

    def run_lookups(phase: str) -> None:
        if not run.executor.pending or rng.random() >= chaos.p_lookups_in_step:
            return
        ran = run.executor.run_some(rng, p_none=0.0)
        run.lookups += len(ran)
        run.trace.extend((f"lookup {phase}", job) for job in ran)
        run.checker(f"lookups {phase} (step {run.driver.stats.steps})")

    return run_lookups


def _paused_lookups(run: SeedRun, rng: random.Random) -> int:
    """At most one lookup while Redis is stopped: each of its calls must time out inside the
    pause (SOCKET_TIMEOUT_S, one retry), so what it finds does not depend on the machine."""
    if not run.executor.pending:
        return 0
    ran = run.executor.run(rng.randrange(run.executor.pending))
    run.lookups += 1
    run.trace.append(("lookup during pause", ran))
    return 1


def _check_oom(run: SeedRun, rng: random.Random, pool: Pool) -> None:
    """The producer writes at once under the OOM (its cache counts the refusals; a write its
    breaker skipped, Redis having been killed a moment ago, never reached Redis)."""
    before = run.producer.redis_stats().get("oom_errors", 0)
    _publish(run, [rng.choice(pool.small)])
    after = run.producer.redis_stats().get("oom_errors", 0)
    run.faults.counters.oom_refusals += int(after - before)


def _publish(run: SeedRun, entries: Iterable[tuple[str, int]]) -> None:
    """The producer publishes ``entries`` and waits for the writes; a big item that landed
    must be stored chunked."""
    entries = list(entries)
    if not run.producer.publish(entries):
        run.failures.append(Failure(run.driver.stats.steps, "producer", "writes took over 10 s"))
    run.publishes += len(entries)
    run.trace.append(("publish", tuple(entries)))
    faults = run.faults
    if not faults.alive or faults.oom:
        return
    for identifier, rows in dict(entries).items():  # what Redis holds: the last write
        if rows * ROW_BYTES <= CHUNK_BYTES:
            continue
        chunks = faults.named_chunks(run.keys.head(identifier))
        if chunks is None:
            continue  # not stored (Redis was down a moment ago, breaker open, ...)
        if chunks:
            run.chunked_published += 1
        else:
            run.failures.append(
                Failure(
                    run.driver.stats.steps,
                    "producer",
                    f"{identifier} ({rows * ROW_BYTES} bytes) is stored unchunked",
                )
            )


def _after_step(run: SeedRun) -> None:
    """Writes an ec_both instance saved during the step land before anything else happens
    (a writer thread racing the next step would make the seed unrepeatable)."""
    if not flush_writes(run.driver.worker_connector, 10.0):
        run.failures.append(Failure(run.driver.stats.steps, "writer", "writes took over 10 s"))
    run.trace.append(
        (
            "redis",
            run.driver.stats.steps,
            _redis_counters(run.driver.connector),
            _redis_counters(run.driver.worker_connector),
            _redis_counters(run.producer.connector),
            run.faults.stored_items(run.keys),
        )
    )
    run.clock(STEP_S)


def _redis_counters(connector: Any) -> tuple[tuple[str, float], ...]:
    """A connector's Redis tier counters, timings and byte counts aside (a blob header holds
    a timestamp of varying length): where two runs' Redis calls went differently, the trace
    shows it at that step."""
    cache = getattr(connector, "_cache", None)
    stats = cache.stats().get("redis", {}) if cache is not None else {}
    noise = ("_us", "_s", "bytes_written", "bytes_read")
    return tuple(sorted((k, v) for k, v in stats.items() if not k.endswith(noise)))


def _drain(run: SeedRun, rng: random.Random, checker: StateChecker) -> None:
    driver = run.driver
    for _ in range(DRAIN_STEPS):
        if not driver.alive or not driver.has_requests():
            return
        ran = run.executor.run_some(rng)
        run.lookups += len(ran)
        run.trace.extend(("lookup", job) for job in ran)
        checker("lookups while draining")
        driver.step(None, _meanwhile(run, rng, run.scenario.chaos))
        _after_step(run)
    left = {r.request_id: r.status.name for r in driver.scheduler.requests.values()}
    driver.failures.append(
        Failure(driver.stats.steps, "drain", f"{len(left)} requests never ended: {left}")
    )


def _random_request(
    run: SeedRun, request_id: str, rng: random.Random, pool: Pool, chaos: Chaos
) -> Request:
    media = rng.random() >= chaos.p_media_less
    sizes = run.scenario.sizes
    count = rng.randint(1, sizes.shape.max_images_per_prompt)
    items: list[Item] = []
    has_big, small = False, sizes.small_rows[1]
    for _ in range(count):
        if items and rng.random() < chaos.p_reuse_in_request:
            identifier = rng.choice(items).identifier  # the same id, maybe at other rows
            used = {i.rows for i in items if i.identifier == identifier}
            others = [v for v in pool.versions(identifier) if v[1] not in used]
            if others and rng.random() < chaos.p_other_size:
                _, rows = rng.choice(others)
            else:
                _, rows = rng.choice(pool.versions(identifier))
        elif pool.big and not has_big and rng.random() < chaos.p_big:
            identifier, rows = rng.choice(pool.big + [a for a in pool.aliases if a[1] > small])
        else:
            identifier, rows = rng.choice(pool.small + [a for a in pool.aliases if a[1] <= small])
        if rows > small:
            if has_big:
                identifier, rows = rng.choice(pool.small)
            has_big = True
        items.append(Item(identifier, rows, media))
    text = [rng.randint(0, 20) for _ in range(len(items) + 1)]
    text[-1] = max(text[-1], 1)
    max_tokens = rng.randint(*chaos.max_tokens)
    assert sum(text) + sum(i.rows for i in items) + max_tokens <= sizes.shape.max_model_len
    if not media:
        run.media_less.add(request_id)
    if any(len(pool.versions(i.identifier)) > 1 for i in items):
        run.reused_sizes += 1
    return image_request(request_id, items, text, max_tokens)


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


# -- the tests -------------------------------------------------------------------------------


def _world(
    name: str,
    tiny_model: Path,
    redis: EmbeddedRedis,
    proxy: LossyProxy,
    stage_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> World:
    scenario = SCENARIOS[name]
    det = deterministic_connector(monkeypatch)
    config = build_vllm_config(
        tiny_model,
        scenario.role,
        extra_config(proxy.url, stage_dir, scenario),
        scenario.sizes.shape,
    )
    producer_config = build_vllm_config(
        tiny_model,
        "ec_producer",
        extra_config(redis.url, stage_dir, scenario, producer_id="chaos-producer"),
        scenario.sizes.shape,
    )
    return World(scenario, config, producer_config, redis, det, stage_dir)


@pytest.fixture
def proxy(private_redis: EmbeddedRedis) -> Any:
    made = LossyProxy(private_redis.port)
    yield made
    made.close()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_chaos_keeps_promises_bounds_state_and_forgets(
    name: str,
    tiny_model: Path,
    private_redis: EmbeddedRedis,
    proxy: LossyProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every scenario's seeds in turn (``SCENARIOS``); the failures of all seeds at once."""
    world = _world(name, tiny_model, private_redis, proxy, tmp_path, monkeypatch)
    started = time.monotonic()
    runs = [run_seed(seed, world, proxy) for seed in seeds_of(name)]
    for run in runs:
        print(run.summary(name))
    print(f"{name}: {len(runs)} seeds in {time.monotonic() - started:.1f}s")
    problems = [f"seed {run.seed}: {f}" for run in runs for f in run.failures]
    problems += [
        f"seed {run.seed}: fault did not take effect: {p}"
        for run in runs
        for p in run.faults.counters.problems
    ]
    problems += [f"the chaos never produced {what}" for what in _missing_chaos(world, runs)]
    failed = sorted({run.seed for run in runs if run.failures or run.faults.counters.problems})
    assert not problems, (
        f"{name}: {len(failed)} of {len(runs)} seeds failed {failed}:\n" + "\n".join(problems)
    )


def _missing_chaos(world: World, runs: list[SeedRun]) -> list[str]:
    """What the seeds of a test must have produced between them, else it proves little."""

    def total(get: Callable[[SeedRun], int]) -> int:
        return sum(get(run) for run in runs)

    wanted: dict[str, int] = {
        "loads": total(lambda r: r.driver.stats.loads),
        "loads of big (chunked) items": total(lambda r: r.driver.stats.big_loads),
        "local encodes": total(lambda r: r.driver.stats.local_encodes),
        "split images": total(lambda r: r.driver.stats.split_images),
        "preemptions": total(lambda r: r.driver.stats.preemptions),
        "aborts": total(lambda r: r.driver.stats.aborts),
        "requests reusing an id at other rows": total(lambda r: r.reused_sizes),
        "publishes during the run": total(lambda r: r.publishes),
        "chunked entries in Redis": total(lambda r: r.chunked_published),
        "FLUSHALLs": total(lambda r: r.faults.counters.flushes),
        "kills": total(lambda r: r.faults.counters.kills),
        "garbage writes": total(lambda r: r.faults.counters.garbage_writes),
        "garbage in a chunk": total(lambda r: r.faults.counters.garbage_chunks),
        "pauses that blocked a PING": total(lambda r: r.faults.counters.pauses_verified),
        "replies lost after the server executed": total(lambda r: r.faults.lost_replies),
        "OOM windows proven by a refused SET": total(lambda r: r.faults.counters.oom_verified),
        "OOM refusals of the producer's writes": total(lambda r: r.faults.counters.oom_refusals),
    }
    if world.scenario.sizes.big_rows is None:
        for what in (
            "loads of big (chunked) items",
            "chunked entries in Redis",
            "garbage in a chunk",
        ):
            del wanted[what]
    if world.scenario.on_missing == "fail":
        del wanted["local encodes"]  # it fails what it cannot load instead
    if world.scenario.chaos.p_media_less:
        wanted["media-less items loaded"] = total(lambda r: r.driver.stats.media_less_loaded)
        wanted["media-less requests failed as retryable"] = total(
            lambda r: sum(r.driver.finish_reasons.get(q) == "ERROR" for q in r.media_less)
        )
    return [f"any {what}" for what, n in wanted.items() if n == 0]


@pytest.mark.parametrize(("name", "seed"), REPLAYS, ids=[f"{n}-{s}" for n, s in REPLAYS])
def test_a_seed_replays_exactly(
    name: str,
    seed: int,
    tiny_model: Path,
    private_redis: EmbeddedRedis,
    proxy: LossyProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two runs of one seed take the same decisions, event by event: what was scheduled,
    loaded, encoded, finished, which lookups ran, which faults hit, what Redis holds."""
    world = _world(name, tiny_model, private_redis, proxy, tmp_path, monkeypatch)
    first = run_seed(seed, world, proxy)
    second = run_seed(seed, world, proxy)
    print(first.summary(name))
    assert len(first.trace) > 500, f"too short a run to prove anything: {first.summary(name)}"
    for index, (a, b) in enumerate(zip(first.trace, second.trace, strict=False)):
        assert a == b, (
            f"seed {seed} of {name} diverged at event {index}:\n  first:  {a}\n  second: {b}\n"
            f"  before: {first.trace[max(0, index - 5) : index]}"
        )
    assert len(first.trace) == len(second.trace), (
        f"one run of seed {seed} went on: {len(first.trace)} vs {len(second.trace)} events"
    )
    assert [str(f) for f in first.failures] == [str(f) for f in second.failures]


def test_an_id_evicted_and_allocated_again_in_one_step_gets_the_loaded_tensor(
    tiny_model: Path, private_redis: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What seed 703 of ec_consumer-tiny hit (an earlier revision of this harness): request A
    encodes X (15 rows) and Z; both wait in vLLM's encoder cache, freeable. Request B needs
    Y (18 rows), then X at 10 rows (a client uuid reused for other content), and Redis has
    both. Scheduling B, vLLM evicts X for Y, then allocates X again as the connector's load;
    ``EncoderCacheManager.get_freed_mm_hashes`` keeps the worker's tensor of an id allocated
    again in the same pass, so the worker still holds A's 15-row X when the 10-row load
    arrives. A load must replace it: B must read the bytes it was promised."""
    det = deterministic_connector(monkeypatch)
    scenario = Scenario("ec_consumer", sizes=TINY)
    extra = extra_config(private_redis.url, tmp_path, scenario) | {"consumer_wait_s": 0}
    shape = TINY.shape
    config = build_vllm_config(tiny_model, "ec_consumer", extra, shape)
    producer_extra = extra_config(private_redis.url, tmp_path, scenario, "chaos-producer")
    producer = Producer(build_vllm_config(tiny_model, "ec_producer", producer_extra, shape), WIDTH)
    driver = EngineDriver(config, shape)
    (executor,) = det.executors

    def run_until_idle(steps: int = 50) -> None:
        for _ in range(steps):
            if not driver.alive or not driver.has_requests():
                return
            executor.run_all()
            driver.step()
            det.clock.advance(STEP_S)

    try:
        a = image_request("a", [Item("x", 15), Item("z", 24)], [1, 1, 1], 1)
        driver.add_request(a)
        run_until_idle()
        assert driver.finish_reasons.get("a") == "LENGTH", driver.failures
        assert {"x", "z"} <= set(driver.worker.encoder_cache)  # freeable, still on the worker
        assert producer.publish([("x", 10), ("y", 18)])
        driver.add_request(image_request("b", [Item("y", 18), Item("x", 10)], [1, 1, 1], 1))
        run_until_idle()
        assert driver.failures == [], "\n".join(map(str, driver.failures))
        assert driver.finish_reasons.get("b") == "LENGTH"
    finally:
        driver.close()
        producer.close()
