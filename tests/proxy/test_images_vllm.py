"""Images on a real vision-language engine: vLLM's CPU build serving the generated tiny
Idefics3 model (`trajstore.tiny_vlm`), through the proxy and the official clients.

What a user of a VLM notices: the engine sees each image as the processor would (its placeholder
ids are the processor's, one run per image), the session becomes one sample whose image spans
are those runs, and the trainer gets back the very pixel values the processor makes from the
bytes the agent sent.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import orjson
import pytest
import torch
from PIL import Image

from tests.proxy.fixtures import ProxyFactory, RunningProxy
from trajstore.store import EventStore
from trajstore.store.projection import Projector
from trajstore.tiny_vlm import IMAGE_SEQ_LEN, IMAGE_TOKEN_ID
from trajstore.trainer.recipe import train_steps
from trajstore.trainer.replay import replay
from trajstore.trainer.selection import Selection
from trajstore.trainer.verl_batch import verl_batch
from trajstore.trainer.vision import MULTI_MODAL_INPUTS, VisionProcessor, attach_verl, with_vision

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def png(color: tuple[int, int, int], size: tuple[int, int] = (56, 84)) -> bytes:
    """A small PNG of one colour with a stripe, so two colours give two different images."""
    image = Image.new("RGB", size, color)
    image.paste((255 - color[0], 0, 0), (0, 0, size[0], size[1] // 4))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def processor_of(model: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model)


async def test_vllm_serves_the_tiny_vlm_an_image_as_its_processor_sees_it(
    vllm_vlm: tuple[str, Path],
) -> None:
    url, model = vllm_vlm
    picture = png((200, 30, 30))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is on the screen?"},
                {"type": "image_url", "image_url": {"url": data_url(picture)}},
            ],
        }
    ]
    body = {
        "model": "tiny", "messages": messages, "max_tokens": 4, "return_token_ids": True,
        "logprobs": True,
    }  # fmt: skip
    async with httpx.AsyncClient(timeout=120) as http:
        response = await http.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()

    processor = processor_of(model)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is on the screen?"},
                                      {"type": "image"}]}],
        add_generation_prompt=True,
    )  # fmt: skip
    expected = processor(text=text, images=[Image.open(io.BytesIO(picture))])["input_ids"][0]
    assert answer["prompt_token_ids"] == list(expected)
    assert answer["prompt_token_ids"].count(IMAGE_TOKEN_ID) == IMAGE_SEQ_LEN
    assert len(answer["choices"][0]["token_ids"]) == 4


# A random model's text does not round-trip through the chat template (its tokens re-encode
# differently), and a conversation with images is rendered by the engine each turn (no token-in
# continuation), so each answer is held to one whole-word token that does: the history then
# extends token for token and the session is one sample.
ROUND_TRIP_WORD = " the"


@pytest.fixture
async def vlm_proxy(start_proxy: ProxyFactory, vllm_vlm: tuple[str, Path]) -> RunningProxy:
    return await start_proxy([vllm_vlm[0]], image_token_id=IMAGE_TOKEN_ID)


def held_to_one_word(model: Path) -> dict[str, Any]:
    [word] = processor_of(model).tokenizer.encode(ROUND_TRIP_WORD, add_special_tokens=False)
    return {"allowed_token_ids": [word]}


async def projected_run(database_url: str, proxy: RunningProxy, session_id: str) -> None:
    reward = await proxy.http.post(f"{proxy.url}/sessions/{session_id}/reward", json={"value": 1})
    assert reward.status_code == 200, reward.text
    assert (await proxy.finish(session_id)).status_code == 200
    async with await EventStore.open(database_url) as store:
        await Projector(store).run_once()


async def located_image(
    database_url: str, session_id: str, model: Path, picture: bytes
) -> dict[str, Any]:
    """The one image the session's one sample locates, checked: its span is the run of
    placeholder ids the processor makes of `picture`."""
    async with await EventStore.open(database_url) as store:
        [row] = await store.pool.fetch(
            "SELECT token_ids, images FROM samples WHERE session_id = $1", session_id
        )
    [located] = orjson.loads(row["images"])
    tokens = np.frombuffer(row["token_ids"], "<i4")
    vision = VisionProcessor.from_pretrained(model)
    assert located["end"] - located["start"] == vision.count(Image.open(io.BytesIO(picture)))
    assert set(tokens[located["start"] : located["end"]].tolist()) == {IMAGE_TOKEN_ID}
    return located


async def test_a_two_turn_openai_session_with_an_image_trains_on_the_processors_inputs(
    vlm_proxy: RunningProxy, vllm_vlm: tuple[str, Path], database_url: str
) -> None:
    _, model = vllm_vlm
    picture = png((30, 160, 40))
    session = await vlm_proxy.new_session(run_id="vlm-openai")
    agent = vlm_proxy.agent(session)
    messages: list[Any] = [
        {"role": "user", "content": [
            {"type": "text", "text": "What is on the screen?"},
            {"type": "image_url", "image_url": {"url": data_url(picture)}}]},
    ]  # fmt: skip
    for follow_up in ("And now?", None):
        answer = await agent.chat.completions.create(
            model="tiny", messages=messages, max_tokens=3, temperature=0,
            extra_body=held_to_one_word(model),
        )  # fmt: skip
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    await projected_run(database_url, vlm_proxy, session["session_id"])

    vision = VisionProcessor.from_pretrained(model)
    async with await EventStore.open(database_url) as store:
        rows = await store.pool.fetch(
            "SELECT token_ids, images FROM samples WHERE session_id = $1", session["session_id"]
        )
        # One sample; its image's span is exactly the run the processor makes of the bytes.
        [row] = rows
        [image] = orjson.loads(row["images"])
        tokens = np.frombuffer(row["token_ids"], "<i4")
        start, end = image["start"], image["end"]
        assert end - start == vision.count(Image.open(io.BytesIO(picture))) == IMAGE_SEQ_LEN
        assert set(tokens[start:end].tolist()) == {IMAGE_TOKEN_ID}

        # Replayed, its vision inputs are the processor's output on the original bytes...
        expected = vision.inputs([Image.open(io.BytesIO(picture)).convert("RGB")])
        selection = Selection(runs=("vlm-openai",))
        [batch] = [b async for b in with_vision(replay(store, selection, batch_size=4), store,
                                                vision)]  # fmt: skip
        [inputs] = batch.get_non_tensor(MULTI_MODAL_INPUTS)
        assert inputs.keys() == expected.keys() and "pixel_values" in inputs
        for key, value in expected.items():
            assert torch.equal(inputs[key], value), key
        # ... in the verl batch as well.
        data = await attach_verl(await verl_batch(store, selection), store, vision)
        [verl_inputs] = data.non_tensor_batch[MULTI_MODAL_INPUTS]
        assert torch.equal(verl_inputs["pixel_values"], expected["pixel_values"])

    # The recipe trains a step on it: the model sees the pixels, the loss is finite.
    [step] = await train_steps(database_url, "vlm-openai", model, 1, training_run="vlm")
    assert math.isfinite(step["loss"])


async def test_a_two_turn_anthropic_session_with_an_image_is_one_sample_over_the_processors_run(
    vlm_proxy: RunningProxy, vllm_vlm: tuple[str, Path], database_url: str
) -> None:
    _, model = vllm_vlm
    picture = png((10, 20, 220), size=(120, 40))
    session = await vlm_proxy.new_session(run_id="vlm-anthropic")
    client = anthropic.AsyncAnthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(picture).decode()}}  # fmt: skip
    messages: list[Any] = [{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}]
    # Claude Code counts its prompt first: the engine's count, the image's placeholders in it.
    counted = await client.messages.count_tokens(model="tiny", messages=messages)
    for follow_up in ("And now?", None):
        answer = await client.messages.create(
            model="tiny", messages=messages, max_tokens=3,
            extra_body=held_to_one_word(model),
        )  # fmt: skip
        messages.append({"role": "assistant", "content": answer.content[0].text})  # type: ignore[union-attr]
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    await projected_run(database_url, vlm_proxy, session["session_id"])

    located = await located_image(database_url, session["session_id"], model, picture)
    assert located["sha256"] == hashlib.sha256(picture).hexdigest()
    first = (await vlm_proxy.session_record(session["session_id"]))["turns"][0]
    assert counted.input_tokens == first["n_prompt_tokens"]


async def test_a_responses_image_in_a_tool_output_reaches_the_engine_and_is_located(
    vlm_proxy: RunningProxy, vllm_vlm: tuple[str, Path], database_url: str
) -> None:
    # Codex's view_image: the image comes back in a function_call_output.
    _, model = vllm_vlm
    picture = png((240, 200, 10), size=(64, 64))
    session = await vlm_proxy.new_session(run_id="vlm-responses")
    agent = vlm_proxy.agent(session)
    tool = {
        "type": "function",
        "name": "view_image",
        "description": "Show an image.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    items: list[Any] = [
        {"role": "user", "content": "Look at shot.png"},
        {"type": "function_call", "call_id": "c1", "name": "view_image",
         "arguments": '{"path": "shot.png"}'},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_image", "image_url": data_url(picture)}]},
    ]  # fmt: skip
    for follow_up in ("And now?", None):
        answer = await agent.responses.create(
            model="tiny", input=items, tools=[tool], max_output_tokens=3,
            extra_body=held_to_one_word(model),
        )  # fmt: skip
        items += [o.model_dump(exclude_none=True) for o in answer.output]
        if follow_up:
            items.append({"role": "user", "content": follow_up})
    await projected_run(database_url, vlm_proxy, session["session_id"])

    await located_image(database_url, session["session_id"], model, picture)
