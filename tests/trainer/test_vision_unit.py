"""`trainer.vision` without a database: a recorded image is given to the model only when its
span is the run the model's processor makes of its bytes; otherwise the sample is refused with
the reason. And rows of images merge into one forward pass as the model takes them."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from trajstore.tiny_vlm import IMAGE_SEQ_LEN, build_tiny_vlm
from trajstore.trainer.errors import ImageMismatch
from trajstore.trainer.vision import VisionProcessor, checked_images, model_inputs


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> VisionProcessor:
    model = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")
    assert VisionProcessor.of_model(Path(model).parent) is None  # no processor: a text model
    found = VisionProcessor.of_model(model)
    assert found is not None
    return found


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (40, 70), (1, 2, 3)).save(out, "PNG")
    return out.getvalue()


def entry(data: bytes, start: int | None, end: int | None, **extra: Any) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "source": "data", "start": start,
            "end": end, **extra}  # fmt: skip


def test_an_image_whose_span_is_the_processors_run_is_given_to_the_model(
    vision: VisionProcessor,
) -> None:
    data = png()
    [picture] = checked_images("s1", [(entry(data, 10, 10 + IMAGE_SEQ_LEN), data)], vision)
    assert picture.size == (40, 70)


@pytest.mark.parametrize(
    ("image", "data", "says"),
    [
        (entry(png(), 10, 10 + IMAGE_SEQ_LEN + 1), png(), "the processor gives 4"),
        (entry(png(), None, None, reason="2 placeholder runs for 1 images"), png(),
         "2 placeholder runs for 1 images"),
        ({"sha256": "0" * 64, "source": "url", "start": 1, "end": 5}, None, "URL image"),
        (entry(b"other", 1, 5), png(), "another hash"),
    ],
)  # fmt: skip
def test_an_image_that_cannot_be_trained_on_as_recorded_is_refused_with_the_reason(
    vision: VisionProcessor, image: dict[str, Any], data: bytes | None, says: str
) -> None:
    with pytest.raises(ImageMismatch) as refused:
        checked_images("s1", [(image, data)], vision)
    assert says in str(refused.value)
    assert "sample s1, image 0" in str(refused.value)


def test_rows_of_images_merge_padded_per_row_or_concatenated() -> None:
    one = {"pixel_values": torch.ones(1, 1, 3, 2, 2), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    two = {"pixel_values": torch.full((1, 2, 3, 2, 2), 2.0),
           "image_grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]])}  # fmt: skip
    merged = model_inputs([one, {}, two])
    assert merged["pixel_values"].shape == (3, 2, 3, 2, 2)
    assert merged["pixel_values"][1].abs().sum() == 0  # a row without images: zeros only
    assert merged["pixel_values"][0, 1].abs().sum() == 0  # padding image
    assert merged["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2], [1, 4, 4]]
