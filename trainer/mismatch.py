"""The train–inference mismatch check: does an engine give the recorded tokens the logprobs that
were recorded when they were sampled?

For each turn, the recorded prompt ids followed by the recorded completion ids are sent back to
an engine's `/v1/completions` as a token-id prompt with `prompt_logprobs: 0` and `max_tokens: 1`.
vLLM then returns, for every prompt position after the first, the logprob of the token that sits
there given everything before it (`choices[0].prompt_logprobs[i] = {"<id>": {"logprob", "rank",
"decoded_token"}}`, entry 0 null; with k = 0 only the token itself). The entries over the
completion are the engine's logprobs of exactly what was generated, to compare with the behaviour
logprobs the proxy recorded.

Per turn it reports the mean and max absolute difference and an estimate of KL(behaviour ‖ engine)
from the sampled tokens alone (Schulman's k3: mean of r - 1 - log r, r = p_engine / p_behaviour,
unbiased and never negative because the tokens were drawn from the behaviour policy).

vLLM computes prompt logprobs from the raw logits (no temperature, no top-p): they are comparable
with sampled logprobs recorded under `--logprobs-mode raw_logprobs` (vLLM's default, recorded per
turn as `logprobs_mode`). A turn recorded with processed logprobs and a temperature other than 1
differs by design; its result says so.

This module talks to an engine, which the trainer otherwise never does: it is a debugging check,
run by `trajstore replay session ID --against URL`, never by training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from trajstore.store.sessions import SessionRecord, TurnRecord
from trajstore.trainer.errors import MismatchCheckFailed


@dataclass
class TurnMismatch:
    """How an engine's logprobs of one recorded completion differ from the recorded ones."""

    turn: int
    choice: int
    request_id: str
    tokens: int  #: completion tokens compared
    mean_abs_diff: float | None = None
    max_abs_diff: float | None = None
    kl: float | None = None  #: k3 estimate of KL(behaviour ‖ engine), nats per token
    worst_token: int | None = None  #: index in the completion of the largest difference
    note: str | None = None  #: why a turn was not compared, or why a difference is expected

    def as_json(self) -> dict[str, Any]:
        """A JSON-able view."""
        return dict(self.__dict__)


def differences(recorded: np.ndarray, engine: np.ndarray) -> tuple[float, float, float, int]:
    """Mean and max |engine - recorded|, the k3 KL estimate, and the index of the max."""
    log_ratio = engine.astype(np.float64) - recorded.astype(np.float64)
    absolute = np.abs(log_ratio)
    kl = float(np.mean(np.expm1(log_ratio) - log_ratio))
    worst = int(np.argmax(absolute))
    return float(np.mean(absolute)), float(absolute[worst]), kl, worst


