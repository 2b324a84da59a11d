"""Every error the trainer side raises, rooted at one class.

    TrainerError
    ├── BadSelection        a `Selection` or replay parameter cannot be used as given
    ├── StepNotFound        the ledger has no such training run or step
    ├── SampleGone          a sample a recorded step used is no longer in the projection
    │   └── SampleChanged   ... or holds other tokens than it did at that step
    ├── StepAlreadyRecorded a training step was recorded already (the ledger never holds it twice)
    ├── MismatchCheckFailed an engine could not be asked for the logprobs of a recorded session
    └── ImageMismatch       a sample's image cannot be rebuilt as recorded (`trainer.vision`)

Store errors (`store.errors.StoreError`) pass through unchanged: they already say what failed.
"""

from __future__ import annotations


class TrainerError(Exception):
    """The trainer failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class BadSelection(TrainerError, ValueError):
    """The selection or replay parameters cannot be used as given."""


class StepNotFound(TrainerError, LookupError):
    """The ledger has no such training run or step."""


class SampleGone(TrainerError, LookupError):
    """A sample that a recorded training step used is no longer in the samples projection."""


class SampleChanged(SampleGone):
    """A sample that a recorded training step used holds other tokens now than it did then."""


class StepAlreadyRecorded(TrainerError):
    """This training step is already in the ledger; a step is recorded once."""


class MismatchCheckFailed(TrainerError):
    """The engine could not be asked for the logprobs of a recorded session."""


class ImageMismatch(TrainerError):
    """A sample's image cannot be given to the model as recorded: its bytes are missing, or its
    placeholder ids are not the run the model's processor makes of them."""
