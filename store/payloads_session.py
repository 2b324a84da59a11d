"""The event contract, part one: a session's own facts and the trainer's steps.

Written to the stream `session-<id>` (`store.events.session_stream`) by the proxy's session API
(`proxy.sessions`) and the reaper, and to `training-<run>` by the trainer's ledger. Each class
is the one payload of its event type (`store.payloads`); fields are optional where a release
wrote the event without them, and then read as their default.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trajstore.store.payloads import Payload, payload_type


@payload_type
class SessionCreated(Payload):
    """`session_created`: an agent episode begins, as its orchestrator defined it."""

    event_type = "session_created"

    run_id: str | None = None  #: also the event's run id
    task_id: str | None = None
    group_id: str | None = None  #: sessions of one task, compared by GRPO
    metadata: dict[str, Any] = Field(default_factory=dict)
    deadline_s: float | None = None  #: seconds after `created_at` it times out
    created_at: float | None = None  #: the proxy's clock (epoch seconds)
    #: The admission limits asked for (`proxy.admission`), so every replica applies them.
    rate_limit: dict[str, Any] | None = None


@payload_type
class RewardAssigned(Payload):
    """`reward_assigned`: a reward for the whole session; a later one corrects an earlier one."""

    event_type = "reward_assigned"

    value: float
    components: dict[str, float] | None = None  #: named parts of the reward, for people
    source: str | None = None  #: who graded it


@payload_type
class SessionFinished(Payload):
    """`session_finished`: the session takes no more requests; its samples can be built."""

    event_type = "session_finished"

    status: str = "completed"  #: completed | aborted | error | timeout
    reason: str | None = None
    #: The lineage its orchestrator names the main one (`store.lineages`); None: the
    #: projection decides. Since migration 0016's release.
    main_lineage: int | None = None


@payload_type
class SessionDiscarded(Payload):
    """`session_discarded`: keep the session in the log, out of training."""

    event_type = "session_discarded"

    reason: str | None = None

    @property
    def why(self) -> str:
        """The reason, or "discarded" when none was given."""
        return self.reason or "discarded"


class StepSample(BaseModel):
    """One sample of a recorded training step, as the batch held it (`trainer.collate`)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    sample_id: str
    session_id: str
    row: int  #: the batch row it was packed into
    reward: float
    advantage: float
    policy_version: int = -1  #: -1: unknown
    staleness: int = -1
    n_tokens: int
    checksum: int  #: CRC-32 of its stored arrays


@payload_type
class TrainingStep(Payload):
    """`training_step`: one step of a training run, enough to lay its batch out again exactly
    (`trainer.ledger`)."""

    event_type = "training_step"

    training_run: str
    step: int  #: from 1; also the event's stream version
    model_version: str | int | None = None
    sample_ids: list[str] = Field(default_factory=list)  #: the batch's samples, in row order
    samples: list[StepSample] = Field(default_factory=list)
    layout: dict[str, Any] = Field(default_factory=dict)  #: batch_size, token_budget, pack
    replay: dict[str, Any] = Field(default_factory=dict)  #: what else the trainer passed
    metrics: dict[str, float] = Field(default_factory=dict)
