"""The gateway's live settings: the policy and placement in force (the database's over the configuration,
``proxy/control/settings.py``), switched on a running gateway without losing its queue, and the prefix index the
locality policies read. A part of ``Gateway`` (``proxy/app.py``): it reads the gateway's pool, tenants,
dispatcher and shared state."""

from __future__ import annotations

import asyncio
import logging

from fairgate.policies.bands import Banded
from fairgate.policies.factory import LIVE_POLICIES, make_placement, make_scheduler
from fairgate.policies.placement import Placement
from fairgate.policies.interactions import MemoryInteractions
from fairgate.policies.windows import MemoryWindows
from fairgate.policies.scheduler import Scheduler
from fairgate.policies.views import RequestView
from fairgate.proxy.config import PLACEMENTS, LOCAL_PLACEMENTS, LOCAL_POLICIES
from fairgate.proxy.control.locality_settings import apply_locality, locality_from_settings, new_index
from fairgate.proxy.control.settings import override_message
from fairgate.storage.shared_index import SharedIndex

log = logging.getLogger("fairgate")


def _family(scheduler: Scheduler) -> type:
    """The scheduler class right below ``Scheduler`` (VTC for LCF and VTC(predict), FCFS for RPM, WSC)."""
    return next(k for k in type(scheduler.parts()[0]).__mro__ if Scheduler in k.__bases__)


class LiveSettings:
    def make_policy(self, name: str, counters=None):
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

    def make_placement(self, name: str) -> Placement:
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
        classes = self.tenants.slo_classes().values()
        if all(c.band == "standard" and c.min_share is None for c in classes):
            return None
        shares: dict[int, float] = {}
        for c in classes:
            if c.min_share is not None:
                shares[c.rank] = max(shares.get(c.rank, 0.0), c.min_share)
        return shares

    def _ensure_index(self) -> None:
        if self.index is None:  # switched to live from a policy or placement that needed no index
            self.index = new_index(self.config.locality)
            if getattr(self, "dispatcher", None) is not None:
                self.dispatcher.index = self.index
                self._sharing = asyncio.ensure_future(self._share_index())  # a reference keeps the task alive

    async def _share_index(self) -> None:
        """With Redis, the approximate index learns what every replica dispatched (storage/shared_index.py)."""
        if self.shared is not None and self.index is not None and not self.index.precise and not self.shared_index:
            self.shared_index = SharedIndex(self.config.redis_url, self.config.redis_namespace, self.index)
            await self.shared_index.start()
            self.dispatcher.shared_index = self.shared_index

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

    def _apply_settings(self, settings: dict[str, str]) -> None:
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
            self.dispatcher.switch_placement(self.make_placement(placement))
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
        old = self.scheduler
        self.scheduler = self.make_policy(name)
        if _family(old) is _family(self.scheduler) and old.keeps_counters:
            self.scheduler.counters = old.counters  # VTC-family (or WSC-family) counters carry over
        elif self.shared is not None and self.scheduler.keeps_counters:
            # counters of another family are in other units (tokens vs typical calls): this replica starts
            # the new family on local counters; restart the fleet on it to share them again
            log.warning("policy family changed: counters are local to this replica until a restart")
        log.info("policy %s → %s (%s)", self.config.policy, name, source)
        self.config.policy = name
        self.dispatcher.switch(self.scheduler)
