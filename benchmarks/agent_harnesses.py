"""The agent CLIs of the harness matrix (benchmarks/agents.py): which package, pinned, how it is
installed into the project's cache, and the README's own command that points it at a session.

Each harness is run with exactly the shell block that follows `<!-- agent: NAME -->` in
README.md, so the README's instructions are what the matrix checks. The block reads four
variables, which the matrix sets as a user would from `POST /sessions`: `SESSION_URL`
(`base_url`), `SESSION_ANTHROPIC_URL` (`anthropic_base_url`), `SESSION_KEY` (`api_key`) and
`TASK`. Each CLI runs with a HOME of its own (no config or login of the machine's user) in a
small project directory.

The cache is `$TRAJSTORE_AGENTS_CACHE`, by default `.cache/agents` in the repository (ignored by
git): npm packages under `npm/<package>-<version>/`, PyPI ones in a virtualenv each under
`pypi/<package>-<version>/`, so that their dependencies never meet the project's. The npm
packages are 100-400 MB each; a second run installs nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trajstore.client import SessionInfo

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


@dataclass(frozen=True)
class Harness:
    """One agent CLI, pinned."""

    name: str  #: the README's marker and the fixture's file name
    registry: str  #: "npm" or "pypi"
    package: str
    version: str
    binary: str
    api: str  #: the trajstore API it speaks (`turns.api`)
    extras: str = ""  #: PyPI extras, e.g. "[openai]"

    @property
    def slug(self) -> str:
        """The cache folder's name: `@openai/codex` 0.169.0 -> `openai+codex-0.169.0`."""
        return self.package.lstrip("@").replace("/", "+") + "-" + self.version


HARNESSES = (
    Harness("codex", "npm", "@openai/codex", "0.169.0", "codex", "responses"),
    Harness("claude-code", "npm", "@anthropic-ai/claude-code", "2.1.328", "claude", "messages"),
    Harness("opencode", "npm", "opencode-ai", "1.18.33", "opencode", "chat"),
    Harness("qwen-code", "npm", "@qwen-code/qwen-code", "0.24.4", "qwen", "chat"),
    Harness("mini-swe-agent", "pypi", "mini-swe-agent", "2.4.6", "mini", "chat"),
    Harness("smolagents", "pypi", "smolagents", "1.26.0", "smolagent", "chat", "[openai]"),
)
BY_NAME = {h.name: h for h in HARNESSES}


def cache_dir() -> Path:
    """Where the CLIs are installed: `$TRAJSTORE_AGENTS_CACHE`, else `.cache/agents`."""
    return Path(os.environ.get("TRAJSTORE_AGENTS_CACHE") or ROOT / ".cache" / "agents")


def install(harness: Harness, cache: Path) -> Path:
    """Install `harness` into `cache` unless it is there; return the folder of its binary."""
    if harness.registry == "npm":
        prefix = cache / "npm" / harness.slug
        bin_dir = prefix / "node_modules" / ".bin"
        if not (bin_dir / harness.binary).exists():
            prefix.mkdir(parents=True, exist_ok=True)
            _run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                  "--loglevel=error", f"{harness.package}@{harness.version}"])  # fmt: skip
        return bin_dir
    venv = cache / "pypi" / harness.slug
    bin_dir = venv / "bin"
    if not (bin_dir / harness.binary).exists():
        _run([sys.executable, "-m", "venv", "--clear", str(venv)])
        spec = f"{harness.package}{harness.extras}=={harness.version}"
        _run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", spec])
    return bin_dir


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}")


def readme_command(name: str, readme: str | None = None) -> str:
    """The shell block after `<!-- agent: NAME -->` in the README: how to run that harness."""
    text = README.read_text() if readme is None else readme
    found = re.search(rf"<!-- agent: {re.escape(name)} -->\s*```sh\n(.*?)```", text, re.DOTALL)
    if found is None:
        raise LookupError(f"README.md has no shell block after <!-- agent: {name} -->")
    return found[1]


def prepare_home(home: Path) -> None:
    """The CLI's own HOME: empty (no config or login of the machine's user)."""
    home.mkdir(parents=True, exist_ok=True)


# The CLIs' own settings and keys, which the machine's environment may hold: left out.
_THEIRS = ("OPENAI_", "ANTHROPIC_", "CODEX_", "CLAUDE_", "OPENCODE", "QWEN_", "MSWEA_",
           "TRAJSTORE_")  # fmt: skip


def run_env(bin_dir: Path, home: Path, session: SessionInfo, task: str) -> dict[str, str]:
    """The environment a harness runs in: the machine's, less any model keys and endpoints,
    with its HOME, its binary on PATH and the session's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_THEIRS)}
    env |= {
        "HOME": str(home),
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        "SESSION_URL": session.base_url,
        "SESSION_ANTHROPIC_URL": session.anthropic_base_url,
        "SESSION_KEY": session.api_key,
        "TASK": task,
        "NO_COLOR": "1",
    }
    return env
