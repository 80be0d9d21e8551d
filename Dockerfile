# vLLM's official OpenAI server image with ec_redis installed into its Python environment.
# Used by every vLLM service of compose.yaml and by its proxy (python3 -m ec_redis.proxy).
#   docker build -t ec-redis-vllm:local --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.33.0 .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
FROM ${VLLM_IMAGE}

COPY pyproject.toml README.md /opt/ec_redis/
COPY src /opt/ec_redis/src

# Keep the image's CUDA torch: pin whatever torch is installed, so resolving ec_redis's
# `torch>=2.4` can never replace it (no CPU wheel, no second CUDA build). The image's Python
# is the system one; PIP_BREAK_SYSTEM_PACKAGES lets a recent pip install into it.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
RUN python3 -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/keep-torch.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/keep-torch.txt /opt/ec_redis \
 && python3 -c "import ec_redis.connector, ec_redis.proxy; import vllm; print('ec_redis ok with vLLM', vllm.__version__)" \
 && rm /tmp/keep-torch.txt

# The image's entrypoint (vllm serve) stays; compose.yaml sets it explicitly per service.
