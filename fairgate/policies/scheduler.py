"""Schedulers: which waiting request runs next. Pure: called with ``now``, no I/O, no clock.

The same objects order admissions inside the simulated engine (engine mode) and dispatch from the gateway's
queue (gateway mode, and the live gateway). The life of a request, as a scheduler hears it:

    add(req, now) -> bool          arrival; False = rejected (RPM)
    peek(now, eligible, backend, queued)
                                   the request that would go next (None: none waits); with ``eligible``, the
                                   next among those it accepts (the gate skips models that have no headroom);
                                   ``backend``: the one asking and ``queued``: the requests that wait for it
                                   (room aside), for a policy that picks per backend (``skips_unfit``)
    pop(req, now, backend)         it was admitted / dispatched (to ``backend``): leaves the queue, input charged
    on_tokens(req, generated, now) it has generated ``generated`` output tokens so far
    on_finish(req, generated, now, prompt_tokens, cached_tokens)
                                   it ended (finished, cancelled or failed) after ``generated`` tokens; the
                                   backend's prompt and cached counts settle the input charge
    remove(req, now)               it left the queue without running (client gone)

What a caller may rely on is declared on the class, never probed: ``throttles`` (``admit`` may refuse),
``skips_unfit`` (it picks per backend among the requests that fit that backend: the gate asks each backend in
turn), ``prefetches`` (its decision reads state another replica may have written: the caller fetches it from
the shared store first), ``keeps_counters`` (its ``counters`` store may be handed to a policy of the same family).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Iterator

from fairgate.accounting.cost import CostFunction, LinearCost
from fairgate.policies.views import RequestView

if TYPE_CHECKING:
    from fairgate.policies.oit import Throttle

Weights = Callable[[str], float]
Eligible = Callable[[RequestView], bool]


def version_of(eligible: Eligible | None) -> object | None:
    """``eligible``'s version, if its caller gave it one (``eligible.version``): while a caller passes an
    ``eligible`` of the same version for a backend, its answer for each request, and the match source's there,
    are what they were, so a policy may keep what it found per client (DLPM does) and ask again only of the
    clients whose queues changed. None: no such promise."""
    return getattr(eligible, "version", None)


def nothing(_req: RequestView) -> bool:
    """``eligible`` from a caller that knows nothing fits (no request could): a policy may skip its scan, and
    still does the bookkeeping an empty pick does (DLPM's CHECKREFILL)."""
    return False


def _unit_weight(_client: str) -> float:
    return 1.0


class Scheduler:
    name = "base"

    def __init__(self, cost: CostFunction | None = None, weights: Weights | None = None):
        self.cost = cost or LinearCost()
        self.weight = weights or _unit_weight

    # admission (throttling) before the queue: None admits; OIT returns a Throttle
    throttles = False  # True if ``admit`` may refuse (the caller then computes ``overloaded``)
    limits_clients = False  # True: each client is held to a request limit of its own in ``add`` (RPM)
    skips_unfit = False  # True: peek/pop per backend, among the requests that fit it (DLPM, LPM)
    prefetches = False  # True: fetch the interaction's state (and OIT's windows) from the shared store first
    keeps_counters = False  # True: a ``counters`` store (VTC's, WSC's) that carries over within a family
    holds_across_replicas = True  # the dispatcher may defer to a less-served tenant queued on another replica
    match: "Callable[[RequestView, str], int] | None" = None  # a prefix-aware policy's match source (DLPM, LPM):
    # prompt tokens a backend caches for a request; its caller sets it (the index, or each simulated engine)

    def admit(self, req: RequestView, now: float, overloaded: bool) -> "Throttle | None":
        return None

    # queue interface
    def add(self, req: RequestView, now: float) -> bool:
        raise NotImplementedError

    def peek(self, now: float, eligible: Eligible | None = None, backend: str = "",
             queued: Eligible | None = None) -> RequestView | None:
        raise NotImplementedError

    def pop(self, req: RequestView, now: float, backend: str = "") -> None:
        raise NotImplementedError

    def remove(self, req: RequestView, now: float) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    # service hooks (no-ops for order-only policies)
    def on_tokens(self, req: RequestView, generated: int, now: float) -> None:
        pass

    def on_step(self, emitted: list[tuple[RequestView, int]], now: float) -> None:
        """The tokens of one engine step, (request, its tokens generated so far) each: ``on_tokens`` for each,
        unless the policy charges them more cheaply together (the simulator calls this)."""
        for req, generated in emitted:
            self.on_tokens(req, generated, now)

    def run_charges(self, emitted: list[tuple[RequestView, int]], steps: int) -> dict[str, float] | None:
        """For a run of ``steps`` more decode steps of one batch after the step ``emitted`` (each request one
        token per step; the simulator's quiet runs): the charge per client that each of those steps makes, if
        they all make the same, the requests' own state then advanced past them all (the caller charges each
        step when it starts, ``charge_clients``); None: they are charged step by step (``on_step``)."""
        return None

    def charge_clients(self, amounts: dict[str, float]) -> None:
        """One step's charges as ``run_charges`` gave them."""

    def on_finish(self, req: RequestView, generated: int, now: float, prompt_tokens: int | None = None,
                  cached_tokens: int | None = None) -> None:
        """``prompt_tokens``: the backend's count, to reconcile the input charged at admission with; 0 refunds
        the input (the request never ran, e.g. its backend failed before the first token). ``cached_tokens``:
        the backend's report of the prompt it had cached (DLPM settles its extend charge on it)."""

    def generation(self, backend: str = "") -> object | None:
        """A value that changes whenever ``peek(…, backend)`` could answer differently, the answers of
        ``eligible`` and of the match source aside; None: unknown (ask every time). A caller that asked and got
        nothing need not ask again until it, or what ``eligible`` accepts, changes."""
        return None

    def waiting_ahead(self, req: RequestView) -> int:
        """About how many waiting requests go before ``req`` (not yet queued): a fair policy serves its tenant's
        own queue in order and each other waiting tenant about once before it, whatever their depths; FCFS
        serves everything first. O(waiting tenants)."""
        mine = self.waiting_by_client()
        return min(len(self), mine.get(req.client, 0) + sum(1 for c in mine if c != req.client))

    def touched(self, req: RequestView) -> None:
        """``req``'s tenant was charged by another instance sharing this one's counters (another band's,
        policies/bands.py): a policy that orders by counters re-reads that tenant's at its next decision."""

    def parts(self) -> list[Scheduler]:
        """The policy objects this one is made of (itself; one per band under bands, policies/bands.py): what
        a caller configuring a kind of policy (FairServe's settings, DLPM's gauges) looks for."""
        return [self]

    def charge_again(self, req: RequestView) -> None:
        """The VTC artifact's second charge of a finishing step (``--artifact-quirks``, simulator only); none
        for any other policy."""

    def set_params(self, **params: float) -> None:
        """Run-time parameters (`fairgate admin locality set`); a policy without any takes none."""

    def counter(self, client: str) -> float:
        return 0.0

    def waiting_clients(self) -> Iterator[str]:
        return iter(())

    def waiting_by_client(self) -> dict[str, int]:
        return {}


class FCFS(Scheduler):
    """First come, first served across all clients."""

    name = "fcfs"

    def __init__(self, cost: CostFunction | None = None, weights: Weights | None = None):
        super().__init__(cost, weights)
        self._q: deque[RequestView] = deque()
        self._gone: set[str] = set()

    def add(self, req: RequestView, now: float) -> bool:
        self._q.append(req)
        return True

    def peek(self, now: float, eligible: Eligible | None = None, backend: str = "",
             queued: Eligible | None = None) -> RequestView | None:
        while self._q and self._q[0].request_id in self._gone:
            self._gone.discard(self._q.popleft().request_id)
        if eligible is None:
            return self._q[0] if self._q else None
        return next((r for r in self._q if r.request_id not in self._gone and eligible(r)), None)

    def pop(self, req: RequestView, now: float, backend: str = "") -> None:
        if self._q and self._q[0] is req:
            self._q.popleft()
        else:  # the first eligible one, behind heads the gate skipped
            self._q.remove(req)

    def remove(self, req: RequestView, now: float) -> None:
        self._gone.add(req.request_id)

    def __len__(self) -> int:
        return len(self._q) - len(self._gone)

    def waiting_clients(self) -> Iterator[str]:
        return iter(self.waiting_by_client())

    def waiting_by_client(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self._q:
            if r.request_id not in self._gone:
                out[r.client] = out.get(r.client, 0) + 1
        return out

    def waiting_ahead(self, req: RequestView) -> int:
        return len(self)  # (first come, first served: all of them)


class RPM(FCFS):
    """FCFS behind a per-client request-per-minute limit: a sliding 60 s window over *accepted* requests;
    a request over the limit is rejected at arrival, as the VTC artifact's RPM ("LShare") does.
    ``limit`` is a number or a function of the client (per-user limits)."""

    name = "rpm"
    limits_clients = True

    def __init__(self, limit: int | Callable[[str], int], cost: CostFunction | None = None,
                 weights: Weights | None = None, window_s: float = 60.0):
        super().__init__(cost, weights)
        self.limit = limit if callable(limit) else (lambda _c, n=limit: n)
        self.window_s = window_s
        self._accepted: dict[str, deque[float]] = {}

    def add(self, req: RequestView, now: float) -> bool:
        times = self._accepted.setdefault(req.client, deque())
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if len(times) >= self.limit(req.client):
            return False
        times.append(now)
        return super().add(req, now)
