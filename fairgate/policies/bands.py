"""Priority bands over a fair policy (SLO classes, accounting/slo.py; docs/guide/slo.md#bands).

Each band (``interactive``, ``standard``, ``batch``: a request's ``band`` is its app's class's) has its own
instance of the configured policy, so the policy orders tenants *within* a band exactly as it would alone (VTC's
counter lift over that band's backlog, DLPM's deficits per band), and the instances share the policy's counter
store. A tenant is normally in one band, its app's; one waiting in two (a user shared by apps of different
bands, or an app whose band changed while its requests waited or ran) has one counter, which a charge in either
band makes the other re-read (``touched``), while DLPM keeps a deficit for it in each. A pick asks the bands in order and takes the first answer, so a
higher band always goes first, and a band with nothing that fits (``eligible``) never holds a lower one back: the
gate stays work-conserving.

A band may be given a minimum share of the dispatches (``min_share``): while it has a request waiting and got
less than that share of the last ``WINDOW`` dispatches, it is asked first (the highest such band first), so a
lower band is never starved for good. Shares are of requests dispatched, not of tokens.

Cost: a decision asks at most ``len(BANDS)`` instances, each at its own cost. Pure: no I/O; time is passed in.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Callable, Iterator

from fairgate.accounting.slo import BANDS
from fairgate.policies.scheduler import Eligible, Scheduler
from fairgate.policies.views import RequestView

STANDARD = BANDS.index("standard")
WINDOW = 200  # the dispatches a minimum share is measured over


class Banded(Scheduler):
    holds_across_replicas = False  # a replica defers to a less-served tenant elsewhere only within one order

    def __init__(self, make_inner: Callable[[], Scheduler], min_share: dict[int, float] | None = None):
        self.inner = [make_inner() for _ in BANDS]
        first = self.inner[0]
        super().__init__(first.cost, first.weight)
        for flag in ("name", "throttles", "limits_clients", "skips_unfit", "prefetches", "keeps_counters"):
            setattr(self, flag, getattr(first, flag))
        self._shares_counters = first.keeps_counters
        if first.keeps_counters:  # one store: a tenant's counter is the same whichever instance reads it
            for s in self.inner[1:]:
                s.counters = first.counters
        self.min_share = dict(min_share or {})  # band → its minimum share of dispatches (set live)
        self._served: deque[int] = deque(maxlen=WINDOW)  # the bands of the last dispatches
        self._pops = 0

    def parts(self) -> list[Scheduler]:
        return list(self.inner)

    def _of(self, req: RequestView) -> Scheduler:
        return self.inner[req.band if 0 <= req.band < len(self.inner) else STANDARD]

    # -- what the instances share ----------------------------------------------------------------------
    @property
    def counters(self):
        return self.inner[0].counters

    @counters.setter
    def counters(self, store) -> None:
        for s in self.inner:
            s.counters = store

    @property
    def match(self):
        return self.inner[0].match

    @match.setter
    def match(self, source) -> None:
        for s in self.inner:
            s.match = source

    def on_blocks(self, backend: str, root, affects=None) -> None:
        for s in self.inner:
            s.on_blocks(backend, root, affects)

    def set_params(self, **params: float) -> None:
        for s in self.inner:
            s.set_params(**params)

    # -- queue -----------------------------------------------------------------------------------------
    def admit(self, req: RequestView, now: float, overloaded: bool):
        return self._of(req).admit(req, now, overloaded)

    def add(self, req: RequestView, now: float) -> bool:
        return self._of(req).add(req, now)

    def _order(self) -> list[int]:
        """The bands in the order a pick asks them: those short of their minimum share first."""
        order = list(range(len(self.inner)))
        if not self.min_share or not self._served:
            return order
        n = len(self._served)
        short = [b for b in order if self.min_share.get(b, 0.0) * n > self._served.count(b) and len(self.inner[b])]
        return short + [b for b in order if b not in short]

    def peek(self, now: float, eligible: Eligible | None = None, backend: str = "",
             queued: Eligible | None = None) -> RequestView | None:
        for b in self._order():
            s = self.inner[b]
            if len(s):
                r = s.peek(now, eligible, backend, queued)
                if r is not None:
                    return r
        return None

    def _charged(self, req: RequestView, by: Scheduler) -> None:
        """A tenant waiting in two bands (a user shared by apps of different bands, or an app whose band changed
        with requests in flight) is charged in one: the other instances re-read its shared counter."""
        if self._shares_counters:
            for s in self.inner:
                if s is not by:
                    s.touched(req)

    def pop(self, req: RequestView, now: float, backend: str = "") -> None:
        s = self._of(req)
        s.pop(req, now, backend)
        self._charged(req, s)
        self._served.append(req.band if 0 <= req.band < len(self.inner) else STANDARD)
        self._pops += 1

    def remove(self, req: RequestView, now: float) -> None:
        self._of(req).remove(req, now)

    def __len__(self) -> int:
        return sum(len(s) for s in self.inner)

    def waiting_ahead(self, req: RequestView) -> int:
        """The higher bands' requests, then those its own band's policy puts before it."""
        band = req.band if 0 <= req.band < len(self.inner) else STANDARD
        return sum(len(s) for s in self.inner[:band]) + self.inner[band].waiting_ahead(req)

    def generation(self, backend: str = "") -> object | None:
        gens = tuple(s.generation(backend) for s in self.inner)
        return None if any(g is None for g in gens) else (gens, self._pops if self.min_share else 0)

    # -- charging and reading ----------------------------------------------------------------------------
    def on_tokens(self, req: RequestView, generated: int, now: float) -> None:
        s = self._of(req)
        s.on_tokens(req, generated, now)
        self._charged(req, s)

    def on_finish(self, req: RequestView, generated: int, now: float, prompt_tokens: int | None = None,
                  cached_tokens: int | None = None) -> None:
        s = self._of(req)
        s.on_finish(req, generated, now, prompt_tokens, cached_tokens)
        self._charged(req, s)

    def charge_again(self, req: RequestView) -> None:
        self._of(req).charge_again(req)

    def counter(self, client: str) -> float:
        """The tenant's counter: its band's (a shared store reads the same in every band; a policy keeping
        service per instance, as DLPM does, has it only in the tenant's band)."""
        return max(s.counter(client) for s in self.inner)

    def waiting_clients(self) -> Iterator[str]:
        return itertools.chain.from_iterable(s.waiting_clients() for s in self.inner)

    def waiting_by_client(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.inner:
            for c, n in s.waiting_by_client().items():
                out[c] = out.get(c, 0) + n
        return out
