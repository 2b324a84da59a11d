"""OpenAI Responses (`POST /v1/responses`), served over the engine's chat completions.

    Responses                               chat
    instructions                            a first system message
    input as text                           one user message
    message items (user, system, developer, their role's message (developer as system); text
      assistant; input_text / output_text)   parts joined as the template expects
    function_call, custom_tool_call,        tool_calls of the assistant message before them
      local_shell_call items                (or of a new one)
    their output items                      tool messages
    reasoning items sent back               left out (a template strips earlier reasoning)
    tools: function, namespace, custom,     function tools (`proxy.apis.responses_tools`)
      local_shell
    hosted tools (web_search, mcp, ...)     left out, recorded (`Translated.dropped`)
    max_output_tokens, text.format          max_tokens, response_format
    previous_response_id, conversation      400: send the whole conversation in `input`
    input_image (data URL, http URL)        image_url parts (detail passed on), in messages
                                              and tool outputs; recorded by reference
    input_image by file_id, input_file,     400 naming the part
      input_audio
    store, include, reasoning,              accepted; not the engine's business (`include`
      prompt_cache_key, client_metadata     shapes the answer: logprobs, reasoning)

Back (`proxy.apis.responses_output`): the first choice as output items, `status` completed, or
incomplete with reason max_output_tokens when cut by length; streams in the Responses event
grammar; errors in OpenAI's shape, mid-stream as `response.failed`.
"""

from __future__ import annotations

import time
from typing import Any

from trajstore.proxy.apis.base import (
    AssistantTurn,
    Dropped,
    ImagePart,
    Translated,
    chat_content,
    image_url_part,
    in_chat_order,
    refuse_media,
    text_content,
)
from trajstore.proxy.apis.responses_output import ResponsesStream, response
from trajstore.proxy.apis.responses_tools import (
    chat_call,
    chat_tool_name,
    chat_tools,
    flat_name,
    output_call_id,
    tool_kinds,
)
from trajstore.proxy.errors import BadRequest, ProxyError

#: The Responses API's own fields, translated or ignored (`store`: the proxy records every
#: request anyway; `metadata`, `client_metadata`, `user` and the like are not the engine's
#: business). Anything else (vLLM's sampling extras such as `seed` or `top_k`) passes on to the
#: engine untouched.
_OWN = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
    "max_output_tokens", "temperature", "top_p", "top_logprobs", "stream", "text", "include",
    "previous_response_id", "conversation", "background", "prompt", "store", "metadata",
    "user", "truncation", "service_tier", "reasoning", "prompt_cache_key", "safety_identifier",
    "stream_options", "max_tool_calls", "prompt_cache_retention", "client_metadata",
    "prompt_cache_options", "context_management", "moderation",
}  # fmt: skip

_CALLS = ("function_call", "custom_tool_call", "local_shell_call")
_OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _parts(content: Any, param: str) -> list[str]:
    """Text parts only (instructions, an assistant's message)."""
    return [p for p in _media_parts(content, (param,), None) if isinstance(p, str)]


