"""Images in chat messages, through a real proxy on a real PostgreSQL: forwarded unchanged,
recorded once per session, located in samples, exported with their bytes.

The tiny model is text-only, so the engine is the fake one as a vision-language model
(`FakeEngine(vision=True)`): each image becomes Qwen2-VL's placeholder id repeated a few times
in the prompt ids it reports, as vLLM reports a VLM's prompt.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import IMAGE_PAD, VISION_START, image_token_count
from tests.proxy.fixtures import ProxyFactory, RunningProxy
from tests.store.test_export import trajstore
from trajstore.store import EventStore, EventType
from trajstore.store.export import export
from trajstore.store.projection import Projector
from trajstore.store.samples import build_samples
from trajstore.store.sessions import rebuild_session

# Not real PNGs: the fake engine does not decode them, and the proxy never does.
PNG_A = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
PNG_B = b"\x89PNG\r\n\x1a\n" + b"another picture" * 50
URL = "https://images.example.com/cat.png"


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def user(text: str, *images: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}, *map(image, images)]}


async def chat(
    proxy: RunningProxy, session: dict[str, Any], messages: list[Any], **extra: Any
) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, **extra}
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    url = f"{proxy.url}/sessions/{session['session_id']}/v1/chat/completions"
    return await proxy.http.post(url, json=body, headers=headers)


def reply_of(response: httpx.Response) -> dict[str, Any]:
    """The assistant message of an answer, whole or streamed, as an agent sends it back."""
    if response.headers["content-type"].startswith("text/event-stream"):
        text = "".join(
            (chunk.get("delta") or {}).get("content") or ""
            for line in response.text.splitlines()
            if line.startswith("data: {")
            for chunk in httpx.Response(200, content=line[6:]).json()["choices"]
        )
        return {"role": "assistant", "content": text}
    message = response.json()["choices"][0]["message"]
    return {"role": "assistant", "content": message["content"]}


async def three_turns(proxy: RunningProxy) -> tuple[dict[str, Any], list[list[Any]]]:
    """A session of three turns: images in the first (a data URL and an http URL), none new
    in the second (streamed), and in the third the first image again and a new one."""
    session = await proxy.new_session()
    turns = [
        (user("what is in these", data_url(PNG_A), URL), {}),
        (user("and now"), {"stream": True}),
        (user("and these", data_url(PNG_A), data_url(PNG_B)), {}),
    ]
    sent: list[list[Any]] = []
    messages: list[Any] = []
    for message, extra in turns:
        messages.append(message)
        sent.append(list(messages))
        response = await chat(proxy, session, messages, **extra)
        assert response.status_code == 200, response.text
        messages.append(reply_of(response))
    return session, sent


async def test_images_reach_the_engine_unchanged_and_are_recorded_once_per_session(
    vlm_proxy: RunningProxy, vlm: FakeEngine, events_of: Callable[[str], Awaitable[list[Any]]]
) -> None:
    session, sent = await three_turns(vlm_proxy)

    # The engine got every message as the agent sent it: the data URLs, the URL to fetch.
    assert [request["messages"] for request in vlm.requests] == sent

    assert (await vlm_proxy.finish(session["session_id"])).status_code == 200  # all stored
    events = await events_of(session["session_id"])
    images = [e for e in events if e.type == EventType.IMAGE_RECORDED]
    assert sorted((e.payload["sha256"], e.payload["source"]) for e in images) == sorted(
        [(sha(PNG_A), "data"), (sha(URL), "url"), (sha(PNG_B), "data")]
    )  # A once, though the agent sent it four times over three turns
    by_hash = {e.payload["sha256"]: e.payload for e in images}
    assert base64.b64decode(by_hash[sha(PNG_A)]["data"]) == PNG_A
    assert (by_hash[sha(PNG_A)]["media_type"], by_hash[sha(PNG_A)]["n_bytes"]) == (
        "image/png", len(PNG_A)
    )  # fmt: skip
    assert by_hash[sha(URL)]["url"] == URL
    # The bytes are stored once: no other event carries them.
    a_text = base64.b64encode(PNG_A).decode()
    carrying = [e.type for e in events if a_text in bytes(e[9]).decode()]
    assert carrying == [EventType.IMAGE_RECORDED]
    # Each image event follows its request's request_received in the request's stream.
    for event in images:
        assert event.stream_version > 1

    # The bodies refer to the images by hash; the record shows how many and the placeholder.
    record = await vlm_proxy.session_record(session["session_id"])
    first, _, third = record["turns"]
    parts = first["messages"][0]["content"]
    assert parts[1]["image_url"]["url"] == f"trajstore-image:sha256:{sha(PNG_A)}"
    assert parts[2]["image_url"]["url"] == f"trajstore-image:sha256:{sha(URL)}"
    assert [p.get("image_url", {}).get("url") for p in third["messages"][-1]["content"]][1:] == [
        f"trajstore-image:sha256:{sha(PNG_A)}",
        f"trajstore-image:sha256:{sha(PNG_B)}",
    ]
    # Continuation does not send ids for images (vLLM would ignore them): rendered, and why.
    assert [t["prompt_source"] for t in record["turns"]] == ["rendered"] * 3
    assert [t["continuation"] for t in record["turns"][1:]] == [
        {"fallback": "non_text_content"}
    ] * 2

    # One sample; its images are the last turn's, in order, each over its placeholder ids.
    (sample,) = build_samples(rebuild_session(session["session_id"], events, packed=True))
    order = [(data_url(PNG_A), sha(PNG_A)), (URL, sha(URL)), (data_url(PNG_A), sha(PNG_A)),
             (data_url(PNG_B), sha(PNG_B))]  # fmt: skip
    assert [i["sha256"] for i in sample.images] == [h for _, h in order]
    assert [i["source"] for i in sample.images] == ["data", "url", "data", "data"]
    assert sample.images[1]["url"] == URL
    tokens = sample.token_ids
    for (url, _), located in zip(order, sample.images, strict=True):
        start, end = located["start"], located["end"]
        assert end - start == image_token_count(url)
        assert tokens[start - 1] == VISION_START and set(tokens[start:end]) == {IMAGE_PAD}
    assert tokens.count(IMAGE_PAD) == sum(image_token_count(url) for url, _ in order)


async def test_the_export_carries_the_images_and_their_bytes_by_hash(
    vlm_proxy: RunningProxy, database_url: str, tmp_path: Path
) -> None:
    session, _ = await three_turns(vlm_proxy)
    assert (await vlm_proxy.finish(session["session_id"])).status_code == 200
    async with await EventStore.open(database_url) as store:
        await Projector(store).run_once()
        out = tmp_path / "samples.parquet"
        assert await export(store, out, images_dir=tmp_path / "images") == 1

    (row,) = pd.read_parquet(out).to_dict("records")
    exported = list(row["images"])
    assert [i["sha256"] for i in exported] == [sha(PNG_A), sha(URL), sha(PNG_A), sha(PNG_B)]
    assert [i["source"] for i in exported] == ["data", "url", "data", "data"]
    tokens = list(row["token_ids"])
    for located in exported:
        assert set(tokens[located["start"] : located["end"]]) == {IMAGE_PAD}
    assert "trajstore-image:sha256:" in row["messages"] and "base64" not in row["messages"]
    # The bytes, once each, named by their hash; a URL image is the URL's to fetch.
    files = {p.name: p.read_bytes() for p in (tmp_path / "images").iterdir()}
    assert files == {sha(PNG_A): PNG_A, sha(PNG_B): PNG_B}

    # The same from the command line, as JSON Lines.
    out = tmp_path / "samples.jsonl"
    done = trajstore(database_url, "export", "--format", "jsonl", "--out", str(out),
                     "--images", str(tmp_path / "cli-images"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"their images are in {tmp_path / 'cli-images'}" in done.stdout
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["images"] == [{k: v for k, v in i.items()} for i in exported]
    assert sorted(p.name for p in (tmp_path / "cli-images").iterdir()) == sorted(files)


async def test_an_image_recorded_again_on_another_replica_is_one_image_to_readers(
    start_proxy: ProxyFactory, vlm: FakeEngine, database_url: str,
    events_of: Callable[[str], Awaitable[list[Any]]],
) -> None:  # fmt: skip
    first = await start_proxy([vlm.url], image_token_id=IMAGE_PAD, session_secret="shared")
    second = await start_proxy([vlm.url], image_token_id=IMAGE_PAD, session_secret="shared")
    session = await first.new_session()
    messages: list[Any] = [user("look", data_url(PNG_A))]
    response = await chat(first, session, messages)
    messages += [reply_of(response), user("again")]
    assert (await chat(second, session, messages)).status_code == 200

    (sample,) = await first.finished_samples(database_url, session["session_id"])
    events = await events_of(session["session_id"])
    assert len([e for e in events if e.type == EventType.IMAGE_RECORDED]) == 2  # larger...
    assert [(i["sha256"], i["source"]) for i in sample.images] == [
        (sha(PNG_A), "data")
    ]  # ...never wrong


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png,iVBORw0KGgo=", "not a base64 data URL: send data:<media type>;base64,"),
        ("data:image/png;base64", "not a base64 data URL"),
        ("data:image/png;base64,not base64!", "does not hold valid base64"),
        ("data:image/png;base64,", "holds no data"),
        ("", "must hold the image's URL"),
        ("trajstore-image:sha256:" + "0" * 64, "send the image itself"),
    ],
)
async def test_a_malformed_image_is_a_400_that_says_what_to_fix(
    vlm_proxy: RunningProxy, vlm: FakeEngine, url: str, says: str,
    events_of: Callable[[str], Awaitable[list[Any]]],
) -> None:  # fmt: skip
    session = await vlm_proxy.new_session()
    response = await chat(vlm_proxy, session, [user("look", url)])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"]
    assert error["param"] == "messages[0].content[1].image_url"
    assert vlm.requests == []  # never forwarded, and nothing recorded of it
    assert [e.type for e in await events_of(session["session_id"])] == [EventType.SESSION_CREATED]


async def test_an_image_over_the_limit_is_a_413_that_gives_the_limit(
    vlm_proxy: RunningProxy, vlm: FakeEngine
) -> None:
    session = await vlm_proxy.new_session()
    response = await chat(vlm_proxy, session, [user("look", data_url(bytes(70 * 1024)))])
    assert response.status_code == 413, response.text
    message = response.json()["error"]["message"]
    assert message == (
        "the image at messages[0].content[1].image_url is 71680 bytes; the limit is 65536 bytes "
        "per image (TRAJSTORE_MAX_IMAGE_BYTES)"
    )
    assert vlm.requests == []
