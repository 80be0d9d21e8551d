"""Run one real vLLM engine from a JSON spec and write its outputs as JSON (a subprocess).

Usage: ``python -m tests.e2e.run_engine --spec spec.json --out out.json``

Each engine needs a fresh process: vLLM's worker-side EC connector is a process-wide
singleton. The spec (all keys but ``model`` optional)::

    {
      "model": "/path/to/tiny-llava-s0",
      "ec_transfer_config": {"ec_connector": "...", "ec_role": "ec_producer", ...} | null,
      "env": {"EC_REDIS_STATS_PATH": "..."},        # set before vLLM is imported
      "llm_kwargs": {"enable_prefix_caching": false}, # overrides the CPU defaults below
      "sampling": {"max_tokens": 4, "prompt_logprobs": 1, "seed": 0},
      "patch": "tests.e2e.faults:flush_redis_after_first_hit",  # called before the engine
      "count_encoder_passes": true,   # count images the vision tower encodes (after start-up)
      "rounds": [[request, ...], ...]                 # or "requests": [request, ...] (one round)
    }

A request is ``{"prompt": "USER: <image>\\n... ASSISTANT:"}`` (raw text) or
``{"question": "..."}`` (rendered through the model's chat template), plus
``"image_seed": int | null`` (an image from ``make_image``; null: text only) and an optional
``"uuid"`` (the multimodal uuid, which vLLM then uses verbatim as the ``mm_hash``).

The output holds ``rounds``: for each request, ``prompt_token_ids``, ``token_ids``, ``text``,
``finish_reason``, ``prompt_logprobs`` (the logprob of each prompt token, ``None`` for the
first) and ``prompt_topk`` (``[[token_id, logprob], ...]`` per position, best first). Floats
are Python floats, which JSON round-trips exactly, so equal runs compare equal with ``==``.
It also holds ``shutdown_errors`` (tracebacks; engine and connector shutdown errors are
reported, not raised) and ``timings_s``. A failure exits non-zero with the traceback on stderr.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import logging
import os
import sys
import time
import traceback
from typing import Any

# One in-process engine; no torch.compile (22 s on the first logprobs request, same
# results); never ask a model hub for anything (a bad model path fails instead).
DEFAULT_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCHDYNAMO_DISABLE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
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
DEFAULT_SAMPLING: dict[str, Any] = {
    "temperature": 0.0,
    "max_tokens": 4,
    "prompt_logprobs": 1,
    "seed": 0,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="path of the JSON spec")
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    try:
        result = run(spec)
    except BaseException:
        traceback.print_exc()
        return 1
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(DEFAULT_ENV)
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    started = time.perf_counter()
    # vLLM is imported only now, after the spec's environment is in place.
    from vllm import LLM, SamplingParams
    from vllm.config import ECTransferConfig

    from tests.e2e.tiny_model import make_image

    llm_kwargs = {**DEFAULT_LLM_KWARGS, **spec.get("llm_kwargs", {})}
    if spec.get("ec_transfer_config") is not None:
        # LLM() turns a dict into a config object only for kv_transfer_config.
        llm_kwargs["ec_transfer_config"] = ECTransferConfig(**spec["ec_transfer_config"])
    sampling = SamplingParams(**{**DEFAULT_SAMPLING, **spec.get("sampling", {})})
    rounds = spec["rounds"] if "rounds" in spec else [spec["requests"]]
    timings: dict[str, Any] = {"import": time.perf_counter() - started}

    if spec.get("patch"):
        # "module:function" called before the engine starts (fault injection for tests).
        module_name, _, function = spec["patch"].partition(":")
        getattr(importlib.import_module(module_name), function)(spec)
    llm = LLM(model=spec["model"], **llm_kwargs)
    timings["engine_init"] = time.perf_counter() - started - timings["import"]
    try:
        if spec.get("count_encoder_passes"):
            from tests.e2e import probes

            llm.apply_model(probes.count_encoder_passes)
        tokenizer = llm.get_tokenizer()
        results: list[list[dict[str, Any]]] = []
        timings["rounds"] = []
        for requests in rounds:
            prompts = [_engine_prompt(req, tokenizer, make_image) for req in requests]
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            timings["rounds"].append(time.perf_counter() - t0)
            results.append([_summarize(out) for out in outputs])
        connector_stats = _connector_stats(llm)
        encoder_passes = (
            sum(llm.apply_model(probes.images_encoded))
            if spec.get("count_encoder_passes")
            else None
        )
    finally:
        shutdown_errors = _shutdown(llm)
    timings["total"] = time.perf_counter() - started
    return {
        "rounds": results,
        "connector_stats": connector_stats,
        "encoder_passes": encoder_passes,
        "shutdown_errors": shutdown_errors,
        "timings_s": timings,
    }


def _connector_stats(llm: Any) -> dict[str, Any]:
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


def _engine_prompt(req: dict[str, Any], tokenizer: Any, make_image: Any) -> dict[str, Any]:
    has_image = req.get("image_seed") is not None
    if "prompt" in req:
        text = req["prompt"]
    else:
        content: list[dict[str, Any]] = [{"type": "image"}] if has_image else []
        content.append({"type": "text", "text": req["question"]})
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    prompt: dict[str, Any] = {"prompt": text}
    if has_image:
        prompt["multi_modal_data"] = {"image": make_image(req["image_seed"])}
        if req.get("uuid") is not None:
            prompt["multi_modal_uuids"] = {"image": req["uuid"]}
    return prompt


def _summarize(out: Any) -> dict[str, Any]:
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


def _shutdown(llm: Any) -> list[str]:
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


def _skip_module_teardown(exit_code: list[int]) -> None:
    """End the process once every atexit handler has run, skipping module teardown.

    Tearing down vLLM's and torch's modules takes about 2 s per engine and does nothing a
    test needs. Non-daemon threads have been joined and every other atexit handler (vLLM's,
    a connector's) has run by now; only ``__del__`` methods of module globals are skipped.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code[0])


if __name__ == "__main__":
    exit_code = [1]  # an uncaught exception leaves 1
    atexit.register(_skip_module_teardown, exit_code)  # registered first, so it runs last
    exit_code[0] = main()
    sys.exit(exit_code[0])
