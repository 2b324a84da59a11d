"""Images through the translated APIs (Anthropic Messages, OpenAI Responses), through the official
clients, a real proxy and a real PostgreSQL, the fake engine as a vision-language model: each
image reaches the engine as a chat `image_url` part, is recorded once per session, the body keeps
a reference in its own shape, and the sample locates it; a bad image is refused naming the
agent's part, with nothing recorded.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import pytest
from openai import AsyncOpenAI, BadRequestError

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import IMAGE_PAD, image_token_count
from tests.proxy.fixtures import RunningProxy
from tests.proxy.test_images import PNG_A, PNG_B, URL, data_url, sha
from trajstore.store import EventType


def claude(session: dict[str, Any]) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
    )


def base64_block(data: bytes) -> dict[str, Any]:
    encoded = base64.b64encode(data).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": encoded}}  # fmt: skip


async def test_anthropic_images_are_recorded_once_by_reference_and_located_in_the_sample(
    vlm_proxy: RunningProxy, vlm: FakeEngine, database_url: str,
    events_of: Callable[[str], Awaitable[list[Any]]],
) -> None:  # fmt: skip
    session = await vlm_proxy.new_session()
    client = claude(session)
    url_block = {"type": "image", "source": {"type": "url", "url": URL}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [
            {"type": "text", "text": "what is in these"}, base64_block(PNG_A), url_block]},
    ]  # fmt: skip
    first = await client.messages.create(model="tiny", max_tokens=8, messages=messages)  # type: ignore[arg-type]
    messages += [
        {"role": "assistant", "content": first.content[0].text},  # type: ignore[union-attr]
        {"role": "user", "content": [base64_block(PNG_B), {"type": "text", "text": "and this"}]},
    ]
    await client.messages.create(model="tiny", max_tokens=8, messages=messages)  # type: ignore[arg-type]

    # The engine got chat image parts: the data URL built from the block, the URL as sent.
    parts = vlm.requests[1]["messages"][0]["content"]
    assert parts[1] == {"type": "image_url", "image_url": {"url": data_url(PNG_A)}}
    assert parts[2] == {"type": "image_url", "image_url": {"url": URL}}

    [sample] = await vlm_proxy.finished_samples(database_url, session["session_id"])  # all stored
    events = await events_of(session["session_id"])
    recorded = [e.payload for e in events if e.type == EventType.IMAGE_RECORDED]
    assert sorted(p["sha256"] for p in recorded) == sorted([sha(PNG_A), sha(URL), sha(PNG_B)])
    a_text = base64.b64encode(PNG_A).decode()
    assert [e.type for e in events if a_text in bytes(e[9]).decode()] == [
        EventType.IMAGE_RECORDED
    ]  # the bytes once, though sent twice
    second = [e for e in events if e.type == EventType.REQUEST_RECEIVED][1].payload
    body_blocks = second["body"]["messages"][0]["content"]
    assert body_blocks[1]["source"] == {
        "type": "url",
        "url": f"trajstore-image:sha256:{sha(PNG_A)}",
    }
    assert second["images"] == [sha(PNG_A), sha(URL), sha(PNG_B)]

    assert [i["sha256"] for i in sample.images] == [sha(PNG_A), sha(URL), sha(PNG_B)]
    tokens = sample.token_ids
    for url, image in zip((data_url(PNG_A), URL, data_url(PNG_B)), sample.images, strict=True):
        assert image["end"] - image["start"] == image_token_count(url)
        assert set(tokens[image["start"] : image["end"]]) == {IMAGE_PAD}
    assert len(sample.turns) == 2  # one conversation, one sample, around the images


async def test_responses_input_images_are_recorded_by_reference_and_located(
    vlm_proxy: RunningProxy, vlm: FakeEngine, database_url: str,
    events_of: Callable[[str], Awaitable[list[Any]]],
) -> None:  # fmt: skip
    session = await vlm_proxy.new_session()
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    item = {"role": "user", "content": [
        {"type": "input_text", "text": "what is this"},
        {"type": "input_image", "image_url": data_url(PNG_A), "detail": "auto"}]}  # fmt: skip
    first = await client.responses.create(model="tiny", input=[item], max_output_tokens=8)  # type: ignore[list-item]
    again = [item, *[o.model_dump(exclude_none=True) for o in first.output],
             {"role": "user", "content": "and again"}]  # fmt: skip
    await client.responses.create(model="tiny", input=again, max_output_tokens=8)  # type: ignore[arg-type]

    assert vlm.requests[0]["messages"][0]["content"][1] == {
        "type": "image_url", "image_url": {"url": data_url(PNG_A), "detail": "auto"}
    }  # fmt: skip
    [sample] = await vlm_proxy.finished_samples(database_url, session["session_id"])
    events = await events_of(session["session_id"])
    assert [e.payload["sha256"] for e in events if e.type == EventType.IMAGE_RECORDED] == [
        sha(PNG_A)
    ]
    received = [e.payload for e in events if e.type == EventType.REQUEST_RECEIVED]
    assert received[1]["body"]["input"][0]["content"][1]["image_url"] == (
        f"trajstore-image:sha256:{sha(PNG_A)}"
    )
    [image] = sample.images
    assert (image["sha256"], image["end"] - image["start"]) == (
        sha(PNG_A), image_token_count(data_url(PNG_A))
    )  # fmt: skip


async def test_a_bad_image_is_a_4xx_naming_the_agents_part_and_nothing_is_recorded(
    vlm_proxy: RunningProxy, vlm: FakeEngine, events_of: Callable[[str], Awaitable[list[Any]]]
) -> None:
    session = await vlm_proxy.new_session()
    client = claude(session)
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                       "data": "not base64!"}}  # fmt: skip
    with pytest.raises(anthropic.BadRequestError) as malformed:
        await client.messages.create(
            model="tiny", max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, bad]}],  # type: ignore[list-item]
        )  # fmt: skip
    assert "messages.0.content.1" in malformed.value.message
    assert "base64" in malformed.value.message

    with pytest.raises(anthropic.APIStatusError) as too_large:
        await client.messages.create(
            model="tiny", max_tokens=8,
            messages=[{"role": "user", "content": [base64_block(bytes(70 * 1024))]}],  # type: ignore[list-item]
        )  # fmt: skip
    assert too_large.value.status_code == 413
    assert "messages.0.content.0" in too_large.value.message

    openai = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    with pytest.raises(BadRequestError) as by_file:
        await openai.responses.create(
            model="tiny",
            input=[{"role": "user", "content": [
                {"type": "input_image", "file_id": "file-abc", "detail": "auto"}]}],  # type: ignore[list-item]
        )  # fmt: skip
    assert by_file.value.param == "input.0.content.0"  # type: ignore[attr-defined]

    assert vlm.requests == []
    assert (await vlm_proxy.finish(session["session_id"])).status_code == 200  # all stored
    assert [e.type for e in await events_of(session["session_id"])] == [
        EventType.SESSION_CREATED, EventType.SESSION_FINISHED
    ]  # fmt: skip
