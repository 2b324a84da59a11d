"""The relay protocol: many engine requests multiplexed over one WebSocket a relay dialled in on.

A relay (`trajstore relay`, `proxy.relay`) runs beside an engine the proxy cannot reach, and
connects to the proxy's `/engines/connect` with `Authorization: Bearer <token>` (the admin key or
one of `TRAJSTORE_RELAY_TOKENS`). Control frames are WebSocket text frames holding one JSON
object with a `type`; body bytes travel in binary frames prefixed with their request's id:

    relay                                              proxy
      │ ─ hello {name, engine, healthy, error, protocol} ▶ │  first frame: who dialled in
      │ ◀─────────────────────── welcome {url, window} ── │  the engine is `relay://<name>`
      │ ◀──── open {id, method, path, headers, body} ──── │  a request (body: UTF-8 text)
      │ ── head {id, status, headers} ─────────────────▶ │  the engine's answer head
      │ ── data: binary [id: 4 bytes big-endian][bytes] ▶ │  body chunks, as the engine sends
      │ ── end {id} ───────────────────────────────────▶ │  the answer is complete
      │ ── error {id, message} ────────────────────────▶ │  the engine failed or broke off
      │ ◀────────────────────────── credit {id, bytes} ── │  the agent took that many bytes
      │ ◀───────────────────────────────── cancel {id} ── │  the agent left: stop generating
      │ ── health {healthy, error} ────────────────────▶ │  the engine's /health, every few s

Ids are chosen by the proxy, one per request, unique on the socket while the request is open.
An `error` before `head` means nothing reached the agent, so the proxy may send the request to
another engine; after `head` it breaks the answer off. A frame for an id no longer open (a
cancelled request) is dropped. When the socket drops, every open request fails the same way.

Flow control is per request, so a slow agent holds back its own answer and no other: each request
may have at most `window` bytes (from `welcome`) of data frames the agent has not taken yet. The
relay stops reading that request's engine answer when its window is spent (splitting a chunk if
need be) and resumes on `credit`, which the proxy sends as the agent takes chunks, a quarter of
the window at a time. The proxy's reader never waits on one request's queue, and a relay that
overruns a window is a protocol error. Version 1 had no credit: a proxy refuses such a relay at
`hello`, with a reason telling to upgrade it, rather than queue its answers without a bound.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import orjson

PATH = "/engines/connect"
VERSION = 2  #: sent in `hello`; a proxy refuses a relay that speaks another one
WINDOW = 1 << 20  #: bytes per request the agent may not have taken yet (sent in `welcome`)
ID = struct.Struct(">I")
MAX_ID = 2**32 - 1
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,99}")  #: a relay's name, as in relay://<name>
SCHEME = "relay://"

HELLO, WELCOME, OPEN, HEAD, END, ERROR, CREDIT, CANCEL, HEALTH = (
    "hello", "welcome", "open", "head", "end", "error", "credit", "cancel", "health",
)  # fmt: skip


class ProtocolError(Exception):
    """The other side sent a frame this protocol does not allow."""


def control(kind: str, **fields: Any) -> str:
    """A control frame's text."""
    return orjson.dumps({"type": kind, **fields}).decode()


def parse_control(text: str) -> dict[str, Any]:
    """A control frame's fields; raise `ProtocolError` if it is not one."""
    try:
        frame = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"a control frame is not JSON: {exc}") from None
    if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
        raise ProtocolError("a control frame must be a JSON object with a type")
    return frame


def data(request_id: int, chunk: bytes) -> bytes:
    """A data frame: body bytes of request `request_id`."""
    return ID.pack(request_id) + chunk


def parse_data(frame: bytes) -> tuple[int, bytes]:
    """A data frame's request id and bytes."""
    if len(frame) < ID.size:
        raise ProtocolError("a data frame is shorter than its id")
    return ID.unpack_from(frame)[0], frame[ID.size :]


def engine_url(name: str) -> str:
    """The URL the proxy lists and records a relay's engine under."""
    if not NAME.fullmatch(name):
        raise ProtocolError(f"a relay name is 1 to 100 letters, digits or . _ : - (not {name!r})")
    return SCHEME + name


def websocket_url(proxy_url: str) -> str:
    """The proxy's relay endpoint, from its HTTP URL."""
    url = proxy_url.rstrip("/")
    if url.startswith("https://"):
        url = "wss://" + url.removeprefix("https://")
    elif url.startswith("http://"):
        url = "ws://" + url.removeprefix("http://")
    return url + PATH
