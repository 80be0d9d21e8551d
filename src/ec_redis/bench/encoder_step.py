"""What the connector adds to an encoder's step, in vLLM's process layout: the scheduler half
in this process, the worker half in a process of its own that receives each step through
vLLM's own shared-memory broadcast queue (``MessageQueue``) and spins on it between steps, as
vLLM's workers do. (vLLM's queue pickles the step's metadata: that is vLLM's transport.)

Each step encodes ``--items`` new items (1; each a fresh tensor of ``--mib`` MiB, made
untimed in the worker as the encoder would) of one request and saves them. The worker is set
up as vLLM's is: once warm, its GC heap is frozen (vLLM's ``freeze_gc_heap``, which its
workers and engine core call after start-up), and the stand-in encoder runs on one thread:
torch's OpenMP workers keep spinning on the other core for a while after a parallel op,
which on this 2-core VM took the core the hooks needed (save_caches p99 5-8 ms with them,
0.6 ms without); a GPU encoder leaves no host thread spinning. Timed: every connector hook
of the step on both halves — ``ensure_cache_available``, ``has_cache_item``,
``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``,
``request_finished`` on the scheduler half; ``bind_connector_metadata``,
``start_load_caches``, ``save_caches``, ``build_connector_worker_meta``,
``clear_connector_metadata`` on the worker half — and ``save_caches`` alone. A PD scheduler
half in a third process is told of each step's last item once the encoder's step ended (as
an EPD proxy would send PD the request) and asks step after step until it can load it; its
time from ``save_caches`` returning is next to a raw redis-py SET + GET of one item's bytes
on the same server, measured in the same run.

Rows: ``thread`` (the defaults: the write on a thread in the worker's process; a producer's
step waits for its write, ``save_wait_s``), ``process`` (``writer_process: true``), each also
``, no wait`` (``save_wait_s: 0``), for ``ec_producer`` and ``ec_both`` (which never
waits), on a quiet machine and with another process keeping one core busy.

What the machine does to any code at that point of the step is measured next to the hooks:
the worker hooks' own CPU time, how many steps' hooks were switched out while they could run
(involuntary context switches), and the wall time of a fixed task of pure Python (1 ms of CPU,
calibrated in the worker) run right after the hooks, once the step's reply is sent, under the
same load (``FixedTask``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing as mp
import resource
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import torch

from ec_redis.bench.timing import percentile
from ec_redis.connector.metadata import ECRedisWorkerMetadata
from ec_redis.demo.drive import IDLE_STEP, engine_config, vllm_request
from ec_redis.demo.workload import activation_like

WIDTH = 2048
SETTINGS: dict[str, dict[str, Any]] = {
    "thread": {},  # the defaults: the write on a thread in the worker's process
    "thread, no wait": {"save_wait_s": 0.0},
    "process": {"writer_process": True},
    "process, no wait": {"writer_process": True, "save_wait_s": 0.0},
}
WORKER_HOOKS = ("bind", "start_load_caches", "save_caches", "worker_meta", "clear")


@dataclass
class StepRow:
    setting: str
    role: str
    load: str  # "quiet" or "one core busy"
    step_p50_ms: float
    step_p99_ms: float
    save_p50_ms: float
    save_p99_ms: float
    visible_p50_ms: float | None  # PD: save_caches -> loadable (ec_producer only)
    visible_p99_ms: float | None
    raw_p50_ms: float  # raw SET + GET of the same bytes
    raw_p99_ms: float
    gc_steps: int = 0  # steps whose worker hooks the garbage collector paused
    gc_max_ms: float = 0.0  # the longest such pause
    cpu_p50_ms: float = 0.0  # the worker hooks' own CPU time (their thread's)
    cpu_p99_ms: float = 0.0
    preempted_steps: int = 0  # steps whose worker hooks were switched out involuntarily
    control_p50_ms: float = 0.0  # the fixed task's wall time, right after the hooks
    control_p99_ms: float = 0.0


def half(model_dir: str, role: str, side: str, extra: dict[str, Any]) -> Any:
    """One connector half over the tiny model's real ``VllmConfig``."""
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    config = engine_config(Path(model_dir))
    config.parallel_config.distributed_executor_backend = "mp"  # vLLM's default layout
    config.ec_transfer_config = ECTransferConfig(
        ec_connector="ECRedisConnector",
        ec_connector_module_path="ec_redis.connector",
        ec_role=role,
        ec_connector_extra_config={**extra, "embed_width": WIDTH},
    )
    which = ECConnectorRole.WORKER if side == "worker" else ECConnectorRole.SCHEDULER
    return ECConnectorFactory.get_connector_class(config.ec_transfer_config)(config, which)


