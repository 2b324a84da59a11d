"""A model request as its request_received event records it, before anything is forwarded: the
agent's body, the sampling and what it asked for; its images recorded once per session and
referred to by hash (`proxy.images`); a chat request's messages stored after those of the
remembered turn it repeats (`messages_prefix`). What the recorder keeps of it is what the
session's next turns are compared with (`proxy.lineages`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from trajstore.proxy.apis.base import ImagePart
from trajstore.proxy.images import Image, referenced, referenced_body
from trajstore.proxy.lineages import SessionTurns, Turn, render_key
from trajstore.proxy.wire import Api, Asked, sampling_of
from trajstore.store.payloads import stored
from trajstore.store.payloads_request import MessagesPrefix, RequestReceived


@dataclass
class Received:
    """The request_received payload of a request, and what its recorder keeps of the request."""

    payload: dict[str, Any]  #: as stored (`RequestReceived`)
    #: The request's images new to the session: their image_recorded events follow this one.
    new_images: list[Image] = field(default_factory=list)
    messages: tuple[int, bytes] = (0, b"")  #: chat: how many messages, as JSON
    render_key: bytes = b""  #: the render options the next turn is compared with
    #: The remembered turns whose messages this request repeats, deepest first.
    candidates: list[Turn] = field(default_factory=list)


def received(
    request_id: str,
    *,
    api: Api,
    body: dict[str, Any],
    chat: dict[str, Any],
    engine: str,
    policy_version: str,
    logprobs_mode: str,
    asked: Asked,
    replica: str | None,
    dropped_tools: list[dict[str, Any]] | None,
    images: list[ImagePart],
    turns: SessionTurns,
    max_image_bytes: int,
    image_token_id: int | None,
) -> Received:
    """Build (and so validate) request `request_id`'s request_received payload.

    `body` is the agent's request as it sent it; `chat` the chat request it was translated
    to (`proxy.apis`; the body itself for chat): its sampling, messages and render options
    are what the next turn is compared with. `replica`: the proxy replica serving it.
    `dropped_tools`: the agent's tools the engine did not get (`proxy.apis.Dropped`).
    `images`: a translated request's images, which its recorded body refers to by hash as
    chat's does (`proxy.apis.ImagePart`). `turns`: the session's remembered turns, which the
    messages may repeat, and the images recorded for it so far (updated with the new ones).
    """
    payload: dict[str, Any] = {
        "request_id": request_id,
        "api": api,
        "body": body,
        "sampling": sampling_of(chat),
        "engine": engine,
        "policy_version": policy_version,
        "logprobs_mode": logprobs_mode,
        "stream": bool(chat.get("stream")),
        "asked": asked.as_json(),
        "received_at": time.time(),
    }
    if replica is not None:
        payload["replica"] = replica
    if dropped_tools:
        payload["dropped_tools"] = dropped_tools
    result = Received(payload)
    messages = chat.get("messages")
    recorded = messages
    if api != "completions" and isinstance(messages, list):
        # Images go into the record once per session, and the body refers to them by hash.
        recorded = _take_images(messages, result, images, turns, max_image_bytes, image_token_id)
        if images and recorded is not messages:
            payload["body"] = referenced_body(body, images, recorded)
    if api != "completions" and isinstance(recorded, list):
        result.messages = (len(recorded), orjson.dumps(recorded))
        result.render_key = render_key(chat)
        # Only a request with history can continue a turn; without, it costs no look-up (a
        # session used as a plain endpoint holds thousands of one-call lineages).
        if any(m.get("role") == "assistant" for m in recorded if isinstance(m, dict)):
            result.candidates = turns.continued_by(result.messages[1])
    if api == "chat" and isinstance(recorded, list):
        # Only chat stores messages by reference: the other APIs' bodies are their own.
        continued = _messages_continued(result.candidates)
        if continued is not None:
            n_messages = continued.n_messages
            payload["body"] = {**body, "messages": recorded[n_messages:]}
            payload["messages_prefix"] = stored(
                MessagesPrefix, request_id=continued.request_id, n_messages=n_messages
            )
        elif recorded is not messages:
            payload["body"] = {**body, "messages": recorded}
    result.payload = stored(RequestReceived, **payload)
    return result


def _take_images(
    messages: list[Any],
    result: Received,
    images: list[ImagePart],
    turns: SessionTurns,
    max_bytes: int,
    image_token_id: int | None,
) -> list[Any]:
    """The messages as recorded: each image replaced by its reference. The images new to
    the session go to `result.new_images`; the payload gets the count, the placeholder id, and
    for a translated API the hashes in order (`images`, its body's own shape being no chat
    messages)."""
    params = {id(image.chat_part): image.param for image in images}
    found = referenced(messages, max_bytes, params)
    if not found.n_images:
        return messages
    result.payload["n_images"] = found.n_images
    if images:
        result.payload["images"] = found.hashes
    if image_token_id is not None:
        result.payload["image_token_id"] = image_token_id
    seen = turns.images
    result.new_images = [image for sha256, image in found.images.items() if sha256 not in seen]
    turns.images = seen | found.images.keys()  # later requests of the session refer to them
    return found.messages


def _messages_continued(candidates: list[Turn]) -> Turn | None:
    """The deepest remembered chat turn whose messages this request repeats first, which
    `messages_prefix` names (then its body stores only the rest); else None.

    Found by the messages' serialisation (`SessionTurns.continued_by`): `[A,B]` and
    `[A,B,C]` agree up to the former's closing bracket, where the latter has a comma, and
    JSON values delimit themselves, so the first messages are the same values.
    """
    for turn in candidates:
        if turn.api == "chat" and turn.n_messages:
            return turn
    return None
