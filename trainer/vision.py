"""A vision-language model's inputs, rebuilt from a replayed batch's recorded image bytes.

A sample of a session with images holds, besides its tokens, each image's hash and the
[start, end) of its run of placeholder ids (`store.samples`; the engine expanded each image into
one placeholder per image feature). A VLM trains on the tokens *and* the pixels: the model's own
processor makes them again from the bytes the agent sent, which the log keeps once per session
(`image_recorded`). This module does that for a batch:

- it reads each sample's images (the `samples.images` column) and their bytes;
- it checks every image's span against the processor's count for those bytes: a span of another
  length, or one the projection could not locate, means the features would land on the wrong
  tokens, so the sample is refused with the reason (`ImageMismatch`), never shifted silently
  (the usual cause: the processor's resizing settings are not the engine's);
- it runs the processor's image part over each row's images, in the order of their placeholders,
  and puts the result in the batch as verl does: `multi_modal_inputs`, one dict of tensors per
  row (Idefics3: `pixel_values` [1, n, 3, H, W] and `pixel_attention_mask`; Qwen2-VL:
  `pixel_values` [patches, D] and `image_grid_thw` [n, 3]), in the TensorDict batch
  (`with_vision`, a non-tensor entry) and in the verl `DataProto` (`attach_verl`,
  `non_tensor_batch`). `model_inputs` merges a batch's rows for one forward pass.

URL images are not fetched (trajstore never fetches them): such a sample is refused as well.
"""

from __future__ import annotations

import base64
import hashlib
import io
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
from tensordict import TensorDict

from trajstore.store import EventStore, sample_reads
from trajstore.store.queries import READ_IMAGES
from trajstore.trainer.collate import sample_ids
from trajstore.trainer.errors import ImageMismatch

#: The non-tensor entry (TensorDict) and `non_tensor_batch` key (verl) of the vision inputs.
MULTI_MODAL_INPUTS = "multi_modal_inputs"


