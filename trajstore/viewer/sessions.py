"""One session's pages: its facts, samples and turns; a turn's body and token strip; live.

    GET /sessions/{id}              the page: facts, samples (branches, divergences), turns
    GET /sessions/{id}/summary      the same without the frame (what a live page swaps in)
    GET /sessions/{id}/turns/{n}    one turn's body: messages, tool calls, timing, token strip
                                    (and the images its strip holds, as thumbnails)
    GET /sessions/{id}/requests/{r} the turn of request r: a redirect to its page, opened at it
    GET /sessions/{id}/images/{sha256}  an image the session recorded, as its bytes
    GET /sessions/{id}/live         server-sent events: `changed` when the log grew, `finished`

Turn bodies are fetched when a turn is opened, so a long session's page stays small: a
64-turn, 100,000-token session is a page of 64 rows, and each turn's strip comes on its own
(`benchmarks/viewer.py`). The session is read and rebuilt once per change of its log and kept
(`cache.SessionCache`), so opening turn after turn does not read it again.
"""

from __future__ import annotations

import asyncio
import base64
import math
from typing import Annotated, Any
from urllib.parse import quote

import orjson
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

from trajstore.store import sample_reads
from trajstore.viewer import queries
from trajstore.viewer.cache import SessionView, session_head
from trajstore.viewer.errors import BadFilter, PageNotFound
from trajstore.viewer.state import Viewer, viewer
from trajstore.viewer.strip import Strip, render

router = APIRouter()
ViewerDep = Annotated[Viewer, Depends(viewer)]

#: Turns listed per page of a session.
TURNS_PER_PAGE = 100


def _mean(values: Any) -> float | None:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else None


def turn_rows(view: SessionView, first: int, last: int) -> list[dict[str, Any]]:
    """What the turns' list shows of each turn from `first` to `last` (excluded)."""
    rows = []
    for index in range(first, min(last, len(view.session.turns))):
        turn = view.session.turns[index]
        choice = turn.choices.get(0)
        message = (choice.message if choice else None) or {}
        branch = view.branch_of.get(index)
        started = view.starts.get(index)
        rows.append({
            "index": index,
            "turn": turn,
            "prompt_tokens": turn.n_prompt_tokens or 0,
            "completion_tokens": sum(len(c.token_ids) for c in turn.choices.values()),
            "finish_reason": choice.finish_reason if choice else None,
            "tool_calls": [c.get("function", {}).get("name", "?")
                           for c in message.get("tool_calls") or []],
            "mean_logprob": _mean(choice.logprobs) if choice and choice.logprobs else None,
            "branch": branch.branch if branch else None,
            "divergence": started.divergence if started else None,
        })  # fmt: skip
    return rows


def _page(value: str | None) -> int:
    try:
        page = int(value or 1)
    except ValueError:
        raise BadFilter(f"page must be a whole number, not {value!r}") from None
    if page < 1:
        raise BadFilter(f"page must be 1 or more, not {page}")
    return page


async def _context(request: Request, app: Viewer, session_id: str, page: str | None
                   ) -> dict[str, Any]:  # fmt: skip
    view = await app.sessions.get(app.store, session_id)
    number = _page(page)
    pages = max(1, math.ceil(len(view.session.turns) / TURNS_PER_PAGE))
    if number > pages:
        raise PageNotFound(f"session {session_id!r} has {pages} page(s) of turns, not {number}")
    projected = await sample_reads.session_samples(app.store, session_id)
    first = (number - 1) * TURNS_PER_PAGE
    tree = view.lineages
    assert tree is not None
    return {
        "request": request,
        "view": view,
        "session": view.session,
        "lineages": tree,
        "samples": [s for row in tree.rows for s in row.samples],
        "projected": projected,
        "turns": turn_rows(view, first, first + TURNS_PER_PAGE),
        "page": number,
        "pages": pages,
        "poll_ms": int(app.settings.poll_interval * 1000),
    }


@router.get("/sessions/{session_id}", response_class=HTMLResponse)
async def session_page(request: Request, app: ViewerDep, session_id: str,
                       page: Annotated[str | None, Query()] = None) -> HTMLResponse:  # fmt: skip
    """A session: its facts, samples and turns (bodies load when opened)."""
    context = await _context(request, app, session_id, page)
    return app.templates.TemplateResponse(request, "session.html", context)


@router.get("/sessions/{session_id}/summary", response_class=HTMLResponse)
async def session_summary(request: Request, app: ViewerDep, session_id: str,
                          page: Annotated[str | None, Query()] = None) -> HTMLResponse:  # fmt: skip
    """The session page's changing part, for a live page to swap in."""
    context = await _context(request, app, session_id, page)
    return app.templates.TemplateResponse(request, "_summary.html", context)


