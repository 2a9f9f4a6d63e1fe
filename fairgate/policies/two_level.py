"""Two-level fairness (``fairness_key: app>user``): apps share the pool by weight, and each app's share is
divided among its own users by weight, so an app cannot gain share by inventing users.

The outer level is VTC over apps (VTC, Alg. 2): every charge an inner scheduler makes to one of its users
(h(n_p, n_q) increments, §4.2) is also made to the user's app, divided by the app's weight (§4.3); the backlogged
app with the smallest counter goes next (ties as VTC's, policies/backlog.py), and an app (re)joining the backlog
gets the counter lift c ← max(c, min over backlogged apps), or the last app to leave's counter if none is
backlogged (§4.1). The inner level is one scheduler of the VTC family per app, over that app's users. Pure, like every
policy: the same object runs in the simulator and the gateway."""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

from fairgate.accounting.cost import CostFunction
from fairgate.policies.backlog import Backlog
from fairgate.policies.counters import CounterStore, MemoryCounters
from fairgate.policies.scheduler import Scheduler, Weights
from fairgate.policies.views import RequestView
from fairgate.policies.vtc import VTC


def app_counter(app: str) -> str:
    """The outer counter's name: not ``app:…``, which is the inner client of an app's calls that name no user."""
    return f"share:app:{app}"


class TwoLevel(Scheduler):
    keeps_counters = True  # its store (users' and apps' counters) carries over on a switch within the family
    def __init__(self, make_inner: Callable[[], VTC], cost: CostFunction | None = None,
                 weights: Weights | None = None,
                 counters: CounterStore | None = None):
        super().__init__(cost, weights)
        self.make_inner = make_inner
        self.inner: dict[str, VTC] = {}
        self._apps = Backlog(counters if counters is not None else MemoryCounters(), key=app_counter)
        self.name = f"{make_inner().name}"

    @property
    def counters(self) -> CounterStore:
        return self._apps.counters

    @counters.setter
    def counters(self, store: CounterStore) -> None:  # a policy switch or a shared store: the inner levels follow
        self._apps.counters = store
        for inner in self.inner.values():
            inner.counters = store

    def _level(self, app: str) -> VTC:
        inner = self.inner.get(app)
        if inner is None:
            inner = self.inner[app] = self.make_inner()
            inner.counters = self.counters
            inner.on_charge = lambda _client, amount, app=app: self._charge_app(app, amount)
        return inner

    def _charge_app(self, app: str, amount: float) -> None:
        self.counters.add(app_counter(app), amount / self.weight(f"app:{app}"))
        self._apps.charged(app, amount > 0)

    # -- queue ---------------------------------------------------------------------------------------
    def add(self, req: RequestView, now: float) -> bool:
        inner = self._level(req.app)
        joining = len(inner) == 0
        if not inner.add(req, now):
            return False
        if joining:  # the app (re)joins the backlog: the counter lift over the apps
            self._apps.join(req.app)
        return True

    def min_waiting_counter(self) -> float | None:
        return self._apps.min_counter()

    def peek(self, now: float, eligible=None, backend: str = "", queued=None) -> RequestView | None:
        for app in self._apps.ascending():  # the least-served app first
            head = self.inner[app].peek(now, eligible)
            if head is not None:
                return head
            if len(self.inner[app]) == 0:
                self._apps.leave(app)
        return None

    def pop(self, req: RequestView, now: float, backend: str = "") -> None:
        inner = self.inner[req.app]
        inner.pop(req, now)
        if len(inner) == 0:
            self._apps.leave(req.app)

    def remove(self, req: RequestView, now: float) -> None:
        self.inner[req.app].remove(req, now)

    def __len__(self) -> int:
        return sum(len(q) for q in self.inner.values())

    def waiting_clients(self) -> Iterator[str]:
        return itertools.chain.from_iterable(q.waiting_clients() for q in self.inner.values())

    def waiting_by_client(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for q in self.inner.values():
            out.update(q.waiting_by_client())
        return out

    def waiting_ahead(self, req: RequestView) -> int:
        """About how many waiting requests go before ``req``, as this policy orders them: its app needs as many
        turns as its own level puts requests before it, plus one; between two of its app's turns each other
        waiting app gets about one — whatever number of users those apps name. O(waiting users of its app +
        apps)."""
        inner = self.inner.get(req.app)
        within = inner.waiting_ahead(req) if inner is not None and len(inner) else 0
        apps = sum(1 for app, q in self.inner.items() if app != req.app and len(q))
        return min(len(self), within + apps * (within + 1))

    # -- charging (the inner level charges its user, and through on_charge the app) ---------------------
    def on_tokens(self, req: RequestView, generated: int, now: float) -> None:
        self.inner[req.app].on_tokens(req, generated, now)

    def on_finish(self, req: RequestView, generated: int, now: float, prompt_tokens: int | None = None,
                  cached_tokens: int | None = None) -> None:
        self.inner[req.app].on_finish(req, generated, now, prompt_tokens, cached_tokens)

    def charge_again(self, req: RequestView) -> None:
        self.inner[req.app].charge_again(req)

    def touched(self, req: RequestView) -> None:
        inner = self.inner.get(req.app)
        if inner is not None:
            inner.touched(req)
        self._apps.charged(req.app)

    def counter(self, client: str) -> float:
        return self.counters.get(client)
