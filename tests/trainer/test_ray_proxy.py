"""The proxy as a named Ray actor, found and used by a rollout task, on a local 2-CPU Ray.

The engine is the fake vLLM (an aiohttp server in this test's event loop), so the test awaits Ray
rather than blocking on `ray.get`: the loop must stay free to answer the proxy's engine calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from openai import OpenAI

from tests.proxy.fake_engine import FakeEngine
from trajstore.proxy.ray_actor import proxy_url, start_proxy_actor
from trajstore.proxy.settings import ProxySettings
from trajstore.store import EventStore
from trajstore.store.sessions import rebuild_session

pytestmark = pytest.mark.slow

NAME = "trajstore-proxy"


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="trajstore")
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0)
def rollout(actor_name: str) -> dict[str, Any]:
    """A rollout worker: finds the proxy by name, runs a one-turn episode, finishes it."""
    base = proxy_url(actor_name)
    with httpx.Client(timeout=30) as http:
        created = http.post(f"{base}/sessions", json={"run_id": "ray-run", "task_id": "t1"})
        created.raise_for_status()
        session = created.json()
        agent = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        answer = agent.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello from a Ray task"}],
            max_tokens=8,
            extra_body={"return_token_ids": True},
        )
        agent.close()
        finished = http.post(
            f"{base}/sessions/{session['session_id']}/finish", json={"status": "completed"}
        )
        finished.raise_for_status()
    return {
        "base": base,
        "session_id": session["session_id"],
        "token_ids": (answer.choices[0].model_extra or {})["token_ids"],
        "text": answer.choices[0].message.content,
    }


async def test_a_rollout_task_finds_the_proxy_actor_and_its_session_is_recorded(
    local_ray: None, engine: FakeEngine, database_url: str
) -> None:
    settings = ProxySettings(engines=[engine.url])
    # In a thread: start_proxy_actor blocks until the proxy serves, and this loop serves the engine.
    handle = await asyncio.to_thread(start_proxy_actor, NAME, settings, database_url)
    try:
        url = await handle.url.remote()
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":8400")  # a free port
        again = await asyncio.to_thread(start_proxy_actor, NAME, settings, database_url)
        assert await again.url.remote() == url  # the same actor, found by name

        result = await rollout.remote(NAME)
        assert result["base"] == url
        assert result["token_ids"]

        async with await EventStore.open(database_url) as store:
            events = await store.read_session(result["session_id"])
        session = rebuild_session(result["session_id"], events)
        assert (session.run_id, session.task_id, session.status) == ("ray-run", "t1", "completed")
        [turn] = session.turns
        assert turn.choices[0].token_ids == result["token_ids"]  # what the agent got is stored
        assert turn.engine == engine.url
    finally:
        await handle.stop.remote()
        ray.kill(handle)


def test_an_unknown_actor_name_is_an_error(local_ray: None) -> None:
    with pytest.raises(ValueError, match="no-such-proxy"):
        proxy_url("no-such-proxy")