def _strips(view: SessionView, index: int) -> list[Strip]:
    """The token strips of one turn: its part of its branch and of alternative samples, or its
    tokens as recorded when it is in no sample."""
    turn = view.turn(index)
    strips = []
    if (span := view.spans.get(index)) is not None:
        started = view.starts.get(index)
        divergence = None
        if started is not None and started.divergence is not None:
            d = started.divergence
            divergence = (d.position, f"diverged at position {d.position}: {d.reason}")
        strips.append(Strip.of_span(span, f"branch {span.sample.branch}", divergence))
    for other in view.alternatives.get(index, []):
        strips.append(Strip.of_span(other, "another choice (a sample of its own)", None))
    if not strips:
        why = {"failed": "failed", "in_progress": "still in progress"}.get(turn.status, turn.status)
        for choice in turn.choices.values():
            strips.append(Strip.of_tokens(f"choice {choice.index}: in no sample ({why})",
                                          choice.token_ids, choice.logprobs))  # fmt: skip
    return strips


@router.get("/sessions/{session_id}/turns/{index}", response_class=HTMLResponse)
async def turn_body(request: Request, app: ViewerDep, session_id: str, index: str
                    ) -> HTMLResponse:  # fmt: skip
    """One turn: the messages it added, its choices and tool calls, timing, token strips."""
    if not index.isdigit():
        raise BadFilter(f"a turn is a number, not {index!r}")
    view = await app.sessions.get(app.store, session_id)
    number = int(index)
    turn = view.turn(number)
    entries = [e for e in view.entries if e.turn == number]
    drawn = []
    source = ""
    for strip in _strips(view, number):
        texts = await app.texts.texts(strip.ids, turn.engine)
        source = texts.source
        drawn.append((strip, render(strip, texts.texts)))
    context = {
        "request": request,
        "session": view.session,
        "turn": turn,
        "index": number,
        "request_entry": next((e for e in entries if e.kind == "request"), None),
        "outcome": next((e for e in entries if e.kind in ("completion", "failure")), None),
        "strips": drawn,
        "text_source": source,
        "divergence": view.starts[number].divergence if number in view.starts else None,
    }
    return app.templates.TemplateResponse(request, "_turn.html", context)


@router.get("/sessions/{session_id}/requests/{request_id}")
async def request_turn(request: Request, app: ViewerDep, session_id: str, request_id: str
                       ) -> RedirectResponse:  # fmt: skip
    """The page of the turn a request id names (what a trace's span links to): the session's
    page of turns that lists it, opened at it."""
    view = await app.sessions.get(app.store, session_id)
    for index, turn in enumerate(view.session.turns):
        if turn.request_id == request_id:
            page = index // TURNS_PER_PAGE + 1
            root = str(request.scope.get("root_path", "")).rstrip("/")
            url = f"{root}/sessions/{quote(session_id, safe='')}?page={page}#turn-{index}"
            return RedirectResponse(url, status_code=307)
    raise PageNotFound(f"session {session_id!r} has no request {request_id!r}")


@router.get("/sessions/{session_id}/images/{sha256}")
async def session_image(app: ViewerDep, session_id: str, sha256: str) -> Response:
    """The bytes of an image the session recorded (a data image; a URL image is the URL's),
    for the strip's thumbnails. Its hash names it, so it never changes: cached for good."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise BadFilter(f"an image is named by its sha256 (64 hex digits), not {sha256!r}")
    row = await app.store.fetchrow(queries.SESSION_IMAGE, session_id, sha256)
    if row is None:
        raise PageNotFound(f"session {session_id!r} recorded no data image {sha256}")
    media_type = row["media_type"] or ""
    return Response(
        base64.b64decode(row["data"]),
        # Only an image type is served as such: the bytes are the agent's, not the viewer's.
        media_type=media_type if media_type.startswith("image/") else "application/octet-stream",
        headers={"Cache-Control": "public, max-age=31536000, immutable",
                 "X-Content-Type-Options": "nosniff"},
    )  # fmt: skip


@router.get("/sessions/{session_id}/live")
async def live(request: Request, app: ViewerDep, session_id: str) -> StreamingResponse:
    """Server-sent events: `changed` whenever the session's log grows, `finished` (then the
    stream ends) once it is finished and nothing more arrives."""
    head = await session_head(app.store, session_id)
    if head[0] == 0:
        raise PageNotFound(f"no session {session_id!r} in the store")

    async def events() -> Any:
        seen = head
        yield b"retry: 2000\n\n"
        while not await request.is_disconnected():
            await asyncio.sleep(app.settings.poll_interval)
            now = await session_head(app.store, session_id)
            if now != seen:
                seen = now
                data = orjson.dumps({"events": now[0], "position": now[1]})
                yield b"event: changed\ndata: " + data + b"\n\n"
                continue
            view = await app.sessions.get(app.store, session_id)
            if view.session.status != "active":
                yield b"event: finished\ndata: {}\n\n"
                return
            yield b": still active\n\n"  # a comment keeps proxies from closing the stream

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
