"""The proxy's memory of each session's last turn, which later prompts reference (no I/O)."""

from __future__ import annotations

from proxy.recorder import PromptContexts


def test_sessions_whose_last_turn_is_oldest_are_forgotten_past_the_bound() -> None:
    contexts = PromptContexts(max_bytes=100)
    contexts.remember("a", "r1", b"x" * 40)
    contexts.remember("b", "r2", b"x" * 40)
    contexts.remember("a", "r3", b"x" * 40)  # a's newer turn replaces its older one
    assert contexts.get("a") == ("r3", b"x" * 40) and contexts.get("b") == ("r2", b"x" * 40)
    contexts.remember("c", "r4", b"x" * 40)  # 120 bytes: b, whose last turn is oldest, goes
    assert contexts.get("b") is None
    assert contexts.get("a") is not None and contexts.get("c") is not None
    contexts.remember("d", "r5", b"x" * 200)  # larger than the bound by itself: nothing kept
    assert [contexts.get(s) for s in "acd"] == [None, None, None]
