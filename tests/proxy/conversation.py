"""One conversation of an agent, as agents hold them: the whole history sent with every call."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI


class Conversation:
    """A system prompt and the messages so far; each call sends them all, as agents do."""

    def __init__(self, agent: AsyncOpenAI, system: str, first: str, **ask: Any) -> None:
        self.agent = agent
        self.ask = {"model": "tiny", "max_tokens": 12, **ask}
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": first},
        ]

    async def call(self, then: str | None = None, *, stream: bool = False, **extra: Any) -> str:
        """One model call; its reply, then `then` (a user message), join the history. Returns
        the reply's text."""
        ask = {**self.ask, "messages": self.messages}
        if extra:
            ask["extra_body"] = {**ask.get("extra_body", {}), **extra}
        if stream:
            text = ""
            async for chunk in await self.agent.chat.completions.create(stream=True, **ask):
                text += "".join(c.delta.content or "" for c in chunk.choices)
            reply: dict[str, Any] = {"role": "assistant", "content": text}
        else:
            answer = await self.agent.chat.completions.create(**ask)
            reply = answer.choices[0].message.model_dump(exclude_none=True)
        if then is not None:
            self.messages += [reply, {"role": "user", "content": then}]
        return str(reply.get("content") or "")
