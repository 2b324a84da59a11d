"""Anthropic Messages (`POST /v1/messages`), served over the engine's chat completions.

    Messages                                chat
    system (text or text blocks)            a first system message
    text blocks of one message              its content (several: text parts)
    assistant tool_use blocks               that message's tool_calls (input as JSON arguments)
    user tool_result blocks                 tool messages, before the message's text
    thinking, redacted_thinking sent back   left out (a template strips them from history)
    tool_reference blocks in a tool_result  the tool's name, as text (every tool is served)
    tools: client, bash_*, text_editor_*    function tools (`proxy.apis.messages_tools`)
    server tools (web_search_*, ...)        left out, recorded (`Translated.dropped`)
    tool_choice auto | any | tool | none    auto | required | that function | none
    stop_sequences, max_tokens              stop, max_tokens
    image blocks (base64, url source)       image_url parts (a data URL, the URL), in user
                                              messages and tool results; recorded by reference
    document, file-source image blocks      400 naming the block
    cache_control, metadata, thinking,      accepted; not the engine's business (headers such
      context_management, output_config     as `anthropic-beta` neither)

Back (`proxy.apis.messages_output`): the first choice as content blocks (thinking, text,
tool_use), `stop_reason` from the finish reason (stop -> end_turn, or stop_sequence when a stop
string matched; length -> max_tokens; tool_calls -> tool_use), usage in input/output tokens;
streams in Anthropic's event grammar (message_start, content_block_start/delta/stop,
message_delta, message_stop) and errors as `{"type": "error", "error": {...}}`.
"""

from __future__ import annotations

from typing import Any

from trajstore.proxy.apis.base import (
    ImagePart,
    Translated,
    chat_content,
    image_url_part,
    in_chat_order,
    refuse_media,
    serialised_arguments,
    text_content,
)
from trajstore.proxy.apis.messages_output import (
    MessagesStream,
    answer,
    error_body,
    stop_reason_of,
)
from trajstore.proxy.apis.messages_tools import chat_tools
from trajstore.proxy.errors import BadRequest, ProxyError

#: Anthropic's own fields, translated (or ignored, for `metadata` and the like); anything else
#: (vLLM's sampling extras such as `seed` or `min_p`) passes on to the engine untouched.
_OWN = {
    "model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking", "service_tier",
    "container", "mcp_servers", "cache_control", "context_management", "diagnostics",
    "inference_geo", "output_config", "speed", "user_profile_id", "workspace_id",
}  # fmt: skip


def _text_of(block: Any, param: str) -> str:
    if not isinstance(block, dict):
        raise BadRequest("each content block must be an object with a 'type'", param=param)
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise BadRequest("a text block needs 'text' as a string", param=param)
        return text
    if kind == "tool_reference":  # a tool search's result: the tool it found, by name
        return str(block.get("tool_name", ""))
    if kind in ("image", "document", "search_result", "container_upload"):
        raise refuse_media(kind, param)
    raise BadRequest(f"unexpected content block {kind!r} here", param=param)


def _texts(content: Any, param: str) -> list[str]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise BadRequest("'content' must be a string or a list of content blocks", param=param)
    return [_text_of(block, param) for block in content]


def _image(
    block: dict[str, Any], at: tuple[str | int, ...], images: list[ImagePart]
) -> dict[str, Any]:
    """An image block as the chat `image_url` part the engine gets (a base64 source as a data
    URL, a URL source as it is); noted in `images` for the recorder."""
    param = ".".join(map(str, at))
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")  # type: ignore[union-attr]
        if not isinstance(media_type, str) or not isinstance(data, str) or not data:
            raise BadRequest(
                f"{param}: a base64 image source needs 'media_type' (image/png, image/jpeg, ...) "
                "and 'data' (the image's bytes in base64)",
                param=param,
            )
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        url = source.get("url")  # type: ignore[union-attr]
        if not isinstance(url, str) or not url:
            raise BadRequest(f"{param}: a url image source needs 'url'", param=param)
    else:
        raise BadRequest(
            f"{param}: image sources of type {kind!r} are not served (Files API uploads need "
            "Anthropic's servers): send the image as a base64 or url source",
            param=param,
        )
    part = image_url_part(url)
    images.append(ImagePart(part, param, at, "source"))
    return part


def _parts(
    content: Any, at: tuple[str | int, ...], images: list[ImagePart]
) -> list[str | dict[str, Any]]:
    """A user message's or tool result's blocks: text as strings, images as chat parts."""
    if isinstance(content, str):
        return [content]
    param = ".".join(map(str, at))
    if not isinstance(content, list):
        raise BadRequest("'content' must be a string or a list of content blocks", param=param)
    out: list[str | dict[str, Any]] = []
    for j, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "image":
            out.append(_image(block, (*at, j), images))
        else:
            out.append(_text_of(block, param))
    return out


