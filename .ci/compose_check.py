"""What .ci/compose checks on the running stack, from the host, through the published ports only.

    python .ci/compose_check.py record --state FILE --role-urls DIR
    python .ci/compose_check.py verify --state FILE

`record`: an agent session through the proxy (127.0.0.1:8400) with the official `openai` client,
which asks for the token ids; a reward and the finish with the session's orchestrator key. Then
over SQL on the published PostgreSQL port (127.0.0.1:54320): a login of the read-only
`trajstore_reader` role (made by the owner, as docs/stack.md tells a person to) reads the sample
the projector made and finds exactly the ids the agent received, and the session in the
`trajectories` view, but not the events table; the proxy's and the projector's own URLs (DIR,
read out of their volumes; the host `postgres` becomes the published port) are refused UPDATE,
DELETE and TRUNCATE of the log, which still holds every event afterwards. What it found goes to
FILE. `verify`, after `compose down` and `up`: the same login finds the same sample and session,
and the log the same events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import numpy as np
from openai import AsyncOpenAI
from sqlalchemy.engine import make_url

PROXY = "http://127.0.0.1:8400"
SQL_HOST, SQL_PORT = "127.0.0.1", 54320
OWNER = f"postgresql://trajstore:trajstore@{SQL_HOST}:{SQL_PORT}/trajstore"  # compose.yaml's
READER_LOGIN = "bringup_reader"
RUN_ID = "compose-bringup"


class CheckFailed(Exception):
    """The stack did not do what docs/stack.md says."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise CheckFailed(what)
    print(f"  ok: {what}")


def published(url: str) -> str:
    """A URL the stack's containers use (host `postgres`) as the host reaches it."""
    return make_url(url).set(host=SQL_HOST, port=SQL_PORT).render_as_string(hide_password=False)


async def record_session() -> dict[str, Any]:
    """One agent turn through the proxy; what the agent received."""
    async with httpx.AsyncClient(timeout=60) as http:
        created = (await http.post(f"{PROXY}/sessions", json={"run_id": RUN_ID})).json()
        agent = AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"])
        answer = await agent.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "What is 17 plus 25?"}],
            max_tokens=12,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        choice = answer.choices[0]
        prompt_ids = (answer.model_extra or {})["prompt_token_ids"]
        completion_ids = (choice.model_extra or {})["token_ids"]
        print(f"  the agent: {len(prompt_ids)} prompt ids, {len(completion_ids)} completion ids,")
        print(f"    reply {choice.message.content!r}")
        check(len(completion_ids) > 0, "the proxy answered the agent with its token ids")
        orchestrator = {"Authorization": f"Bearer {created['orchestrator_key']}"}
        session_url = f"{PROXY}/sessions/{created['session_id']}"
        reward = await http.post(f"{session_url}/reward", json={"value": 0.5}, headers=orchestrator)
        finish = await http.post(
            f"{session_url}/finish", json={"status": "completed"}, headers=orchestrator
        )
        check(
            reward.is_success and finish.is_success, "reward and finish with the orchestrator key"
        )
    return {
        "session_id": created["session_id"],
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": [c.logprob for c in choice.logprobs.content or []] if choice.logprobs else [],
        "reward": 0.5,
    }


async def event_count(session_id: str) -> int:
    owner = await asyncpg.connect(OWNER)
    try:
        return int(
            await owner.fetchval("SELECT count(*) FROM events WHERE session_id = $1", session_id)
        )
    finally:
        await owner.close()


