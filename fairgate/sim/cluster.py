"""Several engines, each with its own local scheduler, behind a router that places every request as it arrives
(the distributed setting of docs/simulator/index.md#several-engines): D²LPM / DoubleQ (local DLPM + the
``d2lpm`` router), RR+LPM, Preble-like (``prefix`` + LPM) and distributed VTC (local VTC +
``client-round-robin``).

The router sees the pool through a ``PrefixIndex`` (the global radix tree R of Algorithm 2): a request's blocks
are inserted for its backend when it is routed (optimistic, line 18), blocks an engine stores or evicts reach
the index as its KV events do (lines 25–27, without lag). ``s_w`` is an engine's waiting + running requests.
"""

from __future__ import annotations

import heapq
from typing import Iterator, Sequence

from fairgate.accounting.prefix import PrefixIndex
from fairgate.policies.scheduler import Scheduler
from fairgate.policies.views import BackendView, RequestView
from fairgate.engine.batching import Engine
from fairgate.sim.policy_queue import PolicyQueue
from fairgate.sim.simulator import Simulator


class Routed(Scheduler):
    """The engines' local schedulers seen as one, for the simulator's hooks: each request's tokens, finish and
    removal go to the scheduler of the engine it was routed to."""

    name = "routed"

    def __init__(self, local: Sequence[Scheduler]):
        super().__init__(local[0].cost, local[0].weight)
        self.local = list(local)
        self.owner: dict[str, int] = {}

    def _of(self, req: RequestView) -> Scheduler:
        return self.local[self.owner.get(req.request_id, 0)]

    def on_tokens(self, req, generated, now):
        self._of(req).on_tokens(req, generated, now)

    def on_finish(self, req, generated, now, prompt_tokens=None, cached_tokens=None):
        self._of(req).on_finish(req, generated, now, prompt_tokens, cached_tokens)

    def remove(self, req, now):
        self._of(req).remove(req, now)

    def __len__(self) -> int:
        return sum(len(s) for s in self.local)

    def counter(self, client: str) -> float:
        return sum(s.counter(client) for s in self.local)

    def waiting_clients(self) -> Iterator[str]:
        return iter({c for s in self.local for c in s.waiting_clients()})

    def waiting_by_client(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.local:
            for c, n in s.waiting_by_client().items():
                out[c] = out.get(c, 0) + n
        return out


class ClusterSimulator(Simulator):
    def __init__(self, workload, local: Sequence[Scheduler], profile, *, placement, **kw):
        self.route = True
        self.local = list(local)
        super().__init__(workload, Routed(self.local), profile, mode="engine", backends=len(self.local),
                         placement=placement, **kw)
        self.index = PrefixIndex(profile.block_size, default_capacity=profile.kv_tokens // profile.block_size)

    def match(self, view: RequestView, backend: str) -> int:
        """The router's view: prompt tokens the index says ``backend`` holds for this request."""
        return self.index.cached_tokens(view.blocks, view.prompt_tokens, backend)

    def _views(self) -> list[BackendView]:
        return [BackendView(str(k), len(e.running), e.kv_used_tokens, e.kv_tokens, waiting=e.waiting)
                for k, e in enumerate(self._engines)]

    def _arrive(self, r, engine: Engine | None) -> None:
        if r.cancelled or r.abandoned:
            return super()._arrive(r, None)
        view = self.views[str(r.id)]
        k = int(self.placement.choose(view, self._views(), r.arrival).name)
        self.s.owner[view.request_id] = k
        if view.blocks:
            self.index.insert(view.blocks, str(k), r.arrival)
        super()._arrive(r, self._engines[k])

    def _receive(self, t, step, backend) -> None:
        super()._receive(t, step, backend)
        for er in step.finished:
            self.placement.on_finish(self.views[er.id], str(backend), er.generated)

    def _run_engine(self) -> None:
        by_id = self.ereqs
        self._engines = []
        for k, s in enumerate(self.local):
            e = Engine(self.profile, admit_every=self.admit_every, client_reserve=self.client_reserve,
                       prefix_caching=self.caching, queue=PolicyQueue(s, self.views, by_id))
            if self.caching:
                name = str(k)
                e.cache.on_store = lambda run, n=name: self.index.insert(run.hashes, n, root=run.root)
                e.cache.on_evict = lambda hs, n=name: self.index.remove(hs, n)
                if s.match is not None:
                    s.match = lambda v, _b, e=e: e.cached_tokens(by_id[v.request_id])
            self._engines.append(e)
        self._local = [[] for _ in self._engines]
        busy: list[tuple[float, int, object]] = []
        in_step = [False] * len(self._engines)
        t = 0.0
        while True:
            self._timeouts(t)
            while busy and busy[0][0] <= t:
                end, k, step = heapq.heappop(busy)
                self._receive(end, step, k)
                in_step[k] = False
            self._arrive_until(t, None)
            if self.check:
                self._check(t)
            self._start_steps(t, busy, in_step)
            t = self._next_time(busy)
            if t is None:
                break
