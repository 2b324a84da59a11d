"""What a rebuilt session holds: its turns, their choices, and how their references resolve.

`store.sessions.rebuild_session` folds a session's events into these records; the payload
contract they follow is in `store.sessions`. A turn's prompt and messages are kept as the log
stores them (what the turn added to the turn it continues) and made whole only when asked
(`TurnRecord.prompt_token_ids`, `TurnRecord.messages`; `store.references`), so a session of
thousands of turns costs what its turns added, not the square of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from trajstore.store.images import image_hashes
from trajstore.store.payloads import VersionSpan, dump
from trajstore.store.payloads_request import (
    Continuation,
    ImageRecorded,
    MessagesPrefix,
    PromptPrefix,
    RequestFailed,
)
from trajstore.store.payloads_session import RewardAssigned
from trajstore.store.references import Messages, Prompts
from trajstore.store.tokens import decode_token_ids


@dataclass
class ChoiceRecord:
    """One generated choice of a turn: its tokens, their logprobs, how it ended."""

    index: int
    token_ids: list[int] = field(default_factory=list)  # bytes as stored, when `packed`
    logprobs: list[float] = field(default_factory=list)  # bytes as stored, when `packed`
    text: str = ""
    finish_reason: str | None = None
    stop_reason: Any = None
    message: dict[str, Any] | None = None
    api_finish_reason: str | None = None  #: in the agent's API's taxonomy, when translated
    #: Which policy version generated which tokens, [{version, start, end}] in order; None when
    #: recorded before spans were (then the turn's `policy_version` generated all of them).
    version_spans: list[VersionSpan] | None = None

    def as_json(self) -> dict[str, Any]:
        """A JSON-able view."""
        return {
            "index": self.index,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "message": self.message,
            "api_finish_reason": self.api_finish_reason,
            "version_spans": (
                None if self.version_spans is None else [dump(s) for s in self.version_spans]
            ),
        }


#: vLLM's request options that constrain decoding with a grammar.
_GUIDED_OPTIONS = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
)  # fmt: skip


@dataclass
class TurnRecord:
    """One model request of a session, as recorded."""

    request_id: str
    api: str
    body: dict[str, Any]
    engine: str | None
    policy_version: str | None
    logprobs_mode: str | None
    stream: bool
    sampling: dict[str, Any]
    #: The prompt's ids as stored (bytes when `packed`): all of them, or when `prompt_prefix`
    #: is set, those after the ids it shares with the turn it continues.
    prompt_added: Any = field(default_factory=list)
    choices: dict[int, ChoiceRecord] = field(default_factory=dict)
    status: str = "in_progress"  # in_progress | completed | failed
    failure: RequestFailed | None = None
    usage: dict[str, Any] | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    first_position: int = 0
    received_at: float | None = None  # the proxy's clock when the request arrived
    messages_prefix: MessagesPrefix | None = None  # body.messages continue that request's
    prompt_source: str | None = None  # chat: continued | rendered (None: recorded before it)
    continuation: Continuation | None = None  # {request_id, choice, drift_at, audit} or {fallback}
    n_images: int = 0  # image parts in its whole messages
    image_token_id: int | None = None  # the engine's image placeholder id, when recorded
    #: A translated API's images, each one's sha256 in prompt order (chat: from its messages)
    image_order: list[str] | None = None
    #: The prompt starts with that request's prompt + completion
    prompt_prefix: PromptPrefix | None = None
    n_prompt_tokens: int | None = None  #: the whole prompt's length (None: not recorded yet)
    #: Per-token arrays the engine returned with it (`store.side_data`): (payload, bytes).
    side_data: list[tuple[Any, bytes | None]] = field(default_factory=list, repr=False)
    session: SessionRecord | None = field(default=None, repr=False, compare=False)

    @property
    def prompt_token_ids(self) -> Any:
        """The whole prompt (bytes when the session was rebuilt `packed`, else a list).

        Made whole on demand, through the turns its reference chain runs back to: reading
        every turn's whole prompt of a long session costs the square of its length; readers of
        whole sessions use `prompt_added` instead.
        """
        if self.prompt_prefix is None or self.session is None:
            return self.prompt_added
        whole = self.session.prompts.whole(self.request_id)
        return whole if self.session.packed else _ints(whole)

    @property
    def messages(self) -> list[Any] | None:
        """The request's whole messages (None when they are not a list or cannot be rebuilt)."""
        if self.messages_prefix is None or self.session is None:
            stored = self.body.get("messages")
            return stored if isinstance(stored, list) else None
        return self.session.messages.whole(self.request_id)

    @property
    def n_messages(self) -> int | None:
        """How many messages the request's whole list holds, from counts (no list is built)."""
        if self.messages_prefix is None or self.session is None:
            stored = self.body.get("messages")
            return len(stored) if isinstance(stored, list) else None
        return self.session.messages.count(self.request_id)

    @property
    def image_hashes(self) -> list[str | None]:
        """The request's images in the order of their placeholders in the prompt: each one's
        hash (None for an image recorded inline, as logs from before references have)."""
        if self.image_order is not None:
            return list(self.image_order)
        return image_hashes(self.messages)

    @property
    def messages_added(self) -> list[Any] | None:
        """The messages the request stored itself: all of them, or those after
        `messages_prefix`."""
        stored = self.body.get("messages")
        return stored if isinstance(stored, list) else None

    @property
    def constrained_by(self) -> str | None:
        """What constrained the engine's decoding (a forced tool call, a JSON format, a vLLM
        guided-decoding option), or None.

        The engine then samples from the grammar-masked distribution, and the logprobs it
        reports (vLLM: even `raw_logprobs`) are that distribution's, not the model's: measured
        on vLLM 0.32, a forced tool call's tokens came back with logprobs near 0 where the model
        gave them about -6. They are no behaviour logprobs for an importance ratio.
        """
        choice = self.body.get("tool_choice")
        if choice == "required" or isinstance(choice, dict):
            return "tool_choice"
        response_format = self.body.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type") in (
            "json_object",
            "json_schema",
        ):
            return "response_format"
        for key in _GUIDED_OPTIONS:
            if self.body.get(key) is not None:
                return key
        return None

    def choice(self, index: int) -> ChoiceRecord:
        """The choice with this index, created on first use."""
        if index not in self.choices:
            self.choices[index] = ChoiceRecord(index)
        return self.choices[index]

    def as_json(self, *, whole: bool = False) -> dict[str, Any]:
        """A JSON-able view: messages, tools, sampling, tokens, logprobs, outcome, timing.

        What the turn added: `messages` after `messages_prefix`, `prompt_added` after
        `prompt_prefix`; with `whole`, also the whole `prompt_token_ids` and `messages` (one
        turn's worth: never every turn's, which is the square of a session)."""
        view = {
            "request_id": self.request_id,
            "api": self.api,
            "messages": self.messages if whole else self.messages_added,
            "messages_prefix": None if whole else _json(self.messages_prefix),
            "prompt": self.body.get("prompt"),
            "tools": self.body.get("tools"),
            "sampling": self.sampling,
            "stream": self.stream,
            "engine": self.engine,
            "policy_version": self.policy_version,
            "logprobs_mode": self.logprobs_mode,
            "prompt_added": _ints_of(self.prompt_added),
            "prompt_prefix": _json(self.prompt_prefix),
            "n_prompt_tokens": self.n_prompt_tokens,
            "prompt_source": self.prompt_source,
            "continuation": _json(self.continuation),
            "choices": [self.choices[i].as_json() for i in sorted(self.choices)],
            "status": self.status,
            "constrained_by": self.constrained_by,
            "failure": _json(self.failure),
            "usage": self.usage,
            "latency_s": self.latency_s,
            "ttft_s": self.ttft_s,
        }
        if whole:
            view["prompt_token_ids"] = _ints_of(self.prompt_token_ids)
        return view


