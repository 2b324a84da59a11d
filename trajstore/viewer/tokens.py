"""Token text for the token strips: from the model's tokenizer, else the engine, else ids.

Where the text comes from, in order (the page names the one used):

1. the tokenizer of a model directory given to the viewer (`TRAJSTORE_UI_TOKENIZER`; `trajstore
   up` passes its local vLLM's model);
2. the tokenizer of the model the session's engine reports (`GET /v1/models`: vLLM's `root` is
   the model's path), when that is a directory on this machine;
3. the engine's `POST /detokenize`, one call per token id not seen before;
4. none: the strip shows ids.

Each token is decoded alone, special tokens included, so a strip shows exactly the ids the
engine saw; a token that is part of a multi-byte character reads as U+FFFD.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)

#: How long an engine that did not answer is left alone before it is asked again.
_ENGINE_RETRY_S = 30.0
#: Calls to /detokenize in flight at once, and the most ids asked for one strip.
_DETOKENIZE_CONCURRENCY = 16
_DETOKENIZE_MAX_IDS = 4096


@dataclass(frozen=True)
class Texts:
    """The text of each token of a strip, and where it came from (None: show ids)."""

    texts: list[str] | None
    source: str


def tokenizer_file(path: Path) -> Path | None:
    """The tokenizer.json of a model directory (or the file itself), if there is one."""
    candidate = path / "tokenizer.json" if path.is_dir() else path
    return candidate if candidate.is_file() else None


class Tokenizer:
    """A `tokenizers` tokenizer that decodes one token at a time, remembering each id."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.path = path
        self._tokenizer = HFTokenizer.from_file(str(path))
        self._known: dict[int, str] = {}

    def decode(self, ids: Sequence[int]) -> list[str]:
        """Each id's text alone."""
        missing = sorted({i for i in ids if i not in self._known})
        if missing:
            decoded = self._tokenizer.decode_batch([[i] for i in missing],
                                                   skip_special_tokens=False)  # fmt: skip
            self._known.update(zip(missing, decoded, strict=True))
        return [self._known[i] for i in ids]


@dataclass
class _Engine:
    """What is known about one engine: its model's tokenizer, its /detokenize answers."""

    tokenizer: Tokenizer | None = None
    root: str | None = None
    asked: bool = False  #: whether /v1/models was asked
    down_until: float = 0.0
    texts: dict[int, str] = field(default_factory=dict)


class TokenTexts:
    """Token text for the viewer's strips, by the order in this module's docstring."""

    def __init__(self, tokenizer: Path | None = None, *, timeout: float = 2.0) -> None:
        self.configured: Tokenizer | None = None
        if tokenizer is not None:
            found = tokenizer_file(tokenizer)
            if found is None:
                raise FileNotFoundError(f"no tokenizer.json in {tokenizer}")
            self.configured = Tokenizer(found)
        self._engines: dict[str, _Engine] = {}
        self._http = httpx.AsyncClient(timeout=timeout)

    async def close(self) -> None:
        """Close the connections to engines."""
        await self._http.aclose()

    async def texts(self, ids: Sequence[int], engine: str | None) -> Texts:
        """The text of each id, as the session's `engine` would have it."""
        if self.configured is not None:
            return Texts(self.configured.decode(ids), f"tokenizer {self.configured.path}")
        if engine is None:
            return Texts(None, "token ids (no tokenizer given and no engine recorded)")
        known = self._engines.setdefault(engine, _Engine())
        if time.monotonic() < known.down_until:
            return Texts(None, f"token ids (the engine {engine} did not answer)")
        if not known.asked:
            await self._ask_model(engine, known)
        if known.tokenizer is not None:
            return Texts(known.tokenizer.decode(ids), f"tokenizer of {known.root} "
                         f"(the model {engine} serves)")  # fmt: skip
        texts = await self._detokenize(engine, known, ids)
        if texts is None:
            return Texts(None, f"token ids (the engine {engine} did not answer)")
        return Texts(texts, f"{engine}/detokenize")

    async def _ask_model(self, engine: str, known: _Engine) -> None:
        """Learn the engine's model; load its tokenizer when it is a directory here."""
        try:
            answer = await self._http.get(engine.rstrip("/") + "/v1/models")
            answer.raise_for_status()
            card: dict[str, Any] = answer.json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            # Not a reason to stop asking it: its /detokenize may still answer (and sets
            # `down_until` when it does not either).
            log.info("the engine %s does not say its model: %s", engine, exc)
            return
        known.asked = True
        known.root = str(card.get("root") or card.get("id") or "")
        found = tokenizer_file(Path(known.root)) if known.root.startswith("/") else None
        if found is not None:
            try:
                known.tokenizer = Tokenizer(found)
            except Exception as exc:  # tokenizers raises its own Exception for a bad file
                log.warning("cannot load the tokenizer %s: %s", found, exc)

    async def _detokenize(
        self, engine: str, known: _Engine, ids: Sequence[int]
    ) -> list[str] | None:
        """Each id's text from the engine's /detokenize (None when it does not answer)."""
        missing = sorted({i for i in ids if i not in known.texts})
        if len(missing) > _DETOKENIZE_MAX_IDS:
            return None
        limit = asyncio.Semaphore(_DETOKENIZE_CONCURRENCY)
        url = engine.rstrip("/") + "/detokenize"

        async def one(token: int) -> None:
            async with limit:
                answer = await self._http.post(url, json={"tokens": [token]})
                answer.raise_for_status()
                known.texts[token] = str(answer.json()["prompt"])

        try:
            await asyncio.gather(*(one(i) for i in missing))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.info("the engine %s does not detokenize: %s", engine, exc)
            known.down_until = time.monotonic() + _ENGINE_RETRY_S
            return None
        return [known.texts[i] for i in ids]
