"""The dispatch gate: requests wait in the policy's fair queue and are released to a backend only when it has
headroom, so the gateway's order is the order that runs — while no backend that could work sits idle.

Headroom is the gateway's own in-flight accounting (KV tokens each request holds or will hold: prompt plus
its output reservation) against the backend's capacity (configured, or read from ``vllm:cache_config_info``)
and its sequence limit, corrected by the backend's metrics: a backend that reports its own waiting queue gets
nothing more until it drains. A backend with nothing in flight always has headroom (work conservation).

``pump()`` is the dispatch loop's body; it runs whenever something changes (an arrival, a release, a fresh
scrape), synchronously, so a release is followed by the next dispatch without a wake-up hop. Two shapes of
decision share it:
- a backend-blind policy (VTC, WSC, FCFS) names the next request; the placement picks among the backends with
  headroom for it;
- a locality-aware policy (DLPM, LPM: ``skips_unfit``) is asked, for each backend with headroom, which request
  goes next *there* (its longest cached prefix among clients with credit on that backend): centralized DLPM
  (docs/policies/locality.md#centralized-dlpm) with the prefix index in place of synchronizing with the
  workers;
- a placement that routes at arrival (``prefix``, ``d2lpm``: ``routes_at_arrival``; and under a policy that
  picks per backend, every placement but least-load, which its pump already is) pins each request to a
  backend when it arrives, as Preble's and D²LPM's global schedulers do (Algorithm 2), counting the requests
  already pinned to a backend in its queue; each backend with headroom then takes, in the policy's order, the
  requests pinned to it (DLPM: longest prefix first among clients with credit, i.e. D²LPM's local DLPM; VTC:
  the least-served client's). A backend with headroom and nothing of its own to take steals the policy's next
  request from the others, so the gateway never idles a backend that could work (a recorded deviation from
  Algorithm 2, which leaves a worker with an empty queue idle); a request pinned to a backend that went down
  is free for any.
Every dispatch enters the request's blocks in the prefix index for its backend (optimistic, as Algorithm 2's
R.INSERT), so the next request with the same prefix sees it at once.

The two pumps are the dispatch core's (policies/dispatch_core.py), which the simulator's gateway mode runs
too; ``PoolSite`` is this gateway's side of them: its backends, the gate's headroom, the cross-replica hold.
"""

from __future__ import annotations

import asyncio
import functools
import math
from dataclasses import replace
from typing import Callable

from fairgate.policies.dispatch_core import Ask, Pins, pump_head, pump_per_backend, routes
from fairgate.policies.oit import OverloadConfig, overloaded
from fairgate.policies.placement import Placement
from fairgate.policies.scheduler import Scheduler
from fairgate.policies.views import RequestView
from fairgate.proxy.control.backends import Backend, BackendPool
from fairgate.proxy.pipeline.kv_gate import MAX_CHOICES, Gate
from fairgate.proxy.pipeline.ticket import DispatchStats, GateConfig, Ticket
from fairgate.proxy.errors import APIError, unavailable
from fairgate.accounting.calibration import EventRate

__all__ = ["Dispatcher", "DispatchStats", "GateConfig", "Ticket"]  # (the ticket's module holds the data)


