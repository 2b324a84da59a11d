"""Where a step runs: the device, its autocast, and how a batch gets there.

    auto  a CUDA GPU when torch sees one, else the CPU
    cuda  a CUDA GPU (an error, with the reason, when torch sees none)
    cpu   the CPU

On a GPU the recipe keeps float32 master weights and optimiser state and computes the forward
and backward passes under bf16 autocast: the matmuls run at bf16 speed while the update keeps
float32's precision (a bf16 weight would round away most AdamW steps at the learning rates RL
uses). On the CPU autocast is off by default (float32 is what the tiny model and the tests use);
it can be asked for, so its path is tested without a GPU.

A batch reaches a GPU through pinned (page-locked) host memory with a non-blocking copy: a DMA
the CPU does not wait for. The prefetch thread (`trainer.prefetch`) issues it on the default
stream, so the copy itself runs after the kernels queued before it; what overlaps the step is
the host's work (reading, collating, pinning), which is what the serial loop waited on. A
separate copy stream would overlap the DMA too; at ~10 k tokens a batch (about 0.4 MB of int64
ids and masks) it is not worth the stream bookkeeping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
from tensordict import TensorDict

from trajstore.trainer.errors import TrainerError

DeviceName = Literal["auto", "cuda", "cpu"]


def resolve_device(name: str) -> torch.device:
    """The device `name` means here (see the module docstring); `TrainerError` if unusable."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
            raise TrainerError(
                f"--device {name}: torch {torch.__version__} sees no CUDA GPU ({build}); "
                "use --device cpu, or install a CUDA build of torch on a machine with a GPU"
            )
        return torch.device(name)
    raise TrainerError(f"unknown device {name!r}: use auto, cuda or cpu")


def default_autocast(device: torch.device) -> bool:
    """bf16 autocast is the default on a GPU, and off on the CPU."""
    return device.type == "cuda"


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast on `device` when enabled; a no-op context otherwise."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def to_device(batch: TensorDict, device: torch.device) -> TensorDict:
    """The batch's tensors on `device`: pinned and copied without blocking when it is a GPU.

    The non-tensor `samples` entry travels along. On the CPU the batch is returned as is.
    """
    if device.type == "cpu":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's kernels run after the call that queued them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, float]]:
    """Measure the device's peak allocated memory (GB) over the block; 0 on the CPU."""
    figures = {"peak_memory_gb": 0.0}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        yield figures
    finally:
        if device.type == "cuda":
            figures["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
