"""The simulator's ``gateway`` mode: the policy orders the gateway's queue, N engines each run FCFS, and a gate
releases a request to an engine only while it still fits that engine's memory (fairgate's real setting).

The release is the dispatch core's (policies/dispatch_core.py), the live gateway's own, over the engines
(``EngineSite``): a backend-blind policy's head goes to the engine the placement picks among those it fits;
a policy that ``skips_unfit`` (DLPM, LPM) is asked, for each engine with room, least loaded first, for its
choice *for that engine* (the longest cached prefix there among clients with credit, the engine's own cache
standing in for a precise index), in rounds until no engine takes one. An engine that was offered nothing is
not asked again until it or the policy's ``generation`` for it changed (the answer would be the same).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right

from fairgate.policies.dispatch_core import Ask, Pins, pump_head, pump_per_backend, routes
from fairgate.policies.scheduler import nothing
from fairgate.policies.views import BackendView
from fairgate.engine.batching import NO_SEAT, Engine, EngineRequest
from fairgate.engine.memory_rule import BatchMemory


class Smallest:
    """The least own KV and the least remaining output among the requests in the policy's queue (each kept
    apart: the memory rule's need grows with both), heaps cleaned lazily. (Kept per client too, it cost the
    Azure replay more than the checks it saved: bench/simulator.py.)"""

    def __init__(self, block_size: int, caching: bool):
        self.bs, self.caching = block_size, caching
        self._own: list[tuple[int, str]] = []
        self._remaining: list[tuple[int, str]] = []
        self._queued: set[str] = set()

    def add(self, er: EngineRequest) -> None:
        blocks = len(er.prompt_blocks(self.bs)) if self.caching else 0
        heapq.heappush(self._own, (er.prompt_len + 1 - blocks * self.bs, er.id))
        heapq.heappush(self._remaining, (er.output_len - 1, er.id))
        self._queued.add(er.id)

    def discard(self, request_id: str) -> None:
        self._queued.discard(request_id)

    def floor(self) -> tuple[int, int] | None:
        """(own, remaining) no queued request is below; None if none is queued."""
        for heap in (self._own, self._remaining):
            while heap and heap[0][1] not in self._queued:
                heapq.heappop(heap)
        return (self._own[0][0], self._remaining[0][0]) if self._queued else None


class GatewayMode:
    """Engine k's verdicts ("does request r fit?") are kept while its state stands still. A decode step that
    finishes nothing moves it only a little: a request's ``room`` there rises by at most ``DRIFT`` (1 + the
    requests handed to k, not yet admitted; engine/memory_rule.py), so a refusal short by more than the drift
    since it was given still stands, and a policy's empty answer built on such refusals still holds. A request
    handed to k only raises the others' need (its refusals stand, its fits go), and admitting handed requests
    that hold no prompt blocks leaves their entries as they were; any other change (a prefill with blocks, a
    finish, an abort) starts k's verdicts afresh.
    (``keep_refusals = False`` asks afresh after every step: tests/test_sim_exact.py compares the two.)"""

    keep_refusals = True
    quiet_runs = True  # an engine's decode steps in a quiet period as one event (``_quiet_until``)
    wake_only = True  # only engines handed a request, at a step's end or aborting one are asked to step

    def _changed(self, k: int, decoded: bool = False, handed: bool = False, steps: int = 1) -> None:
        """Engine k's state moved on (``decoded``: by ``steps`` decode steps that finished nothing; ``handed``: it
        was handed a request, which only raises every other request's need, so its refusals stand)."""
        if not self._memo:
            return  # (engine mode)
        memo = self._memo[k]
        if decoded and self.keep_refusals and memo is not None and not self._local[k]:
            memo[0].advance(steps)  # every request decoded: the summary stands, shifted (engine/memory_rule.py)
        elif not (handed and self.keep_refusals):  # (a handed request joined it: ``_hand``)
            self._memo[k] = None  # its batch summary is rebuilt when next asked
        if decoded and self.keep_refusals:
            self._drift[k] += steps * (1 + len(self._local[k]))
            if self._said_yes[k] or self._drift[k] >= self._limit[k]:
                self._new_version(k)
            if self._drift[k] >= self._watch[k]:
                self._moved.add(k)  # (the refusal ``EngineSite.fitting`` keeps for the head may have turned)
            return
        self._new_version(k)
        if handed and self.keep_refusals:
            verdicts = self._verdicts[k]
            for rid in [rid for rid, (room, _) in verdicts.items() if room >= 0]:
                del verdicts[rid]  # (a kept room is then an upper bound: a refusal's, all that is read)
        else:
            self._verdicts[k] = {}
            self._epoch[k] += 1
            self._drift[k] = 0
            self._moved.add(k)

    def _new_version(self, k: int) -> None:
        """Some answer of engine k's ``eligible`` may differ from what it said under its version so far."""
        self._version[k] += 1
        self._said_yes[k], self._limit[k] = False, float("inf")

    def _room(self, k: int, er: EngineRequest) -> float:
        """``er``'s room on engine k (≥ 0: it fits), or, for a refusal kept from before the latest decode
        steps, a bound on it that is still negative."""
        verdicts, drift = self._verdicts[k], self._drift[k]
        kept = verdicts.get(er.id)
        if kept is not None:
            room, at = kept
            if at == drift or room + (drift - at) < 0:
                return room + (drift - at)
        memory, clients = self._summary(k)[:2]
        room = self._engines[k].room(memory, clients, er)
        verdicts[er.id] = (room, drift)
        return room

    def _summary(self, k: int) -> tuple:
        """Engine k's batch summary (engine/memory_rule.py), its clients, and its entries (and, once ``_fit`` asked,
        its view); across decode steps that only advance the summary, the entries are those it was built from
        (each u + rem, all the view reads of them, stands)."""
        memo = self._memo[k]
        if memo is None:
            e, local = self._engines[k], self._local[k]
            entries = self._committed(k)
            clients = {x.client for x in e.running} | {q.client for q in local}
            memo = self._memo[k] = (BatchMemory(entries), clients, entries)
        return memo

    def _fit(self, k: int, er: EngineRequest) -> BackendView | None:
        """Engine k's view if ``er`` fits it beside what it runs and was handed (the memory rule), else None."""
        if self._room(k, er) < 0:
            return None
        memo = self._summary(k)
        if len(memo) == 3:  # (the view is kept with the summary: both stand until engine k changes)
            e, entries = self._engines[k], memo[2]
            memo = self._memo[k] = (*memo, BackendView(self._names[k], len(e.running) + len(self._local[k]),
                                                       sum(u + rem for u, rem in entries), e.kv_tokens))
        return memo[3]

    def _fits_on(self, k: int):
        """``eligible`` for a policy's pick for engine k (its state does not change during the pick); the
        closest refusal it gave is left in ``self._closest``. Its version (scheduler.version_of) stands while
        each answer it gave would be given again: no "yes" given yet and every "no" still short after the
        decode steps since (``_limit``: the drift at which the first of them could turn)."""
        room, ereqs, drift, limit, said_yes = self._room, self.ereqs, self._drift[k], self._limit, self._said_yes

        def eligible(v) -> bool:
            r = room(k, ereqs[v.request_id])
            if r >= 0:
                said_yes[k] = True
                return True
            if r > self._closest:
                self._closest = r
            if drift - r < limit[k]:
                limit[k] = drift - r
            return False

        if self.keep_refusals:
            eligible.version = (k, self._version[k], self._pin_epoch)
        return eligible

    def _floor_room(self, k: int) -> float:
        """The most room any queued request could have on engine k (``Smallest``'s floor; NO_SEAT with none
        queued), a refusal kept as ``_room`` keeps one."""
        floor = self.smallest.floor()
        if floor is None:
            return NO_SEAT
        kept, drift = self._floor_kept[k], self._drift[k]
        if kept is not None and kept[:2] == (floor, self._epoch[k]) and kept[3] + (drift - kept[2]) < 0:
            return kept[3] + (drift - kept[2])
        memory, clients = self._summary(k)[:2]
        room = self._engines[k].room_any(memory, clients, *floor)
        self._floor_kept[k] = (floor, self._epoch[k], drift, room)
        return room

    def _may_fit(self, k: int) -> bool:
        """Could any queued request fit engine k? (If not, the policy is told so: ``nothing`` fits.)"""
        room = self._floor_room(k)
        if room < 0:
            self._closest = room
        return room >= 0

    def _gate(self, engines: list[Engine], local: list[list[EngineRequest]], t: float) -> None:
        """Release requests in policy order while some engine can still fit the next one (the dispatch core's
        pumps, policies/dispatch_core.py, over the engines: ``EngineSite``)."""
        if not self._routing and not self.s.skips_unfit:
            return pump_head(self.s, self.placement, self._site, t)
        if self._unplaced:  # a placement's "none now" at arrival, asked again
            for v in [self.views[rid] for rid in sorted(self._unplaced, key=int)]:
                self._route(v, t)
        if all(map(self._still_refused, range(len(engines)))):
            return  # (every engine would be skipped: no need to order them)
        pump_per_backend(self.s, self._site, t)

    def _still_refused(self, k: int) -> bool:
        """Engine k was offered nothing, and nothing changed since but decode steps too few to matter."""
        refused = self._refused[k]  # (generation, epoch, drift it holds below), None unless kept
        return refused is not None and self._drift[k] < refused[2] and refused[1] == self._epoch[k] \
            and refused[0] == self.s.generation(self._names[k])

    def _hand(self, v, k: int, t: float) -> None:
        """Request ``v`` goes to engine k (popped from the policy under its name when the policy picks per
        engine)."""
        if self.s.skips_unfit or self._routing:
            self.s.pop(v, t, self._names[k])
        else:
            self.s.pop(v, t)
        if (pinned := self.pins.unpin(self.placement, v, ran=True)) is not None and pinned != self._names[k]:
            self._placed_on[v.request_id] = pinned  # (stolen: the placement charged where it was pinned)
        er = self.ereqs[v.request_id]
        self.smallest.discard(v.request_id)
        self.w.requests[int(v.request_id)].dispatched = t
        if self.out.ttft_predictions is not None:
            self.out.ttft_predictions.dispatched(int(v.request_id), k, er.prompt_len, t)
        self._engines[k].add(er, t)
        self._local[k].append(er)
        self._woken(k)
        if self.keep_refusals and (memo := self._memo[k]) is not None:  # (it joins the summary, as _committed
            memo[0].add(er.prompt_len + 1, er.output_len - 1)  # counts a handed request; memo[2] is its list)
            memo[1].add(er.client)
            self._memo[k] = memo[:3]  # (the view is taken again)
        self._changed(k, handed=True)

    def _route(self, v, t: float) -> None:
        """Pin request ``v`` to the engine the placement picks as it arrives (policies/dispatch_core.py,
        ``Pins``), each engine's view counting what runs and was handed there; a placement's "none now"
        (Aladdin's) is asked again at the next release (the live gateway: at its next heartbeat)."""
        views = [self._backend_view(k) for k in range(self.n)]
        if self.pins.route(self.placement, v, views, t) is not None:
            if v.request_id in self._unplaced:
                self._unplaced.discard(v.request_id)
                self._pin_epoch += 1  # (what the engines' picks may take changed without a queue change)
                self._refused = [None] * self.n
        elif not self.placement.routes_at_arrival:
            self._unplaced.add(v.request_id)

    def _backend_view(self, k: int) -> BackendView:
        e, entries = self._engines[k], self._summary(k)[2]
        return BackendView(self._names[k], len(e.running) + len(self._local[k]), sum(u + rem for u, rem in entries),
                           e.kv_tokens)

    def _unqueue(self, v) -> None:
        """Request ``v`` left the policy's queue without running: its pin is given back."""
        self._unplaced.discard(v.request_id)
        self.pins.unpin(self.placement, v, ran=False)

    def _woken(self, k: int) -> None:
        if self._wake is not None:
            self._wake.add(k)

    def _quiet_until(self, k: int, e: Engine) -> float | None:
        """The horizon of engine k's quiet run from now (the next arrival or deadline), None unless nothing
        waits in the gateway or on k and k has a batch to decode. O(1)."""
        if len(self.s) or self._local[k] or not e.quiet():
            return None
        horizon = self._arrivals[0][0] if self._arrivals else math.inf
        return min(horizon, self._deadlines[0][0]) if self._deadlines else horizon

    def _run_gateway(self) -> None:
        engines = [Engine(self.profiles[k], admit_every=self.admit_every, client_reserve=self.client_reserve,
                          prefix_caching=self.caching) for k in range(self.n)]
        if self.caching and self.s.match is not None:  # DLPM / LPM look at each engine's cache
            self.s.match = lambda v, b: engines[int(b or 0)].cached_tokens(self.ereqs[v.request_id])
        local: list[list[EngineRequest]] = [[] for _ in engines]  # handed to the engine, not yet admitted
        self._engines, self._local = engines, local
        self._names = [str(k) for k in range(self.n)]  # engine k's backend name for the policy
        self._site = EngineSite(self)  # the engines as the dispatch core sees them
        self._routing = routes(self.s, self.placement)  # requests pinned to an engine as they arrive
        self.pins, self._unplaced, self._pin_epoch = Pins(), set(), 0
        self._placed_on: dict[str, str] = {}  # engine its placement charged, where it ran elsewhere (stolen)
        self._memo: list[tuple | None] = [None] * self.n  # engine k's batch summary (until it changes)
        self._verdicts: list[dict[str, tuple[float, int]]] = [{} for _ in engines]  # id → (room, drift then)
        self._drift = [0] * self.n  # engine k's drift bound since its verdicts began
        self._closest = NO_SEAT  # the closest refusal of the pick being made
        self._floor_kept: list[tuple | None] = [None] * self.n  # (floor, epoch, drift, room) on engine k
        # the request that fit no engine when the pump last asked, the engines whose refusal of it may have
        # turned since, and the drift at which each engine's would (EngineSite.fitting)
        self._nowhere: str | None = None
        self._moved: set[int] = set()
        self._watch = [math.inf] * self.n
        self._version = [0] * self.n  # engine k's eligible's version, with
        self._said_yes = [False] * self.n  # whether it accepted a request under it
        self._limit = [float("inf")] * self.n  # and the drift at which its first refusal under it could turn
        self.smallest = Smallest(self.profile.block_size, self.caching)
        self._epoch = [0] * self.n  # engine k's changes (its cache, the match source, with them)
        # (policy generation, epoch, drift it holds below) of engine k's last empty answer
        self._refused: list[tuple | None] = [None] * self.n
        busy: list[tuple[float, int, object]] = []  # heap of (end, engine, step)

        def started(k: int, step, grew: int) -> None:
            if step.kind == "decode":  # unresized: no finish, no abort dropped
                steps, memo = len(step.ends) if step.ends else 1, self._memo[k]
                if grew and grew == -len(step.finished) and memo is not None and self.keep_refusals \
                        and not local[k]:  # only finishes: the summary advances, less what finished
                    memo[0].advance(steps)
                    memo[0].drop_finished()
                    self._changed(k)  # (every verdict afresh)
                    self._memo[k] = (memo[0], {x.client for x in self._engines[k].running}, memo[2])
                    return None
                return self._changed(k, decoded=not grew, steps=steps)
            admitted = {id(x) for x in step.emitted}  # no longer handed-but-waiting
            handed = len(local[k])
            local[k] = [q for q in local[k] if id(q) not in admitted]
            if grew != len(step.emitted) or handed - len(local[k]) != grew or any(x._held for x in step.emitted) \
                    or not self.keep_refusals:
                self._changed(k)
            # else each admitted request was handed here and its entry is what it was while handed ((prompt + 1,
            # output − 1), no blocks held), and no other request decoded: nothing a verdict or the summary reads
            # moved (the summary was built since the hand, unadvanced: a step with a handed request drops it)

        # Quiet periods: while nothing waits in the gateway and an engine was handed nothing, nothing can be
        # decided until the next arrival (or deadline), so that engine's decode steps up to then (or to its
        # next finish) run as one event (Engine.decode_run): the same times and tokens, and each step charged
        # when it would have started, in the same order (``_charge_until``), so every counter is the same to
        # the bit. Not with interactions whose stages follow each other (a finish may release the next stage at
        # once; an open-loop replay's arrive at their own times), a token ledger, the artifact's charging or
        # invariant checks.
        self._quiet = self.quiet_runs and not ((self.w.interactions and not self.w.open_loop) or self.record_ledger
                                               or self.quirks or self.check)
        in_step = [False] * self.n
        self._wake = set() if self.wake_only else None
        t = 0.0
        while True:
            if self._later:
                self._charge_until(t)  # (before anything reads the policy's counters at t)
            self._timeouts(t)
            self._arrive_until(t, None)
            while busy and busy[0][0] <= t:
                end, k, step = heapq.heappop(busy)
                if step.ends is not None and step.ends[0] <= self.w.duration_s:  # (a run: its steps before the
                    self.out.horizon_tokens += len(step.emitted) * bisect_right(step.ends, self.w.duration_s, 0,
                                                                                len(step.ends) - 1)  # last)
                self._receive(end, step, k)
                in_step[k] = False
                self._woken(k)
            self._arrive_until(t, None)  # stages released by what just finished (no think time)
            self._gate(engines, local, t)
            if self.check:
                self._check(t)
                head = self.s.peek(t)
                if head is not None and any(not e.running and not local[k] and not in_step[k]
                                            for k, e in enumerate(engines)):
                    self.out.idle_with_fitting_queue += 1  # an empty engine left idle with work waiting
            self._start_steps(t, busy, in_step, started)
            t = self._next_time(busy)
            if t is None:
                break


