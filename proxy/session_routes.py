"""The session routes of the proxy's HTTP API: create a session, read it (a page, a turn),
reward, finish or discard it, and the models its agent may call.

A read is checked and flushed here and answered by the reader process (`proxy.reads`).
"""

from __future__ import annotations

import secrets
import urllib.parse
from typing import Annotated, Any

from fastapi import FastAPI, Path, Query
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from trajstore.proxy.errors import Overloaded
from trajstore.proxy.sessions import CreateSession, Discard, Finish, Reward
from trajstore.proxy.state import (
    Authorization,
    ProxyState,
    State,
    require_admin,
    require_orchestrator,
    require_session,
)
from trajstore.proxy.transport import TransportError


class SessionCreated(BaseModel):
    """What `POST /sessions` returns: where the agent points its client.

    OpenAI clients take `base_url` (`OPENAI_BASE_URL`), which ends in /v1; the Anthropic SDK and
    Claude-Code-style CLIs take `anthropic_base_url` (`ANTHROPIC_BASE_URL`), to which they add
    /v1/messages themselves. The same `api_key` serves both, and only calls models: the
    caller keeps `orchestrator_key`, which rewards, finishes and discards (`proxy.auth`).
    """

    session_id: str
    base_url: str
    anthropic_base_url: str
    api_key: str
    orchestrator_key: str
    run_id: str


def add_session_routes(app: FastAPI) -> None:
    """The routes under /sessions, and the models an agent may call."""

    @app.post("/sessions", status_code=201, response_model=SessionCreated)
    async def create_session(
        body: CreateSession, state: State, response: Response, authorization: Authorization = None
    ) -> SessionCreated:
        require_admin(state, authorization)
        session_id = body.session_id or secrets.token_hex(12)
        session, created = await state.registry.create(body, session_id)
        state.admission.offer(session.run_id, session.rate_limit, session.created_at)
        if not created:
            response.status_code = 200
        return SessionCreated(
            session_id=session.session_id,
            base_url=f"{state.public_url}/sessions/{session.session_id}/v1",
            anthropic_base_url=f"{state.public_url}/sessions/{session.session_id}",
            api_key=state.registry.key_for(session.session_id),
            orchestrator_key=state.registry.orchestrator_key_for(session.session_id),
            run_id=session.run_id,
        )

    @app.get("/sessions/{session_id}")
    async def get_session(
        session_id: str,
        state: State,
        authorization: Authorization = None,
        turn: Annotated[int | None, Query(ge=0, description="A turn to give whole")] = None,
        after: Annotated[int, Query(ge=-1, description="Start after this turn")] = -1,
        limit: Annotated[int | None, Query(ge=1, description="Turns in this page")] = None,
    ) -> Response:
        """The session as recorded, streamed: each turn with what it added to the turn it
        continues (`prompt_added` after `prompt_prefix`, `messages` after `messages_prefix`, as
        the log stores them: the answer grows with the session, not its square) and its
        `lineage` and `branch`; with `after` and `limit`, a page of turns and `next`, the URL of
        the page after it; with `turn`, that turn also whole (`prompt_token_ids`, all its
        `messages`) when the page holds it. See `store.pages`."""
        params = {"after": str(after)}
        if turn is not None:
            params["turn"] = str(turn)
        if limit is not None:
            params["limit"] = str(limit)
        return await _read(state, session_id, authorization, "", params)

    @app.get("/sessions/{session_id}/turns/{n}")
    async def get_turn(
        session_id: str,
        n: Annotated[int, Path(ge=0, description="The turn's index in the session")],
        state: State,
        authorization: Authorization = None,
    ) -> Response:
        """One turn whole: the turn as a page shows it (`index`, `lineage`, `branch`, its tools
        in full) with its whole `prompt_token_ids` and all its `messages`, without the rest of
        the page. The same key as the session's read."""
        return await _read(state, session_id, authorization, f"/turns/{n}")

    @app.post("/sessions/{session_id}/reward")
    async def reward(
        session_id: str, body: Reward, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        require_orchestrator(state, session_id, authorization)
        await state.registry.reward(session_id, body)
        return {"session_id": session_id, "reward": body.value}

    @app.post("/sessions/{session_id}/finish")
    async def finish(
        session_id: str, body: Finish, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        require_orchestrator(state, session_id, authorization)
        session = await state.registry.finish(session_id, body)
        return {"session_id": session_id, "status": session.status}

    @app.post("/sessions/{session_id}/discard")
    async def discard(
        session_id: str, body: Discard, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        require_orchestrator(state, session_id, authorization)
        await state.registry.discard(session_id, body)
        return {"session_id": session_id, "discarded": body.reason}

    async def models(state: ProxyState) -> Response:
        engines = state.engines.engines
        engine = next((e for e in engines if e.healthy), engines[0] if engines else None)
        if engine is None:
            raise Overloaded("no engine yet: name one, or connect a relay")
        try:
            answer = await engine.connection().send(
                "GET", "/v1/models", None, {}, timeout=state.settings.request_timeout
            )
            return Response(await answer.read(), status_code=answer.status,
                            media_type="application/json")  # fmt: skip
        except (TransportError, TimeoutError) as exc:
            raise Overloaded(f"the engine at {engine.url} cannot be reached: {exc}") from None

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(
        session_id: str, state: State, authorization: Authorization = None
    ) -> Response:
        require_session(state, session_id, authorization, model_call=True)
        return await models(state)

    @app.get("/v1/models")
    async def header_models(state: State) -> Response:
        return await models(state)


async def _read(
    state: ProxyState,
    session_id: str,
    authorization: str | None,
    under: str,
    params: dict[str, str] | None = None,
) -> Response:
    """A session read: checked and flushed here, answered by the reader process (`proxy.reads`),
    passed on a chunk at a time; its status and errors as the reader gives them."""
    require_session(state, session_id, authorization)
    await state.registry.get(session_id)
    await state.registry.writer.flush()  # show what this replica recorded so far
    path = f"/sessions/{urllib.parse.quote(session_id, safe='')}{under}"
    answer = await state.reader.get(path, params or {})
    if answer.status != 200:
        try:
            body = await answer.read()
        finally:
            answer.release()
        return Response(body, status_code=answer.status, media_type="application/json")
    return StreamingResponse(state.reader.relay(answer), media_type="application/json")
