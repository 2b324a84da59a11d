"""Schema migrations: Alembic, driven from Python (`trajstore migrate`) or its own CLI.

The revisions live in the top-level `alembic/` folder of the repository; this package reaches
them as `_alembic` (a link in the repository, a copy in a wheel).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic.config import Config
from sqlalchemy.exc import DBAPIError

from alembic import command
from trajstore.store.errors import MigrationBlocked

_SCRIPTS = Path(__file__).parent / "_alembic"


def alembic_config(url: str) -> Config:
    """An Alembic configuration pointing at the store's revisions and at `url`."""
    config = Config()
    config.set_main_option("script_location", str(_SCRIPTS))
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