class Dispatcher:
    def __init__(self, scheduler: Scheduler, pool: BackendPool, placement: Placement,
                 config: GateConfig | None = None, shared=None,
                 overload: Callable[[], OverloadConfig] = OverloadConfig, index=None):
        self.scheduler, self.pool, self.placement = scheduler, pool, placement
        self.index = index  # PrefixIndex, or None when nothing reads it
        self.shared_index = None  # SharedIndex: what this replica dispatched, told to the others (Redis)
        self.overload = overload
        self.config = config or GateConfig()
        self.shared = shared  # SharedState across replicas, or None
        self.gate = Gate(self.config, shared, self.now)  # which backend has room for which request
        self._site = PoolSite(self)  # the backends as the dispatch core sees them
        if shared is not None:
            shared.backlog_source = lambda: self.scheduler.waiting_clients()
            shared.inflight_source = lambda: self.gate.claims(self.pool.backends)
            shared.on_sync.extend((self.gate.synced, self.pump))
        self._tickets: dict[str, Ticket] = {}
        self._sent: dict[str, Ticket] = {}  # dispatched and not ended (their progress: ``progress``)
        self._queued: dict[str, int] = {}  # waiting tickets per fairness key, and per app (the queue caps)
        self._queued_apps: dict[str, int] = {}
        self._users_waiting: dict[str, int] = {}  # per app, its users (``user:`` keys) with a request waiting
        self._user_app: dict[str, str] = {}  # each such user, and the app it is counted for (a shared user's first)
        self.pins = Pins()  # waiting tickets pinned to a backend at arrival (``routes``)
        self._unplaced: set[str] = set()  # waiting tickets a placement asked at arrival said "none now" of
        self.stats = DispatchStats()
        self.rate = EventRate()  # how fast requests leave the queue (pipeline/shedding.py)
        self.arrivals = EventRate()  # and come to it (fairgate_backends_needed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rechecking: asyncio.TimerHandle | None = None

    def now(self) -> float:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.time()

    def __len__(self) -> int:
        return len(self._tickets)

    # -- the request's side -------------------------------------------------------------------------
    async def acquire(self, view: RequestView, kv_tokens: int, exclude: set[str] = frozenset(),
                      output: int = 0, choices: int = 1, streamed: bool = True) -> Ticket:
        """Wait in the fair queue until a backend is reserved for this request; the ticket's future holds it.
        ``output``: of ``kv_tokens``, the output reserved (the rest is its prompt, held from the start), over
        ``choices`` choices; ``streamed``: its progress will be read as it streams."""
        if not self.pool.candidates(view.model, exclude):
            raise unavailable(f"no backend can serve model {view.model!r} right now", self.config.retry_after_s)
        if self.shared is not None and self.scheduler.prefetches and not exclude:
            # WSC reads the interaction's state, OIT the windows: fetch them from Redis
            await self.shared.prepare(view.client, view.app, view.interaction if view.in_interaction else None,
                                      self.now(), windows=self.scheduler.throttles)
        now = self.now()
        if not exclude:  # (once per request, not again on a retry)
            self.arrivals.event(now)
            if self.shared is not None:  # (an idle replica syncs less often: work came)
                self.shared.touch()
        if self.scheduler.throttles and not exclude:  # OIT, once per request (not again on a retry)
            throttle = self.scheduler.admit(view, now, self.overloaded(view.model))
            if throttle is not None:
                self.stats.throttled += 1
                raise APIError(429, throttle.message, code=throttle.reason, headers={
                    "retry-after": str(max(1, math.ceil(throttle.retry_after_s))), "x-should-retry": "true"})
            now = self.now()
        view = self._seat(view)  # (no wait from here to ``_track``: the seat is counted as it is given)
        self._check_caps(view)
        ticket = Ticket(view, kv_tokens, set(exclude), self._loop.create_future(), now,
                        self.scheduler.counter(view.client), choices=max(1, choices),
                        streamed=streamed and choices <= MAX_CHOICES,
                        output=min(max(0, output), max(0, kv_tokens - view.prompt_tokens)))
        if not self.scheduler.add(view, now):
            self.stats.rejected += 1
            raise APIError(429, "request-per-minute limit reached for this client", code="rate_limit_exceeded",
                           headers={"retry-after": "60", "x-should-retry": "true"})
        self._track(ticket)
        try:  # (a placement or policy that raises leaves no ticket behind)
            if self._routes():
                self._route(ticket, now)
            self.pump()
            f = ticket.future
            if f.done() and not f.cancelled() and f.exception() is None:  # a backend had headroom: no wait
                return ticket
            # (not wait_for: Python 3.11's returns the result, and swallows the cancellation, when the client
            # leaves in the turn a backend is granted: the request would run for nobody)
            async with asyncio.timeout(self.config.queue_timeout_s):
                await asyncio.shield(ticket.future)
        except BaseException as e:  # timed out, failed by the gate, or the client went away
            f = ticket.future
            if f.done() and not f.cancelled() and f.exception() is None:
                self.abandon(ticket, f.result())  # a backend was reserved as we gave up: hand it back
            else:
                self._drop(ticket)
            if isinstance(e, asyncio.TimeoutError):
                raise unavailable(f"waited {self.config.queue_timeout_s:.0f} s in the queue without a backend",
                                  self.config.retry_after_s) from None
            raise
        return ticket

    def _check_caps(self, view: RequestView) -> None:
        """Bounded queues: a tenant cannot fill the gateway's memory, nor all tenants together."""
        if len(self._tickets) >= self.config.max_queued:
            raise APIError(503, f"the gateway's queue is full ({self.config.max_queued} requests waiting)",
                           type="server_error", code="queue_full", headers={
                               "retry-after": str(self.config.retry_after_s), "x-should-retry": "true"})
        if self._queued.get(view.client, 0) >= self.config.max_queued_per_tenant:
            self.stats.rejected += 1
            raise APIError(429, f"too many requests waiting for this client ({self.config.max_queued_per_tenant})",
                           code="tenant_queue_full", headers={
                               "retry-after": str(self.config.retry_after_s), "x-should-retry": "true"})
        if self._queued_apps.get(view.app, 0) >= self.config.max_queued_per_app:
            self.stats.rejected += 1
            raise APIError(429, f"too many requests waiting for this app ({self.config.max_queued_per_app})",
                           code="app_queue_full", headers={
                               "retry-after": str(self.config.retry_after_s), "x-should-retry": "true"})

    def _seat(self, view: RequestView) -> RequestView:
        """The request as it waits: under its user's key, unless ``max_users_per_app`` other users of its app
        already wait; then under the app's own, ``app:<app>``, whose turns the app's further users share. O(1);
        decided and counted with no wait between (``acquire``)."""
        most, client = self.config.max_users_per_app, view.client
        if most is None or client in self._queued or self._users_waiting.get(view.app, 0) < most \
                or not client.startswith("user:") or self.scheduler.throttles or self.scheduler.limits_clients:
            return view
        return replace(view, client=f"app:{view.app}")

    def _track(self, ticket: Ticket) -> None:
        view = ticket.view
        self._tickets[view.request_id] = ticket
        waiting = self._queued.get(view.client, 0)
        self._queued[view.client] = waiting + 1
        if not waiting and view.client.startswith("user:"):
            self._user_app[view.client] = view.app
            self._users_waiting[view.app] = self._users_waiting.get(view.app, 0) + 1
        self._queued_apps[view.app] = self._queued_apps.get(view.app, 0) + 1

    def oldest_waiting(self) -> dict[str, float]:
        """Each fairness key with a request waiting, and the arrival of its oldest (the console's). O(waiting)."""
        oldest: dict[str, float] = {}
        for ticket in self._tickets.values():
            view = ticket.view
            if view.client not in oldest or view.arrival < oldest[view.client]:
                oldest[view.client] = view.arrival
        return oldest

    def _route(self, ticket: Ticket, now: float) -> None:
        """Pin the request to the backend the placement picks at arrival (policies/dispatch_core.py, ``Pins``)."""
        views = [b.view() for b in self.pool.candidates(ticket.view.model, ticket.exclude)]
        if self.pins.route(self.placement, ticket.view, views, now) is not None:
            self._unplaced.discard(ticket.view.request_id)
        elif not self.placement.routes_at_arrival:  # (Aladdin: no backend meets its targets now) it waits, and
            self._unplaced.add(ticket.view.request_id)  # is asked about again at the heartbeat (``_recheck``)

    def _untrack(self, request_id: str, dispatched: bool = False) -> Ticket | None:
        ticket = self._tickets.pop(request_id, None)
        self._unplaced.discard(request_id)
        if ticket is not None:
            view = ticket.view
            self.pins.unpin(self.placement, view, ran=dispatched)  # (routed, never dispatched: refunded)
            _less(self._queued, view.client)
            _less(self._queued_apps, view.app)
            if view.client not in self._queued and (app := self._user_app.pop(view.client, None)) is not None:
                _less(self._users_waiting, app)
        return ticket

    def _drop(self, ticket: Ticket) -> None:
        if self._untrack(ticket.view.request_id) is not None:
            self.scheduler.remove(ticket.view, self.now())
        if not ticket.future.done():
            ticket.future.cancel()
        self.pump()

    def started(self, ticket: Ticket, backend: Backend) -> None:
        """Its first token came (or it ended without one): its prompt no longer waits for ``backend``'s prefill."""
        backend.prefilling -= ticket.prefilling
        ticket.prefilling = 0

    def _scheduler_of(self, ticket: Ticket) -> Scheduler:
        """The scheduler that admitted ``ticket``: it settles its charges, even after a switch emptied its queue
        (a policy with no request waiting is falsy: ``is None``, never ``or``)."""
        return self.scheduler if ticket.scheduler is None else ticket.scheduler

    def _placement_of(self, ticket: Ticket) -> Placement:
        return self.placement if ticket.placement is None else ticket.placement

    def charge(self, ticket: Ticket, generated: int) -> None:
        """Output tokens generated so far (charged as they stream)."""
        now = self.now()
        if ticket.first_read is None:  # (its rate from its first token on: not its wait and prefill)
            if generated > 0:
                ticket.first_read = (now, generated)
        elif now > ticket.first_read[0]:  # (over the whole stream: reads that came bunched do not spike it)
            ticket.rate = (generated - ticket.first_read[1]) / (now - ticket.first_read[0])
        ticket.generated, ticket.charged_at = generated, now
        self._scheduler_of(ticket).on_tokens(ticket.view, generated, now)

    def reserve(self, ticket: Ticket, backend: Backend, kv_tokens: int) -> None:
        """The request now holds ``kv_tokens`` on ``backend`` (never less than it held: a reservation grows)."""
        if kv_tokens > ticket.kv_tokens:
            grew = kv_tokens - ticket.kv_tokens
            backend.grow(grew)
            self.gate.running(backend).remove(ticket)  # (out at its old size, back at its new)
            ticket.output += grew
            ticket.kv_tokens = kv_tokens
            self.gate.running(backend).add(ticket)
            if self.shared is not None:  # the other replicas' budgets may hold what it grew into: tell them soon
                self.shared.wake()

    def finish(self, ticket: Ticket, backend: Backend, generated: int, prompt_tokens: int | None,
               cached_tokens: int | None = None) -> None:
        """The request ended after ``generated`` tokens: settle its charge, free its reservation.
        ``cached_tokens``: the backend's report, which corrects DLPM's extend charge (the index predicted it)."""
        scheduler = self._scheduler_of(ticket)
        scheduler.on_finish(ticket.view, generated, self.now(), prompt_tokens, cached_tokens)
        self._placement_of(ticket).on_finish(ticket.view, backend.name, generated)
        self.gate.seat_freed(backend)  # (before it leaves)
        self._leave(ticket, backend)

    def abandon(self, ticket: Ticket, backend: Backend) -> None:
        """The backend failed before the first token: refund the input and free the reservation."""
        self._scheduler_of(ticket).on_finish(ticket.view, 0, self.now(), prompt_tokens=0)
        self._placement_of(ticket).refund(ticket.view, ticket.placed_on or backend.name)
        self._leave(ticket, backend)

    def _leave(self, ticket: Ticket, backend: Backend) -> None:
        """The request holds nothing on ``backend`` any more; the queue may move."""
        self.started(ticket, backend)
        self._sent.pop(ticket.view.request_id, None)
        self.gate.running(backend).remove(ticket)
        backend.release(ticket.kv_tokens)
        self.pump()

    def progress(self, request_id: str) -> int | None:
        """Output tokens a dispatched request has streamed so far, per choice (None: not streamed, or not
        running here), as a placement reads them (Aladdin's ledger)."""
        ticket = self._sent.get(request_id)
        return ticket.generated // max(1, ticket.choices) if ticket is not None and ticket.streamed else None

    def switch_placement(self, placement: Placement) -> None:
        """Place with ``placement`` from now on: the waiting requests lose their pins (refunded) and, if it
        routes at arrival, are routed again by it, in their arrival order."""
        self._unpin_all()
        self.placement = placement
        self._route_all(self.now())
        self.pump()

    def _unpin_all(self) -> None:
        """The waiting requests lose their pins (refunded by the placement that made them)."""
        self._unplaced.clear()
        for ticket in self._tickets.values():
            self.pins.unpin(self.placement, ticket.view, ran=False)

    def _route_all(self, now: float) -> None:
        """The waiting requests pinned again, in arrival order, if the pair in force routes at arrival."""
        if self._routes():
            for ticket in sorted(self._tickets.values(), key=lambda t: t.enqueued):
                self._route(ticket, now)

    def _routes(self) -> bool:
        return routes(self.scheduler, self.placement)

    def switch(self, scheduler: Scheduler) -> None:
        """Run ``scheduler`` from now on: the waiting requests move to it in their arrival order; requests
        already running settle with the scheduler that admitted them (pins are made or dropped as the pair
        now routes at arrival or not)."""
        now = self.now()
        routed = self._routes()
        old, self.scheduler = self.scheduler, scheduler
        if self._routes() != routed:
            self._unpin_all()
            self._route_all(now)
        for ticket in sorted(self._tickets.values(), key=lambda t: t.enqueued):
            old.remove(ticket.view, now)
            if not scheduler.add(ticket.view, now):  # e.g. over an RPM limit under the new policy
                self._untrack(ticket.view.request_id)
                ticket.future.set_exception(APIError(
                    429, "request-per-minute limit reached for this client", code="rate_limit_exceeded",
                    headers={"retry-after": "60", "x-should-retry": "true"}))
        self.pump()

    def overloaded(self, model: str) -> bool:
        """The pool that serves ``model`` is overloaded (OIT's trigger): requests wait here for headroom, a
        backend queues on its own, or the committed KV load (this replica's and the others') is high."""
        views = []
        for b in self.pool.candidates(model):
            v = b.view()
            tokens, count = self.shared.kv.inflight.get(b.name, (0, 0)) if self.shared is not None else (0, 0)
            v = replace(v, inflight=v.inflight + count, inflight_tokens=self.gate.committed(b) + tokens)
            views.append(v)
        return overloaded(views, len(self), self.overload())

    # -- the gate -----------------------------------------------------------------------------------
    def _defer(self, ticket: Ticket, now: float) -> bool:
        """Across replicas: hold our head back while a client with a smaller counter waits on another replica
        (by more than this request's own cost), for at most ``hold_max_s`` so no backend idles for long."""
        shared = self.shared
        if shared is None or not shared.up or shared.global_min is None or shared.is_mine(shared.global_min[0]) \
                or not self.scheduler.holds_across_replicas:
            return False
        view = ticket.view
        slack = self.scheduler.cost.h(view.prompt_tokens, view.max_tokens or 256) / self.scheduler.weight(view.client)
        if self.scheduler.counter(view.client) <= shared.global_min[1] + slack:
            return False
        ticket.held_since = ticket.held_since or now
        return now - ticket.held_since < self.config.hold_max_s

    def pump(self) -> None:
        if self.scheduler.skips_unfit or self._routes():
            self._pump_per_backend()
        else:
            self._pump_head()

    def _dispatch(self, view: RequestView, ticket: Ticket, backend: Backend, now: float) -> None:
        self.scheduler.pop(view, now, backend.name)
        ticket.scheduler, ticket.placement = self.scheduler, self.placement
        ticket.placed_on = self.pins.of.get(view.request_id) or backend.name
        self._untrack(view.request_id, dispatched=True)
        self._sent[view.request_id] = ticket
        self.rate.event(now)
        backend.acquire(ticket.kv_tokens)
        backend.sent(now)
        if self.index is not None and view.blocks:
            ticket.predicted_cached = self.index.cached_tokens(view.blocks, view.prompt_tokens, backend.name, now)
            if not self.index.precise:  # the approximate index learns from what it dispatches
                if backend.kv_capacity:
                    self.index.set_capacity(backend.name, backend.kv_capacity // self.index.block_size)
                self.index.insert(view.blocks, backend.name, now)
                if self.shared_index is not None:
                    self.shared_index.record(backend.name, view.blocks)
        ticket.prefilling = max(0, view.prompt_tokens - (ticket.predicted_cached or 0))
        ticket.charged_at = now
        backend.prefilling += ticket.prefilling
        self.gate.place(backend, ticket)
        self.stats.dispatched += 1
        ticket.future.set_result(backend)

    def _recheck(self) -> None:
        """Pump again after a heartbeat: a placement that held its request back (none of the backends could meet
        its targets) may take it once their prefills are done, with no release to wake the queue."""
        if self._rechecking is None:
            def again() -> None:
                self._rechecking = None
                now = self.now()
                for request_id in list(self._unplaced):  # (the placement may have a backend for them now)
                    if (t := self._tickets.get(request_id)) is not None:
                        self._route(t, now)
                self.pump()

            self.now()  # (the loop, known)
            self._rechecking = self._loop.call_later(self.config.recheck_s, again)

    def close(self) -> None:
        """Stop: no recheck left pending."""
        if self._rechecking is not None:
            self._rechecking.cancel()
            self._rechecking = None

    def _pump_per_backend(self) -> None:
        """Each backend with headroom, least loaded first, takes the request the policy picks for it among
        those pinned to it (or not pinned), else, under a placement that routes at arrival, steals one; rounds
        go on until no backend takes one (a request that fits nowhere waits for a release). A request its
        placement had no backend for at arrival waits until it has one (asked again at each heartbeat:
        O(those requests × backends) a heartbeat, whatever the events). O(backends) peeks a dispatch."""
        if self._unplaced:  # asked about again at the heartbeat (``_recheck``), not at every event
            self._recheck()
        self._site.per_backend(self.scheduler.skips_unfit, self._routes() and self.placement.routes_at_arrival)
        pump_per_backend(self.scheduler, self._site, self.now())

    def _pump_head(self) -> None:
        """Dispatch in the policy's order while the head fits. A head that must wait for headroom holds back
        its own model's requests only: the others are served from the next head the policy names among them
        (one model's backlog never blocks another model's backends)."""
        pump_head(self.scheduler, self.placement, self._site, self.now())


def _less(counts: dict[str, int], key: str) -> None:
    """One fewer of ``key``; a count that reaches 0 leaves ``counts`` (they hold only what waits)."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


class PoolSite:
    """The gateway's backends as the dispatch core's ``Site`` (policies/dispatch_core.py): those up that serve
    a request's model and that it was not tried on; room is the KV gate's headroom, and a request that fits
    may wait for a less-served client queued on another replica (``Dispatcher._defer``)."""

    models_apart = True

    def __init__(self, dispatcher: Dispatcher):
        self.d = dispatcher
        self._by: dict[str, Backend] = {}  # by name: the head's candidates, or a per-backend round's backends
        self._up: set[str] = set()
        self._local = self._steals = False

    # -- the head pump ------------------------------------------------------------------------------------
    def names(self, view: RequestView) -> list[str] | None:
        d = self.d
        ticket = d._tickets.get(view.request_id)
        if ticket is None:  # gone; the scheduler skips it from now on
            d.scheduler.remove(view, d.now())
            return None
        serving = d.pool.candidates(view.model, ticket.exclude)
        if not serving:  # nothing can ever take it: fail it rather than block the queue
            d.scheduler.remove(view, d.now())
            d._untrack(view.request_id)
            ticket.future.set_exception(unavailable(
                f"no backend can serve model {view.model!r} right now", d.config.retry_after_s))
            return None
        self._by = {b.name: b for b in serving}
        return list(self._by)

    def fitting(self, view: RequestView, names, now: float) -> list:
        ticket, gate = self.d._tickets[view.request_id], self.d.gate
        return [b.view() for b in self._by.values() if gate.headroom(b, ticket)]

    def holds(self, view: RequestView, now: float) -> bool:
        return self.d._defer(self.d._tickets[view.request_id], now)

    def unplaced(self, view: RequestView) -> None:
        self.d._recheck()  # (it may have a backend once time passes)

    # -- the per-backend pump -----------------------------------------------------------------------------
    def per_backend(self, local: bool, steals: bool) -> None:
        """The next rounds' setting: the policy picks per backend (``local``: no cross-replica hold), and a
        backend may take a request pinned elsewhere (``steals``: the placement routes at arrival)."""
        self._local, self._steals = local, steals

    def order(self) -> list[str]:
        backends = self.d.pool.backends
        self._up = {b.name for b in backends if b.up}
        self._by = {b.name: b for b in sorted(backends, key=lambda b: (b.view().load, b.name)) if b.up}
        return list(self._by)

    def ask(self, backend: str, now: float) -> Ask:
        d, b, up, local = self.d, self._by[backend], self._up, self._local

        def queued(v: RequestView, steal: bool = False) -> bool:
            """``v`` waits for ``b`` (routed here or not routed), room aside."""
            t = d._tickets.get(v.request_id)
            if t is None or b.name in t.exclude or v.model not in b.models or v.request_id in d._unplaced:
                return False
            return steal or d.pins.waits_for(v.request_id, b.name, up)

        def fits(v: RequestView, steal: bool = False) -> bool:
            if not queued(v, steal):
                return False
            t = d._tickets[v.request_id]
            return d.gate.headroom(b, t) and (local or not d._defer(t, now))

        if not self._steals:
            return Ask(fits, queued)
        return Ask(fits, queued, (functools.partial(fits, steal=True), functools.partial(queued, steal=True)))

    def refused(self, backend: str) -> None:
        pass

    def dispatch(self, view: RequestView, backend: str, now: float) -> bool:
        d = self.d
        b = self._by[backend]
        ticket = d._tickets[view.request_id]
        if b not in d.pool.candidates(view.model, ticket.exclude):
            return False  # ejected since (outlier detection): not this round
        d._dispatch(view, ticket, b, now)
        return True
