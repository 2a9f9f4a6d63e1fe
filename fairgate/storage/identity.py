"""Keys → identity, and the admin changes to apps, users, keys, weights and limits (each one audited)."""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fairgate.storage.models import AdminAudit, ApiKey, App, Setting, User

KEY_PREFIX = "fg-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class KeyIdentity:
    key_id: int
    app: str
    app_weight: float
    app_rpm: int | None
    user: str | None  # set for a user key; an app key may name its end users per request
    user_weight: float | None
    user_rpm: int | None


class NotFound(LookupError):
    pass


class Conflict(ValueError):
    pass


async def lookup_key(session: AsyncSession, key: str) -> KeyIdentity | None:
    """The identity behind a key, or None if it is unknown or disabled (or its app or user is)."""
    row = (await session.execute(
        select(ApiKey, App, User).join(App, ApiKey.app_id == App.id).outerjoin(User, ApiKey.user_id == User.id)
        .where(ApiKey.key_hash == hash_key(key)))).first()
    if row is None:
        return None
    k, app, user = row
    if k.disabled or app.disabled or (user is not None and user.disabled):
        return None
    return KeyIdentity(k.id, app.name, app.weight, app.rpm_limit,
                       user.name if user else None, user.weight if user else None, user.rpm_limit if user else None)


def _public(obj: Any) -> dict[str, Any]:
    out = {}
    for col in obj.__table__.columns:
        if col.key == "key_hash":
            continue
        v = getattr(obj, col.key)
        out[col.key] = v.isoformat() if hasattr(v, "isoformat") else v
    return out


class Admin:
    """Admin operations; every change writes an audit row in the same transaction."""

    def __init__(self, sessions: async_sessionmaker, actor: str = "cli"):
        self.sessions, self.actor = sessions, actor

    def _audit(self, s: AsyncSession, action: str, target: str, before: Any, after: Any) -> None:
        dump = lambda v: None if v is None else json.dumps(v, default=str, sort_keys=True)  # noqa: E731
        s.add(AdminAudit(actor=self.actor, action=action, target=target, before=dump(before), after=dump(after)))

    async def _get(self, s: AsyncSession, model, name: str):
        obj = (await s.execute(select(model).where(model.name == name))).scalar_one_or_none()
        if obj is None:
            raise NotFound(f"no {model.__tablename__[:-1]} named {name!r}")
        return obj

    async def create_app(self, name: str, weight: float = 1.0, rpm: int | None = None) -> dict[str, Any]:
        async with self.sessions.begin() as s:
            return _public(await self._create(s, App, name, weight, rpm))

    async def create_user(self, name: str, weight: float = 1.0, rpm: int | None = None) -> dict[str, Any]:
        async with self.sessions.begin() as s:
            return _public(await self._create(s, User, name, weight, rpm))

    async def _create(self, s: AsyncSession, model, name: str, weight: float = 1.0, rpm: int | None = None):
        """A new app or user, audited in the caller's transaction."""
        kind = model.__tablename__[:-1]
        if (await s.execute(select(model).where(model.name == name))).scalar_one_or_none():
            raise Conflict(f"{kind} {name!r} already exists")
        obj = model(name=name, weight=weight, rpm_limit=rpm, disabled=False)
        s.add(obj)
        await s.flush()
        self._audit(s, f"{kind}.create", f"{kind}:{name}", None, _public(obj))
        return obj

    async def create_key(self, app: str, user: str | None = None, name: str | None = None) -> dict[str, Any]:
        """A new key for an app (and optionally a user, created if new). The key is returned only here."""
        key = new_key()
        async with self.sessions.begin() as s:
            a = await self._get(s, App, app)
            u = None
            if user is not None:
                u = (await s.execute(select(User).where(User.name == user))).scalar_one_or_none()
                u = u or await self._create(s, User, user)
            k = ApiKey(key_hash=hash_key(key), prefix=key[:10], name=name, app_id=a.id,
                       user_id=u.id if u else None, disabled=False)
            s.add(k)
            await s.flush()
            info = {"id": k.id, "prefix": k.prefix, "name": name, "app": app, "user": user}
            self._audit(s, "key.create", f"key:{k.id}", None, info)
        return {"key": key, **info}

    async def list(self, what: str) -> list[dict[str, Any]]:
        async with self.sessions() as s:
            if what == "keys":
                rows = (await s.execute(
                    select(ApiKey, App.name, User.name).join(App, ApiKey.app_id == App.id)
                    .outerjoin(User, ApiKey.user_id == User.id).order_by(ApiKey.id))).all()
                return [{**_public(k), "app": a, "user": u} for k, a, u in rows]
            model = {"apps": App, "users": User}[what]
            return [_public(o) for o in (await s.execute(select(model).order_by(model.id))).scalars()]

    async def set_disabled(self, what: str, ident: str, disabled: bool = True) -> dict[str, Any]:
        async with self.sessions.begin() as s:
            if what == "key":
                obj = await s.get(ApiKey, int(ident)) if ident.isdigit() else (await s.execute(
                    select(ApiKey).where(ApiKey.prefix == ident))).scalar_one_or_none()
                if obj is None:
                    raise NotFound(f"no key {ident!r} (give its id or prefix)")
            else:
                obj = await self._get(s, {"app": App, "user": User}[what], ident)
            before = _public(obj)
            obj.disabled = disabled
            await s.flush()
            self._audit(s, f"{what}.{'disable' if disabled else 'enable'}", f"{what}:{ident}", before, _public(obj))
            return _public(obj)

    async def set_field(self, what: str, name: str, field: str, value: Any) -> dict[str, Any]:
        """Set ``weight`` or ``rpm_limit`` of an app or user (a user is created if new)."""
        async with self.sessions.begin() as s:
            model = {"app": App, "user": User}[what]
            obj = (await s.execute(select(model).where(model.name == name))).scalar_one_or_none()
            if obj is None and what == "user":
                obj = await self._create(s, User, name)
            elif obj is None:
                raise NotFound(f"no app named {name!r}")
            before = _public(obj)
            setattr(obj, field, value)
            await s.flush()
            self._audit(s, f"{what}.set_{field}", f"{what}:{name}", before, _public(obj))
            return _public(obj)

    async def set_setting(self, key: str, value: str) -> dict[str, Any]:
        """A gateway-wide setting (the active policy); running gateways pick it up within seconds."""
        async with self.sessions.begin() as s:
            row = await s.get(Setting, key)
            before = None if row is None else {"key": key, "value": row.value}
            if row is None:
                s.add(Setting(key=key, value=value))
            else:
                row.value = value
            self._audit(s, f"setting.{key}", f"setting:{key}", before, {"key": key, "value": value})
        return {"key": key, "value": value}

    async def settings(self) -> dict[str, str]:
        async with self.sessions() as s:
            return {r.key: r.value for r in (await s.execute(select(Setting))).scalars()}

    async def audit_log(self, limit: int = 50) -> list[dict[str, Any]]:
        async with self.sessions() as s:
            rows = (await s.execute(select(AdminAudit).order_by(AdminAudit.id.desc()).limit(limit))).scalars()
            return [_public(r) for r in rows]
