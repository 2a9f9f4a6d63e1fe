"""Audit queries over the usage log: summaries per user / app / interaction, top-N, failures, export."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import String, case, func, select
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from fairgate.storage.models import Status, UsageLog


class _TimeBucket(FunctionElement):
    """The UTC hour or day an arrival falls in, as ISO text (``2026-11-24`` or ``2026-11-24T05:00``)."""

    type = String()
    inherit_cache = True

    def __init__(self, column, unit: str):
        super().__init__(column)
        self.unit = unit


@compiles(_TimeBucket, "sqlite")
def _bucket_sqlite(element, compiler, **kw):
    fmt = {"day": "%Y-%m-%d", "hour": "%Y-%m-%dT%H:00"}[element.unit]
    return f"strftime('{fmt}', {compiler.process(element.clauses, **kw)})"


@compiles(_TimeBucket, "postgresql")
def _bucket_postgresql(element, compiler, **kw):
    fmt = {"day": "YYYY-MM-DD", "hour": 'YYYY-MM-DD"T"HH24:00'}[element.unit]
    return f"to_char({compiler.process(element.clauses, **kw)} AT TIME ZONE 'UTC', '{fmt}')"


# A user is a user of its app (the same name in two apps is two users; a shared user shows once per app), and
# an interaction is its user's: both group with the columns that scope them. Time groups are UTC.
GROUPS = {"user": (UsageLog.app, UsageLog.user), "app": (UsageLog.app,),
          "interaction": (UsageLog.app, UsageLog.user, UsageLog.interaction),
          "model": (UsageLog.model,), "backend": (UsageLog.backend,), "slo_class": (UsageLog.slo_class,),
          "day": (_TimeBucket(UsageLog.arrival, "day").label("day"),),
          "hour": (_TimeBucket(UsageLog.arrival, "hour").label("hour"),)}
TIME_GROUPS = ("day", "hour")
FAILED = tuple(s.value for s in Status if s is not Status.OK)
STATUSES = {"ok": Status.OK.value, "errors": Status.ERROR.value, "cancelled": Status.CANCELLED.value,
            "throttled": Status.THROTTLED.value, "rejected": Status.REJECTED.value}  # column → status: every row is in exactly one, so they add up to requests


def group_keys(by: list[str]) -> list:
    """The columns a summary grouped ``by`` these starts with: time first, then in order, no repeats."""
    keys: dict[str, Any] = {}
    for b in sorted(by, key=lambda b: b not in TIME_GROUPS):
        keys.update((c.key, c) for c in GROUPS[b] if c.key not in keys)
    return list(keys.values())


def _window(stmt, since: datetime | None, until: datetime | None, **eq: str | None):
    if since is not None:
        stmt = stmt.where(UsageLog.arrival >= since)
    if until is not None:
        stmt = stmt.where(UsageLog.arrival < until)
    for col, value in eq.items():
        if value is not None:
            stmt = stmt.where(getattr(UsageLog, col) == value)
    return stmt


async def summary(sessions: async_sessionmaker, by: str | list[str], since: datetime | None = None,
                  until: datetime | None = None, top: int | None = None, **eq: str | None) -> list[dict[str, Any]]:
    """One object per group: requests, token sums, and the requests by outcome (``ok + errors + cancelled +
    throttled + rejected = requests``); time groups newest first, then by total tokens."""
    keys = group_keys([by] if isinstance(by, str) else by)
    times = [c for c in keys if c.key in TIME_GROUPS]
    total = func.sum(UsageLog.prompt_tokens + UsageLog.completion_tokens)
    count_if = lambda cond: func.sum(case((cond, 1), else_=0))  # noqa: E731
    stmt = select(
        *keys, func.count().label("requests"),
        func.coalesce(func.sum(UsageLog.prompt_tokens), 0).label("prompt_tokens"),
        func.coalesce(func.sum(UsageLog.system_tokens), 0).label("system_tokens"),
        func.coalesce(func.sum(UsageLog.cached_tokens), 0).label("cached_tokens"),
        func.coalesce(func.sum(UsageLog.completion_tokens), 0).label("completion_tokens"),
        func.coalesce(total, 0).label("total_tokens"),
        *(count_if(UsageLog.status == status).label(column) for column, status in STATUSES.items()),
        count_if(UsageLog.slo_met.is_not(None)).label("slo_requests"),  # requests judged by an SLO class,
        count_if(UsageLog.slo_met.is_(True)).label("slo_met"),  # and those that met its targets
    ).group_by(*keys).order_by(*(t.desc() for t in times), total.desc(), *(k for k in keys if k not in times))
    stmt = _window(stmt, since, until, **eq)
    if top:
        stmt = stmt.limit(top)
    async with sessions() as s:
        names = {c.key for c in keys}
        return [{k: (int(v) if k not in names and v is not None else v) for k, v in row._mapping.items()}
                for row in await s.execute(stmt)]


def _row(r: UsageLog) -> dict[str, Any]:
    out = {}
    for col in UsageLog.__table__.columns:
        v = getattr(r, col.key)
        out[col.key] = v.isoformat() if isinstance(v, datetime) else v
    return out


async def rows(sessions: async_sessionmaker, since: datetime | None = None, until: datetime | None = None,
               failed_only: bool = False, limit: int | None = None, newest_first: bool = False,
               **eq: str | None) -> list[dict[str, Any]]:
    """Usage rows in arrival order (``newest_first``: the other way)."""
    order = (UsageLog.arrival.desc(), UsageLog.id.desc()) if newest_first else (UsageLog.arrival, UsageLog.id)
    stmt = _window(select(UsageLog), since, until, **eq).order_by(*order)
    if failed_only:
        stmt = stmt.where(UsageLog.status.in_(FAILED))
    if limit:
        stmt = stmt.limit(limit)
    async with sessions() as s:
        return [_row(r) for r in (await s.execute(stmt)).scalars()]


REPLAYED = ("arrival", "dispatched_at", "finished_at", "app", "user", "fairness_key", "interaction", "stage",
            "prompt_tokens", "completion_tokens", "policy", "backend", "slo_ttft_ms", "slo_atgt_ms", "slo_met")


async def served_rows(sessions: async_sessionmaker, since: datetime | None = None, until: datetime | None = None,
                      limit: int | None = None) -> list[dict[str, Any]]:
    """The served rows (``ok``) in arrival order, with only what a replay reads (``REPLAYED``): a million of
    them are a few hundred MB, read in batches."""
    columns = [getattr(UsageLog, c) for c in REPLAYED]
    stmt = _window(select(*columns), since, until).where(UsageLog.status == Status.OK.value)
    stmt = stmt.order_by(UsageLog.arrival, UsageLog.id).execution_options(yield_per=20_000)
    if limit:
        stmt = stmt.limit(limit)
    out: list[dict[str, Any]] = []
    async with sessions() as s:
        async for part in (await s.stream(stmt)).partitions():  # (a batch a switch, not a row)
            out += [dict(zip(REPLAYED, row), status="ok") for row in part]
    return out


async def refused_interactions(sessions: async_sessionmaker, since: datetime | None = None,
                               until: datetime | None = None) -> int:
    """Interactions with a request refused for load or a limit (``throttled``) in the window."""
    pairs = _window(select(UsageLog.app, UsageLog.fairness_key, UsageLog.interaction), since, until).where(
        UsageLog.status == Status.THROTTLED.value).distinct().subquery()
    async with sessions() as s:
        return int((await s.execute(select(func.count()).select_from(pairs))).scalar_one() or 0)