@dataclass(frozen=True)
class VisionProcessor:
    """A model's processor (`AutoProcessor`), as replay uses it: to count each image's
    placeholders and to make its pixel inputs."""

    processor: Any

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> VisionProcessor:
        """The processor saved with the model (what the engine served it with)."""
        from transformers import AutoProcessor

        return cls(AutoProcessor.from_pretrained(model_dir))  # type: ignore[no-untyped-call]

    @classmethod
    def of_model(cls, model_dir: str | Path) -> VisionProcessor | None:
        """The model's processor when it has an image part (a vision-language model), else
        None."""
        config = Path(model_dir) / "processor_config.json"
        if not (config.exists() or (Path(model_dir) / "preprocessor_config.json").exists()):
            return None
        return cls.from_pretrained(model_dir)

    @property
    def image_token_id(self) -> int:
        """The placeholder id the processor repeats once per image feature."""
        return int(self.processor.image_token_id)

    def count(self, image: Any) -> int:
        """How many placeholder ids the processor gives `image` (a PIL image)."""
        ids = self.processor(text=self.processor.image_token, images=[image])["input_ids"][0]
        return int(np.count_nonzero(np.asarray(ids) == self.image_token_id))

    def inputs(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The model's image inputs for `images` (PIL images, in placeholder order)."""
        out = self.processor.image_processor(images=list(images), return_tensors="pt")
        return {key: value for key, value in out.items() if isinstance(value, torch.Tensor)}


def image_of(data: bytes) -> Any:
    """Bytes as a PIL image (RGB, as processors expect)."""
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


async def read_images(
    store: EventStore, ids: Sequence[uuid.UUID | str]
) -> dict[str, list[tuple[dict[str, Any], bytes | None]]]:
    """Each sample's images (served projection), in placeholder order, with their bytes (None
    for a URL image, or one whose `image_recorded` event the session lacks)."""
    rows = await sample_reads.read_images(store, [uuid.UUID(str(i)) for i in ids])
    listed = {
        str(row["sample_id"]): (row["session_id"], orjson.loads(row["images"] or "[]"))
        for row in rows
    }
    sessions = sorted({session for session, images in listed.values() if images})
    hashes = sorted({i["sha256"] for _, images in listed.values() for i in images if i})
    found = await store.fetch(READ_IMAGES, sessions, hashes) if hashes else []
    data = {row["sha256"]: base64.b64decode(row["data"]) for row in found}
    return {
        sample: [(image, data.get(image.get("sha256") or "")) for image in images]
        for sample, (_, images) in listed.items()
    }


def checked_images(
    sample_id: str, images: list[tuple[dict[str, Any], bytes | None]], vision: VisionProcessor
) -> list[Any]:
    """A sample's images as PIL images, each checked against its span; `ImageMismatch` naming
    the image and the reason when one cannot be trained on as recorded."""
    out = []
    for n, (image, data) in enumerate(images):
        where = f"sample {sample_id}, image {n} (sha256 {image.get('sha256')})"
        if data is None:
            why = "a URL image (trajstore never fetches it)" if image.get("source") == "url" else (
                "its bytes are not in the log"
            )  # fmt: skip
            raise ImageMismatch(f"{where}: {why}, so its pixels cannot be rebuilt")
        if hashlib.sha256(data).hexdigest() != image.get("sha256"):
            raise ImageMismatch(f"{where}: the recorded bytes have another hash")
        start, end = image.get("start"), image.get("end")
        if start is None or end is None:
            reason = image.get("reason") or "its placeholder ids were not located"
            raise ImageMismatch(f"{where}: {reason}")
        picture = image_of(data)
        expected = vision.count(picture)
        if end - start != expected:
            raise ImageMismatch(
                f"{where}: the sample holds {end - start} placeholder ids at [{start}, {end}), "
                f"the processor gives {expected} for these bytes; its resizing settings "
                "(size, min/max pixels) must be the engine's"
            )
        out.append(picture)
    return out


async def row_inputs(
    store: EventStore, vision: VisionProcessor, rows: Sequence[Sequence[str]]
) -> list[dict[str, torch.Tensor]]:
    """The vision inputs of each row (its samples' images in order; {} for a row without)."""
    images = await read_images(store, [s for row in rows for s in row])
    out = []
    for row in rows:
        pictures = [p for s in row for p in checked_images(s, images.get(s, []), vision)]
        out.append(vision.inputs(pictures) if pictures else {})
    return out


async def with_vision(
    batches: AsyncIterator[TensorDict], store: EventStore, vision: VisionProcessor
) -> AsyncIterator[TensorDict]:
    """`trainer.replay`'s batches with their vision inputs (`multi_modal_inputs`, one dict per
    row); a sample whose images cannot be rebuilt as recorded raises `ImageMismatch`."""
    async for batch in batches:
        described = batch.get_non_tensor("samples")
        rows: list[list[str]] = [[] for _ in range(batch.batch_size[0])]
        for sample in described:
            rows[sample["row"]].append(sample["sample_id"])
        assert [s for row in rows for s in row] == sample_ids(batch)
        batch.set_non_tensor(MULTI_MODAL_INPUTS, await row_inputs(store, vision, rows))
        yield batch


async def attach_verl(data: Any, store: EventStore, vision: VisionProcessor) -> Any:
    """A verl `DataProto` (`trainer.verl_batch`) with `non_tensor_batch["multi_modal_inputs"]`,
    verl's own place for them (one dict per row)."""
    ids = [[str(s)] for s in data.non_tensor_batch["sample_id"]]
    inputs = await row_inputs(store, vision, ids)
    data.non_tensor_batch[MULTI_MODAL_INPUTS] = np.array(inputs, dtype=object)
    return data


def model_inputs(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch's per-row vision inputs as one forward pass takes them.

    Inputs batched per row (a leading dimension of 1: Idefics3's `pixel_values` [1, n, ...])
    are zero-padded to the most images of a row and stacked (the model skips all-zero images);
    the others (Qwen2-VL's flattened patches and grids) are concatenated in row order.
    """
    keys = sorted({key for row in rows for key in row})
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        present = [row[key] for row in rows if key in row]
        if present[0].dim() >= 3 and all(t.shape[0] == 1 for t in present):
            most = max(t.shape[1] for t in present)
            shape = present[0].shape[2:]
            stacked = []
            for row in rows:
                padded = torch.zeros((most, *shape), dtype=present[0].dtype)
                if key in row:
                    padded[: row[key].shape[1]] = row[key][0]
                stacked.append(padded)
            out[key] = torch.stack(stacked)
        else:
            out[key] = torch.cat(present)
    return out
