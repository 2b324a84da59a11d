"""Schema migrations: Alembic, driven from Python (`trajstore migrate`) or its own CLI.

The revisions live in the top-level `alembic/` folder of the repository; a wheel carries them
inside this package as `store/_alembic`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic.config import Config
from sqlalchemy.exc import DBAPIError

from alembic import command
from store.errors import MigrationBlocked

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


@contextmanager
def _lock_timeouts_explained() -> Iterator[None]:
    # A revision that must lock a table the proxy writes to gives up after a few seconds
    # (0006 does), rather than queue every append behind its lock request.
    try:
        yield
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) != "55P03":  # lock_not_available
            raise
        raise MigrationBlocked(
            "a migration could not lock a table in time: a long transaction holds it (see "
            "pg_stat_activity); run `trajstore migrate` again once that transaction has ended"
        ) from exc


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision` (synchronous: call it off the loop)."""
    with _lock_timeouts_explained():
        command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at `url` down to `revision`."""
    with _lock_timeouts_explained():
        command.downgrade(alembic_config(url), revision)
