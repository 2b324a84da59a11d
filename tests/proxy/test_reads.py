"""The proxy's reader process (`proxy.reads`): replaced past its memory bound, gone when idle, and
the reads it answers the same throughout."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory, RunningProxy
from trajstore.proxy.reads import Reader

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def a_session_with_turns(proxy: RunningProxy, turns: int = 3) -> str:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    for _ in range(turns):
        await agent.chat.completions.create(**CHAT)
    return str(session["session_id"])


def reader_of(proxy: RunningProxy) -> Reader:
    reader: Reader = proxy.app.state.proxy.reader
    return reader


def alive(pid: int) -> bool:
    """Whether the process runs (an exited one not yet waited for is a zombie: gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


async def test_a_reader_past_its_memory_bound_is_replaced_and_reads_go_on(
    start_proxy: ProxyFactory, engine: FakeEngine
) -> None:
    # 64 MiB: less than any Python process holding asyncpg and a session, so every read
    # finds the reader past its bound and starts another.
    proxy = await start_proxy([engine.url], reader_max_bytes=64 << 20)
    sid = await a_session_with_turns(proxy)
    first = (await proxy.http.get(f"{proxy.url}/sessions/{sid}")).json()
    old = reader_of(proxy).pid
    assert old is not None
    again = (await proxy.http.get(f"{proxy.url}/sessions/{sid}")).json()
    new = reader_of(proxy).pid
    assert new is not None and new != old
    assert again == first  # the same answer from the fresh reader
    for _ in range(100):  # the old one finished its reads and went
        if not alive(old):
            break
        await asyncio.sleep(0.1)
    assert not alive(old)


async def test_an_idle_reader_exits_and_the_next_read_starts_another(
    start_proxy: ProxyFactory, engine: FakeEngine
) -> None:
    proxy = await start_proxy([engine.url], reader_idle_timeout=0.5)
    sid = await a_session_with_turns(proxy, 2)
    turn = (await proxy.http.get(f"{proxy.url}/sessions/{sid}/turns/1")).json()
    pid = reader_of(proxy).pid
    assert pid is not None and turn["index"] == 1 and turn["prompt_token_ids"]
    for _ in range(100):
        if reader_of(proxy).pid is None:
            break
        await asyncio.sleep(0.1)
    assert reader_of(proxy).pid is None  # gone, its memory with it
    again = (await proxy.http.get(f"{proxy.url}/sessions/{sid}/turns/1")).json()
    assert again == turn and reader_of(proxy).pid not in (None, pid)


async def test_one_turn_needs_the_session_s_key_as_the_session_read_does(
    start_proxy: ProxyFactory, engine: FakeEngine
) -> None:
    proxy = await start_proxy([engine.url], api_key="admin-key")
    session = await proxy.new_session()
    await proxy.agent(session).chat.completions.create(**CHAT)
    url = f"{proxy.url}/sessions/{session['session_id']}/turns/0"
    assert (await proxy.http.get(url)).status_code == 401
    wrong = await proxy.http.get(url, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    mine = await proxy.http.get(url, headers={"Authorization": f"Bearer {session['api_key']}"})
    assert mine.status_code == 200 and mine.json()["index"] == 0
    other = await proxy.new_session()
    theirs = await proxy.http.get(url, headers={"Authorization": f"Bearer {other['api_key']}"})
    assert theirs.status_code in (401, 403)
    unknown = await proxy.http.get(
        f"{proxy.url}/sessions/nobody/turns/0", headers={"Authorization": "Bearer admin-key"}
    )
    assert unknown.status_code == 404
