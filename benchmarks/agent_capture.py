"""What a real agent CLI sends, kept: the task it is given, the engine's script, the front that
records each request, and the fixture file (benchmarks/agents.py runs the CLIs).

- `scripted_tool_call`: the tool-calling fake engine's policy for a real harness. Each
  conversation of a CLI (its own system prompt, its own tools) is answered by how many steps it
  took (its assistant messages): first a shell `ls`, then a read of README.md, then a sub-agent
  where the CLI offers one (Claude Code's `Agent`, opencode's `task`, Qwen Code's `agent`,
  Codex's `spawn_agent`; never from inside a sub-agent), then the CLI's own way to finish where
  it has one (mini-swe-agent's submit command, smolagents' `final_answer`), then a text answer,
  which ends it. Arguments are filled from each tool's own JSON schema, so the CLI runs the
  tools for real and its later requests carry real tool results. Requests without tools
  (titles, summaries) get the engine's text.
- `Capture`: an HTTP front between the CLI and trajstore's proxy (the proxy's
  `TRAJSTORE_PUBLIC_URL`, so sessions' base URLs point at it): it passes every request on
  unchanged and keeps method, path, arrival and end times, headers (no keys) and body.
- `write_fixture`: the calls with the token ids the proxy recorded for each, as gzipped JSON
  lines (tests/fixtures/harnesses/; `tests/harness_fixtures.py` reads and replays them).
"""

from __future__ import annotations

import gzip
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from trajstore.store.sessions import SessionRecord, TurnRecord

JSON = dict[str, Any]

TASK = "List the files in this directory, then read README.md and say in one line what it is."
#: The project a CLI works in (its cwd): small, and the same for every harness.
WORKDIR_FILES = {
    "README.md": "# hello\n\nA one-file demo project: hello.py prints a greeting.\n",
    "hello.py": 'print("hello")\n',
}
SUBAGENT_PROMPT = "Read README.md and report its first line."
#: The command by which mini-swe-agent (and SWE-agent's family) says it is done.
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

# Tool names by what the script wants of them, as the CLIs name them (Claude Code, opencode,
# Qwen Code, Codex, the Python harnesses); the first one offered is used.
SHELL_TOOLS = ("Bash", "bash", "run_shell_command", "shell", "exec_command", "shell_command",
               "local_shell", "python_interpreter")  # fmt: skip
READ_TOOLS = ("Read", "read", "read_file", "view", "ReadFile")
DELEGATE_TOOLS = ("Task", "Agent", "task", "agent", "spawn_agent")
FINISH_TOOLS = ("final_answer",)  # smolagents' tool-calling agent ends by calling it

# Request headers never kept: credentials, and what HTTP itself sets.
_SECRET_PARTS = ("auth", "key", "token", "cookie", "secret")
_TRANSPORT = frozenset({"host", "content-length", "connection", "accept-encoding",
                        "transfer-encoding", "keep-alive"})  # fmt: skip
# The model-call paths (after the session's prefix) and their trajstore API.
MODEL_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
    "/v1/messages/count_tokens": "count_tokens",
}


# -- the engine's script ------------------------------------------------------------------------


def _tools_by_name(body: JSON) -> dict[str, JSON]:
    tools = {}
    for tool in body.get("tools") or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name"):
            tools[str(function["name"])] = function
    return tools


def _pick(tools: dict[str, JSON], names: tuple[str, ...]) -> JSON | None:
    for name in names:
        if name in tools:
            return tools[name]
    # Namespaced tools reach the engine as "<namespace>.<name>" or "<namespace>__<name>".
    for name, tool in tools.items():
        if any(name.endswith(("." + n, "__" + n)) for n in names):
            return tool
    return None


def _value(prop: str, schema: JSON, wanted: JSON) -> Any:
    """An argument for property `prop` of `schema`: what the script wants, else a plain value."""
    kind = schema.get("type")
    if prop in wanted:
        value = wanted[prop]
        if kind == "array" and isinstance(value, str):
            return ["bash", "-lc", value]  # Codex's shell takes an argv
        return value
    if schema.get("enum"):
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    return {"integer": 1, "number": 1, "boolean": False, "array": [], "object": {}}.get(
        str(kind), "x"
    )


def _arguments(tool: JSON, wanted: JSON) -> JSON:
    """Arguments for `tool` from its JSON schema: its required properties and any the script
    names that it has."""
    params = tool.get("parameters") or {}
    props: JSON = params.get("properties") or {}
    names = [*params.get("required", []), *(p for p in wanted if p in props)]
    return {p: _value(p, props.get(p) or {}, wanted) for p in dict.fromkeys(names)}


