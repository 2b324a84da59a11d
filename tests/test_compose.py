"""compose.yaml, checked with no Docker and no system package: tests/compose.py resolves it as
Compose does (the committed `.env`, interpolation, anchors, profiles), the Compose specification's
JSON schema validates the result, and every command a service would run is run here against the
real CLI. Where Docker Compose is installed (v2: `docker compose`; v1: `docker-compose`), it
resolves the file too and must start the same services with the same settings (v1, whose
`config` lists every service, with the same profiles). .ci/compose brings the stack up for real.

tests/compose-spec.json is the Compose specification's schema as Docker Compose embeds it:
`schema/compose-spec.json` of the compose-spec/compose-go repository (the original, of which
compose-spec/compose-spec keeps a copy) at release v2.13.0 (2026-06-29, commit 0670a1c),
unmodified; Apache-2.0, compose-go's license. To update it, replace the file with a newer
release's copy and run these tests.
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

from tests.compose import ComposeError, Stack, interpolate, read_env_file, resolve, schema_errors
from tests.conftest import world_readable_tempdir
from trajstore.vllm_server import CPU_FLAGS

ROOT = Path(__file__).resolve().parent.parent
TRAJSTORE_IMAGES = {"trajstore:latest", "trajstore:vllm-cpu"}
CORE = {"postgres", "migrate", "partitions", "proxy", "projector"}
YOUR_ENGINES = "http://host.docker.internal:8000,http://host.docker.internal:8001"
# What a user types, as environments: nothing; the GPU switch; their own engines and none of ours.
SWITCHES: dict[str, dict[str, str]] = {
    "no variables": {},
    "gpu": {"COMPOSE_PROFILES": "gpu"},
    "your engines": {"COMPOSE_PROFILES": "", "TRAJSTORE_ENGINES": YOUR_ENGINES},
}


def every_service(**environ: str) -> Stack:
    """The stack with every profile active, so that each service's settings can be read."""
    return resolve({**environ, "COMPOSE_PROFILES": "*"})


# The resolver's rules, on small inputs (each as Compose v2.40 resolves it).


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("${SET}/${EMPTY}/${UNSET}", "x//"),
        ("${EMPTY:-d} ${EMPTY-d} ${UNSET-d} ${SET:-d}", "d  d x"),
        ("${EMPTY:+r} ${EMPTY+r} ${UNSET+r} ${SET:+r}", " r  r"),
        ("${EMPTY?m}|${SET:?m}", "|x"),
        ("$SET/$$SET/$${SET}/$1", "x/$SET/${SET}/$1"),
    ],
)
def test_interpolation_follows_compose(template: str, expected: str) -> None:
    assert interpolate(template, {"SET": "x", "EMPTY": ""}) == expected


@pytest.mark.parametrize("template", ["${EMPTY:?say what}", "${UNSET?say what}"])
def test_a_required_variable_stops_with_its_message(template: str) -> None:
    with pytest.raises(ComposeError, match=r"missing a value: say what"):
        interpolate(template, {"EMPTY": ""})


@pytest.mark.parametrize("template", ["${1A}", "${A", "${A:=b}"])
def test_a_malformed_variable_is_refused(template: str) -> None:
    with pytest.raises(ComposeError, match=r"invalid interpolation format"):
        interpolate(template, {"A": "x"})


def test_the_env_file_gives_defaults_that_the_environment_overrides(tmp_path: Path) -> None:
    (tmp_path / "compose.yaml").write_text(
        "services:\n"
        "  core: {image: 'x:${TAG}'}\n"
        "  extra: {image: y, profiles: [more]}\n"
    )  # fmt: skip
    (tmp_path / ".env").write_text("# defaults\nTAG=1 # a comment\nCOMPOSE_PROFILES=more\n")
    assert read_env_file(tmp_path / ".env") == {"TAG": "1", "COMPOSE_PROFILES": "more"}
    stack = resolve({}, tmp_path / "compose.yaml")
    assert stack.services["core"]["image"] == "x:1" and set(stack.services) == {"core", "extra"}
    # Set in the environment, even to nothing, a variable wins over the file.
    stack = resolve({"TAG": "2", "COMPOSE_PROFILES": ""}, tmp_path / "compose.yaml")
    assert stack.services["core"]["image"] == "x:2" and set(stack.services) == {"core"}


def test_the_schema_finds_what_compose_would_refuse() -> None:
    document = every_service().document
    document["services"]["proxy"]["comand"] = ["proxy"]
    document["services"]["migrate"]["volumes"] = "recorder-url:/run/trajstore/recorder"
    errors = schema_errors(document)
    assert any(e.startswith("services.proxy:") and "'comand'" in e for e in errors), errors
    assert any(e.startswith("services.migrate.volumes:") for e in errors), errors


# compose.yaml as a user meets it.


