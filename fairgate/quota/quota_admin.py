"""`fairgate admin limit|budget|price`: token and concurrency limits, budgets and prices in SQL, each change
audited in the same transaction (the ``Admin`` of storage/identity.py). Running gateways read them within
``settings_refresh_s`` (proxy/control/tenants.py)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from fairgate.storage.identity import Admin, NotFound, _public, user_key
from fairgate.storage.models import ApiKey, App, Price, Quota, User

LIMIT_FIELDS = ("rpm", "tpm", "tpm_kind", "concurrency")
BUDGET_FIELDS = ("budget_tokens", "budget_usd", "budget_period")
TPM_KINDS = ("total", "input", "output", "weighted")
PERIODS = ("day", "week", "month", "total")


async def _target(admin: Admin, s: AsyncSession, app: str | None, user: str | None,
                  key: str | None) -> tuple[str, Any]:
    """The meter name of ``--key`` (id or prefix), ``--app A --user U`` (created if new), ``--user U`` (shared,
    or the one app's user of that name) or ``--app A``, and its row (the key, user or app)."""
    if key is not None:
        obj = await s.get(ApiKey, int(key)) if key.isdigit() and len(key) <= 18 else (await s.execute(
            select(ApiKey).where(ApiKey.prefix == key))).scalar_one_or_none()
        if obj is None:
            raise NotFound(f"no key {key!r} (give its id or prefix)")
        return f"key:{obj.id}", obj
    if user is not None:
        if app is not None:
            a = await admin._get(s, App, app)
            obj = await admin._find_user(s, user, a) or await admin._new_user(s, user, a)
            return f"user:{user_key(app, user, obj.app_id is None)}", obj
        obj = await admin._user(s, user, None)
        name = user if obj.app_id is None else user_key((await s.get(App, obj.app_id)).name, user)
        return f"user:{name}", obj
    if app is None:
        raise NotFound("give --app A, --app A --user U, --user U or --key KEY")
    return f"app:{app}", await admin._get(s, App, app)


def _row(target: str, q: Quota | None, rpm: int | None) -> dict[str, Any]:
    out = {"target": target, "rpm": rpm}
    for f in LIMIT_FIELDS[1:] + BUDGET_FIELDS:
        out[f] = getattr(q, f) if q is not None else None
    return out


async def set_quota(admin: Admin, app: str | None, user: str | None, key: str | None,
                    **values: Any) -> dict[str, Any]:
    """Set limits or a budget (``values``: fields of ``Quota``; 0 or None in a number clears it). An app's or a
    user's ``rpm`` goes on its own row (FairServe's OIT reads it there), a key's in ``quotas``."""
    async with admin.sessions.begin() as s:
        target, obj = await _target(admin, s, app, user, key)
        q = await s.get(Quota, target)
        before = _row(target, q, getattr(obj, "rpm_limit", None) if q is None or key is None else q.rpm)
        if q is None:
            q = Quota(target=target, tpm_kind="total", budget_period="month")
            s.add(q)
        for field, value in values.items():
            if field == "rpm" and not isinstance(obj, ApiKey):
                obj.rpm_limit = value or None
            else:
                setattr(q, field, value or None if field not in ("tpm_kind", "budget_period") else value)
        await s.flush()
        after = _row(target, q, q.rpm if isinstance(obj, ApiKey) else obj.rpm_limit)
        kind = "budget" if set(values) & set(BUDGET_FIELDS) else "limit"
        admin._audit(s, f"{kind}.set", target, before, after)
        return after


async def clear_quota(admin: Admin, app: str | None, user: str | None, key: str | None,
                      budget: bool) -> dict[str, Any]:
    """Clear a target's limits (its request limit too), or its budget."""
    fields = BUDGET_FIELDS[:2] if budget else ("rpm", "tpm", "concurrency")
    return await set_quota(admin, app, user, key, **{f: None for f in fields})


async def quotas(admin: Admin) -> list[dict[str, Any]]:
    """Every target with a limit or a budget: the quotas table, and apps' and users' request limits."""
    async with admin.sessions() as s:
        rows = {q.target: _row(q.target, q, q.rpm) for q in (await s.execute(select(Quota))).scalars()}
        for name, rpm in (await s.execute(select(App.name, App.rpm_limit).where(App.rpm_limit.is_not(None)))).all():
            rows.setdefault(f"app:{name}", _row(f"app:{name}", None, None))["rpm"] = rpm
        users = await s.execute(select(User.name, User.rpm_limit, App.name).outerjoin(App, User.app_id == App.id)
                                .where(User.rpm_limit.is_not(None)))
        for name, rpm, app in users.all():
            t = f"user:{user_key(app, name, app is None)}"
            rows.setdefault(t, _row(t, None, None))["rpm"] = rpm
    return [r for _, r in sorted(rows.items()) if any(r[f] is not None for f in r if f not in (
        "target", "tpm_kind", "budget_period"))]


async def set_price(admin: Admin, model: str, input_: float, output: float, cached: float | None) -> dict[str, Any]:
    async with admin.sessions.begin() as s:
        p = await s.get(Price, model)
        before = None if p is None else _public(p)
        if p is None:
            p = Price(model=model, input=input_, output=output)
            s.add(p)
        p.input, p.output, p.cached = input_, output, cached
        await s.flush()
        admin._audit(s, "price.set", f"model:{model}", before, _public(p))
        return _public(p)


async def clear_price(admin: Admin, model: str) -> dict[str, Any]:
    async with admin.sessions.begin() as s:
        p = await s.get(Price, model)
        if p is None:
            raise NotFound(f"no price for model {model!r}")
        before = _public(p)
        await s.execute(delete(Price).where(Price.model == model))
        admin._audit(s, "price.clear", f"model:{model}", before, None)
        return before


async def prices(admin: Admin) -> list[dict[str, Any]]:
    async with admin.sessions() as s:
        return [_public(p) for p in (await s.execute(select(Price).order_by(Price.model))).scalars()]
