"""Schema migrations: Alembic, driven from Python (`trajstore migrate`) or its own CLI.

The revisions live in the top-level `alembic/` folder of the repository; a wheel carries them
inside this package as `store/_alembic`.
"""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config

from alembic import command

_REPO_SCRIPTS = Path(__file__).resolve().parent.parent / "alembic"
_PACKAGED_SCRIPTS = Path(__file__).resolve().parent / "_alembic"


def alembic_config(url: str) -> Config:
    """An Alembic configuration pointing at the store's revisions and at `url`."""
    scripts = _REPO_SCRIPTS if (_REPO_SCRIPTS / "env.py").is_file() else _PACKAGED_SCRIPTS
    config = Config()
    config.set_main_option("script_location", str(scripts))
    # Passed as an attribute, not an option: configparser would choke on '%' in passwords.
    config.attributes["database_url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision` (synchronous: call it off the loop)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at `url` down to `revision`."""
    command.downgrade(alembic_config(url), revision)
