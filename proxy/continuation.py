"""Token-in continuation: a turn that continues the session's previous one reaches the engine as
the ids the engine already saw and sampled, plus the template's rendering of the new messages.

An agent sends back the assistant's *text*. Rendered through the chat template and tokenised
again, it often gives other ids than those sampled (a different split of the same text, reasoning
a template strips from earlier turns, a tool call re-serialised): the engine then sees a context
the model never produced, and the turns cannot be joined into one training sample. The proxy
knows the ids, so when it can prove that a request continues the previous turn it sends the
engine the previous prompt + the sampled completion + the new messages' ids, as a pre-tokenised
prompt on the same `/v1/chat/completions` request (vLLM: `kv_transfer_params.prompt_token_ids`;
the answer, its tool-call and reasoning parsing stay the engine's).

The rule. The previous turn k had messages M, prompt ids P and, per choice i, completion ids C_i
and the reply A_i the proxy returned. This request continues choice i when, in order (the first
check that fails names the fallback, recorded with the turn, and the prompt is rendered from the
messages as the agent sent them, exactly as without this module):

1. `no_previous_turn`: the session has a completed chat turn (in memory, else read from the log).
2. `history_changed` / `no_new_messages`: messages = M + [A] + N with N not empty; M comes back
   exactly (compared as orjson serialises it: an agent sends its own messages back verbatim).
3. `reply_changed`: A equals one choice's reply, compared parsed, as clients really differ:
   `content` null, "" or text parts alike; tool-call arguments as JSON values (spacing and key
   order do not matter); reasoning fields ignored (the OpenAI API has no way to send them back).
4. `new_messages_include_assistant`: N holds no assistant message (one would be text the model
   did not sample, or a later turn this replica has not seen: then the log is read first).
5. `previous_not_stopped`: C_i ended on the engine's end of turn (finish_reason `stop` or
   `tool_calls`), or was cut by `length`; not by a stop string (the ids sampled past the text
   the agent got back), nor empty.
6. `render_options_changed` / `non_text_content`: tools, chat template and its kwargs as in
   turn k; text content only, in every message (checked first, before the log is read): an
   image's placeholder ids mean nothing to the engine without the image, and vLLM renders the
   messages of such a request itself, ignoring the ids (which would then count as
   `engine_ignored_token_prompt` and stop continuation on that engine for every session).
7. The engine renders (its `/tokenize`, which applies the model's own chat template):
       R = render(M + [A] + N, generation prompt)         what the engine would see from text
       S = render(BASE + N, gen) minus render(BASE)        the new messages, after a neutral BASE
       E = what render(BASE + [reply "a"]) and render(BASE + [reply "b"]) end with alike:
           how the template ends a reply (ChatML: `<|im_end|>` and a newline)
   The glue g after the sampled ids is E without its first token when C_i ends with that
   token (the engine stopped on the template's end of turn and sampled it), and all of E when
   C_i was cut by `length` (the end of turn is the template's, as it would be from text, and
   the projection gives it loss mask 0). `end_not_in_template`: C_i stopped on another token.
   `not_separable`: R does not end with E + S, i.e. the new messages would not render the same
   after the real history, or the real reply does not end as the template ends one.
   `engine_cannot_render`: the engine has no `/tokenize`, or the template refused BASE (a
   template enforcing strict role alternation may).
8. The prompt is P + C_i + g + S. Where it differs from R first is the drift avoided (`None`
   when there is none: the template happened to re-render the sampled ids exactly).

The engine echoes the prompt it used (`prompt_token_ids`); the recorder checks it on every
continued turn, and an engine that did not honour the ids (`engine_ignored_token_prompt`) gets
rendered prompts from then on (`proxy.engines.Engine.token_prompts`).

Because turn k+1's prompt starts with turn k's prompt and sampled completion, the projection
(`store.samples`) joins the turns into one sample with no change: g and S get loss mask 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import orjson

from trajstore.proxy.apis import TRANSLATIONS
from trajstore.proxy.engines import Engine
from trajstore.proxy.errors import ProxyError
from trajstore.proxy.replicas import Replicas
from trajstore.proxy.transport import TransportError
from trajstore.store import EventStore, StoreError
from trajstore.store.sessions import TurnRecord, rebuild_session
from trajstore.store.tokens import TOKEN_DTYPE, encode_token_ids, shared_prefix

log = logging.getLogger(__name__)

#: The conversation the new messages are rendered after, to separate them from the history.
BASE: list[dict[str, Any]] = [{"role": "user", "content": "."}]
_STUB_REPLIES = ({"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"})

#: Request fields that change how the template renders: a continuation needs them unchanged.
RENDER_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "documents")


def _renders_plainly(body: dict[str, Any]) -> bool:
    """Whether the engine renders this request as its messages + the generation prompt."""
    return (
        body.get("add_generation_prompt", True) is True
        and not body.get("continue_final_message")
        and not body.get("echo")
    )


Source = Literal["continued", "rendered"]


class Ending(NamedTuple):
    """How one choice of a turn ended, as the next turn may continue it."""

    tokens: bytes  #: the completion's ids, packed
    finish_reason: str | None
    stop_reason: Any
    reply: dict[str, Any] | None  #: the assistant message the proxy returned


class Plan(NamedTuple):
    """How this request's prompt reaches the engine."""

    source: Source
    #: The prompt to send, when continued (int32: orjson writes it without a list in between).
    token_ids: np.ndarray[Any, np.dtype[np.int32]] | None = None
    packed: bytes = b""  #: the same, packed: what the engine's echo must equal
    fallback: str | None = None  #: why the prompt is rendered (None: nothing to continue)
    drift_at: int | None = None  #: continued: where the text rendering would first differ
    choice: int | None = None  #: continued: which choice of the previous turn

    def as_json(self) -> dict[str, Any]:
        """What the prompt_tokens event records of it (the contract in `store.sessions`)."""
        out: dict[str, Any] = {"prompt_source": self.source}
        if self.source == "continued":
            out["continuation"] = {"choice": self.choice, "drift_at": self.drift_at}
        elif self.fallback is not None:
            out["continuation"] = {"fallback": self.fallback}
        return out


