"""The discrete-event simulator: the engine model and the real policy objects, in virtual time.

- ``engine`` mode: one engine whose waiting queue *is* the policy (the paper's setting);
- ``gateway`` mode: the policy orders the gateway's queue; N engines each run FCFS; a dispatch gate releases
  the next request to an engine only while it still fits that engine's memory (running requests plus those
  already handed to it), so the engine's own queue never holds more than it will admit at its next
  admission point, and an engine with room never waits for the gateway (fairgate's real setting).

Counters are charged when a step starts (input at admission, one output token per running request), as the
VTC artifact does; a token is *received* (service ledger, first token, finish) when its step ends.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

from fairgate.accounting.cost import CostFunction
from fairgate.policies.placement import LeastLoad
from fairgate.policies.scheduler import Scheduler
from fairgate.policies.views import BackendView, RequestView
from fairgate.sim.engine import Engine, EngineRequest
from fairgate.sim.profiles import EngineProfile
from fairgate.sim.workload import SimRequest, Workload

ARTIFACT_ADMIT_EVERY = 10  # max_wait_tokens: admission tried every 10 decode steps (notes/vtc.md §2.1)
ARTIFACT_CLIENT_RESERVE = 32  # 4·r adapter tokens per distinct client in the batch (r = 8)


@dataclass
class SimOutcome:
    workload: Workload
    mode: str
    backends: int
    makespan: float
    requests: list[SimRequest]
    # token-level ledger: per client, (time, weighted service) increments when received
    ledger: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    scheduler: Scheduler | None = None
    invariant_violations: list[str] = field(default_factory=list)
    max_counter_spread: float = 0.0
    max_batch_tokens: int = 0  # largest Σ (prompt + output) over a running batch: the M of Lemma 4.3
    idle_with_fitting_queue: int = 0  # work-conservation violations observed


class _PolicyQueue:
    """Adapts a scheduler to the engine's waiting-queue interface (engine mode)."""

    def __init__(self, scheduler: Scheduler, views: dict[int, RequestView], by_id: dict[str, EngineRequest]):
        self.s, self.views, self.by_id = scheduler, views, by_id

    def push(self, er: EngineRequest, now: float) -> bool:
        return self.s.add(self.views[int(er.id)], now)

    def peek(self, now: float) -> EngineRequest | None:
        v = self.s.peek(now)
        return None if v is None else self.by_id[v.request_id]

    def pop(self, er: EngineRequest, now: float) -> None:
        self.s.pop(self.views[int(er.id)], now)

    def __len__(self) -> int:
        return len(self.s)


