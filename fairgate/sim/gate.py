"""The simulator's ``gateway`` mode: the policy orders the gateway's queue, N engines each run FCFS, and a gate
releases a request to an engine only while it still fits that engine's memory (fairgate's real setting).

A policy that ``skips_unfit`` (DLPM, LPM) is pumped as the live gateway pumps it (``proxy/pipeline/dispatcher.py``):
each engine with room, least loaded first, takes the policy's choice *for that engine* (the longest cached
prefix there among clients with credit, the engine's own cache standing in for a precise index); rounds go
on until no engine takes one. An engine that was offered nothing is not asked again until it or the policy's
``generation`` for it changed (the answer would be the same).
"""

from __future__ import annotations

import heapq

from fairgate.policies.scheduler import nothing
from fairgate.policies.views import BackendView
from fairgate.sim.engine import Engine, EngineRequest
from fairgate.sim.memory_rule import BatchMemory


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
    def _changed(self, k: int) -> None:
        if self._verdict:
            self._verdict[k] = None  # engine k's state moved on: its summary and verdicts with it
            self._epoch[k] += 1

    def _fit(self, k: int, er: EngineRequest) -> BackendView | None:
        """Engine k's view if ``er`` fits it beside what it runs and was handed (the memory rule), else None.
        Between two changes of engine k, its batch is summarised once (sim/memory_rule.py) and each request's
        verdict kept: a policy that asks about many candidates asks in O(log batch) each, once."""
        memo = self._summary(k)
        memory, clients, view, verdicts, entries = memo
        fits = verdicts.get(er.id)
        if fits is None:
            fits = verdicts[er.id] = self._engines[k].fits(memory, clients, er)
        if not fits:
            return None
        if view is None:  # built on the first request that fits
            e = self._engines[k]
            view = BackendView(str(k), len(e.running) + len(self._local[k]), sum(u + rem for u, rem in entries),
                               e.kv_tokens)
            self._verdict[k] = (memory, clients, view, verdicts, entries)
        return view

    def _summary(self, k: int) -> tuple:
        """Engine k's batch summary, its clients, its view (once a request fits), the verdicts given since its
        state last changed, and its entries."""
        memo = self._verdict[k]
        if memo is None:
            e, local = self._engines[k], self._local[k]
            entries = self._committed(k)
            clients = {x.client for x in e.running} | {q.client for q in local}
            memo = self._verdict[k] = (BatchMemory(entries), clients, None, {}, entries)
        return memo

    def _fits_on(self, k: int):
        """``eligible`` for a policy's pick for engine k (its state does not change during the pick)."""
        memory, clients, _view, verdicts, _entries = self._summary(k)
        engine, ereqs = self._engines[k], self.ereqs

        def eligible(v) -> bool:
            fits = verdicts.get(v.request_id)
            if fits is None:
                fits = verdicts[v.request_id] = engine.fits(memory, clients, ereqs[v.request_id])
            return fits

        return eligible

    def _may_fit(self, k: int) -> bool:
        """Could any queued request fit engine k? (If not, the policy is told so: ``nothing`` fits.)"""
        floor = self.smallest.floor()
        if floor is None:
            return False
        memory, clients, *_ = self._summary(k)
        return self._engines[k].fits_any(memory, clients, *floor)

    def _gate(self, engines: list[Engine], local: list[list[EngineRequest]], t: float) -> None:
        """Release requests in policy order while some engine can still fit the next one."""
        if self.s.skips_unfit:
            return self._gate_per_engine(engines, local, t)
        while (v := self.s.peek(t)) is not None:
            er = self.ereqs[v.request_id]
            views = [view for k in range(len(engines)) if (view := self._fit(k, er)) is not None]
            if not views:
                return
            k = int(self.placement.choose(v, views, t).name)
            self.s.pop(v, t)
            self.smallest.discard(v.request_id)
            r = self.w.requests[int(v.request_id)]
            r.dispatched = t
            engines[k].add(er, t)
            local[k].append(er)
            self._changed(k)

    def _gate_per_engine(self, engines: list[Engine], local: list[list[EngineRequest]], t: float) -> None:
        while True:
            taken = False
            for k in sorted(range(len(engines)), key=lambda k: (len(engines[k].running) + len(local[k]), k)):
                gen = self.s.generation(str(k))
                if gen is not None and self._refused[k] == (gen, self._epoch[k]):
                    continue  # asked with nothing changed since: the answer is the same none
                v = self.s.peek(t, self._fits_on(k) if self._may_fit(k) else nothing, str(k))
                if v is None:
                    self._refused[k] = (self.s.generation(str(k)), self._epoch[k])
                    continue
                er = self.ereqs[v.request_id]
                self.s.pop(v, t, str(k))
                self.smallest.discard(v.request_id)
                self.w.requests[int(v.request_id)].dispatched = t
                engines[k].add(er, t)
                local[k].append(er)
                self._changed(k)
                taken = True
            if not taken:
                return

    def _run_gateway(self) -> None:
        engines = [Engine(self.profile, admit_every=self.admit_every, client_reserve=self.client_reserve,
                          prefix_caching=self.caching) for _ in range(self.n)]
        if self.caching and self.s.match is not None:  # DLPM / LPM look at each engine's cache
            self.s.match = lambda v, b: engines[int(b or 0)].cached_tokens(self.ereqs[v.request_id])
        local: list[list[EngineRequest]] = [[] for _ in engines]  # handed to the engine, not yet admitted
        self._engines, self._local = engines, local
        self._verdict = [None] * self.n
        self.smallest = Smallest(self.profile.block_size, self.caching)
        self._epoch = [0] * self.n  # engine k's changes (its cache, the match source, with them)
        self._refused: list[tuple | None] = [None] * self.n  # (policy generation, epoch) of k's last empty answer
        busy: list[tuple[float, int, object]] = []  # heap of (end, engine, step)

        def started(k: int, step) -> None:  # what the engine admitted is no longer handed-but-waiting
            self._changed(k)
            if step.kind == "prefill":
                admitted = {id(x) for x in step.emitted}
                local[k] = [q for q in local[k] if id(q) not in admitted]

        in_step = [False] * self.n
        t = 0.0
        while True:
            self._timeouts(t)
            self._arrive_until(t, None)
            while busy and busy[0][0] <= t:
                end, k, step = heapq.heappop(busy)
                self._receive(end, step.emitted, step.finished, k)
                in_step[k] = False
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
