"""The trajectory viewer: runs, sessions, turns and every token's logprob, in a browser.

Server-rendered pages (FastAPI + Jinja2) over the event log, read-only: `trajstore ui` serves
them, `trajstore up` serves them beside the proxy. The viewer reads through `trajstore.store`
(sessions rebuilt from their events, samples built by the projection's rules, the
`trajectories` view); nothing in store/, proxy/ or trainer/ imports it. docs/viewer.md says
what each page shows.
"""

from __future__ import annotations

from trajstore.viewer.app import create_app, open_read_only
from trajstore.viewer.settings import ViewerSettings

__all__ = ["ViewerSettings", "create_app", "open_read_only"]
