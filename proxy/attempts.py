"""One agent request on its way through the engines: what its attempts share (`Call`), each
engine request of the turn (`Segment`), how the answers go back (`Reply`), and an engine lost
before the agent got anything (`EngineLost`), which sends the request to another engine.

`proxy.forwarding` makes them; `proxy.streamed_turn` and `proxy.outcomes` use them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from trajstore.proxy.apis import Dropped, ImagePart, Translation
from trajstore.proxy.engines import Engine
from trajstore.proxy.errors import ProxyError
from trajstore.proxy.sessions import Session
from trajstore.proxy.switching import Generation
from trajstore.proxy.transport import Answer
from trajstore.proxy.wire import Api, Asked, strip

#: Engines one request may be sent to, when the first ones are lost.
ATTEMPTS = 3


class EngineLost(Exception):
    """The engine was lost before the agent got anything: try another (recorded already)."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Segment:
    """One engine request of a turn: the first, or a continuation after a weight switch."""

    engine: Engine
    answer: Answer
    generation: Generation
    release: Callable[[], None]
    unregister: Callable[[Generation], None]

    def close(self) -> None:
        """It is over: the engine's slot and the switch's watch are released (again: no-op)."""
        self.release()
        self.generation.close = None
        self.unregister(self.generation)


@dataclass
class Call:
    """What every attempt at one agent request shares."""

    api: Api
    session: Session
    body: dict[str, Any]  #: the agent's request
    chat: dict[str, Any]  #: what the engine is asked (chat, or the agent's completions body)
    asked: Asked
    translation: Translation | None
    headers: dict[str, str]
    dropped: list[Dropped]  #: of the agent's tools, those the engine does not get
    images: list[ImagePart]  #: a translated request's images (`proxy.apis.ImagePart`)


@dataclass
class Reply:
    """How the engine's answers go back to the agent: as the engine gave them, less what the
    agent did not ask for (chat, completions), or translated into its API (`proxy.apis`)."""

    asked: Asked
    translation: Translation | None
    body: dict[str, Any]  #: the agent's request
    request_id: str
    headers: dict[str, str] = field(default_factory=dict)  #: said with the answer

    def answer(self, data: dict[str, Any]) -> bytes:
        """A whole answer, as the agent's API gives it."""
        if self.translation is None:
            return orjson.dumps(strip(data, self.asked, streaming=False))
        return orjson.dumps(self.translation.answer(data, self.body, self.request_id))