RENDERED = Plan("rendered")


def render_key(body: dict[str, Any]) -> bytes:
    """The request's render options, comparable between turns."""
    return orjson.dumps([body.get(field) for field in RENDER_FIELDS])


# -- comparing the reply the agent sent back with the one it was given -------------------------


def _text(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
    return raw


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any, Any]]:
    calls = []
    for call in message.get("tool_calls") or ():
        function = (call.get("function") if isinstance(call, dict) else None) or {}
        calls.append((call.get("id"), function.get("name"), _arguments(function.get("arguments"))))
    return calls


def same_reply(sent: dict[str, Any], returned: dict[str, Any] | None) -> bool:
    """Whether the assistant message an agent sent back is the reply it was given (rule 3)."""
    if returned is None or sent.get("role") != "assistant":
        return False
    return _text(sent.get("content")) == _text(returned.get("content")) and _calls(sent) == _calls(
        returned
    )


# -- the continuation itself -------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """The session's previous chat turn, as a continuation needs it."""

    request_id: str
    prompt: bytes  #: its prompt ids, packed
    n_messages: int
    messages: bytes  #: its messages as orjson serialises them
    render_key: bytes
    choices: tuple[Ending, ...]
    api: str = "chat"  #: the API it came in (its messages are the chat ones it was sent as)
    #: For a turn read from the log: its messages and render options, parsed. PostgreSQL's
    #: jsonb does not keep key order, so these are compared as values, not as bytes.
    from_log: tuple[list[Any], list[Any]] | None = None
    #: The images this replica recorded for the session up to this turn, by sha256: the next
    #: turn refers to them instead of recording them again (`proxy.images`).
    images: frozenset[str] = frozenset()

    @property
    def tokens(self) -> bytes:
        """Its prompt + completion (choice 0), packed: what a later prompt may reference."""
        return self.prompt + self.choices[0].tokens if self.choices else self.prompt

    @property
    def size(self) -> int:
        """About how many bytes it holds."""
        held = len(self.prompt) + len(self.messages) + len(self.render_key)
        return held + sum(len(ending.tokens) for ending in self.choices)


class _Refused(Exception):
    """The engine cannot render this conversation (no /tokenize, or the template refused it)."""


