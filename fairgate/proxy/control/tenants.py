"""Weights and limits of apps and users, read from SQL and refreshed every few seconds, so an admin change
reaches every running gateway without a restart."""

from __future__ import annotations

import logging

import orjson
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from fairgate.accounting.slo import SloClass
from fairgate.periodic import Periodic
from fairgate.quota.meters import Limits
from fairgate.storage.identity import allow_key, slo_key, user_key
from fairgate.storage.models import App, Price, Quota, Setting, User

log = logging.getLogger("fairgate")


class Tenants:
    def __init__(self, sessions: async_sessionmaker, refresh_s: float = 2.0, default_rpm: int = 60):
        self.sessions, self.refresh_s, self.default_rpm = sessions, refresh_s, default_rpm
        self._apps: dict[str, tuple[float, int | None]] = {}
        self._users: dict[str, tuple[float, int | None]] = {}  # by user_key: "app/name", or "name" if shared
        self._shared: frozenset[str] = frozenset()  # names of shared users
        self._periodic = Periodic("tenants-refresh", refresh_s, self.refresh)
        self.settings: dict[str, str] = {}
        self.on_settings: list = []  # callbacks(settings) when a setting changed
        self._allowed: dict[str, frozenset[str]] = {}  # parsed allow lists, by app
        self._allowed_raw: dict[str, str | None] = {}
        self._slo: dict[str, tuple[str, SloClass | None]] = {}  # app → (its setting, parsed)
        self.version = 0  # read from SQL this many times
        self.quotas: dict[str, Limits] = {}  # target ("app:A", "user:A/U", "key:ID") → its limits and budget
        self.prices: dict[str, tuple[float, float, float]] = {}  # model → USD per million input, output, cached

    async def start(self) -> None:
        await self.refresh()
        self._periodic.start()  # a failed refresh keeps the last known values

    async def stop(self) -> None:
        await self._periodic.stop()

    async def refresh(self) -> None:
        async with self.sessions() as s:
            apps = (await s.execute(select(App.name, App.weight, App.rpm_limit))).all()
            users = (await s.execute(select(User.name, User.weight, User.rpm_limit, App.name)
                                     .outerjoin(App, User.app_id == App.id))).all()
            settings = {r.key: r.value for r in (await s.execute(select(Setting))).scalars()}
            quotas = (await s.execute(select(Quota))).scalars().all()
            prices = (await s.execute(select(Price))).scalars().all()
        self.quotas = {q.target: Limits(q.rpm, q.tpm, q.tpm_kind, q.concurrency, q.budget_tokens, q.budget_usd,
                                        q.budget_period) for q in quotas}
        self.prices = {p.model: (p.input, p.output, p.input if p.cached is None else p.cached) for p in prices}
        self.version += 1  # (what the gate derived from them is derived again)
        self._apps = {n: (w, r) for n, w, r in apps}
        self._users = {user_key(a, n, a is None): (w, r) for n, w, r, a in users}
        self._shared = frozenset(n for n, _w, _r, a in users if a is None)
        if settings != self.settings:
            self.settings = settings
            for callback in self.on_settings:
                callback(settings)

    def is_shared(self, app: str, name: str) -> bool:
        """``name``, named by ``app``, is the user an admin shared among apps: a name is the app's own
        unless it is shared and the app has no user of that name itself."""
        return name in self._shared and user_key(app, name) not in self._users

    def _entry(self, client: str) -> tuple[float, int | None]:
        kind, _, name = client.partition(":")
        book = self._users if kind == "user" else self._apps if kind == "app" else {}
        return book.get(name, (1.0, None))

    def weight(self, client: str) -> float:
        """The fair-share weight of a fairness key (``user:…`` or ``app:…``); 1 if unknown."""
        return self._entry(client)[0] or 1.0

    def rpm(self, client: str) -> int:
        return self._entry(client)[1] or self.default_rpm

    def own_limit(self, client: str) -> int | None:
        """A fairness key's own request limit (``user:…`` or ``app:…``), if an admin set one."""
        return self._entry(client)[1]

    def allowed_fields(self, app: str) -> frozenset[str]:
        """The guarded body fields an admin allowed this app to forward (`fairgate admin app allow`)."""
        raw = self.settings.get(allow_key(app))
        if raw != self._allowed_raw.get(app):
            try:
                fields = frozenset(f for f in orjson.loads(raw) if isinstance(f, str)) if raw else frozenset()
            except orjson.JSONDecodeError:
                fields = frozenset()
            self._allowed[app], self._allowed_raw[app] = fields, raw
        return self._allowed.get(app, frozenset())

    def slo_class(self, app: str) -> SloClass | None:
        """The app's SLO class (`fairgate admin slo set`); None without one, or if the stored one does not parse
        (said once in the log)."""
        raw = self.settings.get(slo_key(app))
        if raw is None:
            return None
        kept = self._slo.get(app)
        if kept is None or kept[0] != raw:
            try:
                kept = (raw, SloClass.from_json(orjson.loads(raw)))
            except (orjson.JSONDecodeError, ValueError, TypeError) as e:
                log.warning("app %r: ignoring its SLO class setting: %s", app, e)
                kept = (raw, None)
            self._slo[app] = kept
        return kept[1]

    def slo_classes(self) -> dict[str, SloClass]:
        """Every app's SLO class (those that parse)."""
        apps = (k[4:-4] for k in self.settings if k.startswith("app.") and k.endswith(".slo"))
        return {app: c for app in apps if (c := self.slo_class(app)) is not None}

    def request_limits(self) -> dict[str, int]:
        """Every request limit an admin set: ``app:A`` or ``user:…`` → requests a minute."""
        return {**{"app:" + n: r for n, (_w, r) in self._apps.items() if r},
                **{"user:" + k: r for k, (_w, r) in self._users.items() if r}}

    def app_limit(self, app: str) -> int | None:
        """An app's own request limit (FairServe's T_app), if an admin set one."""
        return self._apps.get(app, (1.0, None))[1]
