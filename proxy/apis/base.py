"""What a translated API provides (`Translation`), and the pieces both translations share: text
content, tool-call arguments, the tools the engine does not see, the engine's answer read as one
assistant message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

import orjson

from trajstore.proxy.errors import BadRequest, ProxyError
from trajstore.store.images import image_parts


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


class Dropped(NamedTuple):
    """Something of the agent's tools the engine does not get: a tool it cannot run (a hosted
    tool, left out), or a custom tool's grammar it cannot enforce (the tool is served without
    it). Recorded with the turn (`request_received.dropped_tools`) and said in a header."""

    param: str  #: where it is in the request: `tools.4`, `tools.5.format`
    type: str  #: the tool's type (`web_search`, `web_search_20250305`), or `grammar`
    name: str | None = None  #: the tool's name, when it has one

    @property
    def whole_tool(self) -> bool:
        """Whether the engine does not see the tool at all (what `hosted_tools=refuse` refuses)."""
        return self.type != "grammar"

    def as_json(self) -> dict[str, Any]:
        """The record's form."""
        out = {"param": self.param, "type": self.type}
        if self.name is not None:
            out["name"] = self.name
        return out


class ImagePart(NamedTuple):
    """One image of a translated request: the chat part the engine gets, and where the agent
    sent it. The recorder checks and hashes the chat part, names `param` when it cannot be
    recorded, and records the agent's block at `path` as a reference (`referenced_block`)."""

    chat_part: dict[str, Any]  #: the `image_url` part of the chat request (this very object)
    param: str  #: the agent's part, as an error names it: `messages.2.content.1`
    path: tuple[str | int, ...]  #: the keys from the agent's body to its block
    field: str  #: the block's key that carries the image: `source` (Messages), `image_url`

    def referenced_block(self, block: dict[str, Any], reference: str) -> dict[str, Any]:
        """The agent's block as the log keeps it: the image's bytes replaced by a reference."""
        if self.field == "source":  # Anthropic's: a URL source names it
            return {**block, "source": {"type": "url", "url": reference}}
        return {**block, self.field: reference}


class Translated(NamedTuple):
    """A request translated to chat, what of its tools the engine does not get, and its
    images (in the order the chat messages hold them)."""

    chat: dict[str, Any]
    dropped: list[Dropped]
    images: list[ImagePart] = []  # noqa: RUF012 (a NamedTuple default, never mutated)


#: What the proxy does with a tool the engine cannot run (`ProxySettings.hosted_tools`).
HostedTools = Literal["drop", "refuse"]


def refuse_hosted(dropped: list[Dropped], runs_on: str) -> None:
    """The 400 for the first tool that is left out, when the proxy is set to refuse them."""
    for item in dropped:
        if item.whole_tool:
            raise BadRequest(
                f"{item.param}: the engine cannot run a {item.type!r} tool (one of {runs_on}'s "
                "own), and this proxy refuses such tools (TRAJSTORE_HOSTED_TOOLS=refuse): remove "
                "it, or let the proxy leave it out (TRAJSTORE_HOSTED_TOOLS=drop, the default)",
                param=item.param,
            )


class Translation(Protocol):
    """One agent API, to and from the engine's chat completions."""

    def translate(self, body: dict[str, Any]) -> Translated:
        """The chat request the agent's request means, and the tools left out of it (hosted
        tools are always left out here: `as_chat` refuses them when told to); `BadRequest`
        saying what to fix."""
        ...

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat request alone (as `translate`)."""
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


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with a name, as both APIs' streams send them."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def text_content(parts: list[str]) -> str | list[dict[str, str]]:
    """Chat content for text blocks: one string, or text parts that the engine joins as the
    model's chat template expects (vLLM: per the template's content format)."""
    if len(parts) == 1:
        return parts[0]
    return [{"type": "text", "text": part} for part in parts]


def refuse_media(kind: Any, param: str) -> BadRequest:
    """The 400 for content the proxy cannot pass on."""
    return BadRequest(
        f"content of type {kind!r} is not supported here: the proxy passes on text, and "
        "images in the messages of the user and in tool results",
        param=param,
    )


def chat_content(parts: list[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Chat content for text and image parts: `text_content` when all are text, else the
    parts in order (text as text parts, images as the `image_url` parts given)."""
    if all(isinstance(part, str) for part in parts):
        return text_content(parts)  # type: ignore[arg-type]
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]


