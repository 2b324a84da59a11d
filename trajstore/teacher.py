"""Teacher scoring: a teacher engine's logprob of every generated token of every sample of a run
(and its top-k alternatives when asked), recorded as `sample_scored` facts (`store.side_data`).

    trajstore score --run R --teacher big --engine http://host:8000 --model big [--top-k 8]
                    [--batch-size 8] [--concurrency 2] [--follow]

The teacher is any vLLM engine serving a model that shares the student's tokenizer. It gets
each sample's token ids as a prompt on the completions API with `prompt_logprobs` (vLLM's
answer: a list as long as the prompt, entry t holding the logprob of token t given the ones
before, and the top-k when k > 0). Samples go `batch_size` to a request, `concurrency` requests
at once. It lives in the room, not in trainer/: the trainer never talks to an engine.

- Resumable and idempotent: the work list is the samples with no score of this teacher yet
  (`store.side_data.unscored_samples`), and a score's event id is derived from (sample, kind,
  teacher), so a scorer killed anywhere and run again scores nothing twice.
- Several teachers side by side: each is named (`--teacher`), and readers pick by name.
- Never a silent gap: a sample the teacher refuses (another vocabulary, a context too long)
  gets a `scoring_failed` fact with the reason and the engine's words, and the run goes on; an
  engine that keeps failing gets the same for its batch, then stops the run with
  `TeacherUnavailable`.
- `--follow` scores what is there, then wakes on every finished session (`FACTS_CHANNEL`, with
  a timed poll as the truth, as the projector does) and scores the new samples.

Errors:

    TeacherError
    ├── TeacherUnavailable   the engine cannot be reached or keeps failing
    └── TeacherRefused       the engine refused these prompts (a 4xx): reason and message
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import click
import httpx
import numpy as np

from trajstore.store import EventStore
from trajstore.store.schema import FACTS_CHANNEL
from trajstore.store.side_data import (
    FIRST,
    LOGPROBS,
    TEACHER_LOGPROBS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    failed_event,
    narrowest_uint,
    sample_stream,
    scored_event,
    unscored_samples,
)
from trajstore.store.subscription import wake_ups

log = logging.getLogger(__name__)

#: How often a batch is sent again after the engine failed it (5xx, connection lost).
ATTEMPTS = 3


class TeacherError(Exception):
    """The teacher could not score."""


class TeacherUnavailable(TeacherError):
    """The teacher engine cannot be reached or keeps failing."""


class TeacherRefused(TeacherError):
    """The teacher engine refused the prompts (a 4xx): `reason` says which kind of input."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Teacher:
    """One teacher engine and how to ask it."""

    name: str  #: recorded as each score's source: several teachers sit side by side
    url: str  #: the engine's base URL (without /v1)
    model: str  #: the served model name
    top_k: int = 0  #: also record the teacher's k best tokens at each generated position
    batch_size: int = 8  #: samples per request
    concurrency: int = 2  #: requests in flight
    timeout_s: float = 300.0
    retry_s: float = 0.5  #: the first wait before asking again after a failure (then doubled)


@dataclass
class ScoringReport:
    """What a scoring pass did."""

    scored: int = 0
    failed: Counter[str] = field(default_factory=Counter)  #: by reason

    def __str__(self) -> str:
        failures = ", ".join(f"{n} {reason}" for reason, n in sorted(self.failed.items()))
        return f"scored {self.scored} samples" + (f"; failed: {failures}" if failures else "")


def refusal_reason(message: str) -> str:
    """The kind of input an engine's 4xx message refuses (vLLM's words)."""
    text = message.lower()
    if "vocab" in text or "out of range" in text or "token id" in text:
        return "vocabulary"
    if "context length" in text or "max_model_len" in text or "too long" in text:
        return "too_long"
    return "engine"


@dataclass
class PromptScores:
    """The teacher's answer for one prompt: entry t scores token t given those before it."""

    logprobs: np.ndarray[Any, np.dtype[np.float32]]  #: NaN at position 0
    topk_ids: np.ndarray[Any, Any] | None = None  #: (n, k), position 0 unused
    topk_logprobs: np.ndarray[Any, np.dtype[np.float32]] | None = None


def read_prompt_logprobs(entries: list[Any], ids: Sequence[int], top_k: int) -> PromptScores:
    """vLLM's `prompt_logprobs` of one prompt as arrays; `TeacherRefused` when it does not
    score exactly these ids."""
    if len(entries) != len(ids):
        raise TeacherRefused(
            "misaligned",
            f"the teacher scored {len(entries)} positions of a {len(ids)}-token prompt",
        )
    n = len(ids)
    logprobs = np.full(n, np.nan, np.float32)
    topk_ids = np.zeros((n, top_k), np.int64) if top_k else None
    topk_logprobs = np.full((n, top_k), np.nan, np.float32) if top_k else None
    for t, entry in enumerate(entries):
        if entry is None:
            continue  # position 0: nothing before it to condition on
        own = entry.get(str(ids[t]))
        if own is None:
            raise TeacherRefused("misaligned", f"the teacher did not score token {ids[t]} at {t}")
        logprobs[t] = own["logprob"]
        if top_k:
            assert topk_ids is not None and topk_logprobs is not None
            ranked = sorted(
                ((v.get("rank") or 0, int(k), v["logprob"]) for k, v in entry.items()),
                key=lambda item: (item[0] < 1, item[0]),
            )
            best = [item for item in ranked if item[0] >= 1][:top_k]
            for j, (_, token, value) in enumerate(best):
                topk_ids[t, j], topk_logprobs[t, j] = token, value
    return PromptScores(logprobs, topk_ids, topk_logprobs)


