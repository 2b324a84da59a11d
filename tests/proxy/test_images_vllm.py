"""Images on a real vision-language engine: vLLM's CPU build serving the generated tiny
Idefics3 model (`trajstore.tiny_vlm`), through the proxy and the official clients.

What a user of a VLM notices: the engine sees each image as the processor would (its placeholder
ids are the processor's, one run per image), the session becomes one sample whose image spans
are those runs, and the trainer gets back the very pixel values the processor makes from the
bytes the agent sent.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from trajstore.tiny_vlm import IMAGE_SEQ_LEN, IMAGE_TOKEN_ID

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
