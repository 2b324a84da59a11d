"""Token-in continuation: a turn that continues an earlier turn of its lineage reaches the engine
as the ids the engine already saw and sampled, plus the template's rendering of the new messages.

An agent sends back the assistant's *text*. Rendered through the chat template and tokenised
again, it often gives other ids than those sampled (a different split of the same text, reasoning
a template strips from earlier turns, a tool call re-serialised): the engine then sees a context
the model never produced, and the turns cannot be joined into one training sample. The proxy
knows the ids, so when it can show that a request continues an earlier turn it sends the engine
that turn's prompt + the sampled completion + the new messages' ids, as a pre-tokenised prompt on
the same `/v1/chat/completions` request (vLLM: `kv_transfer_params.prompt_token_ids`; the
answer, its tool-call and reasoning parsing stay the engine's).

Which turn. A session holds several conversations (`store.lineages`); the turn continued is the
deepest earlier turn whose messages the request repeats first (`proxy.lineages`: from this
replica's memory, else the session's log). Lineages of one session may be in flight at once;
nothing is locked across them.

The rule. That turn k had messages M, prompt ids P and, per choice i, completion ids C_i and the
reply A_i the proxy returned. This request continues choice i when, in order (the first check that
fails names the fallback, recorded with the turn, and the prompt is rendered from the messages as
the agent sent them, exactly as without this module):

1. `no_previous_turn`: the session has a completed turn (in memory, else read from the log);
   `history_changed`: none of its turns' messages start the request's.
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
   `lineage_not_separable`: an audit (below) found this lineage's template not separable.
7. The engine renders (its `/tokenize`, which applies the model's own chat template), with a
   neutral conversation BASE in place of the history, so that the cost is the new messages':
       B = render(BASE + [A])                   the reply, as the template ends one
       W = render(BASE + [A] + N, generation)   then the new messages
       E = what render(BASE + [reply "a"]) and render(BASE + [reply "b"]) end with alike:
           how the template ends a reply (ChatML: `<|im_end|>` and a newline; cached)
   `not_separable` unless W starts with B (the new messages leave the reply as it was) and B
   ends with E (the real reply ends as the template ends one). S = W after B: the new
   messages' ids. The glue g after the sampled ids is E without its first token when C_i ends
   with that token (the engine stopped on the template's end of turn and sampled it), and all of
   E when C_i was cut by `length` (the end of turn is the template's, as it would be from text,
   and the projection gives it loss mask 0). `end_not_in_template`: C_i stopped on another
   token. `engine_cannot_render`: the engine has no `/tokenize`, or the template refused BASE (a
   template enforcing strict role alternation may).
8. The prompt is P + C_i + g + S.

What the check proves, and what it no longer proves. It proves that the template renders the
new messages after this reply as S, and ends the reply as it ends any: the prompt is what the
template would give if it renders each message independently of what came before. It no longer
renders the whole conversation every turn, so it does not prove that the real history leaves the
rendering of the new messages unchanged (a template that numbers tool results, strips reasoning
before the last user message, or changes once a conversation is long). The *audit* does: on a
lineage's first continued turn, then once `audit_every` turns were continued since the last one
(`TRAJSTORE_CONTINUATION_AUDIT_EVERY`, default 16) and the conversation has grown by half since
it (`TRAJSTORE_CONTINUATION_AUDIT_GROWTH`, 0.5: audits at geometric lengths, so that their cost
per turn stays flat however long the conversation gets), the engine also renders the whole
conversation R = render(M + [A] + N, generation), which must end with E + S; where it does not,
the turn is rendered from its messages (`audit_failed`) and the lineage is rendered from then on
(`lineage_not_separable`). Where the prompt first differs from R is the drift avoided (`drift_at`,
`None` when there is none), measured on audited turns only.

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
from typing import Any, Literal, NamedTuple

import numpy as np
import orjson

from trajstore.proxy.engines import Engine
from trajstore.proxy.lineages import RENDER_FIELDS, Turn, render_key
from trajstore.proxy.transport import TransportError
from trajstore.store.replies import same_reply, text_of
from trajstore.store.tokens import TOKEN_DTYPE, encode_token_ids, shared_prefix

log = logging.getLogger(__name__)

#: The conversation the new messages are rendered after, to separate them from the history.
BASE: list[dict[str, Any]] = [{"role": "user", "content": "."}]
_STUB_REPLIES = ({"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"})


def _renders_plainly(body: dict[str, Any]) -> bool:
    """Whether the engine renders this request as its messages + the generation prompt."""
    return (
        body.get("add_generation_prompt", True) is True
        and not body.get("continue_final_message")
        and not body.get("echo")
    )


Source = Literal["continued", "rendered"]


class Plan(NamedTuple):
    """How this request's prompt reaches the engine."""

    source: Source
    #: The prompt to send, when continued (int32: orjson writes it without a list in between).
    token_ids: np.ndarray[Any, np.dtype[np.int32]] | None = None
    packed: bytes = b""  #: the same, packed: what the engine's echo must equal
    fallback: str | None = None  #: why the prompt is rendered (None: nothing to continue)
    drift_at: int | None = None  #: audited: where the text rendering would first differ
    choice: int | None = None  #: continued: which choice of the turn continued
    turn: Turn | None = None  #: the turn continued (or, rendered, the one it looked like)
    audit: bool = False  #: whether the whole conversation was rendered to check it

    def as_json(self) -> dict[str, Any]:
        """What the prompt_tokens event records of it (the contract in `store.sessions`)."""
        out: dict[str, Any] = {"prompt_source": self.source}
        if self.source == "continued":
            # The turn continued is the one the prompt's `prefix` names; `drift_at` is there
            # only when measured (an audited turn).
            continued: dict[str, Any] = {"choice": self.choice}
            if self.audit:
                continued["drift_at"] = self.drift_at
            out["continuation"] = continued
        elif self.fallback is not None:
            out["continuation"] = {"fallback": self.fallback}
        return out