def _worker(handle: Any, model_dir: str, role: str, extra: dict[str, Any], out: Any) -> None:
    """The worker process: vLLM's spin on the broadcast queue between steps, then the step."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.utils.gc_utils import freeze_gc_heap

    torch.set_num_threads(1)  # the stand-in encoder: no OpenMP workers left spinning
    connector = half(model_dir, role, "worker", extra)
    # the writer process is started with the worker half; time the steady state, not its start
    if not connector._worker._cache.warm_writes(120):
        raise RuntimeError("the writer process never came up")
    queue = MessageQueue.create_from_handle(handle, 0)
    out.send_bytes(b"{}")  # subscribed: the parent may wait for the queue (which has no timeout)
    queue.wait_until_ready()
    freeze_gc_heap()  # as vLLM's worker does once warm
    gc_pauses = _GcPauses()
    control = FixedTask.calibrated(CONTROL_CPU_S)
    control_s = 0.0  # the fixed task's wall time after the previous step's hooks
    rows = 0
    while True:
        message = queue.dequeue()
        if message is None:
            break
        mm_hashes, rows, seed, meta = message
        tensors = [activation_like(rows, WIDTH, seed=seed + i) for i in range(len(mm_hashes))]
        timings: dict[str, float] = {}
        gc_pauses.seconds = 0.0
        cpu, switches = time.thread_time(), _involuntary_switches()
        started = time.perf_counter()
        connector.bind_connector_metadata(meta)
        timings["bind"] = time.perf_counter() - started
        encoder_cache: dict[str, torch.Tensor] = {}
        started = time.perf_counter()
        connector.start_load_caches(encoder_cache)
        timings["start_load_caches"] = time.perf_counter() - started
        encoder_cache.update(zip(mm_hashes, tensors, strict=True))  # the encoder's outputs
        started = time.perf_counter()
        for mm_hash in mm_hashes:
            connector.save_caches(encoder_cache=encoder_cache, mm_hash=mm_hash)
        saved_at = time.monotonic()
        timings["save_caches"] = time.perf_counter() - started
        started = time.perf_counter()
        worker_meta = connector.build_connector_worker_meta()
        timings["worker_meta"] = time.perf_counter() - started
        started = time.perf_counter()
        connector.clear_connector_metadata()
        timings["clear"] = time.perf_counter() - started
        cpu_s = time.thread_time() - cpu  # the hooks' own CPU (and the untimed lines between)
        preempted = _involuntary_switches() - switches
        gc_s = gc_pauses.seconds  # pauses of the collector inside the timed hooks
        out.send_bytes(json.dumps({
            "timings": timings, "saved_at": saved_at, "gc_s": gc_s, "cpu_s": cpu_s,
            "preempted": preempted, "control_s": control_s,
            "pending": worker_meta.pending_writes, "loaded_step": worker_meta.loaded_step,
        }).encode())  # fmt: skip
        # The same machine right after the hooks, doing fixed work; after the reply, so that
        # the step's timings exclude it (reported with the next step's). It holds the GIL:
        # a write on a thread of this process may wait for it (docs/benchmarks.md).
        started = time.perf_counter()
        control.run()
        control_s = time.perf_counter() - started
    connector.shutdown()


CONTROL_CPU_S = 0.001  # the fixed task's CPU time: about an encoder step's hooks at p50


class FixedTask:
    """A fixed amount of pure-Python work (``iterations`` of a loop that holds the GIL, as the
    hooks do), timed in every step right after the hooks (once the step's reply is sent): its
    wall time is what this machine does to *any* code of that size at that point of the step
    (the writer process, Redis and PD busy with the item just saved, a burner on a core),
    whatever the connector does."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations

    @classmethod
    def calibrated(cls, cpu_s: float, runs: int = 15) -> FixedTask:
        """A task taking about ``cpu_s`` of this thread's CPU time (the median of ``runs``)."""
        task = cls(10_000)
        for _ in range(3):  # scale from the last estimate; converges in one or two rounds
            samples = sorted(task.cpu_seconds() for _ in range(runs))
            task = cls(max(1, round(task.iterations * cpu_s / max(samples[runs // 2], 1e-9))))
        return task

    def cpu_seconds(self) -> float:
        started = time.thread_time()
        self.run()
        return time.thread_time() - started

    def run(self) -> int:
        total = 0
        for i in range(self.iterations):
            total += i & 7
        return total


def _involuntary_switches() -> int:
    """How often the kernel has switched this thread out while it could still run."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


class _GcPauses:
    """Seconds the garbage collector ran since ``seconds`` was last reset (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


def _pd(model_dir: str, extra: dict[str, Any], inbox: Any, out: Any) -> None:
    """PD's scheduler half: for each item it is told of, asks step after step until it can
    load it; answers the seconds from the encoder's ``save_caches`` returning."""
    connector = half(model_dir, "ec_consumer", "scheduler", extra)
    out.send_bytes(b"{}")  # up
    while True:
        raw = inbox.recv_bytes()
        if raw == b"stop":
            break
        task = json.loads(raw)
        mm_hash, rows, saved_at = task["mm_hash"], task["rows"], task["saved_at"]
        req = vllm_request(f"pd-{mm_hash}", (mm_hash, rows), media=False)
        deadline = time.monotonic() + 30
        while not (connector.ensure_cache_available(req, 0) and connector.has_cache_item(mm_hash)):
            if time.monotonic() > deadline:
                break
            connector.build_connector_meta(IDLE_STEP)
        seen = time.monotonic() - saved_at if time.monotonic() <= deadline else -1.0
        connector.request_finished(req)
        out.send_bytes(json.dumps({"seconds": seen}).encode())
    connector.shutdown()


def measure(
    url: str, model_dir: str, setting: str, role: str, load: str, mib: float, steps: int,
    progress: Callable[[str], None], items: int = 1,
) -> StepRow:  # fmt: skip
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    progress(f"encoder step: {setting}, {role}, {load}, {items} x {mib:g} MiB x{steps}")
    namespace = f"step{time.time_ns()}"
    extra = {"redis_url": url, "namespace": namespace, **SETTINGS[setting]}
    context = mp.get_context("spawn")
    queue = MessageQueue(1, 1)
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(
        target=_worker,
        args=(queue.export_handle(), model_dir, role, {**extra, "producer_id": "bench-encoder"},
              send),
        daemon=True,
    )  # fmt: skip
    pd_in_receive, pd_in_send = context.Pipe(duplex=False)
    pd_out_receive, pd_out_send = context.Pipe(duplex=False)
    with_pd = role == "ec_producer"
    pd = context.Process(target=_pd, args=(model_dir, extra, pd_in_receive, pd_out_send),
                         daemon=True)  # fmt: skip
    worker.start()
    if with_pd:
        pd.start()
    scheduler = half(model_dir, role, "scheduler", extra)
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()  # as vLLM's engine core does once started
    _receive(receive, worker, "worker")  # a worker that died starting up raises here
    queue.wait_until_ready()
    if with_pd:
        _receive(pd_out_receive, pd, "PD")
    rows = int(mib * 2**20) // (2 * WIDTH)
    steps_ms: list[float] = []
    saves_ms: list[float] = []
    gc_ms: list[float] = []
    cpu_ms: list[float] = []
    control_ms: list[float] = []
    preempted = 0
    visible_ms: list[float] = []
    try:
        with _load(load):
            for step in range(steps + 2):  # two warm-up steps: connections, the first write
                mm_hashes = [f"{namespace}-item-{step}-{i}" for i in range(items)]
                mm_hash = mm_hashes[-1]  # the one PD asks for: saved last
                req = vllm_request(f"req-{mm_hash}", *[(h, rows) for h in mm_hashes])
                deadline = time.monotonic() + 30
                while not scheduler.ensure_cache_available(req, 0):  # the producer's check
                    if time.monotonic() > deadline:
                        raise RuntimeError("the request was never ready to schedule")
                    scheduler.build_connector_meta(IDLE_STEP)
                started = time.perf_counter()
                scheduler.ensure_cache_available(req, 0)
                if any(scheduler.has_cache_item(h) for h in mm_hashes):
                    raise RuntimeError("a new item was already published: refusing to report")
                for index in range(items):
                    scheduler.update_state_after_alloc(req, index)
                meta = scheduler.build_connector_meta(_Scheduled())
                sched_s = time.perf_counter() - started
                queue.enqueue((mm_hashes, rows, step * items, meta))
                reply = json.loads(_receive(receive, worker, "worker"))
                output = _Output(ECRedisWorkerMetadata(reply["pending"], reply["loaded_step"]))
                started = time.perf_counter()
                scheduler.update_connector_output(output)
                scheduler.request_finished(req)
                sched_s += time.perf_counter() - started
                if with_pd:
                    pd_in_send.send_bytes(json.dumps(
                        {"mm_hash": mm_hash, "rows": rows, "saved_at": reply["saved_at"]}
                    ).encode())  # fmt: skip
                    seen = json.loads(_receive(pd_out_receive, pd, "PD"))["seconds"]
                    if seen < 0:
                        raise RuntimeError("PD never found a saved item: refusing to report")
                if step < 2:
                    continue
                steps_ms.append((sched_s + sum(reply["timings"].values())) * 1e3)
                saves_ms.append(reply["timings"]["save_caches"] * 1e3)
                gc_ms.append(reply["gc_s"] * 1e3)
                cpu_ms.append(reply["cpu_s"] * 1e3)
                control_ms.append(reply["control_s"] * 1e3)
                preempted += reply["preempted"] > 0
                if with_pd:
                    visible_ms.append(seen * 1e3)
        raw = raw_set_get(url, rows * WIDTH * 2, steps)
    finally:
        queue.enqueue(None)
        if with_pd:
            pd_in_send.send_bytes(b"stop")
        worker.join(30)
        if with_pd:
            pd.join(30)
        scheduler.shutdown()
        _purge(url, namespace)  # every case writes GBs: a server of the bench's own fills up
    return StepRow(
        setting, role, load,
        percentile(steps_ms, 50), percentile(steps_ms, 99),
        percentile(saves_ms, 50), percentile(saves_ms, 99),
        percentile(visible_ms, 50) if visible_ms else None,
        percentile(visible_ms, 99) if visible_ms else None,
        percentile(raw, 50), percentile(raw, 99),
        sum(ms > 0 for ms in gc_ms), max(gc_ms, default=0.0),
        percentile(cpu_ms, 50), percentile(cpu_ms, 99), preempted,
        percentile(control_ms, 50), percentile(control_ms, 99),
    )  # fmt: skip


@dataclass
class _Scheduled:
    """The one field of vLLM's SchedulerOutput the connector reads: this step ran work."""

    total_num_scheduled_tokens: int = 1


@dataclass
class _Output:
    """vLLM's ECConnectorOutput for the step: what the worker half reported."""

    ec_connector_worker_meta: ECRedisWorkerMetadata


def _receive(connection: Any, process: Any, name: str) -> bytes:
    """The next message of ``process``, or an error once it has died (never a hang)."""
    while not connection.poll(1.0):
        if not process.is_alive():
            raise RuntimeError(f"the {name} process died (exit code {process.exitcode})")
    data: bytes = connection.recv_bytes()
    return data


def _purge(url: str, namespace: str) -> None:
    """Delete what a case wrote (its own namespace)."""
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(f"{namespace}:*", count=1000):
            client.unlink(key)
    finally:
        client.close()


def raw_set_get(url: str, nbytes: int, runs: int) -> list[float]:
    """Milliseconds for one redis-py SET and one GET of ``nbytes`` on the same server."""
    client = redis.Redis.from_url(url)
    payload = bytes(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy())
    out: list[float] = []
    key = f"bench-raw-{secrets.token_hex(6)}"  # this run's own: nobody else's key is touched
    try:
        for run in range(runs + 1):
            started = time.perf_counter()
            client.set(key, payload)
            client.get(key)
            if run:
                out.append((time.perf_counter() - started) * 1e3)
    finally:
        with contextlib.suppress(redis.RedisError):  # a server gone: the first error is told
            client.delete(key)
        client.close()
    return out


@contextmanager
def _load(load: str) -> Iterator[None]:
    """``one core busy``: another process spins on a core for the block."""
    if load == "quiet":
        yield
        return
    burner = mp.get_context("spawn").Process(target=_burn, daemon=True)
    burner.start()
    try:
        yield
    finally:
        burner.kill()
        burner.join(10)


def _burn() -> None:
    while True:
        pass


def run(
    url: str, mib: float, steps: int, progress: Callable[[str], None], items: int = 1
) -> list[StepRow]:
    from ec_redis.demo.tiny_model import build_tiny_llava

    rows: list[StepRow] = []
    with tempfile.TemporaryDirectory(prefix="ec_redis_step_model_") as tmp:
        model_dir = str(build_tiny_llava(Path(tmp)))
        for load in ("quiet", "one core busy"):
            for role in ("ec_producer", "ec_both"):
                for setting in SETTINGS:
                    if role == "ec_both" and setting.endswith(", no wait"):
                        continue  # ec_both never waits: the same as without ", no wait"
                    row = measure(url, model_dir, setting, role, load, mib, steps, progress, items)
                    rows.append(row)
    return rows


def render(rows: list[StepRow]) -> str:
    lines = [
        "| load | role | code | step hooks p50 ms | p99 ms | save_caches p50 ms | p99 ms "
        "| PD sees it p50 ms | p99 ms | raw SET+GET p50 ms | p99 ms | GC in hooks: steps, max ms "
        "| worker hooks' CPU p50 ms | p99 ms | steps preempted in hooks "
        "| fixed 1 ms task p50 ms | p99 ms |",
        "|---|---|---|" + "---:|" * 14,
    ]
    for r in rows:
        seen = (
            f"{r.visible_p50_ms:.1f} | {r.visible_p99_ms:.1f}"
            if r.visible_p50_ms is not None and r.visible_p99_ms is not None
            else "- | -"
        )
        lines.append(
            f"| {r.load} | {r.role} | {r.setting} | {r.step_p50_ms:.2f} | {r.step_p99_ms:.2f} "
            f"| {r.save_p50_ms:.3f} | {r.save_p99_ms:.3f} | {seen} "
            f"| {r.raw_p50_ms:.1f} | {r.raw_p99_ms:.1f} | {r.gc_steps}, {r.gc_max_ms:.2f} "
            f"| {r.cpu_p50_ms:.2f} | {r.cpu_p99_ms:.2f} | {r.preempted_steps} "
            f"| {r.control_p50_ms:.2f} | {r.control_p99_ms:.2f} |"
        )
    return "\n".join(lines)
