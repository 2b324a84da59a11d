#!/usr/bin/env bash
# The GPU check in one prepared command, for a GPU machine without network (docs/performance.md,
# "Training on a GPU"). That machine has Python 3.12 with torch, transformers, numpy, pyarrow and
# aiohttp, but not the store's dependencies.
#
#   bash benchmarks/gpu_check.sh fetch   here, with network: their cp312 wheels into .gpu-wheels/
#   bash benchmarks/gpu_check.sh run     there, from the repository's root: install them, run
#                                        benchmarks/gpu.py on the GPU (a few minutes)
#   bash benchmarks/gpu_check.sh run --long --out results.json
#                                        the long-context mode (benchmarks/gpu_long.py, ~6 min):
#                                        before/after memory per token, 32 k/64 k samples, the
#                                        longest sample for 0.5B and 1.5B, Liger-Kernel's path
#
# .gpu-wheels/ is not committed (ignore it in .git/info/exclude and carry it to the machine).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
PACKAGES=(
    asyncpg sqlalchemy greenlet alembic mako markupsafe pydantic pydantic-core pydantic-settings
    python-dotenv typing-inspection annotated-types orjson platformdirs pgserver fasteners
    "tensordict==0.15.3" pyvers click rich markdown-it-py mdurl pygments
    "liger-kernel==0.8.5"  # pure Python over Triton (the machine has torch and triton)
)
case "${1:-}" in
fetch)
    mkdir -p "$WHEELS"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 --platform any -d "$WHEELS" "${PACKAGES[@]}"
    du -sh "$WHEELS"
    ;;
run)
    python3 -m pip install --quiet --no-deps --no-index "$WHEELS"/*.whl
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py "${@:2}"
    ;;
*)
    echo "usage: $0 fetch | run [gpu.py options]" >&2
    exit 2
    ;;
esac