def _common_end(a: list[int], b: list[int]) -> list[int]:
    """The longest run of ids both lists end with."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n :]


def _ends_with(ids: Sequence[int], tail: Sequence[int]) -> bool:
    return len(tail) <= len(ids) and list(ids[len(ids) - len(tail) :]) == list(tail)


def turn_from_record(record: TurnRecord) -> Turn | None:
    """A completed chat turn as rebuilt from the log (`rebuild_session(packed=True)`), or None."""
    translation = TRANSLATIONS.get(record.api)
    if record.status != "completed" or (record.api != "chat" and translation is None):
        return None
    try:
        chat = record.body if translation is None else translation.to_chat(record.body)
    except ProxyError:
        return None
    messages = chat.get("messages")
    if not isinstance(messages, list):
        return None
    if not isinstance(record.prompt_token_ids, bytes) or not record.choices:
        return None
    endings = []
    for index in range(len(record.choices)):
        choice = record.choices.get(index)
        if choice is None:
            return None
        tokens = choice.token_ids if isinstance(choice.token_ids, bytes) else b""
        endings.append(Ending(tokens, choice.finish_reason, choice.stop_reason, choice.message))
    options = [chat.get(field) for field in RENDER_FIELDS]
    return Turn(
        record.request_id,
        record.prompt_token_ids,
        len(messages),
        b"",
        b"",
        tuple(endings),
        api=record.api,
        from_log=(messages, options),
    )


async def last_turn_in_log(
    store: EventStore, replicas: Replicas, session_id: str, wait: float = 2.0
) -> Turn | None:
    """The session's last completed chat turn as the log has it, for a turn that continues
    one this replica does not remember (served by another replica, or before a restart).

    The other replicas are asked to store the session's events first (the finish barrier), but
    for `wait` seconds at most: a turn is not held up for long; without them, the log's last
    turn may be an older one, and the checks then fall back to rendering.
    """
    try:
        async with asyncio.timeout(wait):
            await replicas.flush_everywhere(session_id)
    except (TimeoutError, ProxyError, StoreError) as exc:
        log.info("continuation reads %s's log without every replica's writes: %s", session_id, exc)
    record = rebuild_session(session_id, await store.read_session(session_id), packed=True)
    for turn in reversed(record.turns):
        if turn.status == "completed" and turn.api != "completions":
            return turn_from_record(turn)
    return None


def _same_options(body: dict[str, Any], turn: Turn) -> bool:
    if turn.from_log is not None:
        return [body.get(field) for field in RENDER_FIELDS] == turn.from_log[1]
    return render_key(body) == turn.render_key


def _continued_messages(messages: list[Any], turn: Turn, now: bytes) -> bool:
    """Whether `messages` starts with `turn`'s messages, byte for byte as serialised."""
    if turn.from_log is not None:
        n = turn.n_messages
        return len(messages) > n and messages[:n] == turn.from_log[0]
    before = turn.messages
    cut = len(before) - 1
    return (
        len(messages) > turn.n_messages
        and now[cut : cut + 1] == b","
        and now.startswith(memoryview(before)[:cut])
    )


