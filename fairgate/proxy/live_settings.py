"""The gateway's live settings: the dispatcher and the policy and placement it runs — the database's over the
configuration (``proxy/control/settings.py``), switched on a running gateway without losing its queue — and the
prefix index the locality policies read. A component of ``Gateway`` (``proxy/app.py``)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from fairgate.accounting.slo import band_shares
from fairgate.policies.bands import Banded
from fairgate.policies.factory import LIVE_POLICIES, make_placement, make_scheduler
from fairgate.policies.interactions import MemoryInteractions
from fairgate.policies.placement import Placement
from fairgate.policies.scheduler import Scheduler
from fairgate.policies.views import RequestView
from fairgate.policies.windows import MemoryWindows
from fairgate.proxy.config import LOCAL_PLACEMENTS, LOCAL_POLICIES, PLACEMENTS, GatewayConfig
from fairgate.proxy.control.locality_settings import apply_locality, locality_from_settings, new_index
from fairgate.proxy.control.settings import override_message
from fairgate.proxy.pipeline.dispatcher import Dispatcher
from fairgate.proxy.pipeline.ticket import GateConfig
from fairgate.storage.shared_index import SharedIndex

if TYPE_CHECKING:
    from fairgate.accounting.length import OutputLengths
    from fairgate.proxy.control.backends import BackendPool
    from fairgate.proxy.control.fairserve import FairServeRuntime
    from fairgate.proxy.control.latency_fits import LatencyFits
    from fairgate.proxy.control.tenants import Tenants
    from fairgate.storage.shared_state import SharedState

log = logging.getLogger("fairgate")


def _family(scheduler: Scheduler) -> type:
    """The scheduler class right below ``Scheduler`` (VTC for LCF and VTC(predict), FCFS for RPM, WSC)."""
    return next(k for k in type(scheduler.parts()[0]).__mro__ if Scheduler in k.__bases__)


class LiveSettings:
    """Builds the dispatcher with the policy and placement in force at start (the database's, said aloud where
    they override the configuration), and applies `fairgate admin policy|placement|locality|fairserve set` to
    it as the tenants' settings change (``apply``)."""

    def __init__(self, config: GatewayConfig, pool: BackendPool, tenants: Tenants, fairserve: FairServeRuntime,
                 cost, latency: LatencyFits, lengths: OutputLengths, shared: SharedState | None):
        self.config, self.tenants, self.fairserve, self.shared = config, tenants, fairserve, shared
        self.cost, self.latency, self.lengths = cost, latency, lengths
        self._locality_base = config.locality  # `admin locality set` applies over the configured values
        self._configured = {"policy": config.policy, "placement": config.placement}  # `… unset` returns here
        self._local_fairserve: dict = {}  # WSC's and OIT's stores without Redis (``_fairserve_stores``)
        self._stored_choices(tenants.settings)  # a policy set in the database is the one started
        c = config
        local = c.policy in LOCAL_POLICIES or c.placement in LOCAL_PLACEMENTS or c.locality.index == "precise"
        self._index_listener = None  # the running DLPM's, told what changed in the index
        self.index = new_index(c.locality) if local else None  # the prefix index, when something reads it
        self.shared_index: SharedIndex | None = None  # the approximate index's exchange with the other replicas
        self._sharing: asyncio.Future | None = None  # (a reference keeps a late exchange's start alive)
        self.dispatcher = Dispatcher(self.policy(c.policy, shared), pool, self.placement(c.placement), GateConfig(
            c.gate_overcommit, c.max_inflight_per_backend, c.queue_timeout_s, c.retry_after_s,
            max_queued=c.max_queued, max_queued_per_tenant=c.max_queued_per_tenant,
            max_queued_per_app=c.max_queued_per_app, kv_gate=c.kv_gate,
            max_users_per_app=c.max_users_per_app if c.fairness_key == "user" else None),
            shared, overload=fairserve.overload, index=self.index)

    @property
    def scheduler(self) -> Scheduler:
        """The policy in force (the dispatcher's)."""
        return self.dispatcher.scheduler

    def policy(self, name: str, counters=None) -> Scheduler:
        """A scheduler from the shared factory, with this gateway's weights, limits, statistics and state."""
        interactions, windows = self._fairserve_stores(name)

        def build() -> Scheduler:  # (under bands, once per band: the stores above are the bands' one set)
            return make_scheduler(name, self.cost, self.tenants.weight, rpm_limit=self.tenants.rpm,
                                  counters=counters, stats=self.fairserve.stats,
                                  fairserve=self.fairserve.policy_config(), interactions=interactions,
                                  windows=windows, two_level=self.config.fairness_key == "app>user",
                                  params=self.config.locality.policy_params(name))

        bands = self._bands()
        s = build() if bands is None else Banded(build, bands)  # SLO bands: one instance per band
        if name in LOCAL_POLICIES:
            self._ensure_index()
            s.match = self.match
            if self._index_listener in self.index.listeners:  # the policy it replaces forgets nothing more
                self.index.listeners.remove(self._index_listener)
            self._index_listener = s.on_blocks
            self.index.listeners.append(s.on_blocks)
        return s

    def placement(self, name: str) -> Placement:
        """A placement from the shared factory, with this gateway's prefix index, weights, latency fits and
        output lengths."""
        return make_placement(name, self.match, self.config.locality.placement_params(name), self.tenants.weight,
                              models=self.latency.model, lengths=self.lengths,
                              progress=lambda rid: self.dispatcher.progress(rid))  # (made before the dispatcher)

    def _fairserve_stores(self, name: str):
        """WSC's open interactions and OIT's windows: Redis's with a shared store, else this gateway's own, made
        once, so a switch (bands coming or going, WSC ↔ FairServe) keeps them."""
        if name not in ("wsc", "fairserve"):
            return None, None
        fs = self.config.fairserve
        if self.shared is not None:
            return (self.shared.interactions(fs.interaction_ttl_s),
                    self.shared.windows(fs.window_s) if name == "fairserve" else None)
        stores, key = self._local_fairserve, (fs.interaction_ttl_s, fs.window_s)
        if key not in stores:
            stores[key] = (MemoryInteractions(fs.interaction_ttl_s), MemoryWindows(fs.window_s))
        interactions, windows = stores[key]
        return interactions, windows if name == "fairserve" else None

    def _bands(self) -> dict[int, float] | None:
        """The bands' minimum shares if any app's SLO class puts it outside the standard band or gives its band a
        minimum share (None: the policy runs alone, as without SLO classes)."""
        return band_shares(self.tenants.slo_classes().values())

    def _ensure_index(self) -> None:
        if self.index is None:  # switched to live from a policy or placement that needed no index (at start, one
            self.index = new_index(self.config.locality)  # that reads it has its index before the dispatcher)
            self.dispatcher.index = self.index
            self._sharing = asyncio.ensure_future(self.share_index())

    async def share_index(self) -> None:
        """With Redis, the approximate index learns what every replica dispatched (storage/shared_index.py)."""
        if self.shared is not None and self.index is not None and not self.index.precise and not self.shared_index:
            self.shared_index = SharedIndex(self.config.redis_url, self.config.redis_namespace, self.index)
            await self.shared_index.start()
            self.dispatcher.shared_index = self.shared_index

    async def stop(self) -> None:
        if self.shared_index is not None:
            await self.shared_index.stop()

    def match(self, view: RequestView, backend: str) -> int:
        """Prompt tokens ``backend`` probably caches for this request (the approximate prefix index)."""
        if self.index is None or not view.blocks:
            return 0
        return self.index.cached_tokens(view.blocks, view.prompt_tokens, backend, asyncio.get_running_loop().time())

    def _choice(self, settings: dict[str, str], key: str, known: tuple[str, ...]) -> str:
        """The policy or placement in force: the database's (proxy/control/settings.py), else the configured one."""
        value = settings.get(key)
        if value is not None and value not in known:
            log.warning("ignoring the database's %s %r: this gateway runs %s", key, value, ", ".join(known))
            value = None
        return value or self._configured[key]

    def _stored_choices(self, settings: dict[str, str]) -> None:
        """At start: the database's policy and placement, said aloud where they override the configuration."""
        for key, known in (("policy", LIVE_POLICIES), ("placement", PLACEMENTS)):
            value = self._choice(settings, key, known)
            if value != self._configured[key]:
                log.warning(override_message(key, value, self.config, self._configured[key]))
                setattr(self.config, key, value)

    def apply(self, settings: dict[str, str]) -> None:
        """`fairgate admin policy set|unset` and `fairserve set` reach this gateway: switch policies (keeping
        the queue, and the counters within a policy family), and apply FairServe's run-time settings to it."""
        name = self._choice(settings, "policy", LIVE_POLICIES)
        if name != self.config.policy:
            self._switch_policy(name, "database" if "policy" in settings else self.config.source("policy"))
        placement = self._choice(settings, "placement", PLACEMENTS)
        if placement != self.config.placement:
            if placement in LOCAL_PLACEMENTS:
                self._ensure_index()
            log.info("placement %s → %s (%s)", self.config.placement, placement,
                     "database" if "placement" in settings else self.config.source("placement"))
            self.config.placement = placement
            self.dispatcher.switch_placement(self.placement(placement))
        bands = self._bands()
        if (bands is not None) != isinstance(self.scheduler, Banded):  # SLO bands came or went: the queue moves
            self._switch_policy(self.config.policy, "SLO bands " + ("on" if bands is not None else "off"))
        elif bands is not None:
            self.scheduler.min_share = bands
        self.fairserve.apply(settings, self.scheduler)
        locality = locality_from_settings(self._locality_base, settings)
        if locality != self.config.locality:
            self.config.locality = locality
            apply_locality(locality, self.config, self.scheduler, self.dispatcher.placement)

    def _switch_policy(self, name: str, source: str) -> None:
        old, new = self.scheduler, self.policy(name)
        if _family(old) is _family(new) and old.keeps_counters:
            new.counters = old.counters  # VTC-family (or WSC-family) counters carry over
        elif self.shared is not None and new.keeps_counters:
            # counters of another family are in other units (tokens vs typical calls): this replica starts
            # the new family on local counters; restart the fleet on it to share them again
            log.warning("policy family changed: counters are local to this replica until a restart")
        log.info("policy %s → %s (%s)", self.config.policy, name, source)
        self.config.policy = name
        self.dispatcher.switch(new)
