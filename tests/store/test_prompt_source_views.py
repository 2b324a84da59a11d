"""How each chat prompt reached the engine (the prompt_tokens contract in `store.sessions`), as
the `turns` and `trajectories` views show it, and migration 0010 that added it."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.support import RecordedSession
from trajstore.store import EventStore, migrations

PROMPTS: list[dict[str, Any]] = [
    {"prompt_source": "rendered"},
    {"prompt_source": "continued", "continuation": {"choice": 0, "drift_at": 7}},
    {"prompt_source": "continued", "continuation": {"choice": 0, "drift_at": None}},
    {"prompt_source": "rendered", "continuation": {"fallback": "reply_changed"}},
]


async def record(store: EventStore) -> None:
    recorded = RecordedSession(store)
    await recorded.created()
    for n, prompt in enumerate(PROMPTS):
        received = {"request_id": f"r{n}", "api": "chat", "body": {"messages": []}}
        await recorded.turn(received, [1, 2], None, prompt=prompt, finished={"choices": []})


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
    # The views 0010 replaced keep their grants (later migrations add views of their own).
    assert {"samples", "trajectories", "turns"} <= {r[0] for r in granted}