def in_chat_order(messages: list[Any], images: list[ImagePart]) -> list[ImagePart]:
    """`images` in the order the chat messages hold them, which is the order of their
    placeholders in the prompt (a Messages tool result comes before the text of its message
    there, whatever the order of the agent's blocks)."""
    if len(images) < 2:
        return images
    by_part = {id(image.chat_part): image for image in images}
    return [by_part[id(part)] for _, _, part in image_parts(messages)]


def image_url_part(url: str, **extra: Any) -> dict[str, Any]:
    """A chat `image_url` part for `url` (`extra`: OpenAI's `detail`, passed on)."""
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def parsed_arguments(raw: Any) -> Any:
    """A tool call's arguments as a JSON value (the raw string when it is not JSON)."""
    if not isinstance(raw, str):
        return raw
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw


def serialised_arguments(value: Any) -> str:
    """Tool-call arguments as chat carries them: a JSON string."""
    return value if isinstance(value, str) else orjson.dumps(value).decode()


@dataclass
class AssistantTurn:
    """The engine's answer as one assistant message: what both APIs translate back.

    A stream's text is kept as its pieces (joined when asked for): appending to one string
    would copy it on every token of a long answer.
    """

    text_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # chat's shape, merged
    finish_reason: str | None = None
    stop_reason: Any = None
    keep_logprobs: bool = False  #: collect `logprobs` (only when the agent asked for them)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat's logprobs.content
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def text(self) -> str:
        """The answer's text so far."""
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        """The answer's reasoning so far (a reasoning parser's output)."""
        return "".join(self.reasoning_parts)

    @classmethod
    def of_answer(cls, chat: dict[str, Any]) -> AssistantTurn:
        """The first choice of a non-streamed chat answer."""
        turn = cls()
        choices = chat.get("choices") or [{}]
        choice = choices[0]
        message = choice.get("message") or {}
        turn.text_parts = [message.get("content") or ""]
        turn.reasoning_parts = [message.get("reasoning_content") or message.get("reasoning") or ""]
        turn.tool_calls = list(message.get("tool_calls") or ())
        turn.finish_reason = choice.get("finish_reason")
        turn.stop_reason = choice.get("stop_reason")
        turn.logprobs = list((choice.get("logprobs") or {}).get("content") or ())
        usage = chat.get("usage") or {}
        turn.prompt_tokens = usage.get("prompt_tokens") or len(chat.get("prompt_token_ids") or ())
        turn.completion_tokens = usage.get("completion_tokens") or len(
            choice.get("token_ids") or ()
        )
        return turn

    def take(self, chunk: dict[str, Any]) -> list[tuple[str, Any]]:
        """Fold one stream chunk in; returns what it added, in order, as (kind, value):
        ("reasoning", text), ("text", text), ("call", index) for a new tool call,
        ("arguments", (index, text)). Only the first choice is an API's answer."""
        added: list[tuple[str, Any]] = []
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_tokens = len(chunk["prompt_token_ids"])
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens") or self.prompt_tokens
            self.completion_tokens = usage.get("completion_tokens") or self.completion_tokens
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                self.reasoning_parts.append(reasoning)
                added.append(("reasoning", reasoning))
            content = delta.get("content")
            if content:
                self.text_parts.append(content)
                added.append(("text", content))
            if "tool_calls" in delta:
                for call in delta["tool_calls"] or ():
                    added += self._take_call(call)
            if self.keep_logprobs:
                self.logprobs += (choice.get("logprobs") or {}).get("content") or ()
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")
            if not usage:
                self.completion_tokens += len(choice.get("token_ids") or ())
        return added

    def _take_call(self, call: dict[str, Any]) -> list[tuple[str, Any]]:
        index = int(call.get("index") or 0)
        function = call.get("function") or {}
        added: list[tuple[str, Any]] = []
        if index >= len(self.tool_calls):
            self.tool_calls.append(
                {
                    "id": call.get("id") or "",
                    "type": "function",
                    "function": {"name": function.get("name") or "", "arguments": ""},
                }
            )
            added.append(("call", index))
        merged = self.tool_calls[index]
        if function.get("arguments"):
            merged["function"]["arguments"] += function["arguments"]
            added.append(("arguments", (index, function["arguments"])))
        return added
