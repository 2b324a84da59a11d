"""Checkpoints: the model, its optimiser and where the run stands, so a run resumes after a kill.

A checkpoint is a directory `step-NNNNNNNN` under the run's checkpoint directory:

    model/           the model and tokenizer (`save_pretrained`: safetensors, loadable by vLLM)
    optimiser.pt     the optimiser's state (AdamW's moments: without them a resumed run would
                     take different steps than an uninterrupted one)
    state.json       `TrainingState`: the last step done, the epoch and the batches of it done,
                     and the live replay's checkpoint when training live

It is written under a `.tmp` name and renamed when complete, then older ones are removed: a kill
at any moment leaves the last complete checkpoint readable.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from trajstore.trainer.errors import TrainerError


@dataclass(frozen=True)
class TrainingState:
    """Where a run stands after `step` steps."""

    step: int = 0  #: steps done (the ledger's last recorded step, once saved)
    epoch: int = 0  #: the pass over the selection the next batch comes from
    batches_in_epoch: int = 0  #: batches of that pass already trained on
    policy_version: int = 0  #: the policy version the weights are (live training)
    live: dict[str, Any] | None = field(default=None)  #: `LiveCheckpoint.as_json()`


def save_checkpoint(
    directory: Path, model: Any, optimiser: torch.optim.Optimizer, state: TrainingState,
    tokenizer_dir: Path | None = None,
) -> Path:  # fmt: skip
    """Write the checkpoint of `state.step`; return its directory. Older ones are removed."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{state.step:08d}"
    partial = directory / f"step-{state.step:08d}.tmp"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    model.save_pretrained(partial / "model")
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(partial / "model")
    torch.save(optimiser.state_dict(), partial / "optimiser.pt")
    (partial / "state.json").write_text(json.dumps(asdict(state)))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    for older in directory.glob("step-*"):
        if older != final:
            shutil.rmtree(older, ignore_errors=True)
    return final


def latest_checkpoint(directory: Path) -> Path | None:
    """The last complete checkpoint under `directory`, or None."""
    if not directory.is_dir():
        return None
    complete = sorted(p for p in directory.glob("step-*") if not p.name.endswith(".tmp"))
    return complete[-1] if complete else None


def load_checkpoint(path: Path, model: Any, optimiser: torch.optim.Optimizer) -> TrainingState:
    """Load the weights and optimiser state of the checkpoint at `path` into the given ones."""
    from safetensors.torch import load_file

    state_file = path / "state.json"
    if not state_file.is_file():
        raise TrainerError(f"{path} is not a checkpoint (no state.json)")
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((path / "model").glob("*.safetensors")):
        weights |= load_file(shard, device=str(next(model.parameters()).device))
    # Tied weights are saved once (lm_head shares the embedding): strict=False, then check.
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    if unexpected or [k for k in missing if k not in tied and not _is_tied(model, k)]:
        raise TrainerError(f"checkpoint {path} does not fit the model: {missing=} {unexpected=}")
    optimiser.load_state_dict(
        torch.load(path / "optimiser.pt", map_location=next(model.parameters()).device)
    )
    return TrainingState(**json.loads(state_file.read_text()))


def _is_tied(model: Any, key: str) -> bool:
    """True when parameter `key` shares its storage with another (saved under the other name)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if key not in params:
        return False
    return any(name != key and p.data_ptr() == params[key].data_ptr() for name, p in params.items())
