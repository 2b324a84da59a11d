"""The house: which part may import which, no import cycle, and one installed name.

store/ imports none of the others; proxy/, trainer/ and the viewer (trajstore/viewer/) import
only store/ (the trainer never talks to an engine, the proxy knows nothing of torch, the viewer
reads the store); the room above them (trajstore/: the command line, the local stack, the demo,
the rollouts, the client, the tiny model) may import them all. Each part's `cli` module is its
own: only the part itself and the root of the command line (trajstore/cli.py) import it. Imports
inside functions count too: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("store", "proxy", "trainer")
#: Parts that live inside the room's folder (trajstore/<name>), not at the top level.
INNER_PARTS = ("viewer",)


def modules() -> dict[str, Path]:
    """Every module of the installed package `trajstore`, by its dotted name."""
    found = {}
    for part in PARTS:
        for path in (ROOT / part).rglob("*.py"):
            name = ".".join(("trajstore", *path.relative_to(ROOT).with_suffix("").parts))
            found[name.removesuffix(".__init__")] = path
    # The room's own modules and the inner parts (the viewer); its links to the parts are above.
    for path in (ROOT / "trajstore").rglob("*.py"):
        relative = path.relative_to(ROOT / "trajstore")
        if relative.parts[0] in PARTS:
            continue
        name = ".".join(("trajstore", *relative.with_suffix("").parts))
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the trajstore modules it imports (a `from package import module` names it)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    imported.add(submodule if submodule in known else node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        graph[name] = {m for m in imported if m in known and m != name}
    return graph


def part_of(module: str) -> str:
    """'store', 'proxy', 'trainer' or 'viewer', or 'room' for the rest of trajstore/."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in (*PARTS, *INNER_PARTS) else "room"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_module_is_found_under_the_installed_name() -> None:
    found = modules()
    assert {"trajstore.store.eventstore", "trajstore.proxy.app", "trajstore.trainer.replay"} <= set(
        found
    )
    assert {"trajstore.cli", "trajstore.demo", "trajstore.stack", "trajstore.tiny_model"} <= set(
        found
    )


def test_arrows_point_toward_the_store() -> None:
    allowed = {
        "store": {"store"},
        "proxy": {"proxy", "store"},
        "trainer": {"trainer", "store"},
        "viewer": {"viewer", "store"},
    }
    wrong = [
        f"{module} imports {other}"
        for module, imported in import_graph().items()
        for other in imported
        if part_of(module) in allowed and part_of(other) not in allowed[part_of(module)]
    ]
    assert wrong == []


def test_the_viewer_is_a_part() -> None:
    assert part_of("trajstore.viewer.app") == "viewer"
    assert part_of("trajstore.demo") == "room"
    assert "trajstore.viewer.app" in modules()


def test_each_part_owns_its_command_line() -> None:
    # A part's `cli` module holds its commands, which the root adds (trajstore/cli.py); a helper
    # another module needs lives in a proper module of that part, not in its `cli`.
    wrong = [
        f"{module} imports {other}"
        for module, imported in import_graph().items()
        for other in imported
        if other.endswith(".cli")
        and module != "trajstore.cli"
        and part_of(module) != part_of(other)
    ]
    assert wrong == []


def test_each_part_exports_its_commands() -> None:
    import click

    from trajstore.cli import main

    for part in ("store", "proxy", "trainer", "viewer"):
        module = __import__(f"trajstore.{part}.cli", fromlist=["commands"])
        assert module.commands and all(isinstance(c, click.Command) for c in module.commands)
        ctx = click.Context(main)
        for command in module.commands:
            assert main.get_command(ctx, command.name) is command, (part, command.name)


def _outside_store() -> dict[str, Path]:
    return {name: path for name, path in modules().items() if part_of(name) != "store"}


def test_only_the_store_touches_its_connection_pool() -> None:
    # The store owns its pool (and how its failures read): the parts run their own SQL through
    # `EventStore.fetch` and friends, the samples through `store.sample_reads`.
    wrong = [
        f"{name}:{node.lineno}"
        for name, path in _outside_store().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "pool"
    ]
    assert wrong == []


def test_only_the_store_queries_samples() -> None:
    # One owner per table: SQL naming `samples` outside store/ (a string constant holding
    # "FROM samples", "JOIN samples", "INSERT INTO samples" or "UPDATE samples", as SQL spells
    # it) is a second place to change.
    said = re.compile(r"\b(FROM|JOIN|INSERT INTO|UPDATE)\s+samples\b")
    wrong = [
        f"{name}:{node.lineno}"
        for name, path in _outside_store().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and said.search(node.value)
    ]
    assert wrong == []


def test_the_rules_above_see_a_breach() -> None:
    # The two checks above would pass on any tree if they never matched anything.
    store_code = (ROOT / "store" / "sample_reads.py").read_text()
    assert re.search(r"\bFROM\s+samples\b", store_code)
    tree = ast.parse("rows = await store.pool.fetch('SELECT 1')")
    assert any(isinstance(n, ast.Attribute) and n.attr == "pool" for n in ast.walk(tree))


def test_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one() -> None:
    # The check above would pass on any graph if the finder never found anything.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_another_packages_proxy_does_not_break_trajstore(tmp_path: Path) -> None:
    # proxy.py (PyPI) installs a top-level `proxy`; so could anything else called store or
    # trainer. With them first on the path, trajstore still imports and runs its own parts.
    for name in PARTS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"FOREIGN = {name!r}\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    script = (
        "import proxy, store, trainer\n"
        "assert proxy.FOREIGN == 'proxy' and store.FOREIGN == 'store'\n"
        "import trajstore.proxy.app, trajstore.store, trajstore.trainer.cli\n"
        "print(trajstore.proxy.app.__file__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("proxy/app.py")
    done = subprocess.run(
        [sys.executable, "-m", "trajstore", "proxy", "--help"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "recording proxy" in done.stdout


def test_every_benchmark_imports() -> None:
    """A benchmark not in CI's run still imports: names it takes from the packages exist (one
    took a function from a module that no longer held it, and failed only when run)."""
    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    code = (
        "import importlib, sys; sys.path[:0] = ['benchmarks', '.']\n"
        f"for name in {names!r}: importlib.import_module(name)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
