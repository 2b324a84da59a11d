"""The docs cannot drift from the code: every module path and name they mention must import.

README.md and docs/*.md name code three ways, and each is checked here:
- a full path anywhere (`trajstore.rollout.verl_loop.TrajstoreAgentLoop`, in prose, in a YAML
  config, in a Python block): the module imports and the names after it are its attributes;
- a part's short path in backticks (`store.samples.build_samples`, `proxy.app`): the same,
  under `trajstore.`;
- a Python block's `import trajstore...` and `from trajstore... import A, B`: each name exists.
The README's Python examples themselves run against a live stack (the proxy on the fake engine
and the real PostgreSQL) in tests/test_readme.py.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FULL_PATH = re.compile(r"\btrajstore(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# A part's path in backticks, not a file name (`store/cli.py` is a path, `cli.py` a file).
SHORT_PATH = re.compile(
    r"`((?:store|proxy|trainer|viewer)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?=[`(\[ ])"
)
FILE_ENDINGS = (".py", ".md", ".png", ".json", ".yaml", ".toml", ".sh", ".gz", ".jsonl")
# The proxy's span attributes are named `trajstore.session.id` and so on (proxy/tracing.py): names
# of trace data, not of code.
SPAN_ATTRIBUTES = set(re.findall(r'"(trajstore\.[\w.]+)"', (ROOT / "proxy/tracing.py").read_text()))
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
FROM_IMPORT = re.compile(r"^\s*from (trajstore[\w.]*) import \(?([\w, \n]+)\)?", re.MULTILINE)
PLAIN_IMPORT = re.compile(r"^\s*import (trajstore[\w.]*)", re.MULTILINE)


def resolve(dotted: str) -> str | None:
    """None when `dotted` is an importable module, or one followed by its attributes; else why
    not."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found: object = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # this prefix is no module: try a shorter one
            raise  # the module exists but needs something that is not installed
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return f"{module_name} has no {'.'.join(parts[cut:])}"
            found = getattr(found, attribute)
        return None
    return "no such module"


def python_imports(text: str) -> list[str]:
    """The dotted names a Python block imports from trajstore (`module` or `module.Name`)."""
    names: list[str] = []
    try:
        tree = ast.parse(text)
    except SyntaxError:  # a fragment: read its import lines as text
        for module, listed in FROM_IMPORT.findall(text):
            names += [f"{module}.{n.strip()}" for n in listed.replace("\n", ",").split(",")
                      if n.strip()]  # fmt: skip
        return names + PLAIN_IMPORT.findall(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trajstore"):
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.startswith("trajstore")]
    return names


def mentions(path: Path) -> set[str]:
    """Every dotted trajstore name the document mentions, in its full form."""
    text = path.read_text()
    found = set(FULL_PATH.findall(text))
    found |= {f"trajstore.{m}" for m in SHORT_PATH.findall(text) if not m.endswith(FILE_ENDINGS)}
    for block in PYTHON_BLOCK.findall(text):
        found |= set(python_imports(block))
    return {n for n in found if not n.endswith(FILE_ENDINGS) and n not in SPAN_ATTRIBUTES}


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_every_name_the_docs_mention_imports(path: Path) -> None:
    broken = {name: why for name in sorted(mentions(path)) if (why := resolve(name))}
    assert broken == {}, f"{path.name} names code that is not there"


def test_the_checks_see_drift() -> None:
    # The test above would pass on any docs if it found nothing or resolved anything.
    text = "`store.samples.build_samples` and trajstore.proxy.tiny_model, `cli.py`"
    block = "from trajstore.store import EventStore, NoSuchThing\nimport trajstore.nowhere\n"
    assert {f"trajstore.{m}" for m in SHORT_PATH.findall(text)} == {
        "trajstore.store.samples.build_samples"
    }
    assert FULL_PATH.findall(text) == ["trajstore.proxy.tiny_model"]
    assert resolve("trajstore.store.samples.build_samples") is None
    assert resolve("trajstore.proxy.tiny_model") == "trajstore.proxy has no tiny_model"
    assert python_imports(block) == [
        "trajstore.store.EventStore",
        "trajstore.store.NoSuchThing",
        "trajstore.nowhere",
    ]
    assert resolve("trajstore.store.NoSuchThing") == "trajstore.store has no NoSuchThing"
    assert resolve("trajstore.nowhere") == "trajstore has no nowhere"
    assert len(mentions(ROOT / "README.md")) > 10
