"""One vLLM engine in this process, for the demo: requests one at a time, each with its
outputs, time to first token, encoder passes and the connector counters it moved.

Usage: ``python -m ec_redis.demo.engine SPEC.json OUT.json PROGRESS.log``. Each engine needs
its own process: vLLM's worker-side EC connector is a process-wide singleton. The spec::

    {"model": "/path/to/tiny-llava-s0",
     "ec_transfer_config": {"ec_connector": ..., "ec_role": "ec_producer", ...} | null,
     "warmup": {"image_seed": 99, "question": "..."} | null,  # answered first, not reported
     "requests": [{"image_seed": 0, "uuid": null, "question": "..."}, ...],
     "max_tokens": 4,
     "image_size": 56,  # make_image's size: the model's vision_tower.image_size
     "llm_kwargs": {"max_model_len": 1024, ...},  # over DEFAULT_LLM_KWARGS
     "turns": "/path/of/a/folder" | null}

With ``turns``, the engine starts, says ``WAITING_FOR_TURN`` and then answers the warm-up
(step 0) and each request (step k) only once ``<turns>/go-<k>`` (or ``<turns>/go-all``)
exists, creating ``<turns>/done-<k>`` after it: the parent starts engines side by side and
still decides who runs when, so that only one engine works at any moment.
Phases go to PROGRESS.log as they happen (one line each, for the parent to relay); vLLM's
own logging goes to this process's stdout/stderr, which the parent sends to a file. The
engine settings below are shared with the end-to-end tests (``tests/e2e/run_engine.py``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ec_redis.demo.tiny_model import IMAGE_SIZE, RAW_PROMPT, make_image

# One in-process engine; no torch.compile (22 s on the first logprobs request, same
# results); never ask a model hub for anything (a bad model path fails instead).
DEFAULT_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCHDYNAMO_DISABLE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
# Small enough for a 2-core machine with a few GB free.
DEFAULT_LLM_KWARGS: dict[str, Any] = {
    "distributed_executor_backend": "uni",
    "dtype": "bfloat16",
    "enforce_eager": True,
    "max_model_len": 256,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 256,
    "kv_cache_memory_bytes": 64 << 20,
    "limit_mm_per_prompt": {"image": 1},
    "seed": 0,
}
# Greedy; prompt logprobs make "identical" a comparison of every prompt position.
DEFAULT_SAMPLING: dict[str, Any] = {
    "temperature": 0.0,
    "max_tokens": 4,
    "prompt_logprobs": 1,
    "seed": 0,
}
WAITING_FOR_TURN = "waiting for its turn"  # the progress line the launcher waits for
TURN_TIMEOUT_S = 1800  # an engine whose parent never gives it a turn stops by itself

Progress = Callable[[str], None]


def run(spec: dict[str, Any], progress: Progress) -> dict[str, Any]:
    os.environ.update(DEFAULT_ENV)
    started = time.perf_counter()
    progress("importing vLLM")
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    from ec_redis.demo import probes

    kwargs = {**DEFAULT_LLM_KWARGS, **spec.get("llm_kwargs", {})}
    if spec.get("ec_transfer_config") is not None:
        # LLM() turns a dict into a config object only for kv_transfer_config.
        kwargs["ec_transfer_config"] = ECTransferConfig(**spec["ec_transfer_config"])
    sampling = SamplingParams(**{**DEFAULT_SAMPLING, "max_tokens": spec.get("max_tokens", 4)})
    progress("starting the engine (loading the model, sizing the KV cache)")
    # disable_log_stats=False: vLLM then records each request's time to first token.
    llm = LLM(model=spec["model"], disable_log_stats=False, **kwargs)
    engine_start_s = time.perf_counter() - started
    progress(f"engine ready ({engine_start_s:.1f} s after the process started)")
    results: list[dict[str, Any]] = []
    turns = Path(spec["turns"]) if spec.get("turns") else None
    if turns is not None:
        progress(WAITING_FOR_TURN)
    try:
        llm.apply_model(probes.count_encoder_passes)
        llm.apply_model(probes.record_embeddings)
        steps = [spec.get("warmup"), *spec["requests"]]
        image_size = spec.get("image_size", IMAGE_SIZE)
        for step, req in enumerate(steps):
            if turns is not None:
                _wait_for(turns / f"go-{step}", turns / "go-all")
            if step == 0:
                if req is not None:
                    llm.generate([_prompt(req, image_size)], sampling, use_tqdm=False)
            else:
                results.append(_answer(llm, _prompt(req, image_size), sampling))
                progress(f"request {step}/{len(steps) - 1} done")
            if turns is not None:
                (turns / f"done-{step}").touch()
        totals = connector_stats(llm)
    finally:
        is_producer = (spec.get("ec_transfer_config") or {}).get("ec_role") == "ec_producer"
        progress("shutting down" + (", flushing its Redis writes" if is_producer else ""))
        shutdown_errors = shutdown(llm)
    return {
        "requests": results,
        "connector_totals": totals,
        "shutdown_errors": shutdown_errors,
        "engine_start_s": engine_start_s,
        "total_s": time.perf_counter() - started,
    }


def _answer(llm: Any, prompt: dict[str, Any], sampling: Any) -> dict[str, Any]:
    """One request alone: its output, time to first token, and what it moved."""
    from ec_redis.demo import probes

    before = (connector_stats(llm), sum(llm.apply_model(probes.images_encoded)))
    llm.apply_model(probes.begin_request)
    t0 = time.perf_counter()
    (output,) = llm.generate([prompt], sampling, use_tqdm=False)
    wall_s = time.perf_counter() - t0
    after = (connector_stats(llm), sum(llm.apply_model(probes.images_encoded)))
    seen, *_ = llm.apply_model(probes.request_seen)  # rank 0's
    return {
        **summarize(output),
        "wall_s": wall_s,
        "ttft_s": _ttft_s(output),
        "encoder_passes": after[1] - before[1],
        "counters": _diff(before[0], after[0]),
        # Digests of the image embeddings this request's steps produced and fed to the LM, and
        # the tokens each of its steps embedded
        "embeddings": seen,
    }


def _prompt(req: dict[str, Any], image_size: int) -> dict[str, Any]:
    prompt: dict[str, Any] = {
        "prompt": RAW_PROMPT.format(question=req["question"]),
        "multi_modal_data": {"image": make_image(req["image_seed"], image_size)},
    }
    if req.get("uuid"):
        prompt["multi_modal_uuids"] = {"image": req["uuid"]}  # vLLM's mm_hash, verbatim
    return prompt


def _wait_for(*paths: Path) -> None:
    """Until one of ``paths`` exists."""
    deadline = time.monotonic() + TURN_TIMEOUT_S
    while not any(path.exists() for path in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no turn within {TURN_TIMEOUT_S} s ({paths[0]} never appeared)")
        time.sleep(0.05)


def _ttft_s(output: Any) -> float | None:
    """vLLM's own time to first token (arrival to first token), as its metrics report it."""
    metrics = getattr(output, "metrics", None)
    latency = getattr(metrics, "first_token_latency", 0.0)
    return float(latency) if latency else None


