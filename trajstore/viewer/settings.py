"""Configuration of the viewer: one pydantic-settings object, environment prefix `TRAJSTORE_UI_`.

Where the event log is comes from the store's settings (`TRAJSTORE_DATABASE_URL`, else the
embedded server), as for every other command.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ViewerSettings(BaseSettings):
    """How `trajstore ui` serves the pages. Every field is read from `TRAJSTORE_UI_<NAME>`."""

    model_config = SettingsConfigDict(env_prefix="TRAJSTORE_UI_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Interface the viewer listens on.")
    port: int = Field(default=8500, ge=0, le=65535, description="Port the viewer listens on.")
    tokenizer: Path | None = Field(
        default=None,
        description="A model directory (or its tokenizer.json) whose tokenizer gives the token "
        "text; unset: the tokenizer of the model the session's engine reports, else the "
        "engine's /detokenize, else token ids.",
    )
    poll_interval: float = Field(
        default=1.0,
        gt=0,
        description="Seconds between looks at an active session's log (live pages).",
    )