def test_with_no_variables_the_stack_is_valid_and_starts_with_the_cpu_engine() -> None:
    stack = resolve({})
    assert schema_errors(stack.document) == []
    assert set(stack.services) == {*CORE, "engine-cpu"}
    assert stack.services["proxy"]["environment"]["TRAJSTORE_ENGINES"] == "http://engine:8000"
    assert stack.services["engine-cpu"]["networks"]["default"]["aliases"] == ["engine"]


def test_one_switch_starts_the_gpu_engine_instead() -> None:
    stack = resolve(SWITCHES["gpu"])
    assert schema_errors(stack.document) == []
    assert set(stack.services) == {*CORE, "engine-gpu"}
    assert stack.services["engine-gpu"]["networks"]["default"]["aliases"] == ["engine"]


def test_your_own_engines_replace_ours() -> None:
    stack = resolve(SWITCHES["your engines"])
    assert schema_errors(stack.document) == []
    assert set(stack.services) == CORE
    assert stack.services["proxy"]["environment"]["TRAJSTORE_ENGINES"] == YOUR_ENGINES
    # An engine on the Docker host, by the name the proxy maps to it (Docker Desktop has it).
    assert "host.docker.internal:host-gateway" in stack.services["proxy"]["extra_hosts"]


def test_the_default_password_is_for_a_stack_published_on_127_0_0_1_only() -> None:
    for name, service in every_service().services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond this machine"
    for environ, password in (({}, "trajstore"), ({"TRAJSTORE_DB_PASSWORD": "s3cret"}, "s3cret")):
        services = every_service(**environ).services
        assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == password
        assert services["migrate"]["environment"]["TRAJSTORE_DATABASE_URL"] == (
            f"postgresql://trajstore:{password}@postgres:5432/trajstore"
        )


def test_only_the_maintenance_holds_the_owners_password() -> None:
    services = every_service(TRAJSTORE_DB_PASSWORD="s3cret").services
    migrate = services["migrate"]["environment"]
    # Migrations and partition upkeep are DDL; neither serves anything nor publishes a port.
    holders = [n for n, s in services.items() if "s3cret" in str(s.get("environment"))]
    assert sorted(holders) == ["migrate", "partitions", "postgres"]
    assert "ports" not in services["partitions"] and "ports" not in services["migrate"]
    # The proxy and the projector get their role's URL from a volume of their own, which the
    # migration writes; the owner's URL (and password) reaches neither.
    for name, role in (("proxy", "RECORDER"), ("projector", "PROJECTOR")):
        environment = services[name]["environment"]
        assert "TRAJSTORE_DATABASE_URL" not in environment
        assert "s3cret" not in str(environment)
        url_file = environment[f"TRAJSTORE_{role}_DATABASE_URL_FILE"]
        assert migrate[f"TRAJSTORE_{role}_DATABASE_URL_FILE"] == url_file
        [(source, target, mode)] = [v.split(":") for v in services[name]["volumes"]]
        written = [v.split(":")[:2] for v in services["migrate"]["volumes"]]
        assert mode == "ro" and [source, target] in written
        assert url_file.startswith(target + "/")
        other = "projector" if name == "proxy" else "proxy"
        assert source not in str(services[other].get("volumes"))


def test_proxy_and_projector_start_after_a_healthy_database_and_a_finished_migration() -> None:
    services = every_service().services
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    for name in ("proxy", "projector"):
        assert services[name]["depends_on"] == {
            "postgres": {"condition": "service_healthy"},
            "migrate": {"condition": "service_completed_successfully"},
        }
    for name in ("postgres", "proxy", "projector", "engine-cpu", "engine-gpu"):
        assert services[name]["healthcheck"]["test"], f"{name} has no health check"
    # Whatever the switch, what a started service waits for is started too.
    for switch, environ in SWITCHES.items():
        started = resolve(environ).services
        for name, service in started.items():
            assert set(service.get("depends_on", {})) <= set(started), f"{switch}: {name}"


