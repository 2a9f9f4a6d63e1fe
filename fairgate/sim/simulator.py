"""The discrete-event simulator: the engine model and the real policy objects, in virtual time.

- ``engine`` mode: one engine whose waiting queue *is* the policy (the paper's setting);
- ``gateway`` mode: the policy orders the gateway's queue; N engines each run FCFS; a dispatch gate releases
  the next request to an engine only while it still fits that engine's memory (running requests plus those
  already handed to it), so the engine's own queue never holds more than it will admit at its next
  admission point, and an engine with room never waits for the gateway (fairgate's real setting).

Counters are charged when a step starts (input at admission, one output token per running request), as the
VTC artifact does; a token is *received* (service ledger, first token, finish) when its step ends.

Interactions (FairServe): a call of a later stage arrives ``think_s`` after its previous stage's last call
finishes. A policy that throttles (``admit``) is asked at each arrival, with the pool's overload state; a
refused call (OIT, or RPM's limit) refuses the rest of its interaction. With a client timeout, a call
not answered in time is abandoned with its interaction: its waiting calls leave the queue, its running ones are aborted.
Tokens spent on interactions that never complete are *wasted*. Finished calls teach ``stats`` (the
per-(app, stage) statistics WSC reads), as live traffic does in the gateway.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from fairgate.accounting.app_stats import AppStats
from fairgate.accounting.cost import CostFunction
from fairgate.policies.oit import OverloadConfig, overloaded
from fairgate.policies.placement import LeastLoad
from fairgate.policies.scheduler import Scheduler
from fairgate.policies.views import BackendView, RequestView
from fairgate.engine.batching import Engine, EngineRequest, Step
from fairgate.sim.gate import GatewayMode
from fairgate.engine.profiles import EngineProfile
from fairgate.sim.policy_queue import PolicyQueue
from fairgate.sim.targets import OVER_CONTEXT, TtftPredictions, targets_of
from fairgate.sim.workload import SimRequest, Workload

if TYPE_CHECKING:
    from fairgate.sim.limits import SimLimits

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
    failed_interactions: set[str] = field(default_factory=set)  # throttled part-way or abandoned
    throttled_interactions: dict[str, str] = field(default_factory=dict)  # interaction → reason
    stats: AppStats | None = None
    horizon_tokens: int = 0  # input tokens admitted + output tokens received within [0, duration_s]
    ttft_predictions: TtftPredictions | None = None  # gateway mode, a workload with latency targets


class Simulator(GatewayMode):
    def __init__(self, workload: Workload, scheduler: Scheduler, profile: EngineProfile, *, mode: str = "engine",
                 backends: int = 1, cost: CostFunction | None = None, admit_every: int | None = None,
                 client_reserve: int = ARTIFACT_CLIENT_RESERVE, record_ledger: bool = False,
                 check_invariants: bool = False, progress: Callable[[float], None] | None = None,
                 artifact_quirks: bool = False, overload: OverloadConfig = OverloadConfig(),
                 stats: AppStats | None = None, placement=None, limits: SimLimits | None = None):
        if mode not in ("engine", "gateway"):
            raise ValueError("mode is engine or gateway")
        if mode == "engine" and backends != 1 and not hasattr(self, "route"):
            raise ValueError("engine mode simulates one engine here (the policy lives inside it); several engines "
                             "with a router are sim/cluster.py's ClusterSimulator")
        self.w, self.s, self.profile, self.mode, self.n = workload, scheduler, profile, mode, backends
        if workload.speeds and mode != "gateway":
            raise ValueError("speeds: (a pool of engines of several speeds) is for gateway mode")
        speeds = workload.speeds or [1.0]
        self.profiles = [profile.scaled(speeds[k % len(speeds)]) for k in range(backends)]  # engine k's
        self.cost = cost or scheduler.cost
        self.admit_every = admit_every or profile.admit_every  # (the profile's engine; the artifact's: 10)
        self.client_reserve = client_reserve
        self.record_ledger, self.check = record_ledger, check_invariants
        self.progress = progress
        # The VTC artifact's charging quirks (docs/policies/vtc.md#artifact-charging): the prefill token is
        # free, and on a step where any request finishes the whole batch is charged twice. Paper semantics by
        # default.
        self.quirks = artifact_quirks
        if artifact_quirks and hasattr(scheduler, "charge_prefill_token"):
            scheduler.charge_prefill_token = False
        self._fit_context(workload.requests, profile)
        self.views = {str(r.id): RequestView(str(r.id), r.client, r.app or r.client, "sim", r.prompt_len, r.output_len,
                                        r.interaction, r.stage, arrival=r.arrival, true_output=r.output_len,
                                        system_tokens=r.system_len, final=r.final,
                                        band=workload.bands.get(r.client, 1), **targets_of(workload, r.client))
                      for r in workload.requests}
        self._by_id = {str(r.id): r for r in workload.requests}  # (an engine request's id → the request)
        self.ereqs = {str(r.id): EngineRequest(str(r.id), r.prompt_len, r.output_len, arrival=r.arrival,
                                               client=r.client, blocks=r.blocks, output_blocks=r.output_blocks or ())
                      for r in workload.requests}
        self.caching = any(r.blocks for r in workload.requests)  # prompts with content: prefix caches on
        if self.caching:
            self.views = {i: replace(v, blocks=tuple(workload.requests[int(i)].blocks or ()))
                          for i, v in self.views.items()}
        self.out = SimOutcome(workload, mode, backends, 0.0, workload.requests, scheduler=scheduler, stats=stats)
        if mode == "gateway" and (workload.slo is not None or workload.slos):
            self.out.ttft_predictions = TtftPredictions(self.profiles)
        self.placement = placement or LeastLoad()
        self.overload, self.stats = overload, stats
        self.limits = limits  # apps' and users' limits, met at arrival (sim/limits.py; replay's --limits)
        # arrivals: a heap of (time, id); later stages of interactions are pushed as earlier ones finish
        self._arrivals = [(r.arrival, r.id) for r in workload.requests if r.arrival != math.inf]
        heapq.heapify(self._arrivals)
        self._arrived = 0
        self._stage_left: dict[str, int] = {}  # calls of the current stage not finished, per interaction
        self._by_parent: dict[str, dict[int, list[int]]] = {}  # interaction → call → the calls sent after it
        for r in workload.requests:
            if r.parent >= 0:
                self._by_parent.setdefault(r.interaction, {}).setdefault(r.parent, []).append(r.id)
        self._deadlines: list[tuple[float, int]] = []  # (deadline, request id) with client timeouts
        self._engines: list[Engine] = []
        self._local: list[list[EngineRequest]] = []
        # gateway mode: engine k's state changes only when it steps, is handed a request or aborts one; the
        # gate's verdict for the queue's head on engine k is kept until then ((version, head) → view or None)
        self._memo: list = []  # per engine in gateway mode: its batch summary (sim/gate.py)
        self._later: list = []  # (start, engine, its step's tokens): quiet runs' later steps, charged as they start

    @staticmethod
    def _fit_context(requests: list[SimRequest], profile: EngineProfile) -> None:
        """A trace's output cut where the model's context ends, as vLLM cuts a request without ``max_tokens``
        (finish "length"); a prompt that fills the context is refused at arrival (``OVER_CONTEXT``)."""
        limit = profile.max_model_len
        for r in requests:
            if r.prompt_len < limit < r.prompt_len + r.output_len:
                r.output_len = limit - r.prompt_len
                if r.output_blocks:
                    del r.output_blocks[limit // profile.block_size:]

    # -- shared bookkeeping ---------------------------------------------------------------------------
    def _receive(self, t: float, step: Step, backend: int) -> None:
        """Step ``step``'s tokens arrive at ``t``: first tokens (a prefill's), the ledger, finishes. A request's
        ``generated`` is its engine request's, read when the run ends."""
        by_id, finished = self._by_id, step.finished
        if t <= self.w.duration_s:
            self.out.horizon_tokens += len(step.emitted)
        if step.kind == "prefill" or self.record_ledger:  # (a decode step's tokens are never a first)
            for er in step.emitted:
                r = by_id[er.id]
                if r.abandoned:
                    continue
                if er.generated == 1:
                    r.first_token = t
                    if self.out.ttft_predictions is not None:
                        self.out.ttft_predictions.first_token(r.id, t - r.arrival)
                if self.record_ledger:
                    # service as the VTC analysis counts it: h(p, q) − h(p, q − 1) for each token received
                    inc = self.cost.delta(er.prompt_len, er.generated - 1, er.generated)
                    self.out.ledger.setdefault(r.client, []).append((t, inc))
        for er in finished:
            r = by_id[er.id]
            if r.abandoned:
                continue
            r.finished = t
            if self.limits is not None:
                self.limits.ended(r, t)
            if self.mode == "gateway":  # (as the live dispatcher tells it)
                self.placement.on_finish(self.views[er.id], str(backend), er.generated)
                self._placed_on.pop(er.id, None)
            if self.s.skips_unfit:  # DLPM settles its extend charge on what the engine cached
                self.s.on_finish(self.views[er.id], er.generated, t, er.prompt_len, cached_tokens=er.cached_tokens)
            else:
                self.s.on_finish(self.views[er.id], er.generated, t)
            if self.stats is not None:
                self.stats.observe(r.app, r.stage, r.prompt_len - r.system_len, r.system_len, er.generated, t)
            if r.interaction:
                self._stage_done(r, t)

    # -- interactions -------------------------------------------------------------------------------------
    def _stage_done(self, r: SimRequest, t: float) -> None:
        if self.w.open_loop:  # (each call arrives at its own time)
            return
        x = r.interaction
        if x in self._by_parent:  # calls that follow their own parent (a tree's branches), not a whole stage
            if x not in self.out.failed_interactions:
                for i in self._by_parent[x].get(r.id, ()):
                    self._release(i, t)
            return
        self._stage_left[x] = self._stage_left.get(x, len(self.w.interactions[x][r.stage])) - 1
        if self._stage_left[x] > 0 or x in self.out.failed_interactions:
            return
        stages = self.w.interactions[x]
        nxt = r.stage + 1
        if nxt < len(stages):
            self._stage_left[x] = len(stages[nxt])
            for i in stages[nxt]:
                self._release(i, t)

    def _release(self, i: int, t: float) -> None:
        self.w.requests[i].arrival = t + self.w.think_s
        self.views[str(i)] = replace(self.views[str(i)], arrival=t + self.w.think_s)
        heapq.heappush(self._arrivals, (t + self.w.think_s, i))

    def _fail(self, x: str, t: float, abandon: bool) -> None:
        """The interaction ends without a response: later calls are never sent; with ``abandon`` (timeout) its
        waiting calls leave the queue and its running ones are aborted."""
        if x in self.out.failed_interactions:
            return
        self.out.failed_interactions.add(x)
        for ids in self.w.interactions[x]:
            for i in ids:
                r = self.w.requests[i]
                if r.arrival == math.inf or (r.arrival > t and r.dispatched is None):
                    r.cancelled = True
                elif abandon and r.finished is None and not r.rejected:
                    self._abandon(r, t)

    def _abandon(self, r: SimRequest, t: float) -> None:
        r.abandoned = True
        if self.limits is not None:
            self.limits.ended(r, t)
        if self.out.ttft_predictions is not None:
            self.out.ttft_predictions.gone(r.id)
        er, view = self.ereqs[str(r.id)], self.views[str(r.id)]
        started = r.admitted is not None
        if r.arrival <= t and (self.mode == "engine" and not started or self.mode == "gateway" and r.dispatched is None):
            self.s.remove(view, t)  # still in the policy's queue
            if self.mode == "gateway":
                self.smallest.discard(view.request_id)
                self._unqueue(view)
        elif self.mode == "gateway" or started:
            holder = None
            for k, e in enumerate(self._engines):
                if er in e.running or er in self._local[k]:
                    holder = k
                    e.abort(er)
                    self._woken(k)
                    self._local[k] = [q for q in self._local[k] if q is not er]
                    self._changed(k)
            if started:
                self.s.on_finish(view, er.generated, t)
            else:
                self.s.on_finish(view, 0, t, prompt_tokens=0)  # handed to an engine, never started: refund
            if self.mode == "gateway" and holder is not None:  # as the live dispatcher tells its placement
                if started:
                    self._placed_on.pop(view.request_id, None)
                    self.placement.on_finish(view, str(holder), er.generated)
                else:
                    self.placement.refund(view, self._placed_on.pop(view.request_id, str(holder)))

    def _timeouts(self, t: float) -> None:
        """A call not answered ``timeout_s`` after it was sent is given up by its client, and with it the rest
        of its interaction (the paper's case study, §5.5: "requests with a timeout")."""
        while self._deadlines and self._deadlines[0][0] <= t:
            _, i = heapq.heappop(self._deadlines)
            r = self.w.requests[i]
            if r.finished is not None or r.rejected or r.abandoned or r.cancelled:
                continue
            if r.interaction:
                self._fail(r.interaction, t, abandon=True)
            else:
                self._abandon(r, t)

    def _overloaded(self, t: float) -> bool:
        # engine mode: overloaded when the head of the waiting queue does not fit
        # (docs/policies/fairserve.md#ambiguity-a6)
        if self.mode == "engine":
            e = self._engines[0]
            head = e.queue.peek(t)
            return head is not None and not e.fits(e.entries(), {x.client for x in e.running}, head)
        views = []
        for k, e in enumerate(self._engines):
            entries = self._committed(k)
            views.append(BackendView(str(k), len(entries), sum(u + rem for u, rem in entries), e.kv_tokens))
        return overloaded(views, len(self.s), self.overload)

    def _committed(self, k: int) -> list[tuple[int, int]]:
        """Engine k's (used, remaining) entries: its running requests and those handed to it, not yet admitted."""
        return self._engines[k].entries() + [(q.prompt_len + 1, q.output_len - 1) for q in self._local[k]]

    def _next_time(self, busy: list) -> float | None:
        """The next event: a step's end or an arrival (None once neither is left), or a deadline before it."""
        nxt = [busy[0][0]] if busy else []
        if self._arrivals:
            nxt.append(self._arrivals[0][0])
        if not nxt:
            return None
        if self._deadlines:
            nxt.append(self._deadlines[0][0])
        t = min(nxt)
        if self.progress and self._arrived % 200 == 0:
            self.progress(min(1.0, t / max(self.w.duration_s, 1e-9)))
        return t

    def _start_steps(self, t: float, busy: list, in_step: list[bool], started=None) -> None:
        """Every idle engine takes its next step at ``t`` (charged now, its end pushed on ``busy``);
        ``started(k, step, grew)`` sees each step first (``grew``: how many more requests its batch holds).
        With ``_wake`` (gateway mode) only the engines woken since they last had nothing to do are asked, in
        engine order: O(woken), not O(engines), per event (the others' ``step`` would be None)."""
        wake, engines = self._wake, self._engines
        if wake is not None:
            order = sorted(wake)
            wake.clear()
        else:
            order = range(len(engines))
        for k in order:
            e = engines[k]
            if self._later:  # (the steps of runs starting now, of engines before k: charged in engine order)
                self._charge_until(t, k, wake is not None)
            if in_step[k]:
                continue
            before = len(e.running)
            horizon = self._quiet_until(k, e) if self._quiet else None
            step = e.decode_run(t, horizon) if horizon is not None else e.step(t)
            if step is None:
                if len(e.running) != before and self.mode == "gateway":
                    self._changed(k)  # it dropped what was aborted: its memory summary moves on
                continue
            if started is not None:
                started(k, step, len(e.running) - before)
            self._charge_step(t, step, k, e)
            heapq.heappush(busy, (t + step.duration if step.ends is None else step.ends[-1], k, step))
            in_step[k] = True
        if self._later and wake is not None:
            self._charge_until(t, len(engines), True)  # (those of the engines after the last woken)

    _quiet = False  # decode runs in quiet periods (gateway mode: sim/gate.py ``_quiet_until``)
    _wake: set[int] | None = None  # gateway mode: the engines that may step (None: ask every engine)

    def _charge_step(self, t: float, step, backend: int, engine: Engine | None = None) -> None:
        by_id = self._by_id
        if self.check and engine is not None:
            batch = sum(r.prompt_len + r.output_len for r in engine.running)
            self.out.max_batch_tokens = max(self.out.max_batch_tokens, batch)
        if step.kind == "prefill":
            for er in step.emitted:
                r = by_id[er.id]
                r.admitted, r.backend, r.cached = t, backend, er.cached_tokens
                if t <= self.w.duration_s:
                    self.out.horizon_tokens += er.prompt_len
                if self.mode == "engine":
                    r.dispatched = t
                if self.record_ledger:
                    self.out.ledger.setdefault(r.client, []).append((t, self.cost.h(er.prompt_len, 0)))
        views = self.views
        if step.ends is None:
            self.s.on_step([(views[er.id], er.generated) for er in step.emitted], t)
        else:  # a quiet run: its first step charged now, each later one when it would have started
            held = [(views[er.id], er.generated - len(step.ends)) for er in step.emitted]
            first = [(view, before + 1) for view, before in held]
            self.s.on_step(first, t)
            amounts = self.s.run_charges(first, len(step.ends) - 1) if len(step.ends) > 1 else None
            for k, start in enumerate(step.ends[:-1], 2):  # (the same amounts each step, or each step's tokens)
                heapq.heappush(self._later, (start, backend, amounts if amounts is not None
                                             else [(view, before + k) for view, before in held]))
        if self.quirks and step.finished:
            for er in step.emitted:
                self.s.charge_again(self.views[er.id])

    def _charge_until(self, t: float, engine: int | None = None, below: bool = False) -> None:
        """The charges of quiet runs' steps that start before ``t`` (or, for ``engine``, at ``t``; with
        ``below``, those of every engine before it too), in the order stepping one at a time makes them: by
        start, then engine (sums the same to the bit, reads see them)."""
        later = self._later
        while later and (later[0][0] < t or later[0][0] == t and (later[0][1] == engine or below
                                                                  and later[0][1] < engine)):
            start, _, emitted = heapq.heappop(later)
            if type(emitted) is dict:
                self.s.charge_clients(emitted)
            else:
                self.s.on_step(emitted, start)

    def _check(self, t: float) -> None:
        """Lemma 4.3: with Q ≠ ∅, max_{i∈Q} c_i − min_{i∈Q} c_i (tracked; the test compares it with U)."""
        cs = [self.s.counter(c) for c in self.s.waiting_clients()]
        if len(cs) > 1:
            self.out.max_counter_spread = max(self.out.max_counter_spread, max(cs) - min(cs))
        for k, e in enumerate(self._engines):  # the engine's kept sum of its batch's own KV is the sum
            if e._tail != e._tails():
                self.out.invariant_violations.append(f"t={t}: engine {k} keeps {e._tail} own KV, has {e._tails()}")

    def _arrive(self, r: SimRequest, engine: Engine | None) -> None:
        self._arrived += 1
        if r.cancelled or r.abandoned:
            return
        if self.w.timeout_s:
            heapq.heappush(self._deadlines, (r.arrival + self.w.timeout_s, r.id))
        if r.prompt_len >= self.profile.max_model_len:  # no room for one token: vLLM answers 400
            r.rejected, r.throttle_reason = True, OVER_CONTEXT
        elif r.prompt_len + r.output_len > self.profile.kv_tokens - self.client_reserve:
            r.rejected = True  # can never fit an engine: refused at once, as vLLM refuses a too-long request
            r.throttle_reason = "too_large"
        elif self.limits is not None and (reason := self.limits.admit(r, r.arrival)) is not None:
            r.rejected, r.throttle_reason = True, reason  # (its app's or user's limit: sim/limits.py)
        elif self.s.throttles and (th := self.s.admit(self.views[str(r.id)], r.arrival, self._overloaded(r.arrival))):
            r.rejected, r.throttle_reason = True, th.reason
        elif self.mode == "engine":
            r.rejected = not engine.add(self.ereqs[str(r.id)], r.arrival)
        else:
            if self.out.ttft_predictions is not None:
                self.out.ttft_predictions.arrive(r.id, self.s.waiting_ahead(self.views[str(r.id)]), r.prompt_len,
                                                 r.arrival)
            r.rejected = not self.s.add(self.views[str(r.id)], r.arrival)
            if not r.rejected:
                self.smallest.add(self.ereqs[str(r.id)])
                if self._routing:
                    self._route(self.views[str(r.id)], r.arrival)
        if r.rejected:
            if self.limits is not None:  # (refused after its limits admitted it: what it reserved, given back)
                self.limits.refused(r, r.arrival)
            r.throttle_reason = r.throttle_reason or "rpm"
            if r.interaction:
                self.out.throttled_interactions[r.interaction] = r.throttle_reason
                self._fail(r.interaction, r.arrival, abandon=False)

    def _next_arrival(self) -> float | None:
        return self._arrivals[0][0] if self._arrivals else None

    def _arrive_until(self, t: float, engine: Engine | None) -> None:
        reqs = self.w.requests
        while self._arrivals and self._arrivals[0][0] <= t:
            self._arrive(reqs[heapq.heappop(self._arrivals)[1]], engine)

    # -- run ------------------------------------------------------------------------------------------
    def run(self) -> SimOutcome:
        if self.mode == "engine":
            self._run_engine()
        else:
            self._run_gateway()
        for r in self.w.requests:
            r.generated = self.ereqs[str(r.id)].generated
        done = [r.finished for r in self.w.requests if r.finished is not None]
        self.out.makespan = max(done) if done else 0.0
        return self.out

    def _run_engine(self) -> None:
        by_id = self.ereqs
        engine = Engine(self.profile, admit_every=self.admit_every, client_reserve=self.client_reserve,
                        prefix_caching=self.caching, queue=PolicyQueue(self.s, self.views, by_id))
        self._engines, self._local = [engine], [[]]
        if self.caching and self.s.match is not None:  # DLPM / LPM look at this engine's cache
            self.s.match = lambda v, _b: engine.cached_tokens(by_id[v.request_id])
        t = 0.0
        while True:
            self._timeouts(t)
            self._arrive_until(t, engine)
            if self.check:
                self._check(t)
            step = engine.step(t)
            if step is None:
                nxt = [x for x in (self._next_arrival(), self._deadlines[0][0] if self._deadlines else None)
                       if x is not None]
                if not nxt or self._next_arrival() is None and not len(engine.queue):
                    break
                t = min(nxt)
                continue
            self._charge_step(t, step, 0, engine)
            end = t + step.duration
            # arrivals during the step see the counters as charged at its start
            self._arrive_until(end, engine)
            self._receive(end, step, 0)
            t = end
            if self.progress and self._arrived % 200 == 0:
                self.progress(min(1.0, t / max(self.w.duration_s, 1e-9)))