def _shell(command: str, code: str = "") -> JSON:
    """What the script asks of a shell tool, under each name CLIs give its input (`code`: the
    same in Python, for smolagents' python_interpreter)."""
    return {"command": command, "cmd": command, "code": code, "description": "Run " + command}


def scripted_tool_call(workdir: Path, body: JSON) -> JSON | None:
    """The call the fake engine answers `body` with (`FakeEngine(tool_policy=...)`), or None
    for a text answer: the script in the module docstring."""
    tools = _tools_by_name(body)
    if not tools:
        return None
    messages = body.get("messages") or []
    readme = str(workdir / "README.md")
    shell = _pick(tools, SHELL_TOOLS)
    listing = _shell("ls", "import os; print(os.listdir('.'))")
    steps: list[tuple[JSON | None, JSON]] = [(shell, listing)]
    if (read := _pick(tools, READ_TOOLS)) is not None:
        steps.append((read, dict.fromkeys(("file_path", "filePath", "absolute_path", "path"),
                                          readme)))  # fmt: skip
    else:
        steps.append((shell, _shell(f"cat {readme}", f"print(open({readme!r}).read())")))
    asked = [m for m in messages if m.get("role") == "user"]
    delegate = _pick(tools, DELEGATE_TOOLS)
    # A sub-agent delegates no further (Qwen Code would let it, five deep).
    if delegate is not None and SUBAGENT_PROMPT not in orjson.dumps(asked).decode():
        # "message": Codex's spawn_agent (its multi_agent tools, once the proxy serves them).
        wanted = {"description": "Read the README", "prompt": SUBAGENT_PROMPT,
                  "message": SUBAGENT_PROMPT}  # fmt: skip
        # An agent type the CLI has: opencode's "general", Claude Code's "general-purpose".
        if named := re.search(r"\bgeneral(?:-purpose)?\b", str(delegate.get("description"))):
            wanted["subagent_type"] = named[0]
        steps.append((delegate, wanted))
    if SUBMIT in orjson.dumps(messages).decode():  # mini-swe-agent ends on its submit command
        steps.append((shell, _shell(f"echo {SUBMIT}")))
    steps.append((_pick(tools, FINISH_TOOLS), {"answer": "A one-file demo project."}))
    offered = [(tool, wanted) for tool, wanted in steps if tool is not None]
    # Steps taken: its assistant messages (smolagents keeps no tool messages, only replies).
    done = sum(1 for m in messages if m.get("role") == "assistant")
    if done >= len(offered):
        return None
    tool, wanted = offered[done]
    return {"name": tool["name"], "arguments": _arguments(tool, wanted)}


# -- the front ----------------------------------------------------------------------------------


@dataclass
class CapturedCall:
    """One HTTP request a CLI sent, as it sent it, and what became of it."""

    seq: int
    t: float  # seconds since the capture began, at arrival (calls are kept as they end)
    done: float  # ... when the answer had been passed back whole
    method: str
    path: str  # without the session's /sessions/{id} prefix
    headers: JSON
    body: Any  # the JSON body, or its text when it is none
    status: int
    received_at: float  # wall clock at arrival, to find the proxy's record of it
    turn: TurnRecord | None = field(default=None, repr=False)

    @property
    def api(self) -> str | None:
        """The trajstore API of a model call (`chat`, `messages`, ...), else None."""
        return MODEL_PATHS.get(self.path.partition("?")[0]) if self.method == "POST" else None


def kept_headers(headers: Any) -> JSON:
    """The request headers worth keeping: no credentials, nothing HTTP itself sets."""
    kept = {}
    for name, value in headers.items():
        lower = name.lower()
        if lower in _TRANSPORT or any(part in lower for part in _SECRET_PARTS):
            continue
        kept[lower] = value
    return kept


