"""The runs: every run at a glance, and one run's figures, plots and sessions.

GET /                the runs: sessions by status, first and last session
GET /runs/{run_id}   one run: status counts, reward mean and distribution, tokens, turns;
                     reward and length over time by policy version; its sessions, filtered
                     (status, task, reward range, divergence, discarded) and sorted
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlencode

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse

from trajstore.viewer import queries
from trajstore.viewer.errors import BadFilter, PageNotFound
from trajstore.viewer.state import Viewer, viewer

router = APIRouter()
ViewerDep = Annotated[Viewer, Depends(viewer)]

#: Sessions a run page's figures and plots are made of (the newest are left out beyond it).
MAX_PLOTTED = 20_000
SESSIONS_PER_PAGE = 50
STATUSES = ("active", "completed", "aborted", "error", "timeout")
#: Plotted policy versions; the rest share one series.
MAX_SERIES = 8


@router.get("/", response_class=HTMLResponse)
async def runs_page(request: Request, app: ViewerDep) -> HTMLResponse:
    """Every run, newest first, with its sessions by status."""
    rows = await app.store.fetch(queries.RUNS)
    found: dict[str, dict[str, Any]] = {}
    for row in rows:
        run = found.setdefault(row["run_id"], {"run_id": row["run_id"], "sessions": 0,
                                                "statuses": {}, "first_at": row["first_at"],
                                                "last_at": row["last_at"]})  # fmt: skip
        run["sessions"] += row["sessions"]
        run["statuses"][row["status"]] = row["sessions"]
        run["first_at"] = min(run["first_at"], row["first_at"])
        run["last_at"] = max(run["last_at"], row["last_at"])
    listed = sorted(found.values(), key=lambda r: r["last_at"], reverse=True)
    return app.templates.TemplateResponse(request, "runs.html", {"runs": listed})


@dataclass(frozen=True)
class SessionFilter:
    """The sessions' table's filters and order, as the page's form sends them."""

    status: str | None = None
    task: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    divergence: bool | None = None
    discarded: bool | None = None
    sort: str = "created"
    descending: bool = False
    page: int = 1

    @classmethod
    def parse(cls, params: dict[str, str]) -> SessionFilter:
        """Read the query string; `BadFilter` names what cannot be read. Empty means any."""
        given = {k: v.strip() for k, v in params.items() if v.strip()}
        unknown = set(given) - {"status", "task", "reward_min", "reward_max", "divergence",
                                "discarded", "sort", "order", "page"}  # fmt: skip
        if unknown:
            raise BadFilter(f"unknown filter(s): {', '.join(sorted(unknown))}")
        status = given.get("status")
        if status is not None and status not in STATUSES:
            raise BadFilter(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
        sort = given.get("sort", "created")
        if sort not in queries.SORTABLE:
            raise BadFilter(f"sort must be one of {', '.join(queries.SORTABLE)}, not {sort!r}")
        order = given.get("order", "asc")
        if order not in ("asc", "desc"):
            raise BadFilter(f"order must be asc or desc, not {order!r}")
        reward_min, reward_max = (_number(given, k) for k in ("reward_min", "reward_max"))
        if reward_min is not None and reward_max is not None and reward_min > reward_max:
            raise BadFilter(f"reward_min ({reward_min}) is above reward_max ({reward_max})")
        page = given.get("page", "1")
        if not page.isdigit() or int(page) < 1:
            raise BadFilter(f"page must be a whole number from 1, not {page!r}")
        return cls(status, given.get("task"), reward_min, reward_max, _yes_no(given, "divergence"),
                   _yes_no(given, "discarded"), sort, order == "desc", int(page))  # fmt: skip

    def arguments(self) -> list[Any]:
        """The filter's parameters of `queries.sessions_page`, $2 to $7."""
        return [self.status, self.task, self.reward_min, self.reward_max, self.divergence,
                self.discarded]  # fmt: skip

    def query(self, **changes: Any) -> str:
        """This filter as a query string, with `changes` (for sort links and pages)."""
        values = {
            "status": self.status, "task": self.task, "reward_min": self.reward_min,
            "reward_max": self.reward_max, "divergence": _word(self.divergence),
            "discarded": _word(self.discarded), "sort": self.sort,
            "order": "desc" if self.descending else "asc", "page": self.page,
        }  # fmt: skip
        values.update(changes)
        return urlencode({k: v for k, v in values.items() if v is not None})


def _number(given: dict[str, str], key: str) -> float | None:
    if key not in given:
        return None
    try:
        value = float(given[key])
    except ValueError:
        raise BadFilter(f"{key} must be a number, not {given[key]!r}") from None
    if not math.isfinite(value):
        raise BadFilter(f"{key} must be a finite number, not {given[key]!r}")
    return value


def _yes_no(given: dict[str, str], key: str) -> bool | None:
    value = given.get(key)
    if value is None:
        return None
    if value not in ("yes", "no"):
        raise BadFilter(f"{key} must be yes or no, not {value!r}")
    return value == "yes"


def _word(value: bool | None) -> str | None:
    return None if value is None else ("yes" if value else "no")


def _histogram(values: list[float], bins: int = 10) -> list[dict[str, Any]]:
    """Equal-width bins over the values' range (one bin when they are all equal)."""
    if not values:
        return []
    low, high = min(values), max(values)
    if high == low:
        return [{"low": low, "high": high, "count": len(values), "share": 1.0}]
    width = (high - low) / bins
    counts = Counter(min(int((v - low) / width), bins - 1) for v in values)
    top = max(counts.values())
    return [{"low": low + i * width, "high": low + (i + 1) * width, "count": counts.get(i, 0),
             "share": counts.get(i, 0) / top} for i in range(bins)]  # fmt: skip


def run_figures(rows: list[Any]) -> dict[str, Any]:
    """Counts, reward statistics and the plots' data of a run's sessions."""
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    tokens = [r["prompt_tokens"] + r["completion_tokens"] for r in rows]
    turns = [r["turns"] for r in rows]
    by_version: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        versions = row["policy_versions"] or []
        by_version[versions[-1] if versions else "none"].append(i)
    names = sorted(by_version, key=lambda v: (len(v), v))
    if len(names) > MAX_SERIES:  # the newest versions get their own series
        kept, rest = names[-(MAX_SERIES - 1) :], names[: -(MAX_SERIES - 1)]
        by_version["older"] = sorted(i for v in rest for i in by_version.pop(v))
        names = ["older", *kept]
    plot = {
        "x": [r["created_at"].timestamp() for r in rows],
        "series": [
            {
                "label": f"policy {name}" if name not in ("none", "older") else name,
                "reward": [rows[i]["reward"] if i in members else None for i in range(len(rows))],
                "tokens": [tokens[i] if i in members else None for i in range(len(rows))],
            }
            for name in names
            for members in [set(by_version[name])]
        ],
    }
    return {
        "sessions": len(rows),
        "statuses": Counter(r["status"] for r in rows),
        "discarded": sum(1 for r in rows if r["discarded"]),
        "diverged": sum(1 for r in rows if r["divergences"]),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "rewarded": len(rewards),
        "histogram": _histogram(rewards),
        "tokens": sum(tokens),
        "tokens_mean": sum(tokens) / len(tokens) if tokens else None,
        "turns_mean": sum(turns) / len(turns) if turns else None,
        "turns_max": max(turns, default=0),
        "tasks": sorted({r["task_id"] for r in rows if r["task_id"] is not None}),
        "plot": orjson.dumps(plot).decode(),
        "capped": len(rows) >= MAX_PLOTTED,
    }


@router.get("/runs/{run_id}", response_class=HTMLResponse)
async def run_page(request: Request, app: ViewerDep, run_id: str) -> HTMLResponse:
    """One run: its figures and plots, and its sessions' table."""
    chosen = SessionFilter.parse(dict(request.query_params))
    store = app.store
    if not await store.fetchval(queries.RUN_EXISTS, run_id):
        raise PageNotFound(f"no run {run_id!r} in the store")
    rows = await store.fetch(queries.RUN_SESSIONS, run_id, MAX_PLOTTED)
    page = await store.fetch(
        queries.sessions_page(chosen.sort, chosen.descending), run_id, *chosen.arguments(),
        SESSIONS_PER_PAGE, (chosen.page - 1) * SESSIONS_PER_PAGE,
    )  # fmt: skip
    total = page[0]["total"] if page else 0
    context = {
        "run_id": run_id,
        "figures": run_figures(rows),
        "sessions": page,
        "total": total,
        "pages": max(1, math.ceil(total / SESSIONS_PER_PAGE)),
        "filter": chosen,
        "statuses": STATUSES,
        "sortable": queries.SORTABLE,
    }
    return app.templates.TemplateResponse(request, "run.html", context)
