"""compose.yaml as Compose resolves it, without Docker: what `docker compose config` would print.

Only what compose.yaml uses of the Compose specification, so that it reads in one sitting:
- the `.env` beside the file gives the variables the environment does not set (a variable set
  to the empty string in the environment still wins);
- in every value (not in keys): `$VAR` and `${VAR}` (unset: empty), `${VAR:-default}` (unset or
  empty), `${VAR-default}` (unset), `${VAR:?message}` and `${VAR?message}` (stop with the
  message), `${VAR:+other}` and `${VAR+other}` (the reverse), and `$$` for one `$`; a `$` before
  anything else is left as it is, as Compose v2 does. Nested defaults (`${A:-${B}}`) are not
  supported;
- YAML anchors and `<<` merge keys, which PyYAML's safe loader resolves;
- profiles: a service without any always starts; one with profiles starts when COMPOSE_PROFILES
  (comma-separated, `*` for all) names one of them.
tests/test_compose.py compares the result with a real Compose v2 wherever one is installed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from jsonschema.validators import validator_for

COMPOSE_FILE = Path(__file__).resolve().parent.parent / "compose.yaml"
SCHEMA_FILE = Path(__file__).resolve().parent / "compose-spec.json"

_NAME = r"[_A-Za-z][_A-Za-z0-9]*"
_TEMPLATE = re.compile(
    rf"\$(?:(?P<escaped>\$)|(?P<named>{_NAME})"
    rf"|\{{(?P<braced>{_NAME})(?:(?P<operator>:?[-?+])(?P<argument>[^}}]*))?\}}|(?P<invalid>\{{))"
)


class ComposeError(Exception):
    """Compose would stop on this file before starting anything."""


@dataclass(frozen=True)
class Stack:
    """A compose file resolved for one environment."""

    document: dict[str, Any]  # the whole file, interpolated: every service, whatever its profile
    profiles: frozenset[str]  # the active profiles

    @property
    def services(self) -> dict[str, dict[str, Any]]:
        """The services `docker compose up` starts, by name."""
        return {
            name: service
            for name, service in self.document["services"].items()
            if not service.get("profiles")
            or "*" in self.profiles
            or self.profiles & set(service["profiles"])
        }


def resolve(environ: Mapping[str, str], path: Path = COMPOSE_FILE) -> Stack:
    """Resolve the compose file as Compose would in `environ` (pass {} for no variables at all)."""
    variables = {**read_env_file(path.parent / ".env"), **environ}
    document = _interpolate_values(yaml.safe_load(path.read_text()), variables)
    profiles = variables.get("COMPOSE_PROFILES", "").split(",")
    return Stack(document, frozenset(p.strip() for p in profiles if p.strip()))


def read_env_file(path: Path) -> dict[str, str]:
    """The variables of a Compose `.env` file (`NAME=value` lines; `#` starts a comment line)."""
    variables: dict[str, str] = {}
    if not path.exists():
        return variables
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, equals, value = line.removeprefix("export ").partition("=")
        if not equals:
            raise ComposeError(f"{path}: not a NAME=value line: {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] in "'\"" and value[-1] == value[0]:
            value = value[1:-1]
        else:
            value = value.split(" #", 1)[0].rstrip()  # an unquoted value ends at ` #`
        variables[name.strip()] = value
    return variables


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """Substitute Compose's `$` forms in one value."""

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["invalid"]:
            raise ComposeError(f"invalid interpolation format in {text!r}")
        name = match["named"] or match["braced"]
        operator, argument = match["operator"] or "", match["argument"]
        value = variables.get(name)
        # With a colon, an empty value counts as unset.
        if operator.startswith(":") and value == "":
            value = None
        if operator.endswith("-"):
            return argument if value is None else value
        if operator.endswith("?"):
            if value is None:
                raise ComposeError(f"required variable {name} is missing a value: {argument}")
            return value
        if operator.endswith("+"):
            return "" if value is None else argument
        return value or ""

    return _TEMPLATE.sub(substitute, text)


def _interpolate_values(node: Any, variables: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, dict):
        return {key: _interpolate_values(value, variables) for key, value in node.items()}
    if isinstance(node, list):
        return [_interpolate_values(item, variables) for item in node]
    return node


@cache
def _schema_validator() -> Any:
    schema = json.loads(SCHEMA_FILE.read_text())
    validator = validator_for(schema)
    validator.check_schema(schema)
    return validator(schema)


def schema_errors(document: Mapping[str, Any]) -> list[str]:
    """What the Compose specification's schema finds wrong in a resolved document, one per line."""
    return [
        f"{'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
        for error in _schema_validator().iter_errors(document)
    ]
