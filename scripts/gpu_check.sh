#!/usr/bin/env bash
# The CUDA checks in one go, for a machine with a GPU, torch and safetensors but no network,
# no vLLM and no redis-server: the gpu-marked tests, the mocked-CUDA tests on a real CUDA
# build, and the bench's CUDA rows. Results go under $OUT (default ./gpu-check-out):
#   env.txt  gpu-tests.log  gpu-tests.xml  mocked-tests.log  cuda-bench.txt  cuda-bench.json
#
# The Python packages the tests need beyond torch/safetensors/numpy/xxhash/pytest/
# pytest-timeout/hypothesis travel as wheels in .whl/ (git-ignored). Build that folder on a
# machine with network access, for the GPU machine's Python (3.12, x86-64):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl \
#     redis==8.1.0 fakeredis==2.41.0 lz4==4.4.5 hiredis==3.5.0
#
# (about 2.5 MB; add e.g. pytest, pytest-timeout, hypothesis, numpy, xxhash, sortedcontainers
# the same way if the machine lacks them — one version of each). With the device tool, name
# `.whl` in `carry` and run `bash scripts/gpu_check.sh` with a timeout_s of about 600.
# Exit status: 0 when every step passed; otherwise the first failing step's status.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ec_redis_site .whl/*.whl || { echo "gpu_check: wheel install failed" >&2; exit 3; }
  export PYTHONPATH="/tmp/ec_redis_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u; uname -a; nvidia-smi 2>&1 | head -20
  "$PY" - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("devices", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for name in ("redis", "fakeredis", "lz4", "xxhash", "safetensors", "hypothesis", "pytest_timeout"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "MISSING", exc)
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here; this script only makes sense on a GPU machine" >&2
  exit 2
fi

status=0
step() {  # step NAME TIMEOUT_S CMD...: run, tee its output to $OUT/NAME, keep the first failure
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

# No test may be skipped for lack of CUDA here: -rA lists every outcome, and the xml keeps it.
step gpu-tests.log 300 "$PY" -m pytest -p no:cacheprovider -m gpu -rA \
  --junitxml "$OUT/gpu-tests.xml" tests/test_cuda.py
step mocked-tests.log 120 "$PY" -m pytest -p no:cacheprovider -q \
  tests/test_cuda_mocked.py tests/test_pinned_pool.py
step cuda-bench.txt 240 "$PY" -m ec_redis.bench.cuda --quick --json "$OUT/cuda-bench.json"

echo "gpu_check: done, status $status; results in $OUT"
exit "$status"
