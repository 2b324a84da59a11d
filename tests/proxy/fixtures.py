"""Fixtures for the proxy: a fake engine, a real vLLM, the proxy served by a real uvicorn, an agent
client."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from openai import AsyncOpenAI

from tests.conftest import free_port
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import IMAGE_PAD
from trajstore.proxy.app import create_app
from trajstore.proxy.server import SERVER_OPTIONS
from trajstore.proxy.settings import ProxySettings
from trajstore.store import EventStore
from trajstore.store.samples import Sample, build_samples
from trajstore.store.sessions import rebuild_session
from trajstore.tiny_model import build_tiny_model
from trajstore.tiny_vlm import build_tiny_vlm
from trajstore.vllm_server import VllmServer


@dataclass
class RunningProxy:
    """A proxy serving on a local port, and handy ways to talk to it."""

    url: str
    settings: ProxySettings
    http: httpx.AsyncClient
    app: Any

    async def new_session(self, **body: Any) -> dict[str, Any]:
        """Create a session and return the proxy's answer (session_id, base_url, api_key)."""
        body.setdefault("run_id", "run-1")
        headers = {}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        response = await self.http.post(f"{self.url}/sessions", json=body, headers=headers)
        assert response.status_code in (200, 201), response.text
        created: dict[str, Any] = response.json()
        return created

    def agent(self, session: dict[str, Any]) -> AsyncOpenAI:
        """An official OpenAI client pointed at the session, as an agent would be."""
        return AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)

    async def session_record(self, session_id: str, *, whole: bool = True) -> dict[str, Any]:
        """The proxy's record of a session (`GET /sessions/{id}`): status, turns, rewards;
        with `whole`, each turn's prompt and messages made whole from what the answer gives
        (`made_whole`), as a client of the API would."""
        response = await self.http.get(f"{self.url}/sessions/{session_id}")
        assert response.status_code == 200, response.text
        record: dict[str, Any] = response.json()
        return made_whole(record) if whole else record

    async def finish(self, session_id: str, status: str = "completed") -> httpx.Response:
        """Finish a session (`POST /sessions/{id}/finish`) and return the proxy's answer."""
        return await self.http.post(
            f"{self.url}/sessions/{session_id}/finish", json={"status": status}
        )

    async def finished_samples(self, database_url: str, session_id: str) -> list[Sample]:
        """Finish a session, then build its samples from the log as the projector would."""
        finished = await self.finish(session_id)
        assert finished.status_code == 200, finished.text
        async with await EventStore.open(database_url) as store:
            events = await store.read_session(session_id)
        return build_samples(rebuild_session(session_id, events, packed=True))


@contextlib.asynccontextmanager
async def serve_proxy(settings: ProxySettings, database_url: str) -> AsyncIterator[RunningProxy]:
    """Run the proxy app under uvicorn in this event loop until the block ends."""
    app = create_app(settings, database_url)
    config = uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning",
                            lifespan="on", **SERVER_OPTIONS)  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # raise what stopped it
    assert server.started, "the proxy did not start"
    async with httpx.AsyncClient(timeout=30) as http:
        try:
            yield RunningProxy(f"http://127.0.0.1:{settings.port}", settings, http, app)
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 15)


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    """A fake vLLM engine on a local port."""
    async with FakeEngine() as fake:
        yield fake


ProxyFactory = Callable[..., Awaitable[RunningProxy]]


@pytest.fixture
async def start_proxy(database_url: str) -> AsyncIterator[ProxyFactory]:
    """Start proxies with chosen settings; all are stopped after the test."""
    stack = contextlib.AsyncExitStack()

    async def start(engines: list[str], **overrides: Any) -> RunningProxy:
        settings = ProxySettings(engines=engines, port=free_port(), **overrides)
        return await stack.enter_async_context(serve_proxy(settings, database_url))

    async with stack:
        yield start


@pytest.fixture
async def tool_engine() -> AsyncIterator[FakeEngine]:
    """A fake engine that calls the first tool it is given, ending on its end-of-turn token."""
    async with FakeEngine(call_tools=True, completion_tokens=6) as fake:
        yield fake


@pytest.fixture
async def vlm() -> AsyncIterator[FakeEngine]:
    """The fake engine as a vision-language model."""
    async with FakeEngine(vision=True, completion_tokens=6) as fake:
        yield fake