class EngineSite:
    """The simulator's engines as the dispatch core's ``Site`` (policies/dispatch_core.py): room is the memory
    rule's (``GatewayMode._fit``, its verdicts kept while they stand), one model, no replicas."""

    __slots__ = ("g",)
    models_apart = False

    def __init__(self, gateway: GatewayMode):
        self.g = gateway

    def names(self, view) -> list[str]:
        return self.g._names

    def fitting(self, view, names, now: float) -> list[BackendView]:
        """The engines ``view`` fits, in engine order. A request that fit none when last asked (a blocked head,
        asked again at every event) is asked again only of the engines that moved since in a way that could
        turn its refusal there (``_changed``: a reset, or decode steps past the refusal's drift): O(those),
        not O(engines)."""
        g = self.g
        er = g.ereqs[view.request_id]
        if not g.keep_refusals:
            return [v for k in range(len(names)) if (v := g._fit(k, er)) is not None]
        asked = sorted(g._moved) if view.request_id == g._nowhere else range(len(names))
        g._moved.clear()
        ready, verdicts, watch = [], g._verdicts, g._watch
        for k in asked:
            if (v := g._fit(k, er)) is not None:
                ready.append(v)
            else:
                room, at = verdicts[k][er.id]
                watch[k] = at - room  # (the drift at which it could turn)
        g._nowhere = None if ready else view.request_id
        return ready

    def holds(self, view, now: float) -> bool:
        return False

    def unplaced(self, view) -> None:
        pass

    def order(self) -> list[str]:
        g = self.g
        return [g._names[k] for k in sorted(range(g.n), key=lambda k: (len(g._engines[k].running) + len(g._local[k]), k))]

    def ask(self, backend: str, now: float) -> Ask | None:
        g = self.g
        k = int(backend)
        if g._still_refused(k):
            return None  # the same none as last time
        g._closest = NO_SEAT
        fits = g._fits_on(k) if g._may_fit(k) else nothing
        if not g._routing:
            return Ask(fits)
        pins, unplaced = g.pins, g._unplaced

        def queued(v) -> bool:
            """``v`` waits for this engine (pinned here, or not pinned), room aside."""
            return v.request_id not in unplaced and pins.waits_for(v.request_id, backend)

        if fits is nothing:
            eligible = nothing
        else:
            def eligible(v) -> bool:
                return queued(v) and fits(v)

            if hasattr(fits, "version"):  # (its own: a steal's peek asks ``fits`` under the same engine version)
                eligible.version = (*fits.version, "queued")
        steal = (fits, None) if g.placement.routes_at_arrival else None
        return Ask(eligible, queued, steal)

    def refused(self, backend: str) -> None:
        """The same none until k's refusals could have turned (or the policy changed)."""
        g = self.g
        k = int(backend)
        gen = g.s.generation(backend)
        if g.keep_refusals and gen is not None:  # (what a policy kept under this version rests on refusals too)
            limit = min(g._limit[k], g._drift[k] - g._closest)
            g._refused[k] = (gen, g._epoch[k], limit)

    def dispatch(self, view, backend: str, now: float) -> bool:
        self.g._hand(view, int(backend), now)
        return True
