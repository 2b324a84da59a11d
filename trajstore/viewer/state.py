"""What every page needs: the read-only store, the token text, the templates, the cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.templating import Jinja2Templates

from trajstore.store.eventstore import EventStore
from trajstore.viewer.settings import ViewerSettings
from trajstore.viewer.tokens import TokenTexts

if TYPE_CHECKING:
    from trajstore.viewer.cache import SessionCache

HERE = Path(__file__).parent


@dataclass
class Viewer:
    """The viewer's state, one per app, made when it starts (`app.create_app`)."""

    store: EventStore  #: on read-only connections (`app.open_read_only`)
    texts: TokenTexts
    templates: Jinja2Templates
    sessions: SessionCache
    settings: ViewerSettings


def viewer(request: Request) -> Viewer:
    """The app's `Viewer` (a FastAPI dependency)."""
    state: Viewer = request.app.state.viewer
    return state