def engine_base(url: str) -> str:
    """The engine's root URL, whether it was given with or without `/v1`."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def prompt_logprobs_of(answer: dict[str, Any], tokens: list[int], start: int) -> list[float]:
    """The logprobs vLLM gave `tokens[start:]`, read from a completions answer."""
    try:
        entries = answer["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError) as exc:
        raise MismatchCheckFailed(
            "the engine's answer has no choices[0].prompt_logprobs; is it a vLLM server?"
        ) from exc
    if not isinstance(entries, list) or len(entries) != len(tokens):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise MismatchCheckFailed(f"expected {len(tokens)} prompt logprobs, the engine gave {got}")
    values = []
    for position in range(start, len(tokens)):
        entry = entries[position] or {}
        found = entry.get(str(tokens[position]))
        if found is None:
            raise MismatchCheckFailed(
                f"the engine gave no logprob for token {tokens[position]} at position {position}"
            )
        values.append(float(found["logprob"]))
    return values


def _note(turn: TurnRecord) -> str | None:
    if turn.constrained_by is not None:
        return (
            f"decoding constrained by {turn.constrained_by}: the recorded logprobs are those of "
            "the grammar-masked distribution and differ by design"
        )
    temperature = turn.sampling.get("temperature", turn.body.get("temperature"))
    processed = (turn.logprobs_mode or "").startswith("processed")
    if processed and temperature not in (None, 1, 1.0):
        return f"recorded as {turn.logprobs_mode} at temperature {temperature}: differs by design"
    return None


class MismatchChecker:
    """Asks one engine for the logprobs of recorded completions (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.url = f"{engine_base(url)}/v1/completions"
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=timeout, headers=headers)

    async def close(self) -> None:
        """Close the HTTP connections."""
        await self.http.aclose()

    async def engine_logprobs(self, model: str, prompt: list[int], completion: list[int]) -> Any:
        """The engine's logprobs of `completion` after `prompt`, or the engine's refusal (a str)."""
        tokens = prompt + completion
        body = {
            "model": model,
            "prompt": tokens,
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 0.0,
        }
        try:
            response = await self.http.post(self.url, json=body)
        except httpx.HTTPError as exc:
            raise MismatchCheckFailed(f"cannot reach the engine at {self.url}: {exc}") from exc
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            return f"the engine refused the turn ({response.status_code}): {message}"
        return prompt_logprobs_of(response.json(), tokens, len(prompt))

    async def check_turn(self, index: int, turn: TurnRecord) -> list[TurnMismatch]:
        """One result per choice of the turn that holds generated tokens."""
        results = []
        for number in sorted(turn.choices):
            choice = turn.choices[number]
            result = TurnMismatch(index, number, turn.request_id, len(choice.token_ids))
            results.append(result)
            model = self.model or turn.body.get("model")
            if not choice.token_ids:
                result.note = "no generated tokens"
            elif len(choice.logprobs) != len(choice.token_ids):
                result.note = "no recorded logprobs for these tokens"
            elif not turn.prompt_token_ids:
                result.note = "no recorded prompt token ids"
            elif not isinstance(model, str):
                result.note = "the turn names no model; pass one (--model)"
            else:
                answer = await self.engine_logprobs(model, turn.prompt_token_ids, choice.token_ids)
                if isinstance(answer, str):
                    result.note = answer
                    continue
                engine = np.asarray(answer, dtype=np.float64)
                recorded = np.asarray(choice.logprobs, dtype=np.float64)
                if not np.isfinite(recorded).all():
                    result.note = "a recorded logprob is not finite"
                    continue
                mean, worst, kl, at = differences(recorded, engine)
                result.mean_abs_diff, result.max_abs_diff = mean, worst
                result.kl, result.worst_token = kl, at
                result.note = _note(turn)
        return results

    async def check_session(self, session: SessionRecord) -> list[TurnMismatch]:
        """Every turn of the session, in order (failed turns too: their tokens were sampled)."""
        results: list[TurnMismatch] = []
        for index, turn in enumerate(session.turns):
            results.extend(await self.check_turn(index, turn))
        return results


async def check_session(
    session: SessionRecord,
    url: str,
    *,
    model: str | None = None,
    api_key: str | None = None,
) -> list[TurnMismatch]:
    """Compare every recorded completion of `session` with an engine's logprobs of it."""
    checker = MismatchChecker(url, model=model, api_key=api_key)
    try:
        return await checker.check_session(session)
    finally:
        await checker.close()


def overall(results: list[TurnMismatch]) -> dict[str, float | int | None]:
    """Token-weighted mean |diff| and KL, and the max |diff|, over the turns compared."""
    compared = [r for r in results if r.mean_abs_diff is not None]
    tokens = sum(r.tokens for r in compared)
    if not tokens:
        return {"tokens": 0, "mean_abs_diff": None, "max_abs_diff": None, "kl": None}
    return {
        "tokens": tokens,
        "mean_abs_diff": math.fsum((r.mean_abs_diff or 0.0) * r.tokens for r in compared) / tokens,
        "max_abs_diff": max(r.max_abs_diff or 0.0 for r in compared),
        "kl": math.fsum((r.kl or 0.0) * r.tokens for r in compared) / tokens,
    }
