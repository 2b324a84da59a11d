"""Every error the viewer raises, rooted at one class; the app turns each into a page.

    ViewerError
    ├── PageNotFound        no such run, session, turn or sample (HTTP 404)
    └── BadFilter           a query parameter that cannot be read (HTTP 400)

The store's own errors (`trajstore.store.errors`) pass through: `SessionNotFound` is a 404 page,
`StoreUnavailable` a 503 page.
"""

from __future__ import annotations


class ViewerError(Exception):
    """The viewer cannot show this page."""

    status = 500

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class PageNotFound(ViewerError, LookupError):
    """There is nothing here: no such run, session or turn in the store."""

    status = 404


class BadFilter(ViewerError, ValueError):
    """A filter of the page cannot be read."""

    status = 400