def _user(content: Any, at: tuple[str | int, ...], images: list[ImagePart]) -> list[dict[str, Any]]:
    """A user message: its tool results as tool messages first, then its text and images."""
    param = ".".join(map(str, at))
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise BadRequest("'content' must be a string or a list of content blocks", param=param)
    out: list[dict[str, Any]] = []
    parts: list[str | dict[str, Any]] = []
    for j, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "tool_result":
            result = block.get("content", "")
            found: list[str | dict[str, Any]] = (
                _parts(result, (*at, j, "content"), images) if result else [""]
            )
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": chat_content(found),
                }
            )
        elif isinstance(block, dict) and block.get("type") == "image":
            parts.append(_image(block, (*at, j), images))
        else:
            parts.append(_text_of(block, param))
    if parts:
        out.append({"role": "user", "content": chat_content(parts)})
    return out


def _assistant(content: Any, param: str) -> dict[str, Any]:
    """An assistant message: text blocks as content, tool_use blocks as tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise BadRequest("'content' must be a string or a list of content blocks", param=param)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            arguments = serialised_arguments(block.get("input", {}))
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # not sent back to the model: templates strip earlier reasoning
        else:
            texts.append(_text_of(block, param))
    message: dict[str, Any] = {"role": "assistant"}
    message["content"] = text_content(texts) if texts else (None if calls else "")
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(
    body: dict[str, Any], images: list[ImagePart] | None = None
) -> list[dict[str, Any]]:
    """The chat messages a Messages request means (system first); its images are noted in
    `images`, in the agent's order (`in_chat_order` gives the prompt's)."""
    images = [] if images is None else images
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": text_content(_texts(system, "system"))})
    for k, message in enumerate(messages):
        param = f"messages.{k}.content"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            out += _user(message.get("content"), ("messages", k, "content"), images)
        elif role == "assistant":
            out.append(_assistant(message.get("content"), param))
        elif role == "system":  # not Anthropic's, but sent by some CLIs mid-conversation
            out.append(
                {"role": "system", "content": text_content(_texts(message.get("content"), param))}
            )
        else:
            raise BadRequest(
                f"messages.{k}: 'role' must be 'user' or 'assistant' (the system prompt goes in "
                "'system')",
                param=f"messages.{k}.role",
            )
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        raise BadRequest(
            "'tool_choice' must be {type: auto | any | tool | none}", param="tool_choice"
        )
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


class Messages:
    """The Anthropic Messages API (a `proxy.apis.Translation`)."""

    def translate(self, body: dict[str, Any]) -> Translated:
        """The chat request a Messages request means, and the tools left out of it."""
        max_tokens = body.get("max_tokens")
        if type(max_tokens) is not int or max_tokens < 1:
            raise BadRequest("'max_tokens' is required: a positive integer", param="max_tokens")
        for refused in ("container", "mcp_servers"):
            if body.get(refused):
                raise BadRequest(f"'{refused}' runs on Anthropic's servers", param=refused)
        chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _OWN}
        chat["model"] = body.get("model")
        images: list[ImagePart] = []
        chat["messages"] = chat_messages(body, images)
        chat["max_tokens"] = max_tokens
        for field in ("temperature", "top_p", "top_k"):
            if body.get(field) is not None:
                chat[field] = body[field]
        stop = body.get("stop_sequences")
        if stop:
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise BadRequest(
                    "'stop_sequences' must be a list of strings", param="stop_sequences"
                )
            chat["stop"] = stop
        chat["tools"], dropped = chat_tools(body["tools"]) if body.get("tools") else ([], [])
        if not chat["tools"]:
            del chat["tools"]  # none, or all run on Anthropic's servers
        if body.get("tool_choice") is not None:
            _tool_choice(body["tool_choice"], chat)
        if body.get("stream"):  # checked with the body (`proxy.wire.parse_body`)
            chat["stream"] = True
        return Translated(chat, dropped, in_chat_order(chat["messages"], images))

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat request alone."""
        return self.translate(body).chat

    def count_tokens_request(self, body: dict[str, Any]) -> Translated:
        """What `count_tokens` asks the engine's `/tokenize`: the prompt the request would be
        (its messages and served tools, the generation prompt), and the tools left out."""
        request: dict[str, Any] = {
            "model": body.get("model"),
            "messages": chat_messages(body),
            "add_generation_prompt": True,
        }
        tools, dropped = chat_tools(body["tools"]) if body.get("tools") else ([], [])
        if tools:
            request["tools"] = tools
        return Translated(request, dropped)

    def answer(self, chat: dict[str, Any], body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """A Messages response from the engine's chat answer."""
        return answer(chat, body, request_id)

    def stream(self, body: dict[str, Any], request_id: str) -> MessagesStream:
        """A translator for one stream."""
        return MessagesStream(body, request_id)

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        """Anthropic's error shape."""
        return error_body(error)

    def finish_reason(self, finish_reason: str | None, stop_reason: Any) -> str | None:
        """Anthropic's `stop_reason` for a chat finish reason."""
        return stop_reason_of(finish_reason, stop_reason)