class Continuer:
    """Decides, per chat request, whether its prompt is continued from ids or rendered."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.enabled = enabled
        self.headers = headers or {}
        self.timeout = timeout
        # Per engine and render options: (render(BASE), E), which every turn reuses.
        self._bases: OrderedDict[tuple[str, bytes], tuple[list[int], list[int]]] = OrderedDict()

    async def plan(
        self,
        engine: Engine,
        body: dict[str, Any],
        messages_json: bytes,
        turn: Turn | None,
        read_log: Callable[[], Awaitable[Turn | None]],
    ) -> Plan:
        """How to send this request's prompt; `read_log` gives the session's last chat turn
        from the log, asked only when the replica's memory has none that fits."""
        messages: list[Any] = body["messages"]
        if not self.enabled or not _has_history(messages):
            return RENDERED
        if _has_media(messages):
            return RENDERED._replace(fallback="non_text_content")
        if turn is not None and turn.n_messages == 0:
            turn = None  # a completions turn: nothing a chat request can continue
        if turn is None or _needs_later_turn(messages, turn, messages_json):
            turn = await read_log() or turn
        if turn is None:
            return RENDERED._replace(fallback="no_previous_turn")
        fallback, choice = _check(body, messages, messages_json, turn)
        if fallback is not None:
            return RENDERED._replace(fallback=fallback)
        assert choice is not None
        if not engine.token_prompts:
            return RENDERED._replace(fallback="engine_ignored_token_prompt")
        try:
            return await self._build(engine, body, turn, choice)
        except _Refused as exc:
            log.info("continuation: the engine at %s cannot render: %s", engine.url, exc)
            return RENDERED._replace(fallback="engine_cannot_render")

    async def _build(self, engine: Engine, body: dict[str, Any], turn: Turn, choice: int) -> Plan:
        messages = body["messages"]
        new = messages[turn.n_messages + 1 :]
        ending = turn.choices[choice]
        (base, reply_end), with_new, text = await _gather(
            self._base(engine, body),
            self._render(engine, body, [*BASE, *new], generation=True),
            self._render(engine, body, messages, generation=True),
        )
        if with_new[: len(base)] != base:
            return RENDERED._replace(fallback="not_separable")
        new_ids = with_new[len(base) :]
        if ending.finish_reason == "length":
            glue = reply_end
        elif reply_end and np.frombuffer(ending.tokens, TOKEN_DTYPE)[-1] == reply_end[0]:
            glue = reply_end[1:]
        else:
            return RENDERED._replace(fallback="end_not_in_template")
        if not _ends_with(text, [*reply_end, *new_ids]):
            return RENDERED._replace(fallback="not_separable")
        # Packed through array('I') (store.tokens), not numpy: a long rendering is a list of
        # Python ints, and numpy converts those one by one.
        packed = b"".join((turn.prompt, ending.tokens, encode_token_ids([*glue, *new_ids])))
        rendered = encode_token_ids(text)
        drift = None if packed == rendered else shared_prefix(packed, rendered)
        prompt = np.frombuffer(packed, TOKEN_DTYPE)
        return Plan("continued", prompt, packed, drift_at=drift, choice=choice)

    async def _base(self, engine: Engine, body: dict[str, Any]) -> tuple[list[int], list[int]]:
        """render(BASE) and how the template ends a reply (E), cached per render options."""
        key = (engine.url, render_key(body))
        cached = self._bases.get(key)
        if cached is not None:
            self._bases.move_to_end(key)
            return cached
        base, *replies = await _gather(
            self._render(engine, body, BASE, generation=False),
            *(self._render(engine, body, [*BASE, r], generation=False) for r in _STUB_REPLIES),
        )
        if any(reply[: len(base)] != base for reply in replies):
            raise _Refused("the template does not render a reply after BASE as an extension")
        self._bases[key] = cached = (base, _common_end(*replies))
        while len(self._bases) > 256:
            self._bases.popitem(last=False)
        return cached

    async def _render(
        self, engine: Engine, body: dict[str, Any], messages: list[Any], *, generation: bool
    ) -> list[int]:
        """The engine's chat-template rendering of `messages`, as token ids."""
        request: dict[str, Any] = {
            "model": body.get("model"),
            "messages": messages,
            "add_generation_prompt": generation,
        }
        for field in RENDER_FIELDS:
            if body.get(field) is not None:
                request[field] = body[field]
        try:
            answer = await engine.connection().send(
                "POST", "/tokenize", orjson.dumps(request),
                {"Content-Type": "application/json", **self.headers}, timeout=self.timeout,
            )  # fmt: skip
            raw = await answer.read()
            if answer.status != 200:
                raise _Refused(f"/tokenize answered {answer.status}: {raw[:200]!r}")
        except (TransportError, TimeoutError) as exc:
            raise _Refused(f"/tokenize failed: {type(exc).__name__}: {exc}") from None
        tokens = orjson.loads(raw).get("tokens")
        if not isinstance(tokens, list):
            raise _Refused("/tokenize answered without tokens")
        return tokens


async def _gather(*awaitables: Awaitable[Any]) -> list[Any]:
    """Await concurrently; the first failure is raised once all are done (none left running)."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _has_media(messages: list[Any]) -> bool:
    """Whether a message has a content part that is not text (an image, audio, a file)."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type", "text") != "text" for part in content
        ):
            return True
    return False


def _has_history(messages: list[Any]) -> bool:
    """Whether an assistant message comes before the last message (a conversation goes on)."""
    return any(m.get("role") == "assistant" for m in messages[:-1])


def _needs_later_turn(messages: list[Any], turn: Turn, messages_json: bytes) -> bool:
    """Whether the messages go on past `turn` with a reply it did not give (a later turn, served
    by another replica), so that the log may know a better previous turn."""
    return _continued_messages(messages, turn, messages_json) and any(
        m.get("role") == "assistant" for m in messages[turn.n_messages + 1 :]
    )


def _check(
    body: dict[str, Any], messages: list[Any], messages_json: bytes, turn: Turn
) -> tuple[str | None, int | None]:
    """Rules 2 to 6: (fallback, None), or (None, the choice continued)."""
    if not _continued_messages(messages, turn, messages_json):
        return "history_changed", None
    if len(messages) <= turn.n_messages + 1:
        return "no_new_messages", None
    sent = messages[turn.n_messages]
    choice = next(
        (i for i, ending in enumerate(turn.choices) if same_reply(sent, ending.reply)), None
    )
    if choice is None:
        return "reply_changed", None
    new = messages[turn.n_messages + 1 :]
    if any(m.get("role") == "assistant" for m in new):
        return "new_messages_include_assistant", None
    ending = turn.choices[choice]
    ended = ending.finish_reason in ("stop", "tool_calls", "length")
    if not ended or isinstance(ending.stop_reason, str) or not ending.tokens:
        return "previous_not_stopped", None
    if not _same_options(body, turn) or not _renders_plainly(body):
        return "render_options_changed", None
    if any(not isinstance(_text(m.get("content")), str) for m in new):
        return "non_text_content", None
    return None, choice
