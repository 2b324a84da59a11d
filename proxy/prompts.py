"""A prompt as the recorder stores it: whole, or as a reference to an earlier turn of the session
plus the ids after the part they share; and, for a chat prompt, how it reached the engine
(continued from a turn's ids, or rendered from the messages, and why).

The contract of the prompt_tokens event is in `store.sessions`.
"""

from __future__ import annotations

from typing import Any

from trajstore.proxy.continuation import Plan
from trajstore.proxy.lineages import Turn
from trajstore.store.payloads import stored
from trajstore.store.payloads_request import Continuation, PromptPrefix, PromptTokens
from trajstore.store.tokens import shared_prefix

#: A prompt is stored as a reference to an earlier turn of the session when it shares at least
#: this many leading tokens with it (the prompt_tokens contract in `store.sessions`).
MIN_SHARED_TOKENS = 16


def prompt_payload(
    packed: bytes, plan: Plan | None, reference: Turn | None
) -> tuple[dict[str, Any], int]:
    """The prompt_tokens payload of the `packed` prompt, and how many of its leading tokens it
    stores by reference to `reference` (0: all of them are in the event).

    `plan`: how a chat prompt reached the engine (None for a prompt of no messages).
    """
    payload: dict[str, Any] = {"choice": None}
    if plan is not None:
        payload |= _prompt_source(plan)
    shared = 0 if reference is None else shared_prefix(packed, reference.tokens)
    if reference is None or shared < MIN_SHARED_TOKENS:
        return stored(PromptTokens, **payload), 0
    payload["prefix"] = stored(PromptPrefix, request_id=reference.request_id, n_tokens=shared)
    payload["n_tokens"] = len(packed) // 4
    return stored(PromptTokens, **payload), shared


def _prompt_source(plan: Plan) -> dict[str, Any]:
    """What the prompt_tokens event records of how the prompt reached the engine: continued
    (the turn and choice, whether audited, the drift measured) or rendered (and why)."""
    if plan.source == "continued":
        request_id = None if plan.turn is None else plan.turn.request_id
        # drift_at is there only when measured (an audited turn): null would say "no drift".
        if plan.audit:
            continued = stored(
                Continuation,
                request_id=request_id,
                choice=plan.choice,
                audit=True,
                drift_at=plan.drift_at,
            )
        else:
            continued = stored(Continuation, request_id=request_id, choice=plan.choice, audit=False)
        return {"prompt_source": "continued", "continuation": continued}
    if plan.fallback is not None:
        return {
            "prompt_source": "rendered",
            "continuation": stored(Continuation, fallback=plan.fallback),
        }
    return {"prompt_source": "rendered"}