@pytest.fixture
async def proxy(start_proxy: ProxyFactory, engine: FakeEngine) -> RunningProxy:
    """One proxy in front of one fake engine."""
    return await start_proxy([engine.url])


@pytest.fixture
async def vlm_proxy(start_proxy: ProxyFactory, vlm: FakeEngine) -> RunningProxy:
    """One proxy in front of the fake vision-language engine, locating its images' placeholders."""
    return await start_proxy([vlm.url], image_token_id=IMAGE_PAD, max_image_bytes=64 * 1024)


@pytest.fixture
async def events_of(database_url: str) -> AsyncIterator[Callable[[str], Awaitable[list[Any]]]]:
    """Read a session's recorded events straight from the store."""
    store = await EventStore.open(database_url)

    async def read(session_id: str) -> list[Any]:
        return await store.read_session(session_id)

    try:
        yield read
    finally:
        await store.close()


@contextlib.contextmanager
def served_vllm(model: Path, workdir: Path, **options: Any) -> Iterator[str]:
    """A real vLLM (CPU build) serving `model` on a free port, its log in `workdir`: its URL;
    stopped on the way out. `options` are `VllmServer`'s (max_model_len, extra_args, ...)."""
    server = VllmServer(model, free_port(), log_file=workdir / "vllm.log", **options)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.contextmanager
def served_tiny_model(*, seed: int = 0, prefix: str = "trajstore-vllm-") -> Iterator[str]:
    """A real vLLM (CPU build) on a freshly generated tiny model of `seed`: its URL."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    model = build_tiny_model(workdir / "model", seed=seed)
    # Trusting a request's chat template lets tests try other templates on the same engine.
    with served_vllm(model, workdir, extra_args=("--trust-request-chat-template",)) as url:
        yield url


@pytest.fixture(scope="session")
def vllm() -> Iterator[str]:
    """One real vLLM (CPU build) for the whole test session, on a freshly generated tiny model.

    Tests that use it carry the `vllm` mark (deselect with `-m "not vllm"`).
    """
    with served_tiny_model() as url:
        yield url


@contextlib.contextmanager
def served_tiny_vlm() -> Iterator[tuple[str, Path]]:
    """A real vLLM (CPU build) on a freshly generated tiny vision-language model
    (`trajstore.tiny_vlm`): its URL and the model's directory (its processor)."""
    workdir = Path(tempfile.mkdtemp(prefix="trajstore-vlm-"))
    model = build_tiny_vlm(workdir / "model")
    with served_vllm(model, workdir, max_model_len=8192) as url:
        yield url, model


@pytest.fixture(scope="module")
def vllm_vlm() -> Iterator[tuple[str, Path]]:
    """A real vLLM serving the tiny vision-language model for one test module (stopped after
    it, so it never runs beside the text model's for long): its URL and the model's
    directory. Tests that use it carry the `vllm` mark."""
    with served_tiny_vlm() as served:
        yield served


def made_whole(record: dict[str, Any]) -> dict[str, Any]:
    """`GET /sessions/{id}`'s answer with every turn's whole `prompt_token_ids`, `messages` and
    `tools`, rebuilt from what each turn added to the turn it references (the contract in
    `store.sessions`; tools from the turn `tools_from` names): a referenced turn came first."""
    states: dict[str, list[int]] = {}  # request id -> its whole prompt + choice 0's tokens
    conversations: dict[str, list[Any] | None] = {}
    tools = {turn["index"]: turn["tools"] for turn in record["turns"]}
    for turn in record["turns"]:
        if turn.get("tools_from") is not None:  # the same tools as that turn's, given there
            turn["tools"] = tools[turn["tools_from"]]
        prefix, added = turn["prompt_prefix"], turn["prompt_added"]
        prompt = added if prefix is None else states[prefix["request_id"]][: prefix["n_tokens"]]
        if prefix is not None:
            prompt = [*prompt, *added]
        assert len(prompt) == (turn["n_prompt_tokens"] or 0)
        choices = turn["choices"]
        states[turn["request_id"]] = [*prompt, *(choices[0]["token_ids"] if choices else [])]
        messages = turn["messages"]
        if turn.get("messages_prefix") is not None:
            earlier = conversations.get(turn["messages_prefix"]["request_id"])
            fits = earlier is not None and len(earlier) == turn["messages_prefix"]["n_messages"]
            messages = [*earlier, *messages] if fits and earlier is not None else None
        conversations[turn["request_id"]] = messages
        turn.update(prompt_token_ids=prompt, messages=messages)
    return record
