"""The generated vision-language model: reproducible, and its processor expands an image into
one run of `IMAGE_SEQ_LEN` placeholder ids (what vLLM serves it with is in
tests/proxy/test_images_vllm.py)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from trajstore.tiny_vlm import IMAGE_SEQ_LEN, IMAGE_TOKEN_ID, build_tiny_vlm


def test_the_tiny_vlm_is_the_same_for_the_same_seed_and_its_processor_expands_images(
    tmp_path: Path,
) -> None:
    from transformers import AutoProcessor

    first = build_tiny_vlm(tmp_path / "a")
    second = build_tiny_vlm(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "processor_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name

    processor = AutoProcessor.from_pretrained(first)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"},
                                             {"type": "image"}]}]  # fmt: skip
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    images = [Image.new("RGB", (30, 90), "red"), Image.new("RGB", (200, 100), "blue")]
    ids = processor(text=text, images=images)["input_ids"][0]
    runs = "".join("x" if i == IMAGE_TOKEN_ID else "." for i in ids).split(".")
    assert [len(r) for r in runs if r] == [IMAGE_SEQ_LEN, IMAGE_SEQ_LEN]
