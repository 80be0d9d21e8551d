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
      "step_log": "/path/steps.jsonl",  # for a patch that records per-step data (step_probe)
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
It also holds ``encoder_passes`` (summed over tensor-parallel ranks) and
``encoder_passes_per_rank``, ``shutdown_errors`` (tracebacks; engine and connector shutdown
errors are reported, not raised) and ``timings_s``. A failure exits non-zero with the
traceback on stderr.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

# The engine settings, the output summary and the shutdown order are the demo's.
from ec_redis.demo.engine import (
    DEFAULT_ENV,
    DEFAULT_LLM_KWARGS,
    DEFAULT_SAMPLING,
    connector_stats,
    exit_now,
    shutdown,
    summarize,
)


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

    from ec_redis.demo.tiny_model import make_image

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
            from ec_redis.demo import probes

            llm.apply_model(probes.count_encoder_passes)
        tokenizer = llm.get_tokenizer()
        results: list[list[dict[str, Any]]] = []
        timings["rounds"] = []
        for requests in rounds:
            prompts = [_engine_prompt(req, tokenizer, make_image) for req in requests]
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            timings["rounds"].append(time.perf_counter() - t0)
            results.append([summarize(out) for out in outputs])
        stats = connector_stats(llm)
        per_rank = (
            llm.apply_model(probes.images_encoded) if spec.get("count_encoder_passes") else None
        )
    finally:
        shutdown_errors = shutdown(llm)
    timings["total"] = time.perf_counter() - started
    return {
        "rounds": results,
        "connector_stats": stats,
        "encoder_passes": sum(per_rank) if per_rank is not None else None,
        "encoder_passes_per_rank": per_rank,
        "shutdown_errors": shutdown_errors,
        "timings_s": timings,
    }


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


if __name__ == "__main__":
    exit_code = [1]  # an uncaught exception leaves 1
    atexit.register(lambda: exit_now(exit_code[0]))  # registered first, so it runs last
    exit_code[0] = main()
    sys.exit(exit_code[0])
