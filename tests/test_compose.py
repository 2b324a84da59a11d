"""compose.yaml, checked without a Docker engine: Debian's docker-compose 1.29 resolves and
validates it, and every command it would run is run here against the real CLI.

docker-compose is required, not optional: a missing one fails these tests (`.ci/test` installs
it), so an invalid compose file can never pass unnoticed.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.vllm_server import CPU_FLAGS
from tests.conftest import world_readable_tempdir

ROOT = Path(__file__).resolve().parent.parent
PASSWORD_MESSAGE = "set TRAJSTORE_DB_PASSWORD to a password for the stack's PostgreSQL"
TRAJSTORE_IMAGES = {"trajstore:latest", "trajstore:vllm-cpu"}


def compose(*args: str, password: str | None = "secret") -> subprocess.CompletedProcess[str]:
    """Run docker-compose on the project's compose.yaml, with or without the required password."""
    program = shutil.which("docker-compose")
    if program is None:
        pytest.fail(
            "docker-compose is not installed; `apt-get install -y docker-compose` "
            "(.ci/test does it) — compose.yaml cannot be validated without it"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    if password is not None:
        env["TRAJSTORE_DB_PASSWORD"] = password
    return subprocess.run(
        [program, "-f", str(ROOT / "compose.yaml"), *args],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def resolved() -> dict[str, Any]:
    """The configuration docker-compose resolves (every service, whatever its profile)."""
    done = compose("config")
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


def test_compose_file_is_valid() -> None:
    done = compose("config", "-q")
    assert done.returncode == 0, done.stderr


def test_the_core_starts_without_a_profile_and_each_engine_has_its_own() -> None:
    # docker-compose 1.29 lists every service in `config`, active or not: read the profiles.
    profiles = {name: s.get("profiles") for name, s in resolved()["services"].items()}
    assert profiles == {
        "postgres": None, "migrate": None, "proxy": None, "projector": None,
        "engine-cpu": ["cpu"], "engine-gpu": ["gpu"],
    }  # fmt: skip


def test_a_missing_password_fails_fast_with_what_to_set() -> None:
    done = compose("config", "-q", password=None)
    assert done.returncode != 0
    assert PASSWORD_MESSAGE in done.stderr


def test_only_the_migration_holds_the_owners_password() -> None:
    services = resolved()["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == "secret"
    migrate = services["migrate"]["environment"]
    assert (
        migrate["TRAJSTORE_DATABASE_URL"] == "postgresql://trajstore:secret@postgres:5432/trajstore"
    )
    # The proxy and the projector get their role's URL from a volume of their own, which the
    # migration writes; the owner's URL (and password) reaches neither.
    for name, role in (("proxy", "RECORDER"), ("projector", "PROJECTOR")):
        environment = services[name]["environment"]
        assert "TRAJSTORE_DATABASE_URL" not in environment
        assert "secret" not in str(environment)
        url_file = environment[f"TRAJSTORE_{role}_DATABASE_URL_FILE"]
        assert migrate[f"TRAJSTORE_{role}_DATABASE_URL_FILE"] == url_file
        [(source, target, mode)] = [v.split(":") for v in services[name]["volumes"]]
        written = [v.split(":")[:2] for v in services["migrate"]["volumes"]]
        assert mode == "ro" and [source, target] in written
        assert url_file.startswith(target + "/")
        other = "projector" if name == "proxy" else "proxy"
        assert source not in str(services[other].get("volumes"))


def test_proxy_and_projector_start_after_a_healthy_database_and_a_finished_migration() -> None:
    services = resolved()["services"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("proxy", "projector"):
        assert services[name]["depends_on"] == {
            "postgres": {"condition": "service_healthy"},
            "migrate": {"condition": "service_completed_successfully"},
        }
    for name in ("postgres", "proxy", "projector", "engine-cpu", "engine-gpu"):
        assert services[name]["healthcheck"]["test"], f"{name} has no health check"


def test_every_trajstore_command_in_compose_is_a_real_cli_command() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["trajstore"]' in dockerfile
    services = resolved()["services"]
    checked = []
    for name, service in services.items():
        if service.get("image") not in TRAJSTORE_IMAGES or "entrypoint" in service:
            continue
        # --help after the arguments: click rejects an unknown option before it prints help.
        done = subprocess.run(
            [sys.executable, "-m", "store", *service["command"], "--help"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{name}: trajstore {service['command']}: {done.stderr}"
        checked.append(service["command"][0])
    assert sorted(checked) == ["migrate", "project", "proxy"]


def test_the_cpu_engine_serves_the_tiny_model_with_the_flags_the_tests_use(
    tmp_path: Path,
) -> None:
    script = resolved()["services"]["engine-cpu"]["command"][0]
    assert " ".join(CPU_FLAGS) in script
    assert "--served-model-name tiny" in script
    # The model-making part, run here as the container would (with a local directory).
    match = re.search(r"python -m proxy\.tiny_model (\S+);", script)
    assert match is not None, script
    target = tmp_path / "tiny"
    done = subprocess.run(
        [sys.executable, "-m", "proxy.tiny_model", str(target)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"test -f {match[1]}/config.json" in script  # what the container checks to reuse it
    assert (target / "config.json").is_file()


def _projector_health_check() -> list[str]:
    test: list[str] = resolved()["services"]["projector"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    # docker-compose prints `$` escaped as `$$`; the container would see one.
    return [sys.executable, "-c", test[3].replace("$$", "$")]


async def test_the_projector_health_check_tells_a_running_projector_from_none(
    database_url: str,
) -> None:
    # As in compose: the projector and its check read the URL the migration wrote for them.
    url_file = world_readable_tempdir("trajstore-compose-") / "url"
    url_file.write_text(database_url + "\n")
    env = {**os.environ, "TRAJSTORE_PROJECTOR_DATABASE_URL_FILE": str(url_file)}
    env.pop("TRAJSTORE_DATABASE_URL", None)
    check = _projector_health_check()

    async def healthy() -> bool:
        probe = await asyncio.create_subprocess_exec(
            *check, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        return await asyncio.wait_for(probe.wait(), 30) == 0

    assert not await healthy()
    projector = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "store", "project", env=env, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert projector.stdout is not None
        await asyncio.wait_for(projector.stdout.readline(), 30)  # "projecting ..."
        for _ in range(50):
            if await healthy():
                break
            await asyncio.sleep(0.2)
        assert await healthy()
    finally:
        projector.terminate()
        await projector.wait()


def test_docs_name_every_setting_and_every_compose_variable() -> None:
    from proxy.settings import ProxySettings
    from store.settings import StoreSettings

    docs = (ROOT / "docs" / "stack.md").read_text()
    readme = (ROOT / "README.md").read_text()
    fields = [*StoreSettings.model_fields, *ProxySettings.model_fields]
    settings = [f"TRAJSTORE_{f.upper()}" for f in fields]
    compose_variables = re.findall(r"\$\{(\w+)", (ROOT / "compose.yaml").read_text())
    missing = [name for name in settings + compose_variables if f"`{name}`" not in docs]
    assert missing == [], f"docs/stack.md does not describe {missing}"
    missing = [name for name in settings if f"`{name}`" not in readme]
    assert missing == [], f"README.md's configuration does not describe {missing}"
