"""Sessions recorded for real, through the proxy in front of the fake engine, for the viewer's
tests: an agent that talks for a few turns, and one that rewrites its history."""

from __future__ import annotations

from typing import Any

from tests.proxy.fixtures import RunningProxy


class Agent:
    """One session of a chatty agent: each turn sends the history back and asks again."""

    def __init__(self, proxy: RunningProxy, session: dict[str, Any]) -> None:
        self.proxy = proxy
        self.session = session
        self.client = proxy.agent(session)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "What is 17 plus 25?"},
        ]

    @classmethod
    async def start(cls, proxy: RunningProxy, run_id: str, task_id: str) -> Agent:
        """A new session of the run."""
        return cls(proxy, await proxy.new_session(run_id=run_id, task_id=task_id))

    @property
    def session_id(self) -> str:
        return str(self.session["session_id"])

    async def turn(self, follow_up: str = "Say it again, shorter.") -> None:
        """One model call; the reply goes into the history with a follow-up question."""
        reply = await self.client.chat.completions.create(
            model="tiny",
            messages=self.messages,
            max_tokens=12,  # type: ignore[arg-type]
        )
        self.messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        self.messages.append({"role": "user", "content": follow_up})

    def rewrite_history(self) -> None:
        """Change the first follow-up question, as an agent that edits its context would: the
        prompt keeps the system prompt, the task and the first reply (more than the 16 tokens
        `store.lineages` asks of an edit inside a conversation) and the latest reply."""
        self.messages[3] = {"role": "user", "content": "Now say it with words."}

    async def finish(self, reward: float) -> None:
        """The reward, then the finish, as the orchestrator sends them."""
        headers = {"Authorization": f"Bearer {self.session['orchestrator_key']}"}
        base = f"{self.proxy.url}/sessions/{self.session_id}"
        http = self.proxy.http
        for path, body in (("reward", {"value": reward}), ("finish", {"status": "completed"})):
            (await http.post(f"{base}/{path}", json=body, headers=headers)).raise_for_status()
        await self.client.close()
