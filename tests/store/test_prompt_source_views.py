"""How each chat prompt reached the engine (the prompt_tokens contract in `store.sessions`), as
the `turns` and `trajectories` views show it, and migration 0010 that added it."""

from __future__ import annotations

import asyncio
from typing import Any

from trajstore.store import (
    EventStore,
    EventType,
    NewEvent,
    migrations,
    request_stream,
    session_stream,
)

PROMPTS: list[dict[str, Any]] = [
    {"prompt_source": "rendered"},
    {"prompt_source": "continued", "continuation": {"choice": 0, "drift_at": 7}},
    {"prompt_source": "continued", "continuation": {"choice": 0, "drift_at": None}},
    {"prompt_source": "rendered", "continuation": {"fallback": "reply_changed"}},
]


async def record(store: EventStore) -> None:
    def event(kind: EventType, payload: dict[str, Any], **arrays: Any) -> NewEvent:
        return NewEvent(kind, session_id="s1", run_id="run-1", payload=payload, **arrays)

    await store.append(session_stream("s1"), [event(EventType.SESSION_CREATED, {})])
    for n, prompt in enumerate(PROMPTS):
        received = {"request_id": f"r{n}", "api": "chat", "body": {"messages": []}}
        await store.append(
            request_stream(f"r{n}"),
            [
                event(EventType.REQUEST_RECEIVED, received),
                event(EventType.PROMPT_TOKENS, {"choice": None, **prompt}, token_ids=[1, 2]),
                event(EventType.COMPLETION_FINISHED, {"choices": []}),
            ],
        )


async def test_turns_and_trajectories_show_how_prompts_reached_the_engine(
    store: EventStore,
) -> None:
    await record(store)
    rows = await store.pool.fetch(
        "SELECT prompt_source, prompt_fallback, drift_at FROM turns ORDER BY position"
    )
    assert [tuple(r) for r in rows] == [
        ("rendered", None, None),
        ("continued", None, 7),
        ("continued", None, None),
        ("rendered", "reply_changed", None),
    ]
    row = await store.pool.fetchrow("SELECT continued_turns, drift_avoided FROM trajectories")
    assert tuple(row) == (2, 1)


async def test_migration_0010_adds_the_columns_to_existing_views_and_keeps_their_grants(
    store: EventStore, database_url: str
) -> None:
    await record(store)
    await asyncio.to_thread(migrations.downgrade, database_url, "0009_messages_references")
    columns = "SELECT column_name FROM information_schema.columns WHERE table_name = $1"
    assert "prompt_source" not in {r[0] for r in await store.pool.fetch(columns, "turns")}
    assert "drift_avoided" not in {r[0] for r in await store.pool.fetch(columns, "trajectories")}
    await asyncio.to_thread(migrations.upgrade, database_url)
    assert "drift_at" in {r[0] for r in await store.pool.fetch(columns, "turns")}
    assert await store.pool.fetchval("SELECT drift_avoided FROM trajectories") == 1
    granted = await store.pool.fetch(
        "SELECT table_name FROM information_schema.role_table_grants "
        "WHERE grantee = 'trajstore_reader' ORDER BY table_name"
    )
    assert [r[0] for r in granted] == ["samples", "trajectories", "turns"]
