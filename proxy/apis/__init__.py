"""The agent APIs served over the engine's chat completions, by translation: Anthropic Messages
(`proxy.apis.messages`) and OpenAI Responses (`proxy.apis.responses`).

One recording path: a Messages or Responses request is translated to the chat request it means,
which the forwarder sends, records and continues (`proxy.continuation`) exactly as a chat
request; the engine's chat answer, or each chunk of its stream, is translated back into the
agent's API, in its own shape and event grammar, with nothing it did not ask for. The log keeps
the agent's own request (`request_received.body`, `api` = messages | responses) and the engine's
tokens, so a session may mix APIs and still becomes samples like any other.

Tools the engine cannot run (the hosted and server tools, which run on OpenAI's or Anthropic's
servers) are left out of what the engine sees, by default: the request is served with the rest,
and the turn records which were left out (`request_received.dropped_tools`, as `Dropped.as_json`),
as does the answer's `X-Trajstore-Dropped-Tools` header. `TRAJSTORE_HOSTED_TOOLS=refuse` makes
them a 400 instead. Real agents declare such tools whatever the provider (Codex its `web_search`),
so refusing them refuses the agent.

Why not the engine's own endpoints: vLLM's `/v1/messages` returns no token ids or logprobs, and
its `/v1/responses` returns them only in its own extensions and renders its own conversation
state; translating keeps one recording path, one continuation rule and one set of failure cases
for every API (its cost: `benchmarks/proxy_overhead.py --apis`).
"""

from typing import Any, NamedTuple

from trajstore.proxy.apis.base import (
    Dropped,
    HostedTools,
    ImagePart,
    StreamTranslation,
    Translation,
    refuse_hosted,
)
from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.apis.responses import Responses
from trajstore.proxy.wire import Api, Asked, asked_for, parse_body

#: The translated APIs, by the name recorded in `request_received.api`.
TRANSLATIONS: dict[str, Translation] = {"messages": Messages(), "responses": Responses()}

_RUNS_ON = {"messages": "Anthropic", "responses": "OpenAI"}

#: The response header that names the tools the engine did not get.
DROPPED_TOOLS_HEADER = "X-Trajstore-Dropped-Tools"


class AgentRequest(NamedTuple):
    """An agent's request in every form the proxy needs."""

    body: dict[str, Any]  #: as the agent sent it
    chat: dict[str, Any]  #: the chat completion it means for the engine
    asked: Asked  #: what the agent itself asked for (a translated API asks for none)
    translation: Translation | None  #: None for chat and completions
    dropped: list[Dropped]  #: of its tools, what the engine does not get
    images: list[ImagePart]  #: a translated request's images, in chat order (chat: none)


def dropped_json(dropped: list[Dropped]) -> list[dict[str, Any]] | None:
    """What the engine did not get, as the record keeps it; None when nothing."""
    return [d.as_json() for d in dropped] if dropped else None


def dropped_header(dropped: list[Dropped]) -> dict[str, str]:
    """The response header naming what the engine did not get (`tools.8=web_search,
    tools.4.format=grammar`); none when nothing."""
    if not dropped:
        return {}
    named = ", ".join(f"{d.param}={d.type}" for d in dropped)
    # The types are the agent's strings: a header value takes printable ASCII only.
    return {DROPPED_TOOLS_HEADER: "".join(c if " " <= c <= "~" else "?" for c in named)}


def as_chat(api: Api, raw: bytes, hosted_tools: HostedTools = "drop") -> AgentRequest:
    """An agent's request in every form the proxy needs (a 400 when it is not valid, or when it
    declares a tool the engine cannot run and `hosted_tools` is `refuse`)."""
    body = parse_body(api, raw)
    translation = TRANSLATIONS.get(api)
    if translation is None:
        return AgentRequest(body, body, asked_for(api, body), None, [], [])
    chat, dropped, images = translation.translate(body)
    if hosted_tools == "refuse":
        refuse_hosted(dropped, _RUNS_ON[api])
    return AgentRequest(body, chat, Asked(False, False, False), translation, dropped, images)


__all__ = [
    "DROPPED_TOOLS_HEADER",
    "TRANSLATIONS",
    "AgentRequest",
    "Dropped",
    "HostedTools",
    "ImagePart",
    "StreamTranslation",
    "Translation",
    "as_chat",
    "dropped_header",
    "dropped_json",
]