class Simulator:
    def __init__(self, workload: Workload, scheduler: Scheduler, profile: EngineProfile, *, mode: str = "engine",
                 backends: int = 1, cost: CostFunction | None = None, admit_every: int = ARTIFACT_ADMIT_EVERY,
                 client_reserve: int = ARTIFACT_CLIENT_RESERVE, record_ledger: bool = False,
                 check_invariants: bool = False, progress: Callable[[float], None] | None = None,
                 artifact_quirks: bool = False):
        if mode not in ("engine", "gateway"):
            raise ValueError("mode is engine or gateway")
        if mode == "engine" and backends != 1:
            raise ValueError("engine mode simulates one engine (the policy lives inside it); use gateway mode "
                             "for several backends")
        self.w, self.s, self.profile, self.mode, self.n = workload, scheduler, profile, mode, backends
        self.cost = cost or scheduler.cost
        self.admit_every, self.client_reserve = admit_every, client_reserve
        self.record_ledger, self.check = record_ledger, check_invariants
        self.progress = progress
        # The VTC artifact's charging quirks (notes/vtc.md §2.2 item 3, §7 item 7): the prefill token is free,
        # and on a step where any request finishes the whole batch is charged twice. Paper semantics by default.
        self.quirks = artifact_quirks
        if artifact_quirks and hasattr(scheduler, "charge_prefill_token"):
            scheduler.charge_prefill_token = False
        self.views = {r.id: RequestView(str(r.id), r.client, r.app or r.client, "sim", r.prompt_len, r.output_len,
                                        arrival=r.arrival, true_output=r.output_len) for r in workload.requests}
        self.ereqs = {str(r.id): EngineRequest(str(r.id), r.prompt_len, r.output_len, arrival=r.arrival,
                                               client=r.client) for r in workload.requests}
        self.out = SimOutcome(workload, mode, backends, 0.0, workload.requests, scheduler=scheduler)
        self.placement = LeastLoad()

    # -- shared bookkeeping ---------------------------------------------------------------------------
    def _receive(self, t: float, ers: list[EngineRequest], finished: list[EngineRequest], backend: int) -> None:
        reqs = self.w.requests
        for er in ers:
            r = reqs[int(er.id)]
            if er.generated == 1:
                r.first_token = t
            if self.record_ledger:
                # service as the VTC analysis counts it: h(p, q) − h(p, q − 1) for each token received
                inc = self.cost.h(er.prompt_len, er.generated) - self.cost.h(er.prompt_len, er.generated - 1)
                self.out.ledger.setdefault(r.client, []).append((t, inc))
        for er in finished:
            r = reqs[int(er.id)]
            r.finished = t
            self.s.on_finish(self.views[int(er.id)], er.generated, t)

    def _charge_step(self, t: float, step, backend: int, engine: Engine | None = None) -> None:
        reqs = self.w.requests
        if self.check and engine is not None:
            batch = sum(r.prompt_len + r.output_len for r in engine.running)
            self.out.max_batch_tokens = max(self.out.max_batch_tokens, batch)
        if step.kind == "prefill":
            for er in step.emitted:
                r = reqs[int(er.id)]
                r.admitted, r.backend = t, backend
                if self.mode == "engine":
                    r.dispatched = t
                if self.record_ledger:
                    self.out.ledger.setdefault(r.client, []).append((t, self.cost.h(er.prompt_len, 0)))
        for er in step.emitted:
            self.s.on_tokens(self.views[int(er.id)], er.generated, t)
        if self.quirks and step.finished and hasattr(self.s, "charge_again"):
            for er in step.emitted:
                self.s.charge_again(self.views[int(er.id)])

    def _check(self, t: float) -> None:
        """Lemma 4.3: with Q ≠ ∅, max_{i∈Q} c_i − min_{i∈Q} c_i (tracked; the test compares it with U)."""
        counter = getattr(self.s, "counter", None)
        if counter is None:
            return
        cs = [counter(c) for c in self.s.waiting_clients()]
        if len(cs) > 1:
            self.out.max_counter_spread = max(self.out.max_counter_spread, max(cs) - min(cs))

    def _arrive(self, r: SimRequest, engine: Engine | None) -> None:
        if r.prompt_len + r.output_len > self.profile.kv_tokens - self.client_reserve:
            r.rejected = True  # can never fit an engine: refused at once, as vLLM refuses a too-long request
            return
        if self.mode == "engine":
            ok = engine.add(self.ereqs[str(r.id)], r.arrival)
        else:
            ok = self.s.add(self.views[r.id], r.arrival)
        r.rejected = not ok

    # -- run ------------------------------------------------------------------------------------------
    def run(self) -> SimOutcome:
        if self.mode == "engine":
            self._run_engine()
        else:
            self._run_gateway()
        done = [r.finished for r in self.w.requests if r.finished is not None]
        self.out.makespan = max(done) if done else 0.0
        return self.out

    def _run_engine(self) -> None:
        by_id = self.ereqs
        engine = Engine(self.profile, admit_every=self.admit_every, client_reserve=self.client_reserve,
                        prefix_caching=False, queue=_PolicyQueue(self.s, self.views, by_id))
        reqs, i, t, n = self.w.requests, 0, 0.0, len(self.w.requests)
        while True:
            while i < n and reqs[i].arrival <= t:
                self._arrive(reqs[i], engine)
                i += 1
            if self.check:
                self._check(t)
            step = engine.step(t)
            if step is None:
                if i >= n:
                    break
                t = reqs[i].arrival
                continue
            self._charge_step(t, step, 0, engine)
            end = t + step.duration
            # arrivals during the step see the counters as charged at its start
            while i < n and reqs[i].arrival <= end:
                self._arrive(reqs[i], engine)
                i += 1
            self._receive(end, step.emitted, step.finished, 0)
            t = end
            if self.progress and i % 200 == 0:
                self.progress(min(1.0, t / max(self.w.duration_s, 1e-9)))

    def _gate(self, engines: list[Engine], local: list[list[EngineRequest]], t: float) -> None:
        """Release requests in policy order while some engine can still fit the next one."""
        while (v := self.s.peek(t)) is not None:
            er = self.ereqs[v.request_id]
            fitting, views = [], []
            for k, e in enumerate(engines):
                entries = e.entries() + [(q.prompt_len + 1, q.output_len - 1) for q in local[k]]
                clients = {x.client for x in e.running} | {q.client for q in local[k]}
                if e.fits(entries, clients, er):
                    fitting.append(k)
                    load = sum(u + rem for u, rem in entries)
                    views.append(BackendView(str(k), len(e.running) + len(local[k]), load, e.kv_tokens))
            if not fitting:
                return
            k = int(self.placement.choose(v, views, t).name)
            self.s.pop(v, t)
            r = self.w.requests[int(v.request_id)]
            r.dispatched = t
            engines[k].add(er, t)
            local[k].append(er)

    def _run_gateway(self) -> None:
        engines = [Engine(self.profile, admit_every=self.admit_every, client_reserve=self.client_reserve,
                          prefix_caching=False) for _ in range(self.n)]
        local: list[list[EngineRequest]] = [[] for _ in engines]  # handed to the engine, not yet admitted
        busy: list[tuple[float, int, object]] = []  # heap of (end, engine, step)
        in_step = [False] * self.n
        reqs, i, t, n = self.w.requests, 0, 0.0, len(self.w.requests)
        while True:
            while i < n and reqs[i].arrival <= t:
                self._arrive(reqs[i], None)
                i += 1
            while busy and busy[0][0] <= t:
                end, k, step = heapq.heappop(busy)
                self._receive(end, step.emitted, step.finished, k)
                in_step[k] = False
            self._gate(engines, local, t)
            if self.check:
                self._check(t)
                head = self.s.peek(t)
                if head is not None and any(not e.running and not local[k] and not in_step[k]
                                            for k, e in enumerate(engines)):
                    self.out.idle_with_fitting_queue += 1  # an empty engine left idle with work waiting
            for k, e in enumerate(engines):
                if in_step[k]:
                    continue
                step = e.step(t)
                if step is None:
                    continue
                if step.kind == "prefill":
                    admitted = {id(x) for x in step.emitted}
                    local[k] = [q for q in local[k] if id(q) not in admitted]
                self._charge_step(t, step, k, e)
                heapq.heappush(busy, (t + step.duration, k, step))
                in_step[k] = True
            nxt = [busy[0][0]] if busy else []
            if i < n:
                nxt.append(reqs[i].arrival)
            if not nxt:
                break
            t = min(nxt)
            if self.progress and i % 200 == 0:
                self.progress(min(1.0, t / max(self.w.duration_s, 1e-9)))
