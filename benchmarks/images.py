"""What an image costs: on the proxy's request path per API, and in the trainer per image.

    python benchmarks/images.py [--repeat 7] [--mib 1]

Proxy: one request carrying one PNG of `--mib` MiB (random bytes: no compression helps) as
each API sends it (chat `image_url`, Messages base64 `image` block, Responses `input_image`),
parsed and translated (`as_chat`), then its `request_received` built, encoded and queued (the
image checked, decoded, hashed, its reference put in the recorded body, its `image_recorded`
event made), against the same request with the image's part left out: the baseline, same run.
Each figure is the least thread CPU time per call over `--repeat` rounds.

Trainer: `trainer.vision` on the generated tiny VLM: the processor's inputs for one image
(what any VLM trainer pays), and the same with the span check first (`checked_images`: a
second processor run to count the image's placeholders), least wall time per image.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from proxy_costs import drive, least, recorder

from trajstore.proxy.apis import as_chat
from trajstore.proxy.wire import Api


def bodies(image: bytes) -> dict[Api, tuple[bytes, bytes]]:
    """Per API, (the request with the image, the same request without it)."""
    encoded = base64.b64encode(image).decode()
    url = "data:image/png;base64," + encoded
    text = "What is on the screen?"
    chat_part = {"type": "image_url", "image_url": {"url": url}}
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": encoded}}  # fmt: skip
    part = {"type": "input_image", "image_url": url}

    def chat(*parts: Any) -> bytes:
        content = [{"type": "text", "text": text}, *parts]
        return orjson.dumps({"model": "m", "max_tokens": 8,
                             "messages": [{"role": "user", "content": content}]})  # fmt: skip

    def messages(*blocks: Any) -> bytes:
        content = [{"type": "text", "text": text}, *blocks]
        return orjson.dumps({"model": "m", "max_tokens": 8,
                             "messages": [{"role": "user", "content": content}]})  # fmt: skip

    def responses(*parts: Any) -> bytes:
        content = [{"type": "input_text", "text": text}, *parts]
        return orjson.dumps({"model": "m", "max_output_tokens": 8,
                             "input": [{"role": "user", "content": content}]})  # fmt: skip

    return {
        "chat": (chat(chat_part), chat()),
        "messages": (messages(block), messages()),
        "responses": (responses(part), responses()),
    }


def request_path(api: Api, raw: bytes) -> None:
    """The proxy's work on one request before it is forwarded."""
    call = as_chat(api, raw)
    rec = recorder()
    rec.max_image_bytes = 8 << 20
    event = rec.received_event(
        api=api, body=call.body, chat=call.chat, engine="http://e", policy_version="0",
        logprobs_mode="raw", asked=call.asked, replica="x", images=call.images,
    )  # fmt: skip
    drive(rec.emit(event))
    drive(rec.drain())


def proxy_rows(repeat: int, mib: float) -> list[tuple[str, float, float]]:
    image = os.urandom(int(mib * (1 << 20)))
    rows = []
    for api, (with_image, without) in bodies(image).items():
        request_path(api, with_image)  # warm
        rows.append((
            api,
            least(lambda: request_path(api, without), repeat, number=50),  # noqa: B023
            least(lambda: request_path(api, with_image), repeat, number=5),  # noqa: B023
        ))  # fmt: skip
    return rows


def trainer_rows(repeat: int) -> tuple[float, float]:
    from PIL import Image

    from trajstore.tiny_vlm import IMAGE_SEQ_LEN, build_tiny_vlm
    from trajstore.trainer.vision import VisionProcessor, checked_images, image_of

    model = build_tiny_vlm(Path(tempfile.mkdtemp(prefix="trajstore-bench-vlm-")) / "model")
    vision = VisionProcessor.from_pretrained(model)
    out = io.BytesIO()
    Image.frombytes("RGB", (640, 400), os.urandom(640 * 400 * 3)).save(out, "PNG")
    data = out.getvalue()
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "source": "data", "start": 0,
             "end": IMAGE_SEQ_LEN}  # fmt: skip

    calls = {
        "inputs": lambda: vision.inputs([image_of(data)]),
        "checked": lambda: vision.inputs(checked_images("s", [(entry, data)], vision)),
    }
    best = dict.fromkeys(calls, float("inf"))
    for call in calls.values():
        call()  # warm
    for _ in range(repeat):  # the two interleaved, round by round: the same machine for both
        for name, call in calls.items():
            started = time.perf_counter()
            for _ in range(10):
                call()
            best[name] = min(best[name], (time.perf_counter() - started) / 10)
    return best["inputs"] * 1e3, best["checked"] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="rounds; the least is kept [7]")
    parser.add_argument("--mib", type=float, default=1.0, help="the image's size in MiB [1]")
    args = parser.parse_args()
    print(f"proxy, one request, a {args.mib:g} MiB image (least thread CPU time)")
    print(f"{'api':<10} {'without, µs':>12} {'with, µs':>12} {'image, µs':>12} {'ratio':>7}")
    for api, without, with_image in proxy_rows(args.repeat, args.mib):
        print(f"{api:<10} {without:12.1f} {with_image:12.1f} {with_image - without:12.1f} "
              f"{with_image / without:7.1f}")  # fmt: skip
    inputs_only, checked = trainer_rows(args.repeat)
    print("trainer, one 640x400 PNG, the tiny VLM's processor (least wall time)")
    print(f"inputs only {inputs_only:.2f} ms · checked, then inputs {checked:.2f} ms · "
          f"ratio {checked / inputs_only:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