async def read_as_reader(state: dict[str, Any]) -> None:
    """The session and its sample over SQL as a login of `trajstore_reader`: as recorded."""
    reader = await asyncpg.connect(
        host=SQL_HOST, port=SQL_PORT, database="trajstore",
        user=READER_LOGIN, password=state["reader_password"],
    )  # fmt: skip
    try:
        sample = None
        deadline = time.monotonic() + 60  # the live projector's delay
        while sample is None and time.monotonic() < deadline:
            sample = await reader.fetchrow(
                "SELECT token_ids, loss_mask, logprobs, prompt_len, response_len, reward"
                " FROM samples WHERE session_id = $1",
                state["session_id"],
            )
            if sample is None:
                await asyncio.sleep(1)
        check(sample is not None, "the projector made the session's sample")
        assert sample is not None
        ids = np.frombuffer(sample["token_ids"], "<i4").tolist()
        mask = np.frombuffer(sample["loss_mask"], np.uint8)
        logprobs = np.frombuffer(sample["logprobs"], "<f4")
        prompt, completion = state["prompt_ids"], state["completion_ids"]
        print(f"  sample: {len(ids)} token ids, prompt_len {sample['prompt_len']},")
        print(f"    response_len {sample['response_len']}, reward {sample['reward']}")
        check(ids == prompt + completion, "its token ids are exactly those the agent received")
        check(
            sample["prompt_len"] == len(prompt)
            and int(mask[len(prompt) :].sum()) == len(completion),
            "its prompt length and loss mask cover the completion",
        )
        check(
            logprobs[len(prompt) :].tobytes() == np.array(state["logprobs"], np.float32).tobytes(),
            "its logprobs are the agent's, bit for bit in float32",
        )
        check(sample["reward"] == state["reward"], "its reward is the one sent")
        row = await reader.fetchrow(
            "SELECT status, reward FROM trajectories WHERE session_id = $1", state["session_id"]
        )
        check(
            row is not None and row["status"] == "completed" and row["reward"] == state["reward"],
            "the `trajectories` view shows the session, completed, with its reward",
        )
        try:
            await reader.fetchval("SELECT count(*) FROM events")
            check(False, "the read-only role cannot read the events table")
        except asyncpg.InsufficientPrivilegeError:
            check(True, "the read-only role cannot read the events table")
    finally:
        await reader.close()


async def refused_rewrites(role: str, url: str, session_id: str) -> None:
    """UPDATE, DELETE and TRUNCATE of the log as `role`: each refused."""
    conn = await asyncpg.connect(published(url))
    try:
        check(await conn.fetchval("SELECT current_user") == role, f"{role}'s URL logs in as {role}")
        for sql in (
            "UPDATE events SET payload = payload WHERE session_id = $1",
            "DELETE FROM events WHERE session_id = $1",
            "TRUNCATE events",
        ):
            args = (session_id,) if "$1" in sql else ()
            try:
                await conn.execute(sql, *args)
                check(False, f"{role}: {sql.split()[0]} refused")
            except asyncpg.PostgresError as exc:
                check(True, f"{role}: {sql.split()[0]} refused ({exc})")
    finally:
        await conn.close()


async def record(role_urls: dict[str, str]) -> dict[str, Any]:
    print("check: an agent session through the proxy at 127.0.0.1:8400")
    state = await record_session()
    print(f"check: over SQL at {SQL_HOST}:{SQL_PORT}, as a login of trajstore_reader")
    state["reader_password"] = secrets.token_urlsafe(16)
    owner = await asyncpg.connect(OWNER)
    try:
        await owner.execute(
            f"CREATE ROLE {READER_LOGIN} LOGIN PASSWORD '{state['reader_password']}'"
            " IN ROLE trajstore_reader"
        )
    finally:
        await owner.close()
    await read_as_reader(state)
    print("check: the proxy's and the projector's roles cannot rewrite the log")
    state["events"] = await event_count(state["session_id"])
    for role, url in role_urls.items():
        await refused_rewrites(role, url, state["session_id"])
    check(
        await event_count(state["session_id"]) == state["events"],
        f"the log still holds the session's {state['events']} events",
    )
    return state


async def verify(state: dict[str, Any]) -> None:
    print("check: after compose down and up, over SQL as the same reader login")
    await read_as_reader(state)
    check(
        await event_count(state["session_id"]) == state["events"],
        f"the log holds the session's {state['events']} events",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["record", "verify"])
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--role-urls", type=Path)
    args = parser.parse_args()
    try:
        if args.phase == "record":
            urls = {
                f"trajstore_{name}": (args.role_urls / name).read_text().strip()
                for name in ("recorder", "projector")
            }
            args.state.write_text(json.dumps(asyncio.run(record(urls))))
        else:
            asyncio.run(verify(json.loads(args.state.read_text())))
    except CheckFailed as exc:
        print(f"  FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
