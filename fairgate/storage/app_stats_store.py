"""The per-(app, stage) token statistics in SQL: a snapshot the gateway writes every few seconds and reads at
start, a rebuild from the usage log (`fairgate admin stats rebuild --since …`), and the request-rate
histories from which throttling limits are suggested."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, text
from sqlalchemy.ext.asyncio import async_sessionmaker

from fairgate.accounting.app_stats import AppStats, SuggestedLimits, suggest_limits
from fairgate.storage.models import AppTokenStats, Status, UsageLog


async def load(sessions: async_sessionmaker, stats: AppStats) -> int:
    """Replace ``stats`` with the snapshot; the number of (app, stage) entries read."""
    async with sessions() as s:
        rows = (await s.execute(select(AppTokenStats))).scalars().all()
    if rows:
        stats.load({"landmark": rows[0].landmark,
                    "entries": [{"app": r.app, "stage": r.stage, **json.loads(r.state)} for r in rows]})
    return len(rows)


SNAPSHOT_LOCK = 0x66676173  # the snapshot's PostgreSQL advisory lock ("fgas")


async def save(sessions: async_sessionmaker, stats: AppStats) -> int:
    """Write the whole snapshot in one transaction (it replaces the previous one). Replicas write it one at a
    time: on PostgreSQL the transaction first takes an advisory lock (two writers deleting and re-inserting at
    once collided on the primary key); SQLite serialises writers itself."""
    dump = stats.dump()
    async with sessions.begin() as s:
        if s.bind.dialect.name == "postgresql":
            await s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": SNAPSHOT_LOCK})
        await s.execute(delete(AppTokenStats))
        for e in dump["entries"]:
            key = (e["app"], int(e["stage"]))
            entry = stats.entries[key]
            s.add(AppTokenStats(app=e["app"], stage=int(e["stage"]), samples=e["n"],
                                mean_input=entry.value("input", "mean"), mean_system=entry.value("system", "mean"),
                                mean_output=entry.value("output", "mean"), landmark=dump["landmark"],
                                state=json.dumps({"w": e["w"], "n": e["n"], "dists": e["dists"]})))
    return len(dump["entries"])


def _ok(stmt, since: datetime | None):
    stmt = stmt.where(UsageLog.status == Status.OK.value)
    return stmt if since is None else stmt.where(UsageLog.arrival >= since)


async def rebuild(sessions: async_sessionmaker, stats: AppStats, since: datetime | None = None) -> int:
    """Recompute the statistics from the usage log's finished calls (from ``since``) and save them."""
    stats.entries.clear()
    stmt = _ok(select(UsageLog.app, UsageLog.stage, UsageLog.prompt_tokens, UsageLog.system_tokens,
                      UsageLog.completion_tokens, UsageLog.arrival), since).order_by(UsageLog.arrival)
    n = 0
    async with sessions() as s:
        for app, stage, prompt, system, completion, arrival in (await s.execute(stmt)).all():
            stats.observe(app, stage, max(0, prompt - system), system, completion, arrival.timestamp())
            n += 1
    await save(sessions, stats)
    return n


async def limits(sessions: async_sessionmaker, since: datetime | None = None, q: float = 0.99,
                 app_headroom: float = 2.0) -> SuggestedLimits:
    """Suggested limits from the usage log's arrivals (every request, throttled ones included)."""
    stmt = select(UsageLog.arrival, UsageLog.user, UsageLog.app)
    if since is not None:
        stmt = stmt.where(UsageLog.arrival >= since)
    async with sessions() as s:
        arrivals = [(t.timestamp(), u or f"app:{a}", a) for t, u, a in (await s.execute(stmt)).all()]
    return suggest_limits(arrivals, q, app_headroom=app_headroom)


async def report(sessions: async_sessionmaker, since: datetime | None = None, q: float = 0.99) -> dict[str, Any]:
    """What `fairgate admin stats` shows: the snapshot's expected tokens and the suggested limits."""
    stats = AppStats()
    await load(sessions, stats)
    lim = await limits(sessions, since, q)
    return {"stats": stats.rows(),
            "suggested": {"quantile": q, "user_rpm": lim.user_rpm, "app_rpm": lim.app_rpm,
                          "users_over": sorted((u for u, p in lim.user_p.items() if p > lim.user_rpm))}}
