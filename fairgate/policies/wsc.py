"""WSC — FairServe's Weighted Service Counter (§4.3, Alg. 1 l.12-18, 26-48; docs/policies/fairserve.md),
and ``fairserve`` = WSC + OIT throttling (§4.2).

- Each finished call charges its user u_i += E_i·(α·L_I + β·L_S + γ·L_O) / w_aj, where
  w_aj = α·N̄_I + β·N̄_S + γ·N̄_O is the historical expectation for its (app, stage) (Eq. 2): a call of typical
  size costs E_i, whatever its app, so users of heavy and light apps get equal *normalised* service.
  E_i = 1 / weight(user): a larger weight, a smaller charge (ambiguity A17).
- Counter lift as VTC's: a user joining the queue gets max(u, min over backlogged users), or the counter of
  the last user to leave the queue when it is empty (Alg. 1 l.12-18).
- Selection: continuation calls first — waiting calls of interactions with a call already admitted
  (ambiguity A4) — from the least-served user among those who have one; otherwise the least-served user's
  earliest call (Alg. 1 l.31-38).
- An interaction's protection is bounded by what its app's interactions are: its first calls (admitted, or
  waiting as continuations) are continuations — served first, never throttled by OIT —, as many as twice
  the calls 99 % of the app's interactions make (``AppStats.interaction_calls``), at least
  ``MIN_INTERACTION_CALLS``; past them its calls are ordinary. An app whose statistics do not say yet, and
  every app, is held to ``max_calls`` (the paper's interactions make up to ~20 calls, §3.3). A client that
  tags a flood with one interaction id buys no more than that; an app that makes its interactions long to
  raise its own bound raises it to ``max_calls`` at most.

Charging. ``charge="finish"`` is the paper's (P5): nothing until the call ends. In a gateway that releases
calls one at a time, the least-served user then stays least-served until one of its calls finishes, so it
takes every slot that frees meanwhile. ``charge="admit"`` (default) charges the *expected* cost at admission
(the call's own input and system tokens, the (app, stage) mean output), tokens beyond the expected output as
they stream, and settles to the exact paper charge at the finish — the same total, charged when the service
is committed. Both are measured by ``fairgate simulate`` (README).

The choice uses two heaps (users with a waiting continuation; all backlogged users) with lazy invalidation,
so a decision costs O(log n). Pure: time is passed in.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from fairgate.accounting.app_stats import AppStats
from fairgate.policies.backlog import Backlog
from fairgate.policies.counters import CounterStore, MemoryCounters
from fairgate.policies.interactions import InteractionStore, MemoryInteractions
from fairgate.policies.oit import OIT, Throttle
from fairgate.policies.scheduler import Scheduler, Weights
from fairgate.policies.views import RequestView

MIN_INTERACTION_CALLS = 4  # an interaction's protected calls, however short the app's interactions are

@dataclass(slots=True, eq=False)
class _Waiting:
    req: RequestView
    cont: bool  # a continuation: its interaction has an admitted call
    live: bool = True


@dataclass(slots=True)
class _Charge:
    user: str
    e: float
    w_aj: float
    input: int  # L_I: prompt tokens less the system prompt
    system: int  # L_S
    expected_output: float
    charged: float = 0.0  # counter units charged so far
    out_charged: float = 0.0  # output tokens covered by ``charged``


@dataclass(frozen=True, slots=True)
class TokenWeights:
    alpha: float = 1.0  # input
    beta: float = 2.0  # system prompt
    gamma: float = 1.0  # output (the paper's (1, 2, 1), "following OpenAI conventions")

    def of(self, input_tokens: float, system_tokens: float, output_tokens: float) -> float:
        """α·L_I + β·L_S + γ·L_O (Eq. 2's weighting, for a call or for an (app, stage)'s expected call)."""
        return self.alpha * input_tokens + self.beta * system_tokens + self.gamma * output_tokens


class WSC(Scheduler):
    name = "wsc"
    keeps_counters = True
    prefetches = True  # the interaction's state (and OIT's windows) may have been written by another replica

    def __init__(self, stats: AppStats | None = None, weights: Weights | None = None, *,
                 tokens: TokenWeights = TokenWeights(), counters: CounterStore | None = None,
                 interactions: InteractionStore | None = None, charge: str = "admit",
                 oit: OIT | None = None, max_calls: int = 32):
        super().__init__(None, weights)
        if charge not in ("admit", "finish"):
            raise ValueError("charge is admit or finish")
        self.stats = stats if stats is not None else AppStats()
        self.tokens, self.charge_at = tokens, charge
        clock = itertools.count()  # the join order, for ties: shared by the two backlogs
        self._all = Backlog(counters if counters is not None else MemoryCounters(), clock=clock)  # users waiting
        self._conts = Backlog(self._all.counters, clock=clock)  # users with a continuation call waiting
        self.interactions = interactions if interactions is not None else MemoryInteractions()
        self.max_calls = max_calls  # an interaction's calls that are continuations, at most (any app)
        self._x_cont: dict[str, int] = {}  # continuation calls waiting, per interaction
        self.oit = oit
        self.throttles = oit is not None
        self._new: dict[str, deque[_Waiting]] = {}
        self._cont: dict[str, deque[_Waiting]] = {}
        self._n: dict[str, int] = {}  # live waiting calls per user
        self._n_cont: dict[str, int] = {}
        self._by_x: dict[str, list[_Waiting]] = {}  # waiting non-continuation calls per interaction
        self._entries: dict[str, _Waiting] = {}
        self._size = 0
        self._peeked: _Waiting | None = None
        self._last_left: str | None = None
        self._charged: dict[str, _Charge] = {}

    # -- the weight of a call -------------------------------------------------------------------------
    def touched(self, req: RequestView) -> None:
        self._all.charged(req.client)
        self._conts.charged(req.client)

    def e(self, user: str) -> float:
        return 1.0 / self.weight(user)

    def w_aj(self, app: str, stage: int) -> float:
        e = self.stats.expected(app, stage)
        return max(1e-9, self.tokens.of(e.input, e.system, e.output))

    def call_cost(self, req: RequestView, output_tokens: float, prompt_tokens: int | None = None) -> float:
        """E_i·(α·L_I + β·L_S + γ·L_O)/w_aj for this call with ``output_tokens`` (the paper's charge)."""
        p = req.prompt_tokens if prompt_tokens is None else prompt_tokens
        system = min(req.system_tokens, p)
        return self.e(req.client) * self.tokens.of(p - system, system, output_tokens) / self.w_aj(req.app, req.stage)

    # -- admission (OIT) ------------------------------------------------------------------------------
    def is_continuation(self, req: RequestView, now: float) -> bool:
        """A call of an open interaction, within the interaction's ``max_calls`` (those admitted, and those
        waiting as continuations)."""
        x = req.interaction
        return (req.in_interaction and self.interactions.is_open(x, now)
                and self.interactions.calls(x) + self._x_cont.get(x, 0) < self.interaction_bound(req.app))

    def interaction_bound(self, app: str) -> int:
        """The calls of one of ``app``'s interactions that are continuations, at most: twice what 99 % of its
        interactions make, at least ``MIN_INTERACTION_CALLS``, at most ``max_calls``. O(the app's stages)."""
        calls = self.stats.interaction_calls(app)
        return self.max_calls if calls is None else min(self.max_calls, max(MIN_INTERACTION_CALLS, 2 * calls))

    def admit(self, req: RequestView, now: float, overloaded: bool) -> Throttle | None:
        if self.oit is None:
            return None
        return self.oit.check(req, self.is_continuation(req, now), overloaded, now)

    # -- queue (the least-served backlogs: policies/backlog.py) -----------------------------------------
    @property
    def counters(self) -> CounterStore:
        return self._all.counters

    @counters.setter
    def counters(self, store: CounterStore) -> None:  # a live policy switch hands the family's store over
        self._all.counters = self._conts.counters = store

    def min_waiting_counter(self) -> float | None:
        return self._all.min_counter()

    def add(self, req: RequestView, now: float) -> bool:
        user = req.client
        if not self._n.get(user):  # counter lift: the user (re)joins the backlog (Alg. 1 l.12-18)
            floor = self.min_waiting_counter()
            if floor is None and self._last_left is not None:
                floor = self.counters.get(self._last_left)
            if floor is not None:
                self.counters.lift(user, floor)
        w = _Waiting(req, self.is_continuation(req, now))
        self._entries[req.request_id] = w
        self._enqueue(w)
        self._size += 1
        return True

    def _enqueue(self, w: _Waiting) -> None:
        user = w.req.client
        if w.cont:
            self._cont.setdefault(user, deque()).append(w)
            self._n_cont[user] = self._n_cont.get(user, 0) + 1
            if w.req.in_interaction:
                self._x_cont[w.req.interaction] = self._x_cont.get(w.req.interaction, 0) + 1
        else:
            self._new.setdefault(user, deque()).append(w)
            if w.req.in_interaction:
                self._by_x.setdefault(w.req.interaction, []).append(w)
        self._n[user] = self._n.get(user, 0) + 1
        self._all.join(user, lift=False)  # (the lift is WSC's own, in add: Alg. 1 l.12-18)
        if w.cont:
            self._conts.join(user, lift=False)

    @staticmethod
    def _head(q: deque[_Waiting] | None) -> _Waiting | None:
        while q and not q[0].live:
            q.popleft()
        return q[0] if q else None

    def peek(self, now: float, eligible=None, backend: str = "", queued=None) -> RequestView | None:
        # continuation calls first (Alg. 1 l.31-35), then the least-served user's earliest call (l.37-38)
        w = self._first(self._conts, self._cont, eligible) or self._first(self._all, self._new, eligible)
        self._peeked = w
        return None if w is None else w.req

    def _first(self, backlog: Backlog, queues: dict, eligible) -> _Waiting | None:
        """The head call of the least-served user in ``backlog`` (that ``eligible`` accepts, if given)."""
        for user in backlog.ascending():
            w = self._head(queues.get(user))
            if eligible is None:
                return w
            if w is not None and not eligible(w.req):  # its earliest call the gate accepts
                w = next((x for x in queues[user] if x.live and eligible(x.req)), None)
            if w is not None:
                return w
        return None

    def _unlink(self, w: _Waiting) -> None:
        user = w.req.client
        w.live = False
        self._size -= 1
        self._n[user] -= 1
        if w.cont:
            self._n_cont[user] -= 1
            if not self._n_cont[user]:
                self._conts.leave(user)
            if w.req.in_interaction:
                x = w.req.interaction
                if self._x_cont[x] > 1:
                    self._x_cont[x] -= 1
                else:
                    del self._x_cont[x]
        elif w.req.in_interaction:
            siblings = self._by_x.get(w.req.interaction)
            if siblings is not None:
                siblings[:] = [s for s in siblings if s is not w]
                if not siblings:
                    del self._by_x[w.req.interaction]
        if not self._n[user]:
            self._all.leave(user)
            self._last_left = user

    def pop(self, req: RequestView, now: float, backend: str = "") -> None:
        w = self._peeked
        assert w is not None and w.req is req, "pop the request peek returned"
        self._peeked = None
        del self._entries[req.request_id]
        self._unlink(w)
        self._last_left = req.client  # Alg. 1 l.39: the last user whose call left Q
        if req.in_interaction:
            x = req.interaction
            self.interactions.open(x, req.client, req.app, req.stage, now)
            kept, bound = [], self.interaction_bound(req.app)
            for sibling in self._by_x.pop(x, ()):  # its waiting calls are continuations now, within its bound
                if not sibling.live:
                    continue
                if self.interactions.calls(x) + self._x_cont.get(x, 0) >= bound:
                    kept.append(sibling)
                    continue
                sibling.live = False
                moved = _Waiting(sibling.req, True)
                self._entries[sibling.req.request_id] = moved
                self._n[sibling.req.client] -= 1
                self._enqueue(moved)
            if kept:
                self._by_x[x] = kept
        self._admit_charge(req)

    def remove(self, req: RequestView, now: float) -> None:
        w = self._entries.pop(req.request_id, None)
        if w is not None and w.live:
            self._unlink(w)
            if self._peeked is w:
                self._peeked = None

    def __len__(self) -> int:
        return self._size

    def waiting_clients(self) -> Iterator[str]:
        return (u for u, n in self._n.items() if n)

    def waiting_by_client(self) -> dict[str, int]:
        return {u: n for u, n in self._n.items() if n}

    def counter(self, client: str) -> float:
        return self.counters.get(client)

    # -- charging ------------------------------------------------------------------------------------
    def _charge(self, user: str, amount: float) -> None:
        if amount:
            self.counters.add(user, amount)
            self._all.charged(user, amount > 0)  # (policies/backlog.py: re-keyed when it matters)
            self._conts.charged(user, amount > 0)

    def _admit_charge(self, req: RequestView) -> None:
        system = min(req.system_tokens, req.prompt_tokens)
        st = _Charge(req.client, self.e(req.client), self.w_aj(req.app, req.stage), req.prompt_tokens - system,
                     system, self.stats.expected(req.app, req.stage).output)
        self._charged[req.request_id] = st
        if self.charge_at == "admit":
            self._settle(st, st.expected_output)

    def _units(self, st: _Charge, output: float) -> float:
        return st.e * self.tokens.of(st.input, st.system, output) / st.w_aj

    def _settle(self, st: _Charge, output: float) -> None:
        target = self._units(st, output)
        self._charge(st.user, target - st.charged)
        st.charged, st.out_charged = target, output

    def on_tokens(self, req: RequestView, generated: int, now: float) -> None:
        st = self._charged.get(req.request_id)
        if st is not None and self.charge_at == "admit" and generated > st.out_charged:
            self._settle(st, generated)  # beyond the expected output: charged as it streams

    def on_finish(self, req: RequestView, generated: int, now: float, prompt_tokens: int | None = None,
                  cached_tokens: int | None = None) -> None:
        st = self._charged.pop(req.request_id, None)
        if st is None:
            return
        if prompt_tokens == 0:  # never ran (its backend failed before the first token): refund
            self._charge(st.user, -st.charged)
        else:
            if prompt_tokens is not None:  # the backend's count replaces the gateway's estimate
                st.input = max(0, prompt_tokens - st.system)
            self._settle(st, generated)  # Alg. 1 l.48: the exact charge
        if req.in_interaction:
            if req.final:
                self.interactions.close(req.interaction)
            else:
                self.interactions.touch(req.interaction, now)