class TeacherClient:
    """Asks one teacher engine for prompt logprobs, with retries on its failures."""

    def __init__(self, teacher: Teacher, http: httpx.AsyncClient) -> None:
        self.teacher = teacher
        self.http = http

    async def max_model_len(self) -> int | None:
        """The longest context the engine serves (vLLM's `/v1/models`), None when unsaid."""
        try:
            response = await self.http.get(f"{self.teacher.url}/v1/models")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise TeacherUnavailable(f"teacher {self.teacher.url} does not answer: {exc}") from exc
        for model in response.json().get("data") or []:
            if model.get("id") == self.teacher.model:
                value = model.get("max_model_len")
                return int(value) if value else None
        raise TeacherUnavailable(
            f"teacher {self.teacher.url} does not serve a model named {self.teacher.model!r}"
        )

    async def score(self, prompts: list[list[int]]) -> list[PromptScores]:
        """Each prompt's scores, in order (one request for them all)."""
        body = {
            "model": self.teacher.model,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": self.teacher.top_k,
        }
        for attempt in range(ATTEMPTS):
            try:
                response = await self.http.post(f"{self.teacher.url}/v1/completions", json=body)
            except httpx.HTTPError as exc:
                failure = f"teacher {self.teacher.url} failed: {exc!r}"
            else:
                if response.status_code < 400:
                    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
                    return [
                        read_prompt_logprobs(c.get("prompt_logprobs") or [], p, self.teacher.top_k)
                        for c, p in zip(choices, prompts, strict=True)
                    ]
                if response.status_code < 500:
                    raise TeacherRefused(refusal_reason(response.text), response.text[:2000])
                failure = f"teacher answered {response.status_code}: {response.text[:500]}"
            log.warning("%s (attempt %d of %d)", failure, attempt + 1, ATTEMPTS)
            await asyncio.sleep(self.teacher.retry_s * 2**attempt)
        raise TeacherUnavailable(failure)


async def _score_batch(
    store: EventStore, client: TeacherClient, rows: list[Any], report: ScoringReport
) -> None:
    """Score `rows` (one request), recording each sample's score or failure; a refused batch
    is asked again one sample at a time, so that only the bad samples fail."""
    teacher = client.teacher
    prompts = [np.frombuffer(row["token_ids"], "<i4").tolist() for row in rows]
    try:
        answers = await client.score(prompts)
    except TeacherRefused as exc:
        if len(rows) > 1:
            for row in rows:
                await _score_batch(store, client, [row], report)
            return
        await _fail(store, teacher, rows[0], exc.reason, str(exc), report)
        return
    except TeacherUnavailable as exc:
        for row in rows:
            await _fail(store, teacher, row, "engine", str(exc), report)
        raise
    for row, answer in zip(rows, answers, strict=True):
        mask = np.frombuffer(row["loss_mask"], np.uint8)
        generated = mask == 1
        teacher_logprobs = answer.logprobs[generated]
        if np.isnan(teacher_logprobs).any():
            await _fail(
                store, teacher, row, "misaligned", "a generated token starts the sample", report
            )
            continue
        arrays: dict[str, Any] = {LOGPROBS: teacher_logprobs}
        if teacher.top_k and answer.topk_ids is not None and answer.topk_logprobs is not None:
            ids = answer.topk_ids[generated]
            arrays[TOPK_IDS] = ids.astype(narrowest_uint(int(ids.max(initial=0))))
            arrays[TOPK_LOGPROBS] = answer.topk_logprobs[generated]
        event = scored_event(
            sample_id=row["sample_id"], session_id=row["session_id"], run_id=row["run_id"],
            source=teacher.name, token_bytes=row["token_ids"], loss_mask=mask,
            behaviour_logprobs=np.frombuffer(row["logprobs"], "<f4"), arrays=arrays,
            model=teacher.model, top_k=teacher.top_k,
        )  # fmt: skip
        await store.append(sample_stream(row["sample_id"]), [event])
        report.scored += 1


async def _fail(
    store: EventStore, teacher: Teacher, row: Any, reason: str, message: str, report: ScoringReport
) -> None:
    log.warning("teacher %s cannot score sample %s: %s", teacher.name, row["sample_id"], message)
    event = failed_event(
        sample_id=row["sample_id"], session_id=row["session_id"], run_id=row["run_id"],
        source=teacher.name, reason=reason, message=message,
    )  # fmt: skip
    await store.append(sample_stream(row["sample_id"]), [event])
    report.failed[reason] += 1


