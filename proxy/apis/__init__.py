"""The agent APIs served over the engine's chat completions, by translation: Anthropic Messages
(`proxy.apis.messages`) and OpenAI Responses (`proxy.apis.responses`).

One recording path: a Messages or Responses request is translated to the chat request it means,
which the forwarder sends, records and continues (`proxy.continuation`) exactly as a chat
request; the engine's chat answer, or each chunk of its stream, is translated back into the
agent's API, in its own shape and event grammar, with nothing it did not ask for. The log keeps
the agent's own request (`request_received.body`, `api` = messages | responses) and the engine's
tokens, so a session may mix APIs and still becomes samples like any other.

Why not the engine's own endpoints: vLLM's `/v1/messages` returns no token ids or logprobs, and
its `/v1/responses` returns them only in its own extensions and renders its own conversation
state; translating keeps one recording path, one continuation rule and one set of failure cases
for every API (its cost: `benchmarks/proxy_overhead.py --apis`).
"""

from typing import Any

from trajstore.proxy.apis.base import StreamTranslation, Translation
from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.apis.responses import Responses
from trajstore.proxy.wire import Api, Asked, asked_for, parse_body

#: The translated APIs, by the name recorded in `request_received.api`.
TRANSLATIONS: dict[str, Translation] = {"messages": Messages(), "responses": Responses()}


def as_chat(
    api: Api, raw: bytes
) -> tuple[dict[str, Any], dict[str, Any], Asked, Translation | None]:
    """An agent's request in every form the proxy needs: its body as sent (a 400 when it is not
    valid), the chat completion it means for the engine, what the agent itself asked for (token
    ids, logprobs: a translated API asks for none), and its translation (None for chat)."""
    body = parse_body(api, raw)
    translation = TRANSLATIONS.get(api)
    if translation is None:
        return body, body, asked_for(api, body), None
    return body, translation.to_chat(body), Asked(False, False, False), translation


__all__ = ["TRANSLATIONS", "StreamTranslation", "Translation", "as_chat"]