RENDERED = Plan("rendered")


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


class Continuer:
    """Decides, per chat request, whether its prompt is continued from ids or rendered."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
        audit_every: int = 16,
        audit_growth: float = 0.5,
    ) -> None:
        self.enabled = enabled
        self.headers = headers or {}
        self.timeout = timeout
        self.audit_every = audit_every
        self.audit_growth = audit_growth
        # Per engine and render options: (render(BASE), E), which every turn reuses.
        self._bases: OrderedDict[tuple[str, bytes], tuple[list[int], list[int]]] = OrderedDict()

    async def plan(
        self,
        engine: Engine,
        body: dict[str, Any],
        candidates: Sequence[Turn],
        known: Turn | None,
        read_log: Callable[[], Awaitable[Turn | None]],
    ) -> Plan:
        """How to send this request's prompt. `candidates`: the remembered turns whose messages
        it repeats, deepest first (`SessionTurns.continued_by`); `known`: the session's latest
        remembered turn; `read_log` gives the deepest such turn from the session's log, asked
        only when this replica remembers nothing of the session (or a later turn than the one
        it found): a request whose history matches no remembered turn has `history_changed`."""
        messages: list[Any] = body["messages"]
        if not self.enabled or not _has_history(messages):
            return RENDERED
        if _has_media(messages):
            return RENDERED._replace(fallback="non_text_content")
        turn = _deepest(messages, candidates)
        if (turn is None and known is None) or (turn and _needs_later_turn(messages, turn)):
            turn = await read_log() or turn  # forgotten, or served by another replica
        if turn is None:
            return RENDERED._replace(
                fallback="no_previous_turn" if known is None else "history_changed"
            )
        rendered = RENDERED._replace(turn=turn)
        fallback, choice = _check(body, messages, turn)
        if fallback is None and turn.chain is not None and turn.chain.off:
            fallback = turn.chain.off
        if fallback is not None:
            return rendered._replace(fallback=fallback)
        assert choice is not None
        if not engine.token_prompts:
            return rendered._replace(fallback="engine_ignored_token_prompt")
        chain = turn.chain
        audit = self._audit_due(turn)
        try:
            plan = await self._build(engine, body, turn, choice, audit)
        except _Refused as exc:
            log.info("continuation: the engine at %s cannot render: %s", engine.url, exc)
            return rendered._replace(fallback="engine_cannot_render")
        if chain is not None and audit:
            chain.since_audit, chain.audited_at = 0, turn.prompt_len
            if plan.fallback == "audit_failed":
                chain.off = "lineage_not_separable"
        elif chain is not None and plan.source == "continued":
            chain.since_audit += 1
        return plan

    def _audit_due(self, turn: Turn) -> bool:
        """Whether this continued turn renders the whole conversation too: the lineage's first
        (as this replica knows it), then once `audit_every` turns have been continued since the
        last audit and the conversation has grown by `audit_growth` since then, so that the
        audits' cost per turn stays flat however long the conversation gets."""
        chain = turn.chain
        if self.audit_every <= 0:
            return False
        if chain is None or chain.audited_at == 0:
            return True
        grown = turn.prompt_len >= chain.audited_at * (1 + self.audit_growth)
        return chain.since_audit + 1 >= self.audit_every and grown

    async def _build(
        self, engine: Engine, body: dict[str, Any], turn: Turn, choice: int, audit: bool
    ) -> Plan:
        messages = body["messages"]
        reply, new = messages[turn.n_messages], messages[turn.n_messages + 1 :]
        ending = turn.choices[choice]
        renders = [
            self._base(engine, body),
            self._render(engine, body, [*BASE, reply], generation=False),
            self._render(engine, body, [*BASE, reply, *new], generation=True),
        ]
        if audit:
            renders.append(self._render(engine, body, messages, generation=True))
        (base, reply_end), with_reply, with_new, *whole = await _gather(*renders)
        rendered = RENDERED._replace(turn=turn)
        if (
            with_reply[: len(base)] != base
            or with_new[: len(with_reply)] != with_reply
            or not _ends_with(with_reply, reply_end)
        ):
            return rendered._replace(fallback="not_separable")
        new_ids = with_new[len(with_reply) :]
        if ending.finish_reason == "length":
            glue = reply_end
        elif reply_end and np.frombuffer(ending.tokens, TOKEN_DTYPE)[-1] == reply_end[0]:
            glue = reply_end[1:]
        else:
            return rendered._replace(fallback="end_not_in_template")
        # Packed through array('I') (store.tokens), not numpy: a long rendering is a list of
        # Python ints, and numpy converts those one by one.
        packed = b"".join((turn.prompt, ending.tokens, encode_token_ids([*glue, *new_ids])))
        drift = None
        if audit:
            text = whole[0]
            if not _ends_with(text, [*reply_end, *new_ids]):
                return rendered._replace(fallback="audit_failed", audit=True)
            as_text = encode_token_ids(text)
            drift = None if packed == as_text else shared_prefix(packed, as_text)
        prompt = np.frombuffer(packed, TOKEN_DTYPE)
        return Plan(
            "continued", prompt, packed, drift_at=drift, choice=choice, turn=turn, audit=audit
        )

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
        for name in RENDER_FIELDS:
            if body.get(name) is not None:
                request[name] = body[name]
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


