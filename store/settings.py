"""Configuration of the store: one pydantic-settings object, environment prefix `TRAJSTORE_`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import platformdirs
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_data_dir() -> Path:
    """Where trajstore keeps its private PostgreSQL when no database URL is configured.

    As root the server runs as an unprivileged user, which cannot enter root's home; so root's
    data lives under /var/lib instead.
    """
    if os.geteuid() == 0:
        return Path("/var/lib/trajstore")
    return Path(platformdirs.user_data_dir("trajstore", appauthor=False))


class StoreSettings(BaseSettings):
    """Where the event log lives. Every field is read from `TRAJSTORE_<NAME>`."""

    model_config = SettingsConfigDict(env_prefix="TRAJSTORE_", extra="ignore")

    database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL; when unset, trajstore starts its own private server.",
    )
    recorder_database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL the proxy records with, as a trajstore_recorder login "
        "(default: the embedded server's socket as that role, else TRAJSTORE_DATABASE_URL).",
    )
    projector_database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL the projector writes samples with, as a trajstore_projector "
        "login (default: the embedded server's socket as that role, else TRAJSTORE_DATABASE_URL).",
    )
    recorder_database_url_file: Path | None = Field(
        default=None,
        description="A file holding the proxy's URL (read when TRAJSTORE_RECORDER_DATABASE_URL "
        "is unset); `trajstore migrate` writes it, with a generated password, when it is set.",
    )
    projector_database_url_file: Path | None = Field(
        default=None,
        description="A file holding the projector's URL, as TRAJSTORE_RECORDER_DATABASE_URL_FILE.",
    )
    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="Directory of the embedded PostgreSQL (its data, socket and log).",
    )
    embedded_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="TCP port (127.0.0.1) of the embedded PostgreSQL; unset: the port it was "
        "made with, else 54329.",
    )
    pg_bin_dir: Path | None = Field(
        default=None,
        description="PostgreSQL server binaries for the embedded server (default: found).",
    )


def store_settings_of(ctx: Any) -> StoreSettings:
    """The store settings the `trajstore` group made from its options (a click context's
    object), else those of the environment: what every command that opens the store reads."""
    settings: StoreSettings | None = (ctx.find_object(dict) or {}).get("settings")
    return settings or StoreSettings()
