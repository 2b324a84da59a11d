"""The session API and its guards: idempotent creation, keys, finish, bad input."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.long_session import record_long_session
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory, RunningProxy, made_whole
from trajstore.proxy.replicas import new_replica_id
from trajstore.proxy.sessions import CreateSession, Finish, SessionRegistry
from trajstore.store import EventStore, EventType

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def post(proxy: RunningProxy, path: str, body: Any, key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return await proxy.http.post(f"{proxy.url}{path}", json=body, headers=headers)


async def test_a_client_chosen_session_id_is_idempotent(proxy: RunningProxy) -> None:
    body = {"run_id": "r", "session_id": "trial-7", "task_id": "t", "metadata": {"seed": 1}}
    first = await post(proxy, "/sessions", body)
    again = await post(proxy, "/sessions", body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json() == again.json()
    assert first.json()["base_url"] == f"{proxy.url}/sessions/trial-7/v1"
    different = await post(proxy, "/sessions", {**body, "task_id": "other"})
    assert different.status_code == 409
    assert "different definition" in different.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "run_id"),
        ({"run_id": "r", "deadline_s": -1}, "deadline_s"),
        ({"run_id": "r", "session_id": "has space"}, "session_id"),
        ({"run_id": "r", "colour": "red"}, "colour"),
    ],
)
async def test_bad_session_bodies_say_which_field(
    proxy: RunningProxy, body: dict[str, Any], field: str
) -> None:
    response = await post(proxy, "/sessions", body)
    assert response.status_code == 422
    assert field in response.text


async def test_keys_open_only_their_own_session(proxy: RunningProxy) -> None:
    a, b = await proxy.new_session(), await proxy.new_session()
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=b["base_url"], api_key=a["api_key"],
                                 max_retries=0).chat.completions.create(**CHAT)  # fmt: skip
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=a["base_url"], api_key="guess",
                                 max_retries=0).chat.completions.create(**CHAT)  # fmt: skip
    await proxy.agent(a).chat.completions.create(**CHAT)


async def test_with_an_api_key_creating_and_admin_calls_need_it(
    start_proxy: ProxyFactory, engine: FakeEngine, events_of: Any
) -> None:
    proxy = await start_proxy([engine.url], api_key="sekret")
    assert (await post(proxy, "/sessions", {"run_id": "r"})).status_code == 401
    assert (await proxy.http.get(f"{proxy.url}/admin/engines")).status_code == 401
    session = await proxy.new_session()  # sends the key
    await proxy.agent(session).chat.completions.create(**CHAT)
    finished = await post(proxy, f"/sessions/{session['session_id']}/finish",
                          {"status": "completed"})  # fmt: skip
    assert finished.status_code == 401
    finished = await post(proxy, f"/sessions/{session['session_id']}/finish",
                          {"status": "completed"}, key=session["api_key"])  # fmt: skip
    assert finished.status_code == 401  # the agent's key only calls models
    finished = await post(proxy, f"/sessions/{session['session_id']}/finish",
                          {"status": "completed"}, key=session["orchestrator_key"])  # fmt: skip
    assert finished.status_code == 200
    # Keys are never written into the log.
    for event in await events_of(session["session_id"]):
        text = str(event.payload)
        assert "sekret" not in text and session["api_key"] not in text


@pytest.mark.parametrize("admin_key", [None, "sekret"], ids=["open", "admin-key"])
async def test_the_agent_cannot_reward_finish_or_discard_any_session(
    start_proxy: ProxyFactory, engine: FakeEngine, admin_key: str | None
) -> None:
    proxy = await start_proxy([engine.url], api_key=admin_key)
    a, b = await proxy.new_session(), await proxy.new_session()
    await proxy.agent(a).chat.completions.create(**CHAT)
    control = [("reward", {"value": 1.0}), ("discard", {"reason": "x"}),
               ("finish", {"status": "completed"})]  # fmt: skip
    for call, body in control:
        for session in (a, b):  # its own session and another's: reward hacking through the API
            refused = await post(proxy, f"/sessions/{session['session_id']}/{call}", body,
                                 key=a["api_key"])  # fmt: skip
            assert refused.status_code == 401, (call, refused.text)
            assert "orchestrator_key" in refused.json()["error"]["message"]
        wrong = await post(proxy, f"/sessions/{a['session_id']}/{call}", body,
                           key=b["orchestrator_key"])  # fmt: skip
        assert wrong.status_code == 401  # another session's orchestrator key
    record = (
        await proxy.http.get(
            f"{proxy.url}/sessions/{a['session_id']}",
            headers={"Authorization": f"Bearer {a['api_key']}"},
        )
    ).json()
    assert record["rewards"] == [] and record["status"] == "active"  # fmt: skip
    assert record["discarded"] is None
    # Reading takes the session's own keys, never another session's.
    other = await proxy.http.get(f"{proxy.url}/sessions/{a['session_id']}",
                                 headers={"Authorization": f"Bearer {b['api_key']}"})  # fmt: skip
    assert other.status_code == 401
    # The orchestrator that created the session holds the key that grades it.
    for call, body in control:
        done = await post(proxy, f"/sessions/{a['session_id']}/{call}", body,
                          key=a["orchestrator_key"])  # fmt: skip
        assert done.status_code == 200, (call, done.text)
    # Its key cannot call models in the agent's place.
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=b["base_url"], api_key=b["orchestrator_key"],
                                 max_retries=0).chat.completions.create(**CHAT)  # fmt: skip
    # The admin key does everything; on an open proxy, so does a call with no key at all.
    key = admin_key or None
    assert (await post(proxy, f"/sessions/{b['session_id']}/reward", {"value": 0.5},
                       key=key)).status_code == 200  # fmt: skip


async def test_finish_reward_discard_and_what_follows(proxy: RunningProxy, events_of: Any) -> None:
    session = await proxy.new_session()
    sid = session["session_id"]
    agent = proxy.agent(session)
    await agent.chat.completions.create(**CHAT)
    assert (await post(proxy, f"/sessions/{sid}/reward", {"value": 0.5})).status_code == 200
    finished = await post(proxy, f"/sessions/{sid}/finish", {"status": "completed"})
    assert finished.json() == {"session_id": sid, "status": "completed"}
    # Every event of the session was durable when finish answered.
    types = [e.type for e in await events_of(sid)]
    assert types[-1] == EventType.SESSION_FINISHED
    assert EventType.COMPLETION_FINISHED in types
    # A retried finish is harmless; a contradicting one is refused.
    assert (
        await post(proxy, f"/sessions/{sid}/finish", {"status": "completed"})
    ).status_code == 200
    assert (await post(proxy, f"/sessions/{sid}/finish", {"status": "error"})).status_code == 409
    with pytest.raises(openai.ConflictError, match="finished"):
        await agent.chat.completions.create(**CHAT)
    # Rewards may arrive after the episode; a later one corrects an earlier one.
    await post(proxy, f"/sessions/{sid}/reward", {"value": 1.0, "components": {"ok": 1.0},
                                                   "source": "judge"})  # fmt: skip
    discarded = await post(proxy, f"/sessions/{sid}/discard", {"reason": "leaked answer"})
    assert discarded.status_code == 200
    record = (await proxy.http.get(f"{proxy.url}/sessions/{sid}")).json()
    assert record["reward"] == 1.0 and len(record["rewards"]) == 2
    assert record["discarded"] == "leaked answer"
    assert record["status"] == "completed"


async def test_unknown_session_is_404_and_bad_bodies_are_400_or_413(
    start_proxy: ProxyFactory, engine: FakeEngine
) -> None:
    proxy = await start_proxy([engine.url], max_body_bytes=10_000)
    missing = await proxy.http.post(f"{proxy.url}/sessions/nope/finish", json={"status": "error"})
    assert missing.status_code == 404
    session = await proxy.new_session()
    url = f"{session['base_url']}/chat/completions"
    auth = {"Authorization": f"Bearer {session['api_key']}"}
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"model": "tiny", "messages": []}', 400, "'messages' must be a non-empty list"),
        (b'{"model": "tiny", "messages": [{"content": "x"}], "n": 1}', 400, "'role'"),
        (b'{"model": "t", "messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "'n'"),
        (b'{"pad": "' + b"x" * 20_000 + b'"}', 413, "limit is 10000 bytes"),
    ]
    for body, status, message in cases:
        response = await proxy.http.post(url, content=body, headers=auth)
        assert response.status_code == status, (body[:40], response.text)
        assert message in response.json()["error"]["message"]
    # The session API has the same limit.
    huge = await proxy.http.post(
        f"{proxy.url}/sessions", content=b'{"run_id": "' + b"r" * 20_000 + b'"}'
    )
    assert huge.status_code == 413
    assert "limit is 10000 bytes" in huge.json()["error"]["message"]


async def test_health_metrics_and_policy_versions(proxy: RunningProxy, engine: FakeEngine) -> None:
    assert (await proxy.http.get(f"{proxy.url}/health")).json()["status"] == "ok"
    engines = (await proxy.http.get(f"{proxy.url}/admin/engines")).json()
    assert engines[0]["url"] == engine.url and engines[0]["healthy"] is True
    changed = await post(proxy, "/admin/engines/policy-version", {"version": "step-42"})
    assert changed.json()[0]["policy_version"] == "step-42"
    session = await proxy.new_session()
    await proxy.agent(session).chat.completions.create(**CHAT)
    record = (await proxy.http.get(f"{proxy.url}/sessions/{session['session_id']}")).json()
    assert record["turns"][0]["policy_version"] == "step-42"
    metrics = (await proxy.http.get(f"{proxy.url}/metrics")).text
    assert 'trajstore_requests_total{api="chat",status="200"} 1.0' in metrics
    assert "trajstore_writer_pending_events" in metrics
    assert "trajstore_sessions_cached 1.0" in metrics
    assert "trajstore_time_to_first_token_seconds_bucket" in metrics
    models = await proxy.agent(session).models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_nul_characters_are_served_and_recorded_as_replacement_characters(
    proxy: RunningProxy, engine: FakeEngine
) -> None:
    # Tool output may carry NUL; PostgreSQL's jsonb cannot. The agent is served all the same.
    session = await proxy.new_session()
    content = "binary\x00output"
    await proxy.agent(session).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=4
    )
    assert engine.requests[0]["messages"][0]["content"] == content  # the engine got it as sent
    record = (await proxy.http.get(f"{proxy.url}/sessions/{session['session_id']}")).json()
    assert record["turns"][0]["messages"][0]["content"] == "binary\ufffdoutput"
    assert len(record["turns"][0]["prompt_added"]) > 0


async def test_a_sessions_answer_gives_what_each_turn_added_and_one_turn_whole_when_asked(
    proxy: RunningProxy,
) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    messages: list[Any] = [{"role": "user", "content": "t1 " * 40}]
    for n in range(3):
        answer = await agent.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        messages += [answer.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"t{n} more"}]  # fmt: skip
    url = f"{proxy.url}/sessions/{session['session_id']}"
    turns = (await proxy.http.get(url)).json()["turns"]
    # Each turn holds what it added to the turn before: the answer grows with the turns.
    assert [t["prompt_prefix"] is None for t in turns] == [True, False, False]
    assert all("prompt_token_ids" not in t for t in turns)
    assert [len(t["messages"]) for t in turns] == [1, 2, 2]
    assert turns[2]["messages_prefix"] == {"request_id": turns[1]["request_id"], "n_messages": 3}
    whole = (await proxy.http.get(url, params={"turn": 2})).json()["turns"]
    assert len(whole[2]["prompt_token_ids"]) == whole[2]["n_prompt_tokens"]
    assert whole[2]["messages"] == messages[:5] and "prompt_token_ids" not in whole[1]
    made = await proxy.session_record(session["session_id"])  # made whole client-side
    assert made["turns"][2]["prompt_token_ids"] == whole[2]["prompt_token_ids"]
    missing = await proxy.http.get(url, params={"turn": 3})
    assert missing.status_code == 404 and "has 3 turns" in missing.text


async def test_a_long_session_s_answer_streams_in_pages_and_grows_with_its_turns(
    proxy: RunningProxy, database_url: str
) -> None:
    async with await EventStore.open(database_url) as store:
        long = await record_long_session(store, 3_000)  # opencode-shaped, 3,000 model calls
    url = f"{proxy.url}/sessions/long"
    answer = await proxy.http.get(url)
    assert answer.status_code == 200, answer.text
    assert "content-length" not in answer.headers  # streamed as it is written, not built whole
    # What each turn added: a few KB a turn (every whole prompt would be 800 MB of JSON).
    assert len(answer.content) < 3_000 * 2_000
    record = answer.json()
    assert len(record["turns"]) == record["n_turns"] == 3_000 and record["next"] is None
    assert [t["lineage"] for t in record["turns"][48:51]] == [0, 1, 0]  # a title call between
    assert record["lineages"][0]["role"] == "main"
    # Pages of 1,000, each naming the next: together, the same turns.
    pages, next_url = [], f"{url}?limit=1000"
    while next_url:
        page = (await proxy.http.get(next_url)).json()
        pages.append(page["turns"])
        next_url = page["next"]
    assert [len(p) for p in pages] == [1000, 1000, 1000]

    def without_tools(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in t.items() if k not in ("tools", "tools_from")} for t in turns]

    assert without_tools([t for p in pages for t in p]) == without_tools(record["turns"])
    assert all(p[0]["tools"] == record["turns"][0]["tools"] for p in pages)  # once a page
    # A client makes every prompt whole from the references, as the log stores them.
    made = made_whole(record)
    assert [len(t["prompt_token_ids"]) for t in made["turns"]] == long.prompt_tokens


async def test_a_session_finished_on_one_replica_is_closed_on_the_others(
    start_proxy: ProxyFactory, engine: FakeEngine
) -> None:
    a = await start_proxy([engine.url], session_secret="shared")
    b = await start_proxy([engine.url], session_secret="shared")
    session = await a.new_session()
    sid = session["session_id"]
    on_b = b.agent({**session, "base_url": session["base_url"].replace(a.url, b.url)})
    await on_b.chat.completions.create(**CHAT)  # replica b now has the session in its cache

    assert (await post(a, f"/sessions/{sid}/finish", {"status": "completed"})).status_code == 200
    # b hears of it from the log within moments, and refuses further model calls.
    refusal = ""
    for _ in range(100):
        try:
            await on_b.chat.completions.create(**CHAT)
        except openai.ConflictError as exc:
            refusal = str(exc)
            break
        await asyncio.sleep(0.02)
    assert "is finished (completed)" in refusal
    # Facts always read the session fresh: b refuses a contradicting finish at once.
    assert (await post(b, f"/sessions/{sid}/finish", {"status": "error"})).status_code == 409
    discarded = await post(a, f"/sessions/{sid}/discard", {"reason": "leak"})
    assert discarded.status_code == 200
    record = (await b.http.get(f"{b.url}/sessions/{sid}")).json()
    assert (record["status"], record["discarded"]) == ("completed", "leak")


async def test_a_replica_keeps_a_bounded_number_of_sessions_and_reads_forgotten_ones_again(
    store: EventStore,
) -> None:
    writer = store.writer()
    await writer.start()
    try:
        registry = SessionRegistry(
            store, writer, b"secret", replica_id=new_replica_id(), max_cached=2
        )
        for name in ("a", "b", "c"):
            await registry.create(CreateSession(run_id="r", task_id=f"task-{name}"), name)
        assert registry.cached == 2  # "a", the least recently used, was forgotten
        await registry.get("b")  # now "c" is the least recently used
        forgotten = await registry.get("a")  # read from the log again, whole
        assert (forgotten.run_id, forgotten.task_id, forgotten.status) == ("r", "task-a", "active")
        assert registry.cached == 2
        await registry.finish("c", Finish(status="completed"))  # "c" was forgotten too
        assert (await registry.get("c")).status == "completed"
    finally:
        await writer.close()
