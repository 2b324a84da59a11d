"""Real agent CLIs' request sequences (tests/fixtures/harnesses/), replayed through the proxy.

The CLIs themselves run in `benchmarks/agents.py` (the harness matrix); here their recorded
bodies go through a session in order, each answered by the fake engine as it was live, and every
model call must come out a turn with prompt and completion ids.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from tests.harness_fixtures import ReplayEngine, fixture_names, load_fixture, replay, send
from tests.proxy.fixtures import ProxyFactory

#: What docs/agents.md describes; each must keep a fixture.
HARNESSES = {"codex", "claude-code", "opencode", "qwen-code", "mini-swe-agent", "smolagents"}


def test_each_harness_of_the_matrix_has_a_fixture_of_a_multi_turn_run() -> None:
    assert set(fixture_names()) == HARNESSES | {f"{name}.vllm" for name in HARNESSES}
    for name in HARNESSES:
        fixture = load_fixture(name)
        assert fixture.header["exit"] == 0, name
        assert len(fixture.model_calls) >= 3, name  # ls, a read, an answer at least
        assert all(c["recorded"]["completion_token_ids"] for c in fixture.model_calls), name


def matrix_harnesses() -> ModuleType:
    """benchmarks/agent_harnesses.py, which says how the matrix runs each CLI."""
    path = Path(__file__).parent.parent / "benchmarks" / "agent_harnesses.py"
    spec = importlib.util.spec_from_file_location("agent_harnesses", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_matrix_runs_each_harness_from_its_readme_block_and_the_session_alone() -> None:
    harnesses = matrix_harnesses()
    assert {h.name for h in harnesses.HARNESSES} == HARNESSES
    for harness in harnesses.HARNESSES:
        block = harnesses.readme_command(harness.name)
        assert harness.binary in block, harness.name
        # Pointed at the session by its variables only: no URL, key or port of one machine.
        assert "SESSION_KEY" in block and re.search(r"SESSION_(ANTHROPIC_)?URL", block)
        assert "127.0.0.1" not in block and "localhost" not in block
        assert '"$TASK"' in block
    with pytest.raises(LookupError):
        harnesses.readme_command("no-such-cli")


@pytest.mark.parametrize("name", fixture_names())
async def test_a_harness_sequence_replays_with_every_call_recorded_with_ids(
    name: str, start_proxy: ProxyFactory
) -> None:
    fixture = load_fixture(name)
    async with ReplayEngine() as engine:
        proxy = await start_proxy([engine.url])
        session = await proxy.new_session(task_id=name)
        replayed = await replay(fixture, session, engine, proxy.http)
        record = await proxy.session_record(session["session_id"])

    assert [r.status for r in replayed] == [r.call["status"] for r in replayed]
    turns = record["turns"]
    assert [t["api"] for t in turns] == [c["api"] for c in fixture.model_calls]
    for turn, call in zip(turns, fixture.model_calls, strict=True):
        assert turn["status"] == "completed"
        assert turn["prompt_token_ids"]
        assert turn["choices"][0]["token_ids"] == call["recorded"]["completion_token_ids"]
    # The replies are the ones the CLI saw, so what the proxy continued live it continues again.
    live = {
        i
        for i, c in enumerate(fixture.model_calls)
        if c["recorded"]["prompt_source"] == "continued"
    }
    again = {i for i, t in enumerate(turns) if t["prompt_source"] == "continued"}
    assert live <= again


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", ["claude-code", "codex", "qwen-code"])
async def test_a_real_harness_first_prompt_fits_the_engine_and_is_recorded_token_for_token(
    name: str, start_proxy: ProxyFactory, vllm: str
) -> None:
    # Claude Code's (Messages, 31 k tokens), Codex's (Responses, 18 k) and Qwen Code's (chat,
    # 49 k) first requests, as each sent them to the real vLLM, but for a short answer.
    fixture = load_fixture(f"{name}.vllm")
    first = fixture.model_calls[0]
    limit = "max_output_tokens" if first["api"] == "responses" else "max_tokens"
    proxy = await start_proxy([vllm])
    session = await proxy.new_session(task_id=name)
    # The CPU reads 49 k tokens in about 10 s alone, several times that beside other work.
    async with httpx.AsyncClient(timeout=300) as http:
        answer = await send(http, session, first, {**first["body"], limit: 16})
    assert answer.status == 200, answer.body[:500]
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    live = first["recorded"]["prompt_token_ids"]
    assert len(live) > 15_000
    assert turn["prompt_token_ids"] == live  # the same tokenizer and template as live
    assert 0 < len(turn["choices"][0]["token_ids"]) <= 16


#: Each harness's conversations as docs/agents.md describes them: the turns (in request order)
#: of each lineage, the main loop first.
LINEAGES = {
    "codex": [[0, 1, 2, 4], [3]],  # the main loop; a spawn_agent sub-agent's one call
    "claude-code": [[0, 1, 2, 3, 7], [4, 5, 6]],  # the main loop; the background Agent
    "opencode": [[1, 2, 3, 7], [0], [4, 5, 6]],  # main; the title call; the task sub-agent
    "qwen-code": [[0, 1, 2, 3, 7], [4, 5, 6]],  # main; the background agent
    "mini-swe-agent": [[0, 1, 2]],
}


@pytest.mark.parametrize("name", sorted(LINEAGES))
async def test_a_harness_sequence_is_one_lineage_per_conversation(
    name: str, start_proxy: ProxyFactory, database_url: str
) -> None:
    """Sub-agents, title calls and the main loop of real CLIs, interleaved as they sent them:
    each conversation one lineage with no divergence, and the main loop the default sample."""
    fixture = load_fixture(name)
    async with ReplayEngine() as engine:
        proxy = await start_proxy([engine.url])
        session = await proxy.new_session(task_id=name)
        await replay(fixture, session, engine, proxy.http)
        samples = await proxy.finished_samples(database_url, session["session_id"])
    main, *others = LINEAGES[name]
    assert sorted(s.turns for s in samples) == sorted(LINEAGES[name])
    assert all(s.divergence is None for s in samples)
    default = next(s for s in samples if s.is_final)
    assert default.turns == main and default.role == "main"
    assert {s.role for s in samples if s.turns != main} <= {"subagent", "side"}
    assert len(others) == len(samples) - 1
