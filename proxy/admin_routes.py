"""The admin routes of the proxy's HTTP API, all behind the proxy's API key: the engines and
their policy versions, weight switches without a drain (`proxy.switching`), and each run's
limits on this replica (`proxy.admission`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field

from trajstore.proxy import versions
from trajstore.proxy.admission import RateLimit
from trajstore.proxy.errors import Conflict, NotFound
from trajstore.proxy.state import Authorization, State, require_admin
from trajstore.proxy.switching import SwitchConflict, UnknownSwitch


class PolicyVersion(BaseModel):
    """`POST /admin/engines/policy-version`: after a weight sync."""

    version: str = Field(min_length=1)
    engine: str | None = None  # all engines when omitted


class SwitchBegin(BaseModel):
    """`POST /admin/switches`: engines are about to load the weights of policy `version`."""

    version: str = Field(min_length=1)
    engines: list[str] | None = None  #: their URLs; all engines when omitted
    checkpoint: str | None = None  #: where the weights are, for the record


class SwitchFailed(BaseModel):
    """`POST /admin/switches/{id}/failed`: the weights did not load."""

    reason: str = Field(min_length=1)


def add_admin_routes(app: FastAPI) -> None:
    """The routes under /admin."""
    _add_switch_routes(app)

    @app.get("/admin/engines")
    async def list_engines(state: State, authorization: Authorization = None) -> list[Any]:
        require_admin(state, authorization)
        return state.engines.describe()

    @app.post("/admin/engines/policy-version")
    async def set_policy_version(
        body: PolicyVersion, state: State, authorization: Authorization = None
    ) -> list[Any]:
        require_admin(state, authorization)
        urls = [body.engine] if body.engine else None
        switches = state.forwarder.switches
        try:
            engines = await versions.set_policy_version(switches, body.version, urls)
        except KeyError:
            raise NotFound(f"no engine {body.engine!r}; see GET /admin/engines") from None
        except SwitchConflict as exc:
            raise Conflict(str(exc)) from None
        return [engine.describe() for engine in engines]

    # A run's limits live in this replica's memory (`proxy.admission`): with N replicas, call
    # each with its share. The admin's limits hold over those sessions ask for, until DELETE.
    @app.get("/admin/runs/{run_id}/limits")
    async def run_limits(
        run_id: str, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        require_admin(state, authorization)
        return state.admission.describe(run_id)

    @app.put("/admin/runs/{run_id}/limits")
    async def set_run_limits(
        run_id: str, body: RateLimit, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        require_admin(state, authorization)
        state.admission.set_limits(run_id, body)
        return state.admission.describe(run_id)

    @app.delete("/admin/runs/{run_id}/limits")
    async def clear_run_limits(
        run_id: str, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        require_admin(state, authorization)
        state.admission.set_limits(run_id, None)
        return state.admission.describe(run_id)


def _add_switch_routes(app: FastAPI) -> None:
    """Weight switches without a drain (`proxy.switching`): began, live, failed."""

    @app.get("/admin/switches")
    async def list_switches(state: State, authorization: Authorization = None) -> list[Any]:
        require_admin(state, authorization)
        return state.forwarder.switches.describe()

    @app.post("/admin/switches", status_code=201)
    async def begin_switch(
        body: SwitchBegin, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        require_admin(state, authorization)
        try:
            switch = await state.forwarder.switches.begin(
                body.version, body.engines, body.checkpoint, state.settings.switch_cut_timeout
            )
        except KeyError as exc:
            raise NotFound(f"no engine {exc}; see GET /admin/engines") from None
        except SwitchConflict as exc:
            raise Conflict(str(exc)) from None
        return switch.describe()

    @app.post("/admin/switches/{switch_id}/live")
    async def switch_live(
        switch_id: str, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        require_admin(state, authorization)
        try:
            return (await state.forwarder.switches.live(switch_id)).describe()
        except UnknownSwitch as exc:
            raise NotFound(str(exc)) from None

    @app.post("/admin/switches/{switch_id}/failed")
    async def switch_failed(
        switch_id: str, body: SwitchFailed, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        require_admin(state, authorization)
        try:
            return (await state.forwarder.switches.failed(switch_id, body.reason)).describe()
        except UnknownSwitch as exc:
            raise NotFound(str(exc)) from None
