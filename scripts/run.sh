#!/usr/bin/env bash
# The main job: install ec_redis and benchmark it on an embedded Redis (a redis-server on a
# free port when one is installed, else fakeredis's TCP server). Extra args go to the bench,
# e.g. `scripts/run.sh --redis-url redis://host:6379/0` or `scripts/run.sh --quick`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q "${EC_REDIS_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e .
exec .venv/bin/ec-redis bench "$@"
