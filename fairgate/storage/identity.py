"""Keys → identity, and the admin changes to apps, users, keys, weights and limits (each one audited)."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from fairgate.accounting.slo import SLO_HEADERS, SloClass
from fairgate.storage.models import GUARDED_FIELDS, AdminAudit, ApiKey, App, Setting, User

KEY_PREFIX = "fg-"
# App names and shared users' names hold no "/": a user's fairness key is "app/name" for a user of an app and
# "name" for a shared user, so neither can be mistaken for the other.
NAME_PATTERN = re.compile(r"^[^\x00-\x1f\x7f/]{1,128}$")
USER_PATTERN = re.compile(r"^[^\x00-\x1f\x7f]{1,128}$")  # a user of an app: what a client may name (proxy/pipeline/caller.py)


def slo_key(app: str) -> str:
    """The setting that holds an app's SLO class (JSON, accounting/slo.py)."""
    return f"app.{app}.slo"


def _slo_row(app: str, slo: SloClass) -> dict[str, Any]:
    row = slo.to_json()
    return {"app": app, "class": row.pop("name"), **row}


def allow_key(app: str) -> str:
    """The setting that holds an app's allowed guarded body fields (a JSON list)."""
    return f"app.{app}.allow_fields"


def user_key(app: str, user: str, shared: bool = False) -> str:
    """The name a user's weight, limits and counters go by: ``app/user``, or ``user`` if an admin shared it."""
    return user if shared else f"{app}/{user}"


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
    user_shared: bool = False  # the key's user is shared among apps (not one app's own)


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
                       user.name if user else None, user.weight if user else None, user.rpm_limit if user else None,
                       user is not None and user.app_id is None)


def _check(name: str, pattern: re.Pattern, what: str) -> None:
    if not isinstance(name, str) or not pattern.match(name):
        slash = " without '/'" if pattern is NAME_PATTERN else ""
        raise Conflict(f"{what} must be 1-128 printable characters{slash}: {name!r}")


def _public(obj: Any) -> dict[str, Any]:
    out = {}
    for col in obj.__table__.columns:
        if col.key == "key_hash":
            continue
        v = getattr(obj, col.key)
        out[col.key] = v.isoformat() if hasattr(v, "isoformat") else v
    return out


