"""`fairgate usage spend`: what each app, user or key spent — tokens, and money at `admin price set`'s prices
— against its budget, from the usage log (the rows are the record; the gateways' meters only enforce).

Without ``since``, each one's spend runs from the start of its budget's current period (a calendar day, week or
month in ``timezone``, or all time), and this calendar month for one without a budget: at most four grouped
queries whatever the number of tenants."""

from __future__ import annotations

import time
from datetime import datetime
from datetime import timezone as tz_utc
from typing import Any
from zoneinfo import ZoneInfo

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import async_sessionmaker

from fairgate.quota.meters import period
from fairgate.storage.identity import user_key
from fairgate.storage.models import Price, Quota, UsageLog

GROUPS = {"app": (UsageLog.app,), "user": (UsageLog.app, UsageLog.user), "key": (UsageLog.key_id,)}


def _target(by: str, row) -> str | None:
    if by == "app":
        return f"app:{row[0]}"
    if by == "user":
        return None if row[1] is None else f"user:{user_key(row[0], row[1])}"
    return None if row[0] is None else f"key:{row[0]}"


async def spend(sessions: async_sessionmaker, by: str = "app", since: datetime | None = None,
                timezone: str = "UTC", now: float | None = None) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    zone = ZoneInfo(timezone)
    cols = GROUPS[by]
    async with sessions() as s:
        budgets = {q.target: q for q in (await s.execute(select(Quota))).scalars()
                   if q.budget_tokens is not None or q.budget_usd is not None}
        prices = {p.model: p for p in (await s.execute(select(Price))).scalars()}
        starts: dict[str, float | None] = {}  # period → its start (None: all time)
        for kind in {q.budget_period for q in budgets.values()} | {"month"}:
            name, _ = period(kind, now, zone)
            starts[kind] = None if kind == "total" else datetime.strptime(name, "%Y-%m-%d").replace(
                tzinfo=zone).timestamp()
        windows = {"since": since} if since is not None else {
            k: None if v is None else datetime.fromtimestamp(v, tz_utc.utc) for k, v in starts.items()}
        sums: dict[str, dict[tuple, list]] = {}
        for name, start in windows.items():
            stmt = select(*cols, UsageLog.model, func.sum(UsageLog.prompt_tokens), func.sum(UsageLog.cached_tokens),
                          func.sum(UsageLog.completion_tokens)).group_by(*cols, UsageLog.model)
            if start is not None:
                stmt = stmt.where(UsageLog.arrival >= start)
            for row in (await s.execute(stmt)).all():
                key = tuple(row[:len(cols)])
                sums.setdefault(name, {}).setdefault(key, []).append(row[len(cols):])
    out = []
    keys = {k for per in sums.values() for k in per}
    for key in sorted(keys, key=lambda k: tuple("" if x is None else str(x) for x in k)):
        target = _target(by, key)
        q = budgets.get(target) if target else None
        if q is None and by == "user" and key[1] is not None:  # a user shared among apps has its budget by name
            q = budgets.get(f"user:{key[1]}")
        window = "since" if since is not None else (q.budget_period if q is not None else "month")
        tokens, usd, priced = 0, 0.0, True
        for model, prompt, cached, completion in sums.get(window, {}).get(key, []):
            prompt, cached, completion = int(prompt or 0), int(cached or 0), int(completion or 0)
            tokens += prompt + completion
            p = prices.get(model)
            if p is None:
                priced = priced and prompt + completion == 0
                continue
            cached_price = p.input if p.cached is None else p.cached
            usd += ((prompt - cached) * p.input + cached * cached_price + completion * p.output) / 1e6
        row = dict(zip(("app", "user") if by == "user" else (by,), key))
        out.append({**row, "tokens": tokens, "usd": round(usd, 9) if priced else None,
                    "budget_tokens": q.budget_tokens if q is not None else None,
                    "budget_usd": q.budget_usd if q is not None else None,
                    "period": None if since is not None else window})
    return out


async def spent_since(sessions: async_sessionmaker, target: str, start: float | None, unit: str,
                      prices: dict[str, tuple[float, float, float]]) -> float:
    """What ``target`` (``app:A``, ``user:A/U``, ``user:U`` shared, ``key:ID``) spent since ``start`` (wall
    seconds; None: ever) by its rows: tokens, or nano-USD at ``prices`` (model → USD per million input, output,
    cached). A budget's meter starts from it (pipeline/quota_gate.py), so a restart forgets nothing."""
    kind, _, name = target.partition(":")
    where = []
    if kind == "app":
        where.append(UsageLog.app == name)
    elif kind == "user":
        app, slash, user = name.partition("/")
        where += [UsageLog.app == app, UsageLog.user == user] if slash else [UsageLog.user == name]
    elif kind == "key" and name.isdigit():
        where.append(UsageLog.key_id == int(name))
    else:
        return 0.0
    if start is not None:
        where.append(UsageLog.arrival >= datetime.fromtimestamp(start, tz_utc.utc))
    stmt = select(UsageLog.model, func.sum(UsageLog.prompt_tokens), func.sum(UsageLog.cached_tokens),
                  func.sum(UsageLog.completion_tokens)).where(*where).group_by(UsageLog.model)
    async with sessions() as s:
        rows = (await s.execute(stmt)).all()
    total = 0.0
    for model, prompt, cached, completion in rows:
        prompt, cached, completion = int(prompt or 0), int(cached or 0), int(completion or 0)
        if unit == "tokens":
            total += prompt + completion
        elif (p := prices.get(model)) is not None:
            total += ((prompt - cached) * p[0] + cached * p[2] + completion * p[1]) * 1e3
    return total