def _deepest(messages: list[Any], candidates: Sequence[Turn]) -> Turn | None:
    """The deepest candidate, preferring (at one depth) the most recent whose reply the request
    repeats."""
    if not candidates:
        return None
    depth = candidates[0].n_messages
    level = [t for t in candidates if t.n_messages == depth]
    sent = messages[depth] if depth < len(messages) else None
    for turn in reversed(level):
        if sent is not None and any(same_reply(sent, e.reply) for e in turn.choices):
            return turn
    return level[-1]


def _needs_later_turn(messages: list[Any], turn: Turn) -> bool:
    """Whether the messages go on past `turn` with a reply it did not give (a later turn, served
    by another replica or forgotten), so that the log may know a better turn to continue."""
    return any(m.get("role") == "assistant" for m in messages[turn.n_messages + 1 :])


def _check(body: dict[str, Any], messages: list[Any], turn: Turn) -> tuple[str | None, int | None]:
    """Rules 2 to 6: (fallback, None), or (None, the choice continued). A remembered turn was
    found by its messages' serialisation, so only a turn read from the log is compared here."""
    n = turn.n_messages
    if turn.from_log is not None and (len(messages) <= n or messages[:n] != turn.from_log[0]):
        return "history_changed", None
    if len(messages) <= n + 1:
        return "no_new_messages", None
    sent = messages[n]
    choice = next(
        (i for i, ending in enumerate(turn.choices) if same_reply(sent, ending.reply)), None
    )
    if choice is None:
        return "reply_changed", None
    new = messages[n + 1 :]
    if any(m.get("role") == "assistant" for m in new):
        return "new_messages_include_assistant", None
    ending = turn.choices[choice]
    ended = ending.finish_reason in ("stop", "tool_calls", "length")
    if not ended or isinstance(ending.stop_reason, str) or not ending.tokens:
        return "previous_not_stopped", None
    if not _same_options(body, turn) or not _renders_plainly(body):
        return "render_options_changed", None
    if any(not isinstance(text_of(m.get("content")), str) for m in new):
        return "non_text_content", None
    return None, choice


def _same_options(body: dict[str, Any], turn: Turn) -> bool:
    if turn.from_log is not None:
        return [body.get(name) for name in RENDER_FIELDS] == turn.from_log[1]
    return render_key(body) == turn.render_key
