"""Audit queries over the usage log: summaries per user / app / interaction, top-N, failures, export."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import async_sessionmaker

from fairgate.storage.models import UsageLog

# A user is a user of its app (the same name in two apps is two users; a shared user shows once per app), and
# an interaction is its user's: both group with the columns that scope them.
GROUPS = {"user": (UsageLog.app, UsageLog.user), "app": (UsageLog.app,),
          "interaction": (UsageLog.app, UsageLog.user, UsageLog.interaction),
          "model": (UsageLog.model,), "backend": (UsageLog.backend,)}
FAILED = ("error", "cancelled", "throttled", "rejected")


def _window(stmt, since: datetime | None, until: datetime | None, **eq: str | None):
    if since is not None:
        stmt = stmt.where(UsageLog.arrival >= since)
    if until is not None:
        stmt = stmt.where(UsageLog.arrival < until)
    for col, value in eq.items():
        if value is not None:
            stmt = stmt.where(getattr(UsageLog, col) == value)
    return stmt


async def summary(sessions: async_sessionmaker, by: str, since: datetime | None = None,
                  until: datetime | None = None, top: int | None = None, **eq: str | None) -> list[dict[str, Any]]:
    """One object per group: requests, token sums, errors and throttles; ordered by total tokens."""
    keys = GROUPS[by]
    total = func.sum(UsageLog.prompt_tokens + UsageLog.completion_tokens)
    count_if = lambda cond: func.sum(case((cond, 1), else_=0))  # noqa: E731
    stmt = select(
        *keys, func.count().label("requests"),
        func.coalesce(func.sum(UsageLog.prompt_tokens), 0).label("prompt_tokens"),
        func.coalesce(func.sum(UsageLog.system_tokens), 0).label("system_tokens"),
        func.coalesce(func.sum(UsageLog.cached_tokens), 0).label("cached_tokens"),
        func.coalesce(func.sum(UsageLog.completion_tokens), 0).label("completion_tokens"),
        func.coalesce(total, 0).label("total_tokens"),
        count_if(UsageLog.status == "ok").label("ok"),
        count_if(UsageLog.status == "error").label("errors"),
        count_if(UsageLog.status == "cancelled").label("cancelled"),
        count_if(UsageLog.status == "throttled").label("throttled"),
    ).group_by(*keys).order_by(total.desc(), *keys)
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
               failed_only: bool = False, limit: int | None = None, **eq: str | None) -> list[dict[str, Any]]:
    stmt = _window(select(UsageLog), since, until, **eq).order_by(UsageLog.arrival, UsageLog.id)
    if failed_only:
        stmt = stmt.where(UsageLog.status.in_(FAILED))
    if limit:
        stmt = stmt.limit(limit)
    async with sessions() as s:
        return [_row(r) for r in (await s.execute(stmt)).scalars()]
