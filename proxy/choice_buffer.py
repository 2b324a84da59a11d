"""One choice of a request as the recorder gathers it: the tokens not yet written as a chunk
event, and what its completion_finished will say of it (finish and stop reasons, the message,
streamed deltas merged into one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trajstore.proxy.wire import ChoiceTokens


@dataclass
class ChoiceBuffer:
    """Tokens of one choice not yet written, and what the finished event will say of it."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logprobs_complete: bool = True
    text: list[str] = field(default_factory=list)
    n_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: Any = None
    message: dict[str, Any] | None = None
    content: list[str] = field(default_factory=list)  # streamed chat content, for the message
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    role: str | None = None
    routed_experts: str | None = None  # as the engine sent them (`proxy.routing`)

    def take(self, choice: ChoiceTokens) -> None:
        """Add what an answer, or one read of a stream, carried of this choice."""
        self.token_ids.extend(choice.token_ids)
        if choice.logprobs is None:
            self.logprobs_complete = self.logprobs_complete and not choice.token_ids
        else:
            self.logprobs.extend(choice.logprobs)
        self.text.append(choice.text)
        self.n_tokens += len(choice.token_ids)
        self.finish_reason = choice.finish_reason or self.finish_reason
        self.stop_reason = choice.stop_reason or self.stop_reason
        if choice.message is not None:
            self.message = choice.message
        if choice.delta:
            self._merge_delta(choice.delta)
        if choice.routed_experts:
            self.routed_experts = choice.routed_experts

    def take_chunk(self) -> tuple[list[int], list[float] | None, str]:
        """The tokens held (ids, logprobs if the engine gave them all, text), now written."""
        chunk = (
            self.token_ids,
            self.logprobs if self.logprobs_complete else None,
            "".join(self.text),
        )
        self.token_ids, self.logprobs, self.text = [], [], []
        self.logprobs_complete = True
        return chunk

    def final_message(self) -> dict[str, Any] | None:
        """The message the choice answered: whole (non-streamed chat), or merged from the
        stream's deltas; None for completions."""
        if self.message:
            return self.message
        if self.role is None and not self.content and not self.tool_calls:
            return None
        message: dict[str, Any] = {
            "role": self.role or "assistant",
            "content": "".join(self.content) or None,
        }
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return message

    def _merge_delta(self, delta: dict[str, Any]) -> None:
        self.role = delta.get("role") or self.role
        if delta.get("content"):
            self.content.append(delta["content"])
        for call in delta.get("tool_calls") or ():
            merged = self.tool_calls.setdefault(
                int(call.get("index") or 0), {"function": {"name": "", "arguments": ""}}
            )
            for key in ("id", "type"):
                if call.get(key):
                    merged[key] = call[key]
            function = call.get("function") or {}
            merged["function"]["name"] += function.get("name") or ""
            merged["function"]["arguments"] += function.get("arguments") or ""
