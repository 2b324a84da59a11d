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

from trajstore.proxy.apis.base import StreamTranslation, Translation
from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.apis.responses import Responses

#: The translated APIs, by the name recorded in `request_received.api`.
TRANSLATIONS: dict[str, Translation] = {"messages": Messages(), "responses": Responses()}

__all__ = ["TRANSLATIONS", "StreamTranslation", "Translation"]
