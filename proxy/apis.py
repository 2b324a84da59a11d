"""The agent APIs served over the engine's chat completions, by translation: Anthropic Messages
(`proxy.messages_api`) and OpenAI Responses (`proxy.responses_api`).

One recording path: a Messages or Responses request is translated to the chat request it means,
which the forwarder sends, records and continues (`proxy.continuation`) exactly as a chat
request; the engine's chat answer, or each chunk of its stream, is translated back into the
agent's API, in its own shape and event grammar, with nothing it did not ask for. The log keeps
the agent's own request (`request_received.body`, `api` = messages | responses) and the engine's
tokens, so a session may mix APIs and still becomes samples like any other.

Why not the engine's own endpoints: vLLM's `/v1/messages` returns no token ids or logprobs, and
its `/v1/responses` returns them only in its own extensions; translating keeps one recording
path, one continuation rule and one set of failure cases for every API (measured cost:
`benchmarks/proxy_overhead.py --apis`).
"""

from __future__ import annotations

from typing import Any, Protocol

from proxy.errors import ProxyError


class StreamTranslation(Protocol):
    """One stream's chat chunks, as the agent's API streams them."""

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The bytes to send the agent for one engine chunk (b"" for none)."""
        ...

    def end(self) -> bytes:
        """The bytes that close the stream, once the engine sent [DONE]."""
        ...

    def error(self, error: ProxyError) -> bytes:
        """The bytes that tell the agent the stream failed."""
        ...


class Translation(Protocol):
    """One agent API, to and from the engine's chat completions."""

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat request the agent's request means; `BadRequest` saying what to fix."""
        ...

    def answer(self, chat: dict[str, Any], body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """The agent's answer, from the engine's chat answer."""
        ...

    def stream(self, body: dict[str, Any], request_id: str) -> StreamTranslation:
        """A translator for one stream."""
        ...

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        """An error in the API's own shape."""
        ...

    def finish_reason(self, finish_reason: str | None, stop_reason: Any) -> str | None:
        """A chat finish reason in the API's own taxonomy (recorded beside the common one)."""
        ...


#: The translated APIs, by the name recorded in `request_received.api`.
TRANSLATIONS: dict[str, Translation] = {}
