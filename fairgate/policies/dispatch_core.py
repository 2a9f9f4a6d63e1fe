"""The dispatch core: which waiting request goes to which backend now, in the policy's order, given which
backends have room for it. The live gateway (proxy/pipeline/dispatcher.py: room is the KV gate's headroom)
and the simulator's gateway mode (sim/gate.py: room is the engine's memory rule) both dispatch through these
two pumps, so what the simulator predicts is what the gateway does, and a change to dispatch is made once.
Each side is a ``Site``: what the backends look like to it, and what dispatching does there.

- ``pump_head`` (a backend-blind policy: VTC, WSC, FCFS): the policy names the next request; the placement
  picks among the backends with room for it. A head with no room holds back its own model's requests only
  (one model's backlog never blocks another model's backends), and only while the site keeps several models
  apart (``Site.models_apart``; else the pump ends there).
- ``pump_per_backend`` (a policy that ``skips_unfit``: DLPM, LPM; or requests pinned at arrival): each
  backend, in the site's order, takes the request the policy picks for it among those that fit there (or,
  where the site lets it, steals one pinned elsewhere); rounds go on until no backend takes one.

Pure: no I/O, no clock; the time is passed in. O(backends) peeks a dispatch, plus what the site's answers
cost.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple, Protocol, Sequence

from fairgate.policies.placement import LeastLoad, Placement
from fairgate.policies.scheduler import Scheduler
from fairgate.policies.views import BackendView, RequestView

Eligible = Callable[[RequestView], bool]


class Ask(NamedTuple):
    """What a backend's peek is given: which requests fit there (``eligible``), which wait for it, room aside
    (``queued``, None: all), and, where it may take a request pinned elsewhere, the same pair for a steal."""

    eligible: Eligible
    queued: Eligible | None = None
    steal: tuple[Eligible, Eligible | None] | None = None


class Site(Protocol):
    """The backends as one side of the dispatch sees them."""

    models_apart: bool  # the queue holds requests of several models, whose backends are apart

    def names(self, view: RequestView) -> Sequence[str] | None:
        """The backends that may serve ``view``, or None if it has left the queue (the site removed it, or
        failed it: no backend can ever serve it)."""

    def fitting(self, view: RequestView, names: Sequence[str], now: float) -> list[BackendView]:
        """The views of those of ``names`` with room for ``view`` now."""

    def holds(self, view: RequestView, now: float) -> bool:
        """``view`` waits though it fits (the live gateway: a less-served client waits on another replica)."""

    def unplaced(self, view: RequestView) -> None:
        """The placement had no backend for ``view`` now (it may have one as time passes)."""

    def order(self) -> Sequence[str]:
        """The backends a round of ``pump_per_backend`` asks, in order (least loaded first)."""

    def ask(self, backend: str, now: float) -> Ask | None:
        """What ``backend``'s peek is given this round, or None: it is not asked."""

    def refused(self, backend: str) -> None:
        """The policy had nothing for ``backend``."""

    def dispatch(self, view: RequestView, backend: str, now: float) -> bool:
        """Send ``view`` to ``backend`` (popping it from the policy); False if the site would not after all."""


def routes(scheduler: Scheduler, placement: Placement) -> bool:
    """Requests are pinned to a backend as they arrive: by a placement that routes at arrival, and by every
    placement but least-load under a policy that picks per backend (``skips_unfit``), whose backends then each
    serve their own pins in its order (the DLPM paper's RR+LPM baseline; its per-backend pump is least-load
    already: each backend, least loaded first, takes the request the policy picks for it)."""
    return placement.routes_at_arrival or (scheduler.skips_unfit and not isinstance(placement, LeastLoad))


class Pins:
    """Requests pinned to a backend as they arrive (``routes``), as Preble's and D²LPM's global schedulers pin
    them (Algorithm 2): each waiting request's backend, and how many wait pinned to each — its queue (s_w),
    which the placement reads in the views it is given. A pin is the placement's to keep; a backend that has
    nothing of its own to take may steal another's when the placement routes at arrival (``Ask.steal``).
    O(backends) a routing, O(1) the rest."""

    def __init__(self) -> None:
        self.of: dict[str, str] = {}  # request id → its backend
        self.waiting: dict[str, int] = {}  # backend → requests pinned to it, waiting

    def route(self, placement: Placement, view: RequestView, views: Sequence[BackendView], now: float) -> str | None:
        """Pin ``view`` where ``placement`` picks among ``views`` (each counting the requests pinned there as
        waiting); None if it picked none."""
        views = [replace(v, waiting=v.waiting + self.waiting.get(v.name, 0)) for v in views]
        chosen = placement.choose(view, views, now)
        if chosen is None:
            return None
        self.of[view.request_id] = chosen.name
        self.waiting[chosen.name] = self.waiting.get(chosen.name, 0) + 1
        return chosen.name

    def unpin(self, placement: Placement, view: RequestView, ran: bool) -> str | None:
        """``view`` leaves its pin: dispatched (``ran``), or gone from the queue, when the placement gives back
        what it charged at the routing (D²LPM's refund). Its backend, or None if it had none."""
        backend = self.of.pop(view.request_id, None)
        if backend is None:
            return None
        left = self.waiting[backend] - 1
        if left:
            self.waiting[backend] = left
        else:
            del self.waiting[backend]
        if not ran:
            placement.refund(view, backend)
        return backend

    def waits_for(self, request_id: str, backend: str, up: set[str] | None = None) -> bool:
        """The request waits for ``backend``: pinned there, not pinned, or pinned to a backend not ``up``."""
        pinned = self.of.get(request_id)
        return pinned is None or pinned == backend or (up is not None and pinned not in up)


def pump_head(scheduler: Scheduler, placement: Placement, site: Site, now: float) -> None:
    """Dispatch in the policy's order while the head fits (module docstring)."""
    held: set[str] = set()  # models whose head waits for room in this pump
    others: Eligible = lambda v: v.model not in held  # noqa: E731
    while (view := scheduler.peek(now, others if held else None)) is not None:
        names = site.names(view)
        if names is None:
            continue
        chosen: BackendView | None = None
        if placement.waits(view, names, now):  # its refusal stands everywhere (no views to build)
            site.unplaced(view)
        elif (ready := site.fitting(view, names, now)) and not site.holds(view, now):
            if (chosen := placement.choose(view, ready, now)) is None:  # (aladdin: no backend meets its targets)
                site.unplaced(view)
        if chosen is None or not site.dispatch(view, chosen.name, now):
            if not site.models_apart:
                return
            held.add(view.model)  # it waits, and its model's requests behind it


def pump_per_backend(scheduler: Scheduler, site: Site, now: float) -> None:
    """Each backend in turn takes the policy's pick for it, in rounds until none takes one (module docstring)."""
    while True:
        taken = False
        for backend in site.order():
            ask = site.ask(backend, now)
            if ask is None:
                continue
            view = scheduler.peek(now, ask.eligible, backend, ask.queued)
            if view is None and ask.steal is not None:
                view = scheduler.peek(now, ask.steal[0], backend, ask.steal[1])
            if view is None:
                site.refused(backend)
                continue
            taken = site.dispatch(view, backend, now) or taken
        if not taken:
            return
