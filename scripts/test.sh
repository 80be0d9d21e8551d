#!/usr/bin/env bash
# The test command: installs everything the tests need, then lint, type check and tests.
# Fails on any lint/type/test failure and when no test ran (pytest exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."

# Real Redis tests need the redis-server binary; install it when missing (Debian/Ubuntu).
if ! command -v redis-server >/dev/null 2>&1; then
  echo "test.sh: installing redis-server" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server
fi
# compose.yaml is validated by a real Compose implementation that works offline (Debian's
# docker-compose 1.29; no Docker engine needed, so without the recommended docker.io).
if ! command -v docker-compose >/dev/null 2>&1; then
  echo "test.sh: installing docker-compose" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends docker-compose
fi

# torch is pinned so a CPU machine never pulls a multi-GB CUDA build; override with
# EC_REDIS_TORCH (e.g. EC_REDIS_TORCH=torch) on a GPU machine.
python3 -m venv .venv
.venv/bin/python -m pip install -q "${EC_REDIS_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e '.[test]'
# A real vLLM engine (CPU build) for the connector's end-to-end tests.
bash scripts/install_vllm.sh .venv

.venv/bin/ruff check src tests
.venv/bin/ruff format --check src tests
.venv/bin/mypy
# EC_REDIS_REQUIRE_*: a missing redis-server, vLLM or docker-compose fails the run instead of
# skipping tests.
EC_REDIS_REQUIRE_REDIS=1 EC_REDIS_REQUIRE_VLLM=1 EC_REDIS_REQUIRE_COMPOSE=1 \
  .venv/bin/python -m pytest -p no:cacheprovider "$@"