def test_every_trajstore_command_in_compose_is_a_real_cli_command() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["trajstore"]' in dockerfile
    checked = []
    for name, service in every_service().services.items():
        if service.get("image") not in TRAJSTORE_IMAGES or "entrypoint" in service:
            continue
        # --help after the arguments: click rejects an unknown option before it prints help.
        done = subprocess.run(
            [sys.executable, "-m", "trajstore", *service["command"], "--help"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{name}: trajstore {service['command']}: {done.stderr}"
        checked.append(service["command"][0])
    assert sorted(checked) == ["migrate", "partitions", "project", "proxy"]


def test_the_cpu_engine_serves_the_tiny_model_with_the_flags_the_tests_use(
    tmp_path: Path,
) -> None:
    script = resolve({}).services["engine-cpu"]["command"][0]
    assert " ".join(CPU_FLAGS) in script
    assert "--served-model-name tiny" in script
    # The model-making part, run here as the container would (with a local directory).
    match = re.search(r"python -m trajstore\.tiny_model (\S+);", script)
    assert match is not None, script
    target = tmp_path / "tiny"
    done = subprocess.run(
        [sys.executable, "-m", "trajstore.tiny_model", str(target)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"test -f {match[1]}/config.json" in script  # what the container checks to reuse it
    assert (target / "config.json").is_file()


async def test_the_projector_health_check_tells_a_running_projector_from_none(
    database_url: str,
) -> None:
    test = resolve({}).services["projector"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    check = [sys.executable, "-c", test[3]]  # `$$1` in the file: the container sees `$1`
    # As in compose: the projector and its check read the URL the migration wrote for them.
    url_file = world_readable_tempdir("trajstore-compose-") / "url"
    url_file.write_text(database_url + "\n")
    env = {**os.environ, "TRAJSTORE_PROJECTOR_DATABASE_URL_FILE": str(url_file)}
    env.pop("TRAJSTORE_DATABASE_URL", None)

    async def healthy() -> bool:
        probe = await asyncio.create_subprocess_exec(
            *check, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        return await asyncio.wait_for(probe.wait(), 30) == 0

    assert not await healthy()
    projector = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajstore", "project", env=env, stdout=asyncio.subprocess.PIPE
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
    from trajstore.proxy.settings import ProxySettings
    from trajstore.store.settings import StoreSettings

    docs = (ROOT / "docs" / "stack.md").read_text()
    readme = (ROOT / "README.md").read_text()
    fields = [*StoreSettings.model_fields, *ProxySettings.model_fields]
    settings = [f"TRAJSTORE_{f.upper()}" for f in fields]
    compose_variables = re.findall(r"\$\{(\w+)", (ROOT / "compose.yaml").read_text())
    compose_variables += list(read_env_file(ROOT / ".env"))
    missing = [name for name in settings + compose_variables if f"`{name}`" not in docs]
    assert missing == [], f"docs/stack.md does not describe {missing}"
    missing = [name for name in settings if f"`{name}`" not in readme]
    assert missing == [], f"README.md's configuration does not describe {missing}"


# A real Compose, where there is one.


def real_compose() -> tuple[list[str], int]:
    """The command line of an installed Docker Compose and its major version (2 and later: the
    `docker compose` plugin or a docker-compose 2.x; 1: the Python docker-compose); skips the
    test when there is none."""
    candidates = []
    if docker := shutil.which("docker"):
        candidates.append([docker, "compose"])
    beside_python = os.pathsep.join([os.environ.get("PATH", ""), str(Path(sys.executable).parent)])
    if standalone := shutil.which("docker-compose", path=beside_python):
        candidates.append([standalone])
    found: list[tuple[list[str], int]] = []
    for command in candidates:
        done = subprocess.run(
            [*command, "version", "--short"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        version = done.stdout.strip().removeprefix("v")
        if done.returncode == 0 and version.split(".")[0].isdigit():
            found.append((command, int(version.split(".")[0])))
    if not found:
        pytest.skip(
            "no `docker compose` (the plugin) and no docker-compose on PATH: a real Compose is "
            "not compared here (the schema tests above still checked compose.yaml); install "
            "Docker Compose (Debian: docker-compose) to compare it"
        )
    return max(found, key=lambda pair: pair[1])


def _unescaped(node: Any) -> Any:
    """Compose's output with `$$` (how `config` prints a `$`) back to what a container sees."""
    if isinstance(node, str):
        return node.replace("$$", "$")
    if isinstance(node, dict):
        return {key: _unescaped(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_unescaped(item) for item in node]
    return node


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_a_real_compose_starts_the_same_services_with_the_same_settings(switch: str) -> None:
    command, major = real_compose()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAJSTORE_", "COMPOSE_"))}
    # v2 prints JSON and only the services the profiles start; v1 prints YAML and every service
    # with its `profiles` (which services `up` starts with no variables, .ci/compose shows).
    output = ["config", "--format", "json"] if major >= 2 else ["config"]
    done = subprocess.run(
        [*command, "-f", str(ROOT / "compose.yaml"), *output],
        env={**env, **SWITCHES[switch]}, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    theirs = _unescaped(yaml.safe_load(done.stdout)["services"])  # JSON is YAML too
    stack = resolve(SWITCHES[switch])
    ours = stack.services if major >= 2 else stack.document["services"]
    assert set(theirs) == set(ours)
    keys = ["command", "entrypoint", "environment", "healthcheck"]
    keys += ["profiles"] if major < 2 else []
    for name, service in ours.items():
        for key in keys:
            if key == "healthcheck" and key in service:
                assert theirs[name][key]["test"] == service[key]["test"], f"{name}.{key}"
            else:
                assert theirs[name].get(key) == service.get(key), f"{name}.{key}"