@dataclass
class SessionRecord:
    """A session rebuilt from its events."""

    session_id: str
    run_id: str | None = None
    task_id: str | None = None
    group_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    deadline_s: float | None = None
    created_at: float | None = None
    recorded_created_at: datetime | None = None  # when the store recorded its creation
    recorded_finished_at: datetime | None = None  # ... and its (last) finish
    status: str = "active"  # active | completed | aborted | error | timeout
    finish_reason: str | None = None
    discarded: str | None = None  # the reason, when discarded
    rewards: list[RewardAssigned] = field(default_factory=list)
    #: The admission limits its creator asked for (`session_created`), if any.
    rate_limit: dict[str, Any] | None = None
    turns: list[TurnRecord] = field(default_factory=list)
    n_events: int = 0
    #: The images its requests recorded, by sha256, without their bytes (`image_recorded`; the
    #: export writes those).
    images: dict[str, ImageRecorded] = field(default_factory=dict)
    #: The lineage its orchestrator named the main one at finish (`store.lineages`), if any.
    main_lineage: int | None = None
    packed: bool = False  #: token ids and logprobs kept as stored (bytes), not lists
    prompts: Prompts = field(default_factory=Prompts, repr=False, compare=False)
    messages: Messages = field(default_factory=Messages, repr=False, compare=False)

    @property
    def reward(self) -> float | None:
        """The last reward assigned (a later assignment corrects an earlier one)."""
        return self.rewards[-1].value if self.rewards else None

    def as_json(self, *, turns: bool = True) -> dict[str, Any]:
        """A JSON-able view of the whole session (without its turns when not `turns`: a
        long session's answer is written a page at a time, `store.pages`)."""
        view = {
            "session_id": self.session_id,
            "run_id": self.run_id,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "metadata": self.metadata,
            "deadline_s": self.deadline_s,
            "created_at": self.created_at,
            "status": self.status,
            "finish_reason": self.finish_reason,
            "discarded": self.discarded,
            "reward": self.reward,
            "rewards": [dump(reward) for reward in self.rewards],
            "main_lineage": self.main_lineage,
            "n_events": self.n_events,
            "images": {sha256: image.described() for sha256, image in self.images.items()},
        }
        if turns:
            view["turns"] = [t.as_json() for t in self.turns]
        return view


def _json(part: BaseModel | None) -> dict[str, Any] | None:
    """A payload or a part of one as the log stores it (None stays None)."""
    return None if part is None else dump(part)


def _ints(packed: bytes | bytearray) -> list[int]:
    ids = decode_token_ids(bytes(packed))
    return [] if ids is None else list(ids.tolist())


def _ints_of(ids: Any) -> list[int]:
    """Ids as a list, however they are held."""
    return _ints(ids) if isinstance(ids, bytes | bytearray) else list(ids)