def _media_parts(
    content: Any, at: tuple[str | int, ...], images: list[ImagePart] | None
) -> list[str | dict[str, Any]]:
    """Content parts: text as strings, `input_image` parts as chat `image_url` parts (noted
    in `images`; None where images cannot be: a 400)."""
    param = ".".join(map(str, at))
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise BadRequest("'content' must be a string or a list of content parts", param=param)
    out: list[str | dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            out.append(str(part.get("text", "")))
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        elif kind == "input_image" and images is not None:
            out.append(_image(part, (*at, j), images))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise refuse_media(kind, f"{param}.{j}")
        else:
            raise BadRequest(f"unexpected content part {kind!r}", param=param)
    return out


def _image(part: dict[str, Any], at: tuple[str | int, ...], images: list[ImagePart]) -> Any:
    """An `input_image` part as the chat `image_url` part the engine gets."""
    param = ".".join(map(str, at))
    url = part.get("image_url")
    if part.get("file_id") and not url:
        raise BadRequest(
            f"{param}: images by 'file_id' need files stored by OpenAI's servers, which "
            "trajstore's proxy does not keep: send 'image_url' (a data URL or an http(s) URL)",
            param=param,
        )
    if not isinstance(url, str) or not url:
        raise BadRequest(
            f"{param}: an input_image needs 'image_url': a data URL "
            "(data:image/png;base64,...) or an http(s) URL the engine can fetch",
            param=param,
        )
    detail = {"detail": part["detail"]} if isinstance(part.get("detail"), str) else {}
    chat_part = image_url_part(url, **detail)
    images.append(ImagePart(chat_part, param, at, "image_url"))
    return chat_part


def _item_messages(items: list[Any], images: list[ImagePart]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        param = f"input.{k}"
        if not isinstance(item, dict):
            raise BadRequest("each input item must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(
                    "a message's 'role' must be user, system, developer or assistant",
                    param=f"{param}.role",
                )
            # Images are the user's (a model does not send them back; system prompts have none).
            where = images if role == "user" else None
            parts = _media_parts(item.get("content"), ("input", k, "content"), where)
            role = "system" if role == "developer" else role
            out.append({"role": role, "content": chat_content(parts) if parts else ""})
        elif kind in _CALLS:
            call = chat_call(item, kind, param)
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind in _OUTPUTS:
            call_id = output_call_id(item, kind, param)
            output = item.get("output", "")
            content = (
                output
                if isinstance(output, str)
                else chat_content(_media_parts(output, ("input", k, "output"), images))
            )
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            continue  # not sent back to the model: templates strip earlier reasoning
        elif kind == "item_reference":
            raise BadRequest(
                "item references need stored responses, which trajstore's proxy does not serve: "
                "send the item itself",
                param=param,
            )
        else:
            raise BadRequest(
                f"input items of type {kind!r} are not served (messages, reasoning, "
                "function_call, custom_tool_call, local_shell_call and their outputs are)",
                param=param,
            )
    return out


def chat_messages(
    body: dict[str, Any], images: list[ImagePart] | None = None
) -> list[dict[str, Any]]:
    """The chat messages a Responses request means (instructions first); its images are noted
    in `images`."""
    images = [] if images is None else images
    for field in ("previous_response_id", "conversation"):
        if body.get(field):
            raise BadRequest(
                f"'{field}' needs conversation state stored by the server, which trajstore's "
                "proxy does not keep: send the whole conversation in 'input' (earlier items, the "
                "previous response's output items, then the new ones)",
                param=field,
            )
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        out.append(
            {"role": "system", "content": text_content(_parts(instructions, "instructions"))}
        )
    given = body.get("input")
    if isinstance(given, str):
        out.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        out += _item_messages(given, images)
    else:
        raise BadRequest("'input' must be a string or a non-empty list of items", param="input")
    return out


def _tool_choice(choice: Any, body: dict[str, Any]) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom"):
        name, namespace = choice.get("name"), choice.get("namespace")
        if isinstance(namespace, str) and isinstance(name, str):
            name = flat_name(namespace, name)
        elif kind == "custom":
            name = chat_tool_name(tool_kinds(body), name)
        return {"type": "function", "function": {"name": name}}
    raise BadRequest(
        "'tool_choice' must be auto, none, required, {type: function, name} or "
        "{type: custom, name}: the engine cannot be made to call a hosted tool",
        param="tool_choice",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequest("'text.format' must be text, json_object or json_schema", param="text")


class Responses:
    """The OpenAI Responses API (a `proxy.apis.Translation`)."""

    def translate(self, body: dict[str, Any]) -> Translated:
        """The chat request a Responses request means, and the tools left out of it."""
        for refused in ("background", "prompt"):
            if body.get(refused):
                raise BadRequest(f"'{refused}' is not served by trajstore's proxy", param=refused)
        chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _OWN}
        chat["model"] = body.get("model")
        images: list[ImagePart] = []
        chat["messages"] = chat_messages(body, images)
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        for field in ("temperature", "top_p", "top_logprobs", "parallel_tool_calls"):
            if body.get(field) is not None:
                chat[field] = body[field]
        dropped: list[Dropped] = []
        if body.get("tools"):
            chat["tools"], dropped = chat_tools(body["tools"])
            if not chat["tools"]:
                del chat["tools"]  # all hosted: the engine gets none, as with no tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"], body)
        response_format = _response_format(body.get("text"))
        if response_format is not None:
            chat["response_format"] = response_format
        if body.get("stream"):  # checked with the body (`proxy.wire.parse_body`)
            chat["stream"] = True
        return Translated(chat, dropped, in_chat_order(chat["messages"], images))

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat request alone."""
        return self.translate(body).chat

    def answer(self, chat: dict[str, Any], body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """A Response object from the engine's chat answer."""
        return response(body, request_id, AssistantTurn.of_answer(chat), time.time())

    def stream(self, body: dict[str, Any], request_id: str) -> ResponsesStream:
        """A translator for one stream."""
        return ResponsesStream(body, request_id)

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        """OpenAI's error shape (the Responses API shares it)."""
        return error.body()

    def finish_reason(self, finish_reason: str | None, stop_reason: Any) -> str | None:
        """`completed`, or the reason a response is incomplete."""
        return "max_output_tokens" if finish_reason == "length" else "completed"