async def score_run(
    store: EventStore,
    teacher: Teacher,
    runs: Sequence[str] | None = None,
    *,
    http: httpx.AsyncClient | None = None,
    progress: Callable[[ScoringReport], None] | None = None,
) -> ScoringReport:
    """Score every sample of `runs` (None: every run) that `teacher` has not scored yet.

    Samples longer than the engine's context get a `too_long` failure without a request.
    `TeacherUnavailable` when the engine keeps failing (the batches it failed are recorded).
    """
    report = ScoringReport()
    own = http is None
    http = http or httpx.AsyncClient(timeout=teacher.timeout_s)
    client = TeacherClient(teacher, http)
    try:
        max_len = await client.max_model_len()
        after: uuid.UUID = FIRST
        page = teacher.batch_size * teacher.concurrency * 4
        while True:
            rows = await unscored_samples(
                store, runs, kind=TEACHER_LOGPROBS, source=teacher.name, after=after, limit=page
            )
            if not rows:
                return report
            after = rows[-1]["sample_id"]
            fitting = []
            for row in rows:
                n = len(row["token_ids"]) // 4
                if max_len is not None and n + 1 > max_len:
                    await _fail(
                        store, teacher, row, "too_long",
                        f"{n} tokens and one to generate exceed the teacher's {max_len}", report,
                    )  # fmt: skip
                else:
                    fitting.append(row)
            await _score_all(store, client, fitting, report)
            if progress is not None:
                progress(report)
    finally:
        if own:
            await http.aclose()


async def _score_all(
    store: EventStore, client: TeacherClient, rows: list[Any], report: ScoringReport
) -> None:
    """`rows` in batches, at most `concurrency` of them in flight; the first engine failure
    stops the rest (after those in flight have recorded theirs)."""
    size = client.teacher.batch_size
    batches = [rows[i : i + size] for i in range(0, len(rows), size)]
    gate = asyncio.Semaphore(client.teacher.concurrency)
    broken: list[TeacherUnavailable] = []

    async def one(batch: list[Any]) -> None:
        async with gate:
            if broken:
                return
            try:
                await _score_batch(store, client, batch, report)
            except TeacherUnavailable as exc:
                broken.append(exc)

    await asyncio.gather(*(one(batch) for batch in batches))
    if broken:
        raise broken[0]


async def follow(
    store: EventStore,
    teacher: Teacher,
    runs: Sequence[str] | None = None,
    *,
    poll_interval: float = 1.0,
    http: httpx.AsyncClient | None = None,
    on_pass: Callable[[ScoringReport], None] | None = None,
) -> None:
    """Score what is there, then every new sample as sessions finish, until cancelled."""
    steps = wake_ups(
        store.url, FACTS_CHANNEL, poll_interval=poll_interval, application_name="trajstore-teacher"
    )
    async with contextlib.AsyncExitStack() as stack:
        if http is None:
            http = await stack.enter_async_context(httpx.AsyncClient(timeout=teacher.timeout_s))
        await stack.enter_async_context(contextlib.aclosing(steps))
        async for _ in steps:
            report = await score_run(store, teacher, runs, http=http)
            if on_pass is not None and (report.scored or report.failed):
                on_pass(report)


@click.command()
@click.option("--run", "runs", multiple=True, help="Only this run (repeatable). Default: all.")
@click.option("--teacher", "name", required=True, help="The teacher's name, recorded as source.")
@click.option("--engine", "url", required=True, help="The teacher engine's URL (vLLM).")
@click.option("--model", required=True, help="The model name the engine serves.")
@click.option("--top-k", default=0, show_default=True, help="Also record the k best tokens.")
@click.option("--batch-size", default=8, show_default=True, help="Samples per request.")
@click.option("--concurrency", default=2, show_default=True, help="Requests in flight.")
@click.option("--follow", "live", is_flag=True, help="Then score new samples as they come.")
@click.pass_context
def score(
    ctx: click.Context,
    runs: tuple[str, ...],
    name: str,
    url: str,
    model: str,
    top_k: int,
    batch_size: int,
    concurrency: int,
    live: bool,
) -> None:
    """Record a teacher's logprobs for every generated token of every sample of a run."""
    from trajstore.store.embedded import database_url
    from trajstore.store.settings import StoreSettings

    teacher = Teacher(name, url.rstrip("/"), model, top_k, batch_size, concurrency)
    settings = ctx.find_root().ensure_object(dict).get("settings") or StoreSettings()

    async def run() -> None:
        async with await EventStore.open(database_url(settings)) as store:
            if live:
                click.echo(f"scoring with teacher {name!r} as samples come; Ctrl-C stops")
                await follow(store, teacher, runs or None, on_pass=lambda r: click.echo(str(r)))
            else:
                click.echo(str(await score_run(store, teacher, runs or None)))

    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(run())
    except TeacherError as exc:
        raise click.ClickException(str(exc)) from exc