def _user_row(user: User, app: str | None) -> dict[str, Any]:
    """A user as every command prints it: its app by name (``None``: shared among apps), never ``app_id``."""
    row = _public(user)
    del row["app_id"]
    return {"id": row.pop("id"), "app": app, "shared": app is None, **row}


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
        _check(name, NAME_PATTERN, "an app name")
        async with self.sessions.begin() as s:
            if (await s.execute(select(App).where(App.name == name))).scalar_one_or_none():
                raise Conflict(f"app {name!r} already exists")
            obj = App(name=name, weight=weight, rpm_limit=rpm, disabled=False)
            s.add(obj)
            await s.flush()
            self._audit(s, "app.create", f"app:{name}", None, _public(obj))
            return _public(obj)

    async def create_user(self, name: str, app: str | None = None, weight: float = 1.0,
                          rpm: int | None = None) -> dict[str, Any]:
        """A user of ``app``, or with no app a user every app may name (an explicit, shared identity)."""
        async with self.sessions.begin() as s:
            a = await self._get(s, App, app) if app is not None else None
            if await self._find_user(s, name, a, shared_fallback=False):
                raise Conflict(f"user {name!r} already exists" + (f" in app {app!r}" if app else " (shared)"))
            return _user_row(await self._new_user(s, name, a, weight, rpm), app)

    async def _new_user(self, s: AsyncSession, name: str, app: App | None, weight: float = 1.0,
                        rpm: int | None = None) -> User:
        _check(name, USER_PATTERN if app is not None else NAME_PATTERN, "a user name" if app is not None
               else "a shared user's name")
        obj = User(name=name, app_id=app.id if app else None, weight=weight, rpm_limit=rpm, disabled=False)
        s.add(obj)
        await s.flush()
        self._audit(s, "user.create", f"user:{user_key(app.name, name) if app else name}", None, _public(obj))
        return obj

    async def _find_user(self, s: AsyncSession, name: str, app: App | None, shared_fallback: bool = True):
        """The user ``name`` of ``app`` (else, if allowed, the shared one); of no app: the shared one."""
        q = select(User).where(User.name == name)
        own = (await s.execute(q.where(User.app_id == app.id) if app else
                               q.where(User.app_id.is_(None)))).scalar_one_or_none()
        if own is None and app is not None and shared_fallback:
            own = (await s.execute(q.where(User.app_id.is_(None)))).scalar_one_or_none()
        return own

    async def _user(self, s: AsyncSession, name: str, app: str | None) -> User:
        """The user an admin command means: ``--app A`` picks A's user (or the shared one of that name);
        without ``--app``, the shared user, else the one app that has a user of that name."""
        if app is not None:
            obj = await self._find_user(s, name, await self._get(s, App, app))
        else:
            found = (await s.execute(select(User).where(User.name == name))).scalars().all()
            shared = [u for u in found if u.app_id is None]
            obj = shared[0] if shared else found[0] if len(found) == 1 else None
            if len(found) > 1 and not shared:
                raise NotFound(f"{len(found)} apps have a user named {name!r}: say which with --app")
        if obj is None:
            raise NotFound(f"no user named {name!r}" + (f" in app {app!r}" if app else ""))
        return obj

    async def create_key(self, app: str, user: str | None = None, name: str | None = None) -> dict[str, Any]:
        """A new key for an app, optionally bound to a user: the app's user of that name (created if new), or
        the shared user of that name if the app has none. The key is returned only here."""
        key = new_key()
        async with self.sessions.begin() as s:
            a = await self._get(s, App, app)
            u = None
            if user is not None:
                u = await self._find_user(s, user, a) or await self._new_user(s, user, a)
            k = ApiKey(key_hash=hash_key(key), prefix=key[:10], name=name, app_id=a.id,
                       user_id=u.id if u else None, disabled=False)
            s.add(k)
            await s.flush()
            info = {"id": k.id, "prefix": k.prefix, "name": name, "app": app, "user": user,
                    "shared_user": bool(u is not None and u.app_id is None)}
            self._audit(s, "key.create", f"key:{k.id}", None, info)
        return {"key": key, **info}

    async def list(self, what: str) -> list[dict[str, Any]]:
        async with self.sessions() as s:
            if what == "keys":
                rows = (await s.execute(
                    select(ApiKey, App.name, User.name).join(App, ApiKey.app_id == App.id)
                    .outerjoin(User, ApiKey.user_id == User.id).order_by(ApiKey.id))).all()
                return [{**{c: v for c, v in _public(k).items() if c not in ("app_id", "user_id")}, "app": a,
                         "user": u} for k, a, u in rows]
            if what == "users":
                rows = (await s.execute(select(User, App.name).outerjoin(App, User.app_id == App.id)
                                        .order_by(User.id))).all()
                return [_user_row(u, a) for u, a in rows]
            return [_public(o) for o in (await s.execute(select(App).order_by(App.id))).scalars()]

    async def set_disabled(self, what: str, ident: str, disabled: bool = True,
                           app: str | None = None) -> dict[str, Any]:
        async with self.sessions.begin() as s:
            if what == "key":
                obj = await s.get(ApiKey, int(ident)) if ident.isdigit() else (await s.execute(
                    select(ApiKey).where(ApiKey.prefix == ident))).scalar_one_or_none()
                if obj is None:
                    raise NotFound(f"no key {ident!r} (give its id or prefix)")
            elif what == "user":
                obj = await self._user(s, ident, app)
            else:
                obj = await self._get(s, App, ident)
            before = _public(obj)
            obj.disabled = disabled
            await s.flush()
            self._audit(s, f"{what}.{'disable' if disabled else 'enable'}", f"{what}:{ident}", before, _public(obj))
            return await self._row(s, obj)

    async def set_field(self, what: str, name: str, field: str, value: Any,
                        app: str | None = None) -> dict[str, Any]:
        """Set ``weight`` or ``rpm_limit`` of an app, or of a user (of ``app``: created there if new)."""
        async with self.sessions.begin() as s:
            if what == "app":
                obj = await self._get(s, App, name)
            elif app is not None:
                a = await self._get(s, App, app)
                obj = await self._find_user(s, name, a) or await self._new_user(s, name, a)
            else:
                obj = await self._user(s, name, None)
            before = _public(obj)
            setattr(obj, field, value)
            await s.flush()
            target = f"app:{name}" if what == "app" else \
                f"user:{name if obj.app_id is None else user_key(app or await self._app_name(s, obj), name)}"
            self._audit(s, f"{what}.set_{field}", target, before, _public(obj))
            return await self._row(s, obj)

    async def _app_name(self, s: AsyncSession, user: User) -> str:
        return (await s.get(App, user.app_id)).name

    async def _row(self, s: AsyncSession, obj: Any) -> dict[str, Any]:
        if isinstance(obj, User):
            return _user_row(obj, None if obj.app_id is None else await self._app_name(s, obj))
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

    async def unset_settings(self, keys: list[str]) -> dict[str, Any]:
        """Remove gateway-wide settings: running gateways return to their configured values (audited)."""
        removed = {}
        async with self.sessions.begin() as s:
            for key in keys:
                row = await s.get(Setting, key)
                if row is not None:
                    removed[key] = row.value
                    self._audit(s, f"setting.{key}", f"setting:{key}", {"key": key, "value": row.value}, None)
                    await s.delete(row)
        return {"unset": sorted(removed), "not_set": sorted(set(keys) - set(removed))}

    async def allow_fields(self, app: str, add: list[str], remove: list[str] = ()) -> dict[str, Any]:
        """Let an app forward guarded body fields (``add``) or stop it (``remove``); audited as a setting."""
        unknown = sorted(set(add) - GUARDED_FIELDS - {SLO_HEADERS})
        if unknown:
            raise Conflict(f"not a guarded field: {', '.join(unknown)} (guarded: {', '.join(sorted(GUARDED_FIELDS))}"
                           f"; the others are always forwarded; {SLO_HEADERS}: the x-slo-* request headers)")
        async with self.sessions() as s:
            await self._get(s, App, app)
            row = await s.get(Setting, allow_key(app))
        fields = set(json.loads(row.value)) if row is not None else set()
        fields = sorted((fields | set(add)) - set(remove))
        await self.set_setting(allow_key(app), json.dumps(fields))
        return {"app": app, "allow_fields": fields}

    async def set_slo(self, app: str, slo: SloClass) -> dict[str, Any]:
        """Give ``app`` an SLO class (replacing its last); running gateways apply it within seconds."""
        async with self.sessions() as s:
            await self._get(s, App, app)
        await self.set_setting(slo_key(app), json.dumps(slo.to_json()))
        return _slo_row(app, slo)

    async def slo_classes(self) -> list[dict[str, Any]]:
        """Every app's SLO class (the settings that hold one; one that does not parse says so)."""
        out = []
        for key, raw in sorted((await self.settings()).items()):
            if key.startswith("app.") and key.endswith(".slo"):
                try:
                    out.append(_slo_row(key[4:-4], SloClass.from_json(json.loads(raw))))
                except (ValueError, TypeError, RecursionError) as e:
                    out.append({"app": key[4:-4], "error": str(e)[:200]})
        return out

    async def settings(self) -> dict[str, str]:
        async with self.sessions() as s:
            return {r.key: r.value for r in (await s.execute(select(Setting))).scalars()}

    async def audit_log(self, limit: int = 50) -> list[dict[str, Any]]:
        async with self.sessions() as s:
            rows = (await s.execute(select(AdminAudit).order_by(AdminAudit.id.desc()).limit(limit))).scalars()
            return [_public(r) for r in rows]
