"""`trajstore replay session ID`: a session's timeline, as of now or any earlier position.

    trajstore replay session S1                      requests, tool results, completions, rewards
    trajstore replay session S1 --as-of 1234         the session as it stood at log position 1234
    trajstore replay session S1 --json               the same, machine-readable
    trajstore replay session S1 --against URL        + the train–inference mismatch per turn

The data comes from `store.timeline` (time travel, entries) and `trainer.mismatch` (the check);
this module only renders it, with rich for people and JSON for programs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import click
import orjson
from rich.console import Console
from rich.table import Table
from rich.text import Text

from trajstore.store.embedded import database_url
from trajstore.store.eventstore import EventStore
from trajstore.store.lineages import Forest
from trajstore.store.pages import Page, rebuild_with_lineages, session_pieces
from trajstore.store.sessions import SessionRecord
from trajstore.store.settings import StoreSettings
from trajstore.store.timeline import Entry, session_events, timeline
from trajstore.trainer.errors import TrainerError
from trajstore.trainer.mismatch import TurnMismatch, check_session, overall

#: Longest message or completion text shown in the terminal (the JSON keeps it whole).
_TEXT_LIMIT = 240
#: Timeline rows per table printed: a session of thousands of turns prints as it goes.
_ROWS_PER_TABLE = 500


def _short(text: Any, limit: int = _TEXT_LIMIT) -> str:
    value = text if isinstance(text, str) else orjson.dumps(text).decode()
    value = value.replace("\n", "⏎ ")
    return value if len(value) <= limit else value[: limit - 1] + "…"


def _message_line(message: Any) -> str:
    if not isinstance(message, dict):
        return _short(message)
    role = message.get("role", "?")
    content = message.get("content")
    if message.get("tool_calls"):
        content = f"{content or ''} tool_calls={_short(message['tool_calls'], 120)}"
    return f"{role}: {_short(content if content is not None else '')}"


def _request_text(details: dict[str, Any]) -> Text:
    text = Text()
    text.append(f"{details['api']} → {details['engine'] or '?'}", style="bold cyan")
    text.append(
        f"  policy {details['policy_version']}  prompt {details['prompt_tokens']} tokens"
        f"  tools {details['n_tools']}  {details['status']}"
    )
    for message in details.get("new_messages", []):
        style = "yellow" if isinstance(message, dict) and message.get("role") == "tool" else ""
        text.append("\n  " + _message_line(message), style=style)
    if details.get("prompt") is not None:
        text.append("\n  prompt: " + _short(details["prompt"]))
    return text


def _timing(details: dict[str, Any]) -> str:
    parts = [f"{details['prompt_tokens']} → {details['completion_tokens']} tokens"]
    if details.get("latency_s") is not None:
        parts.append(f"{details['latency_s'] * 1000:.0f} ms")
    if details.get("ttft_s") is not None:
        parts.append(f"ttft {details['ttft_s'] * 1000:.0f} ms")
    return "  ".join(parts)


def _outcome_text(details: dict[str, Any], failed: bool) -> Text:
    text = Text()
    if failed:
        text.append(f"FAILED {details.get('reason')} ({details.get('status')})", style="bold red")
        text.append(f": {_short(details.get('message') or '')}\n  ")
    text.append(_timing(details), style="dim")
    for choice in details["choices"]:
        mean = choice["mean_logprob"]
        stats = f"[{choice['index']}] {choice['tokens']} tokens, {choice['finish_reason']}"
        if mean is not None:
            stats += f", mean logprob {mean:.3f}"
        text.append(f"\n  {stats}: ", style="green")
        text.append(_short(choice["text"]))
        for call in choice["tool_calls"]:
            text.append("\n    tool call " + _short(call, 160), style="magenta")
    return text


def _entry_text(entry: Entry) -> Text:
    details = entry.details
    match entry.kind:
        case "request":
            return _request_text(details)
        case "completion" | "failure":
            return _outcome_text(details, failed=entry.kind == "failure")
        case "reward":
            rest = {k: v for k, v in details.items() if k != "value"}
            return Text(f"reward {details.get('value')}  {_short(rest, 160) if rest else ''}")
        case "finished":
            return Text(f"{details.get('status')}  {details.get('reason') or ''}", "bold")
        case _:
            return Text(_short(details))


def _header(session: SessionRecord, as_of: int | None) -> Text:
    when = "now" if as_of is None else f"as of position {as_of}"
    text = Text(f"session {session.session_id}", style="bold")
    text.append(f"  ({when})\n")
    text.append(
        f"run {session.run_id}  task {session.task_id}  group {session.group_id}  "
        f"status {session.status}  reward {session.reward}  turns {len(session.turns)}  "
        f"events {session.n_events}"
    )
    if session.discarded:
        text.append(f"\ndiscarded: {session.discarded}", style="red")
    return text


def _timeline_table(entries: list[Entry]) -> Table:
    table = Table(show_lines=False, expand=True)
    table.add_column("pos", justify="right", style="dim", no_wrap=True)
    table.add_column("+s", justify="right", no_wrap=True)
    table.add_column("turn", justify="right", no_wrap=True)
    table.add_column("lin", justify="right", no_wrap=True)
    table.add_column("what", no_wrap=True)
    table.add_column("details", ratio=1)
    for entry in entries:
        turn = "" if entry.turn is None else str(entry.turn)
        lineage = "" if entry.lineage is None else str(entry.lineage)
        table.add_row(
            str(entry.position), f"{entry.at_s:.3f}", turn, lineage, entry.kind, _entry_text(entry)
        )
    return table


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.2e}"


def _mismatch_table(results: list[TurnMismatch], url: str) -> Table:
    table = Table(title=f"recorded logprobs against {url}", expand=True)
    for name in ("turn", "choice", "tokens", "mean |Δ|", "max |Δ|", "KL", "note"):
        table.add_column(name, justify="left" if name == "note" else "right")
    for r in results:
        table.add_row(
            str(r.turn), str(r.choice), str(r.tokens), _number(r.mean_abs_diff),
            _number(r.max_abs_diff), _number(r.kl), r.note or "",
        )  # fmt: skip
    return table


@dataclass
class Gathered:
    """What `replay session` shows: the session, its lineages, its timeline, the mismatch."""

    session: SessionRecord
    forest: Forest
    entries: list[Entry]
    mismatch: list[TurnMismatch] | None


async def gather(
    url: str, session_id: str, as_of: int | None, against: str | None, **engine: Any
) -> Gathered:
    """Read the session (as of `as_of`) and make what `replay session` shows of it."""
    async with await EventStore.open(url) as store:
        events = await session_events(store, session_id, as_of)
    session, forest = rebuild_with_lineages(session_id, events)
    entries = timeline(session, events, forest.lineage_of)
    del events
    mismatch = None if against is None else await check_session(session, against, **engine)
    return Gathered(session, forest, entries, mismatch)


def json_pieces(gathered: Gathered, as_of: int | None, against: str | None) -> Iterator[bytes]:
    """The JSON document, a piece at a time (a long session's is never held whole)."""
    yield b'{"as_of":' + orjson.dumps(as_of) + b',"session":'
    yield from session_pieces(gathered.session, Page(), forest=gathered.forest)
    yield b',"timeline":['
    for n, entry in enumerate(gathered.entries):
        yield (b"," if n else b"") + orjson.dumps(entry.as_json())
    yield b"]"
    if gathered.mismatch is not None:
        mismatch = {
            "against": against,
            "turns": [m.as_json() for m in gathered.mismatch],
            "overall": overall(gathered.mismatch),
        }
        yield b',"mismatch":' + orjson.dumps(mismatch)
    yield b"}\n"


@click.command("session")
@click.argument("session_id")
@click.option(
    "--as-of",
    type=click.IntRange(min=1),
    metavar="POSITION",
    help="Show the session as it stood when the log reached this event position.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option(
    "--against",
    metavar="URL",
    help="A vLLM server: compare its logprobs of each recorded completion with the recorded ones.",
)
@click.option("--model", help="Model name at that server [default: the one each turn asked for].")
@click.option(
    "--engine-api-key",
    envvar="TRAJSTORE_ENGINE_API_KEY",
    show_envvar=True,
    help="Bearer token the server wants, if any.",
)
@click.pass_context
def session(
    ctx: click.Context,
    session_id: str,
    as_of: int | None,
    as_json: bool,
    against: str | None,
    model: str | None,
    engine_api_key: str | None,
) -> None:
    """A session's timeline: requests, tool results, completions, rewards, failures, timings."""
    settings = ctx.find_root().ensure_object(dict).get("settings") or StoreSettings()
    try:
        gathered = asyncio.run(
            gather(database_url(settings), session_id, as_of, against,
                    model=model, api_key=engine_api_key)
        )  # fmt: skip
    except TrainerError as exc:
        raise click.ClickException(str(exc)) from exc

    if as_json:
        for piece in json_pieces(gathered, as_of, against):
            click.echo(piece, nl=False)
        return

    console = Console(soft_wrap=False)
    console.print(_header(gathered.session, as_of))
    entries = gathered.entries
    for start in range(0, len(entries), _ROWS_PER_TABLE):  # printed as it goes, not held whole
        console.print(_timeline_table(entries[start : start + _ROWS_PER_TABLE]))
    mismatch = gathered.mismatch
    if mismatch is not None and against is not None:
        console.print(_mismatch_table(mismatch, against))
        total = overall(mismatch)
        if total["tokens"]:
            console.print(
                f"over {total['tokens']} tokens: mean |Δ| {total['mean_abs_diff']:.2e}, "
                f"max |Δ| {total['max_abs_diff']:.2e}, KL {total['kl']:.2e} nats/token"
            )
        else:
            console.print("no turn could be compared (see the notes)")
