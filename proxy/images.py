"""Images in chat requests: checked, hashed, and recorded once per session, by reference.

The engine gets the agent's request unchanged: data URLs as sent, http URLs for the engine to
fetch (vLLM fetches them itself; the proxy never does). What the log keeps is different
(the contract is in `store.sessions`):

- each image once per session, in an `image_recorded` event of the request that first brings
  it: a data URL's media type and base64 data, keyed by the SHA-256 of the decoded bytes; an
  http URL as its text, keyed by the SHA-256 of that text;
- the request body with a reference in each image's place (`trajstore-image:sha256:<hex>`,
  `store.images`), so the 16th turn of a conversation with a screenshot does not store the
  screenshot a 16th time, even where the messages cannot be stored by reference
  (`messages_prefix`: another replica, a rewritten history).

Which images are already recorded is this replica's memory of the session's last turn
(`continuation.Turn.images`), as for the other references: after a restart or on another
replica an image is recorded again (larger, never wrong; readers keep one per hash).

A data URL that is not one (no `;base64,`, data that is not base64) is a 400 that says what to
fix, and an image over `TRAJSTORE_MAX_IMAGE_BYTES` a 413 that gives the limit: the engine would
refuse the first, and the second would not fit in an event.
"""

from __future__ import annotations

import binascii
import hashlib
from dataclasses import dataclass
from typing import Any, Literal

from trajstore.proxy.apis.base import ImagePart
from trajstore.proxy.errors import BadRequest, PayloadTooLarge
from trajstore.store.events import MAX_PAYLOAD_BYTES
from trajstore.store.images import REFERENCE_PREFIX, image_parts, part_url, reference
from trajstore.store.payloads_request import ImageRecorded

#: The largest image one `image_recorded` event can hold: its base64 text is 4/3 of its bytes,
#: and the event's payload has a few hundred bytes besides.
MAX_STORABLE_IMAGE_BYTES = (MAX_PAYLOAD_BYTES - 4096) // 4 * 3

#: The default limit per image (`TRAJSTORE_MAX_IMAGE_BYTES`): OpenAI's own is 20 MB, but a 5 MB
#: image is already a few thousand placeholder tokens after any VLM's resizing.
DEFAULT_MAX_IMAGE_BYTES = 5 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Image:
    """One image of a request, as the log records it."""

    sha256: str
    source: Literal["data", "url"]
    url: str | None = None  #: source url: the URL as sent
    media_type: str | None = None  #: source data: the data URL's media type ("" when none)
    data: str | None = None  #: source data: the base64 text as sent (checked)
    n_bytes: int | None = None  #: source data: the decoded size

    def payload(self) -> ImageRecorded:
        """The `image_recorded` event's payload."""
        if self.source == "url":
            return ImageRecorded(sha256=self.sha256, source="url", url=self.url)
        return ImageRecorded(
            sha256=self.sha256,
            source="data",
            media_type=self.media_type,
            n_bytes=self.n_bytes,
            data=self.data,
        )


@dataclass(frozen=True, slots=True)
class Referenced:
    """A request's messages with each image replaced by its reference, and its images."""

    messages: list[Any]  #: the same list when there is no image
    images: dict[str, Image]  #: by sha256, in the order they first appear
    n_images: int  #: image parts, repeats included
    hashes: list[str]  #: each image part's sha256, in order, repeats included


def referenced(
    messages: list[Any], max_bytes: int, params: dict[int, str] | None = None
) -> Referenced:
    """Check and hash every `image_url` part of `messages`; `BadRequest` or `PayloadTooLarge`
    naming the part when one cannot be recorded (as `params` names it, by the part's id, for
    a translated API's parts; else `messages[i].content[j].image_url`). The messages are copied
    only where an image is replaced; the agent's own list goes to the engine untouched."""
    images: dict[str, Image] = {}
    hashes: list[str] = []
    out: list[Any] | None = None
    for i, j, part in image_parts(messages):
        where = (params or {}).get(id(part)) or f"messages[{i}].content[{j}].image_url"
        image = _image(part_url(part), where, max_bytes)
        images.setdefault(image.sha256, image)
        hashes.append(image.sha256)
        if out is None:
            out = list(messages)
        if out[i] is messages[i]:
            out[i] = {**messages[i], "content": list(messages[i]["content"])}
        value = part.get("image_url")
        url = reference(image.sha256)
        out[i]["content"][j] = {
            **part,
            "image_url": {**value, "url": url} if isinstance(value, dict) else url,
        }
    return Referenced(messages if out is None else out, images, len(hashes), hashes)


def _image(url: Any, where: str, max_bytes: int) -> Image:
    if not isinstance(url, str) or not url:
        raise BadRequest(
            f"{where} must hold the image's URL: a data URL (data:image/png;base64,...) "
            "or an http(s) URL the engine can fetch",
            param=where,
        )
    if url.startswith(REFERENCE_PREFIX):
        raise BadRequest(
            f"{where} is a reference of the proxy's own record ({REFERENCE_PREFIX}...): "
            "send the image itself, as a data URL or an http(s) URL",
            param=where,
        )
    if url[:5].lower() != "data:":
        return Image(hashlib.sha256(url.encode()).hexdigest(), "url", url=url)
    return _data_image(url, where, max_bytes)


def _data_image(url: str, where: str, max_bytes: int) -> Image:
    """A data URL as vLLM reads one (RFC 2397, base64 only): data:[<type>][;<param>]*;base64,."""
    spec, comma, data = url[5:].partition(",")
    media_type, semicolon, encoding = spec.rpartition(";")
    if not comma or not semicolon or encoding.strip().lower() != "base64":
        raise BadRequest(
            f"{where} is not a base64 data URL: send data:<media type>;base64,<data> "
            "(for example data:image/png;base64,iVBORw0...)",
            param=where,
        )
    # The size is known from the text's length: a 413 costs no decoding.
    n_bytes = len(data) // 4 * 3 - data[-2:].count("=")
    if n_bytes > max_bytes:
        raise PayloadTooLarge(
            f"the image at {where} is {n_bytes} bytes; the limit is {max_bytes} bytes per image "
            "(TRAJSTORE_MAX_IMAGE_BYTES)",
            param=where,
        )
    try:
        # Strict, as vLLM decodes (no line breaks, padding where it belongs); binascii's own
        # strict mode is about a fifth faster than b64decode(validate=True), and the agent
        # re-sends each image every turn.
        decoded = binascii.a2b_base64(data, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(
            f"the data URL at {where} does not hold valid base64 ({exc}): encode the image's "
            "bytes with standard base64, without line breaks",
            param=where,
        ) from None
    if not decoded:
        raise BadRequest(f"the data URL at {where} holds no data", param=where)
    return Image(
        hashlib.sha256(decoded).hexdigest(),
        "data",
        media_type=media_type.partition(";")[0],
        data=data,
        n_bytes=len(decoded),
    )


def referenced_body(
    body: dict[str, Any], images: list[ImagePart], recorded: list[Any]
) -> dict[str, Any]:
    """A translated request's body as the log keeps it: each image block replaced by its
    reference (the one its chat part got in `recorded`), the rest shared with the agent's."""
    references = [part_url(part) for _, _, part in image_parts(recorded)]
    out = dict(body)
    for image, url in zip(images, references, strict=True):
        node: Any = out
        for key in image.path[:-1]:  # copy along the path, so the agent's body stays as sent
            child = node[key]
            node[key] = child = list(child) if isinstance(child, list) else dict(child)
            node = child
        node[image.path[-1]] = image.referenced_block(node[image.path[-1]], url)
    return out