def _diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for side, counters in after.items():
        old = before.get(side, {})
        moved = {k: v - old.get(k, 0) for k, v in counters.items() if isinstance(v, (int, float))}
        out[side] = {k: v for k, v in moved.items() if v and not k.endswith(("_state", "_depth"))}
    return out


def connector_stats(llm: Any) -> dict[str, Any]:
    """Cumulative counters of both connector halves, when the connector offers them (the
    scheduler half lives in the in-process engine core, the worker half is vLLM's singleton)."""
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    out: dict[str, Any] = {}
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    scheduler = getattr(getattr(core, "scheduler", None), "ec_connector", None)
    if scheduler is not None and hasattr(scheduler, "stats_snapshot"):
        out["scheduler"] = scheduler.stats_snapshot()
    if has_ec_transfer() and hasattr(get_ec_transfer(), "stats_snapshot"):
        out["worker"] = get_ec_transfer().stats_snapshot()
    return out


def summarize(out: Any) -> dict[str, Any]:
    """One ``RequestOutput`` as JSON: tokens, text, and every prompt position's logprobs.

    Floats are Python floats, which JSON round-trips exactly, so equal runs compare equal.
    """
    completion = out.outputs[0] if out.outputs else None
    prompt_ids = list(out.prompt_token_ids or [])
    chosen: list[float | None] = []
    topk: list[list[list[float]] | None] = []
    for pos, entry in enumerate(out.prompt_logprobs or []):
        if entry is None:  # the first prompt token has no logprob
            chosen.append(None)
            topk.append(None)
            continue
        chosen.append(float(entry[prompt_ids[pos]].logprob))
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank, kv[0]))
        topk.append([[tok, float(lp.logprob)] for tok, lp in ranked])
    return {
        "prompt_token_ids": prompt_ids,
        "token_ids": list(completion.token_ids) if completion else [],
        "text": completion.text if completion else "",
        "finish_reason": completion.finish_reason if completion else None,
        "prompt_logprobs": chosen if out.prompt_logprobs is not None else None,
        "prompt_topk": topk if out.prompt_logprobs is not None else None,
    }


def shutdown(llm: Any) -> list[str]:
    """Engine core first (executor, then the scheduler-side connector), then the worker-side
    connector singleton. Errors are printed and returned, not raised."""
    from vllm.distributed.ec_transfer import ensure_ec_transfer_shutdown

    # LLM has no shutdown() in vLLM 0.32; its in-process engine core does.
    engine_shutdown = getattr(llm, "shutdown", None) or llm.llm_engine.engine_core.shutdown
    errors = []
    for step in (engine_shutdown, ensure_ec_transfer_shutdown):
        try:
            step()
        except Exception:
            traceback.print_exc()
            errors.append(traceback.format_exc())
    return errors


def exit_now(code: int) -> None:
    """End the process once every atexit handler has run, skipping module teardown.

    Tearing down vLLM's and torch's modules takes about 2 s per engine and does nothing the
    caller needs. Register with ``atexit`` first, so it runs last: non-daemon threads have
    been joined and every other handler (vLLM's, a connector's) has run by then.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> int:
    spec_path, out_path, progress_path = (Path(a) for a in argv)
    with progress_path.open("a", buffering=1) as log:

        def progress(line: str) -> None:
            log.write(line + "\n")

        try:
            result = run(json.loads(spec_path.read_text()), progress)
        except BaseException as exc:
            traceback.print_exc()
            progress(f"failed: {type(exc).__name__}: {exc}")
            return 1
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    import atexit

    exit_code = [1]  # an uncaught exception leaves 1
    atexit.register(lambda: exit_now(exit_code[0]))  # registered first, so it runs last
    exit_code[0] = main(sys.argv[1:])
    sys.exit(exit_code[0])