class Capture:
    """An HTTP front that passes every request on to `upstream` and keeps it (`calls`)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.calls: list[CapturedCall] = []
        self.url = ""
        self._began = time.monotonic()
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def start(self, port: int) -> str:
        """Listen on `port`; return the front's URL."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
        self._http = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        """Close the listener and the client."""
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def take(self) -> list[CapturedCall]:
        """The calls kept since the last `take`, in the order they arrived (numbered so), and a
        new clock for the next ones."""
        calls, self.calls = sorted(self.calls, key=lambda c: c.t), []
        for seq, call in enumerate(calls):
            call.seq = seq
        self._began = time.monotonic()
        return calls

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        assert self._http is not None
        arrived, wall = time.monotonic(), time.time()
        raw = await request.read()
        forward = {k: v for k, v in request.headers.items() if k.lower() not in _TRANSPORT}
        response = web.StreamResponse()
        status = 502
        try:
            async with self._http.request(
                request.method, self.upstream + request.path_qs, data=raw, headers=forward
            ) as upstream:
                status = upstream.status
                response.set_status(status)
                for name, value in upstream.headers.items():
                    if name.lower() not in _TRANSPORT:
                        response.headers[name] = value
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
        except (aiohttp.ClientError, ConnectionResetError):
            if not response.prepared:
                response = web.Response(status=502, text="capture: the proxy cannot be reached")
        finally:
            self.calls.append(
                CapturedCall(
                    seq=-1,  # numbered by arrival in `take`
                    t=round(arrived - self._began, 3),
                    done=round(time.monotonic() - self._began, 3),
                    method=request.method,
                    path=_session_path(request.path_qs),
                    headers=kept_headers(request.headers),
                    body=_body(raw),
                    status=status,
                    received_at=wall,
                )
            )
        return response


def _session_path(path: str) -> str:
    """`/sessions/{id}/v1/...` -> `/v1/...`: fixtures do not name the session."""
    if path.startswith("/sessions/"):
        _, _, rest = path[len("/sessions/") :].partition("/")
        return "/" + rest
    return path


def _body(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")


# -- matching calls to turns, and the fixture ---------------------------------------------------


def attach_turns(calls: list[CapturedCall], session: SessionRecord) -> None:
    """Give each model call its turn of `session`: the turn of the same API whose recorded body
    is the call's, arrived nearest to it (turns are recorded as the proxy received them, and
    parallel calls may arrive in either order)."""
    free = list(session.turns)
    for call in calls:
        if call.api in (None, "count_tokens"):
            continue
        same = [t for t in free if t.api == call.api]
        exact = [t for t in same if _same_body(t, call.body)]
        pool = exact or same
        if not pool:
            continue
        turn = min(pool, key=lambda t: abs((t.received_at or 0.0) - call.received_at))
        call.turn = turn
        free.remove(turn)


def in_proxy_order(calls: list[CapturedCall]) -> list[CapturedCall]:
    """The calls in the order the proxy received them (renumbered so): calls sent at the same
    moment (a sub-agent's and its parent's) may reach the front and the proxy in either order,
    and a replay should meet the proxy's order, which decided the recording."""
    ordered = sorted(calls, key=lambda c: (c.turn and c.turn.received_at) or c.received_at)
    for seq, call in enumerate(ordered):
        call.seq = seq
    return ordered


def _same_body(turn: TurnRecord, body: Any) -> bool:
    if not isinstance(body, dict):
        return False
    recorded = turn.body
    if turn.api == "chat":  # chat's record drops nothing but may hold images by reference
        return recorded.get("messages") == body.get("messages")
    return bool(recorded == body)


def call_record(call: CapturedCall) -> JSON:
    """One fixture line: the call as sent, and the ids the proxy recorded for it."""
    record: JSON = {
        "seq": call.seq, "t": call.t, "done": call.done, "method": call.method,
        "path": call.path, "api": call.api, "status": call.status, "headers": call.headers,
        "body": call.body,
    }  # fmt: skip
    turn = call.turn
    if turn is not None:
        choice = turn.choices.get(0)
        record["recorded"] = {
            "status": turn.status,
            "prompt_token_ids": list(turn.prompt_token_ids),
            "completion_token_ids": list(choice.token_ids) if choice else [],
            "finish_reason": choice.finish_reason if choice else None,
            "message": choice.message if choice else None,  # the engine's answer, in chat's shape
            "prompt_source": turn.prompt_source,
            "continuation": turn.continuation,
        }
    return record


def write_fixture(path: Path, header: JSON, calls: list[CapturedCall]) -> int:
    """Write the header and the calls as gzipped JSON lines; return the file's size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [orjson.dumps(header), *(orjson.dumps(call_record(c)) for c in calls)]
    # mtime=0: the same capture gives the same bytes.
    data = gzip.compress(b"\n".join(lines) + b"\n", compresslevel=9, mtime=0)
    path.write_bytes(data)
    return len(data)
