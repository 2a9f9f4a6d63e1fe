"""FairServe in the live gateway: the per-(app, stage) statistics WSC reads — learned from every finished call
while a policy that reads them is in force, snapshotted to SQL, shared through Redis — the limits OIT applies,
and the settings an admin changes at run time (`fairgate admin fairserve set`, SQL settings ``fairserve.*``)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from sqlalchemy.ext.asyncio import async_sessionmaker

from fairgate.accounting.app_stats import AppStats
from fairgate.periodic import Periodic
from fairgate.policies.factory import FairServeConfig
from fairgate.policies.oit import OverloadConfig
from fairgate.policies.wsc import WSC, TokenWeights
from fairgate.proxy.call import Call, Status
from fairgate.proxy.config import FairServeSettings
from fairgate.proxy.control.settings import FAIRSERVE_RUNTIME as RUNTIME
from fairgate.proxy.control.tenants import Tenants
from fairgate.storage import app_stats_store

log = logging.getLogger("fairgate.fairserve")
GENERATION = "stats.generation"  # bumped by `fairgate admin stats rebuild`: gateways reload the snapshot
_UNSEEN = object()


class FairServeRuntime:
    def __init__(self, settings: FairServeSettings, sessions: async_sessionmaker, tenants: Tenants,
                 default_user_rpm: int, shared_stats=None):
        self.base, self.settings = settings, settings
        self.sessions, self.tenants, self.default_user_rpm = sessions, tenants, default_user_rpm
        self.stats = AppStats(settings.half_life_s, settings.statistic, settings.min_samples,
                              max_stages_per_app=settings.max_stages_per_app)
        self.shared = shared_stats  # SharedStats (Redis) or None
        self._saved_version = -1
        self._periodic = Periodic("stats-snapshot", settings.snapshot_s, self.snapshot)
        self._generation: object = _UNSEEN
        self._reload: asyncio.Task | None = None
        self.learning: bool | None = None  # the policy in force reads the statistics (None: not yet applied)

    async def start(self) -> None:
        n = await self._load_snapshot(seed_redis=False)
        log.info("app statistics: %d (app, stage) entries from the SQL snapshot", n)
        self._periodic.start()

    async def _load_snapshot(self, seed_redis: bool) -> int:
        """Read the SQL snapshot; with Redis, seed it (at start, only if the fleet has none) or replace it."""
        n = await app_stats_store.load(self.sessions, self.stats)
        if self.shared is not None:
            await (self.shared.replace(self.stats) if seed_redis else self.shared.start(self.stats))
        self._saved_version = self.stats.version
        return n

    async def stop(self) -> None:
        await self._periodic.stop()
        if self._reload is not None:
            await asyncio.gather(self._reload, return_exceptions=True)
        await self.snapshot()

    async def snapshot(self) -> None:
        if self.shared is not None:
            await self.shared.sync(self.stats)
        if self.stats.version != self._saved_version:
            version = self.stats.version
            await app_stats_store.save(self.sessions, self.stats)
            self._saved_version = version

    # -- what the policy reads -----------------------------------------------------------------------
    def user_limit(self, client: str) -> int | None:
        """T_user: the user's own limit, else the run-time or configured global one, else ``rpm_limit``."""
        return self.tenants.own_limit(client) or self.settings.user_rpm or self.default_user_rpm

    def policy_config(self) -> FairServeConfig:
        s = self.settings
        return FairServeConfig(s.alpha, s.beta, s.gamma, s.charge, s.window_s, s.interaction_ttl_s,
                               s.max_interaction_calls, user_limit=self.user_limit,
                               app_limit=self.tenants.app_limit)

    def overload(self) -> OverloadConfig:
        return OverloadConfig(self.settings.kv_threshold, self.settings.queue_threshold)

    # -- what traffic teaches ------------------------------------------------------------------------
    def observe(self, call: Call) -> None:
        """A finished call, learned from while a policy that reads the statistics (WSC's) is in force (under
        any other, every request would pay for what no decision reads; they stay as they stood)."""
        if not self.learning or call.status is not Status.OK or call.dispatched_at is None:
            return
        t = call.tally
        system = min(t.system_tokens, t.prompt_tokens)
        args = (call.app, call.stage, t.prompt_tokens - system, system, t.completion_tokens, time.time())
        self.stats.observe(*args)
        if self.shared is not None:
            self.shared.observe(*args)

    # -- run-time settings ---------------------------------------------------------------------------
    def apply(self, settings: dict[str, str], scheduler) -> None:
        """``fairserve.*`` settings over the configured values; a new stats generation reloads the snapshot."""
        changes = {}
        for name, parse in RUNTIME.items():
            raw = settings.get(f"fairserve.{name}")
            if raw is None:
                continue
            try:
                changes[name] = parse(raw)
            except ValueError:
                log.warning("ignoring setting fairserve.%s = %r", name, raw)
        self.settings = replace(self.base, **changes)
        wsc = [part for part in scheduler.parts() if isinstance(part, WSC)]
        for part in wsc:
            s = self.settings
            part.tokens = TokenWeights(s.alpha, s.beta, s.gamma)
            part.charge_at = s.charge
        was, self.learning = self.learning, bool(wsc)
        if was is not None and was != self.learning:
            log.info("app statistics: %s", "learned again from finished calls, from where they stood (`fairgate "
                     "admin stats rebuild --since …` learns the calls since from the usage log)" if wsc else
                     "no longer learned (the policy in force does not read them)")
        generation = settings.get(GENERATION)
        if generation != self._generation:
            first = self._generation is _UNSEEN
            self._generation = generation
            if not first:
                self._reload = asyncio.get_running_loop().create_task(self._reload_snapshot())

    async def _reload_snapshot(self) -> None:
        n = await self._load_snapshot(seed_redis=True)
        log.info("app statistics reloaded after a rebuild: %d entries", n)
