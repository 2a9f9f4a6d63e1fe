"""The gate's KV check (docs/operations/configuration.md#reservation). A request reserves its prompt and the
output it will likely produce; the question is how those reservations add up on one backend:

- ``kv_gate: peaks`` sums them: every request at its largest at once. Requests that started at different times
  never are, so the pool runs under-filled (the two-replica test's backends held 0.60 of their KV on average);
- ``kv_gate: future`` (the default) asks what the running requests will hold in each future decode iteration,
  as Aladdin's constraint (e) does (policies/kv_profile.py): each holds its prompt and the tokens generated so
  far, growing by one per iteration until its reservation is reached; a newcomer fits if at no future iteration
  the sum passes the capacity. Progress is read from the streams (the tokens charged so far).

Each backend's profile is taken at most once per ``heartbeat_s`` (the running requests all advance together, and
a profile's margins do not move while they do) and again whenever a request comes, goes or grows its
reservation; a check is then a binary search, O(log n).

Across replicas (storage/shared_state.py) each replica gates a backend against its KV *budget* there, a curve
over the future steps (accounting/kv_curve.py) which the fleet's budgets never exceed together at any step: what
this replica publishes is what its requests will hold at each future step (an upper bound), how many they are,
how fast its streams there advance, and whether its gate wanted more room since the last sync; its budget is
what its requests hold plus its share of the KV no replica holds at each step. So two replicas never fill the
same free KV before hearing of each other (a backend that admits as vLLM does would preempt), and requests of
two replicas that peak at different steps share a backend. Until its first budget it counts the others'
budgets, at the most each reaches, as a fixed load; once Redis has been away for its ``ttl_s``, it has the
whole backend again.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import numpy as np

from fairgate.accounting.kv_curve import Budget, Curve, Margin, upper
from fairgate.policies.kv_profile import KVProfile

if TYPE_CHECKING:
    from fairgate.proxy.control.backends import Backend
    from fairgate.proxy.pipeline.ticket import GateConfig, Ticket


BLOCK = 16  # vLLM allocates KV in blocks: a request's tokens are counted up to a whole block
STALE_S = 1.0  # a stream not read for this long (a slow client holds the relay up) may be further on than read
MAX_CHOICES = 16  # a request of more choices (a batch of prompts × n) counts at its largest: the profile holds
# an item per choice, and a client must not be able to grow it without bound


def _items(t: Ticket, now: float | None = None) -> tuple[int, int, int]:
    """A streamed request in the profile as (end, start, copies): each of its n choices grows by one token a step
    from its share of the prompt and of what was generated (up to a whole block), until its share of the
    reservation (at least one step more: it has not ended). Read ``now``, a stream may be further on than its
    last read: by its read rate times the time since, counted in what it holds from the start while its end
    stays where the read put it (an upper bound of where it is)."""
    c = max(1, t.choices)
    generated = min(t.generated, t.output)
    end = max(1, -(-(t.output - generated) // c))
    ahead = 0 if now is None else min(t.output - generated, int(t.rate * max(0.0, now - t.charged_at)))
    start = -(-(t.kv_tokens - t.output + generated + ahead) // (c * BLOCK)) * BLOCK
    return end, start, c


def slack(aged: float) -> float:
    """How far the backend may truly be from ``aged`` steps past a budget's step: a step (what the others counted
    may be that far on or back), and a quarter of the steps since (the step clock's rate is a replica's measure
    of the backend's, and a busy machine slows the backend or delays the next sync)."""
    return 1.0 + 0.25 * aged


class FutureKV:
    """One backend's requests from this replica, as the gate counts them: streamed ones in a future-KV profile
    kept up to date in place (retaken each heartbeat, as their progress moves on); those with no progress to
    read (answers fetched whole, streams not read for ``STALE_S``) at their largest, a fixed load."""

    def __init__(self, heartbeat_s: float = 0.01):
        self.heartbeat_s = heartbeat_s
        self.tickets: dict[int, Ticket] = {}
        self.whole = 0  # KV of the requests fetched whole, each at its reservation
        self._profile: KVProfile | None = None
        self._at = -math.inf
        self._shape: dict[int, tuple[int, int, int] | int] = {}  # ticket → its items, or its fixed KV if stale
        self._stale = 0  # KV of the streams counted at their largest in this heartbeat's view
        self.rate = 0.0  # the fastest read rate of its streams, tokens a second (decode steps a second)
        self.step_rate = 0.0  # their median read rate: the backend's decode steps a second, as they show it
        self.version = 0  # changes whenever what the view holds does
        # budget → (budget, margin) for the view at ``_margins_version`` (its budget, and what it holds itself to
        # while a sync is out or since one failed)
        self._margins: dict[int, tuple[Budget, Margin]] = {}
        self._margins_version = -1

    def add(self, ticket: Ticket) -> None:
        self.tickets[id(ticket)] = ticket
        self.version += 1
        if not ticket.streamed:
            self.whole += ticket.kv_tokens
        elif self._profile is not None:
            shape = self._shape[id(ticket)] = _items(ticket)
            self._profile.add(*shape)

    def remove(self, ticket: Ticket) -> None:
        if self.tickets.pop(id(ticket), None) is None:
            return
        self.version += 1
        if not ticket.streamed:
            self.whole -= ticket.kv_tokens
            return
        shape = self._shape.pop(id(ticket), None)
        if self._profile is None or shape is None:
            return
        if isinstance(shape, int):
            self._stale -= shape
        else:
            self._profile.remove(*shape)

    def profile(self, now: float, room: int) -> KVProfile:
        """The profile of the streamed requests against ``room`` less the fixed load."""
        profile = self._view(now)
        profile.set_capacity(room - self.whole - self._stale)
        return profile

    def committed(self, now: float) -> int:
        """The most KV these requests will hold together at any future step."""
        return self._view(now).peak() + self.whole + self._stale

    def _view(self, now: float) -> KVProfile:
        if self._profile is None or now - self._at >= self.heartbeat_s:
            items, shapes, stale, rates, fastest = [], {}, 0, [], 0.0
            for key, t in self.tickets.items():
                if not t.streamed:
                    continue
                if now - t.charged_at > STALE_S:
                    shapes[key] = t.kv_tokens
                    stale += t.kv_tokens
                    continue
                end, start, copies = shapes[key] = _items(t, now)
                items.extend([(end, start)] * copies)
                fastest = max(fastest, t.rate)  # (tokens a second: at least the steps of its fastest choice)
                if t.generated >= 8 * copies:  # (a rate read over a few steps at least; n choices: n tokens a step)
                    rates.append(t.rate / copies)
            rates.sort()
            self.rate = fastest
            self.step_rate = rates[len(rates) // 2] if rates else 0.0
            self._profile, self._at, self._shape, self._stale = KVProfile(items, None), now, shapes, stale
            self.version += 1
        return self._profile

    def curve(self, now: float) -> Curve:
        """An upper bound of what these requests hold at each future step from ``now`` (what the replica
        publishes: the view is taken again, so its steps count from now)."""
        self._at = -math.inf
        profile = self._view(now)
        return upper(profile.ends, profile.start_sums, self.whole + self._stale)

    def margin(self, now: float, budget: Budget, capacity: float) -> Margin:
        """What ``budget`` (aged at the backend's step clock, as every replica ages it) leaves beside these
        requests at each future step, within ``capacity``."""
        profile = self._view(now)
        if self._margins_version != self.version:
            self._margins, self._margins_version = {}, self.version
        kept = self._margins.get(id(budget))
        if kept is None or kept[0] is not budget or kept[1].capacity != capacity:
            aged = budget.aged(self._at)
            margin = Margin(profile.ends, profile.start_sums, self.whole + self._stale, budget.curve, aged, capacity,
                            slack=slack(aged))
            kept = self._margins[id(budget)] = (budget, margin)
        return kept[1]

    def since_view(self, now: float) -> int:
        """Decode steps its requests may have taken since the view was taken (at the fastest stream's read rate):
        a newcomer checked against the view is checked as if it had come that much earlier, ending that much
        later (it then holds at least what it will at each step)."""
        return math.ceil(self.rate * max(0.0, now - self._at) - 1e-9)


class Gate:
    """Whether a backend has room for a request now: never idle while something waits, never while it queues
    on its own (the gateway's order would not be the order that runs), within its batch cap, and within its KV
    as ``kv_gate`` counts it: alone, the backend's; across replicas, this replica's budget curve there."""

    def __init__(self, config: GateConfig, shared, now: Callable[[], float]):
        self.config, self.shared, self.now = config, shared, now
        self._running: dict[str, FutureKV] = {}
        self._wanted: set[str] = set()  # backends that refused a request for KV within the budget
        self._claimed: set[str] = set()  # those told at a sync whose answer has not come yet
        self._told: dict[str, int] = {}  # backend → the sync that last told the others of it
        self._peak_margins: dict[str, tuple[Budget, int, Margin]] = {}
        self._syncs = 0

    def claims(self, backends, limit: int) -> dict[str, tuple[Curve, int, int, bool, float]]:
        """What this replica tells the others at a sync, of ``limit`` backends at most: those where its gate
        wants room and those not told for 2⌈backends / limit⌉ syncs first, then those told longest ago (a budget
        not renewed stands, aging as before)."""
        self._syncs += 1
        due = 2 * -(-len(backends) // limit)  # (a backend not told for this many syncs goes first, wanted or not)

        def order(b: Backend) -> tuple[bool, int]:
            told = self._told.get(b.name, 0)
            return b.name not in self._wanted and self._syncs - told < due, told

        chosen = sorted(backends, key=order)[:limit]
        for b in chosen:
            self._told[b.name] = self._syncs
        return {b.name: self.claim(b) for b in chosen}

    def claim(self, b: Backend) -> tuple[Curve, int, int, bool, float]:
        """What this replica tells the others of ``b`` at a sync: what its requests there hold at each future
        step (an upper bound), how many they are, the KV the gate may fill there in all (0: unknown), whether it
        wanted more room since the last sync that went through, and how fast its streams there are read."""
        if b.name in self._wanted:
            self._wanted.discard(b.name)
            self._claimed.add(b.name)
        now, capacity = self.now(), self._capacity(b) if b.kv_capacity else 0
        if self._future(b):
            running = self.running(b)
            curve, rate = running.curve(now), running.step_rate
        else:
            curve, rate = Curve.flat(b.inflight_tokens), 0.0
        return curve, b.inflight, capacity, b.name in self._claimed, rate

    def synced(self) -> None:
        """A sync went through: what it told the others of wanting room is known to them."""
        self._claimed.clear()

    def _future(self, b: Backend) -> bool:
        return self.config.kv_gate == "future" and bool(b.kv_capacity) and bool(self.running(b).tickets)

    def budget(self, b: Backend) -> Budget | None:
        """This replica's KV budget on ``b`` from the last sync across replicas (None: none, or no sync yet)."""
        return self.shared.budget.get(b.name) if self.shared is not None else None

    def budget_now(self, b: Backend) -> float | None:
        """The KV this replica's requests may hold on ``b`` now, by its budget (None: no budget)."""
        budget = self.budget(b)
        if budget is None:
            return None
        return max(0.0, float(budget.curve.at(budget.aged(self.now()))))

    def _capacity(self, b: Backend) -> int:
        return int(b.kv_capacity * self.config.overcommit)

    def room(self, b: Backend) -> int:
        """The KV the requests of this replica may hold on ``b`` (which has a known capacity) before a budget
        is known: its capacity (times ``overcommit``) less the other replicas' budgets."""
        room = self._capacity(b)
        if self.shared is not None:
            room -= self.shared.inflight.get(b.name, (0, 0))[0]
        return room

    def free(self, b: Backend) -> float:
        """The KV this replica could still commit on ``b`` at every future step (the headroom gauge)."""
        budget = self.budget(b)
        if budget is None:
            return self.room(b) - self.committed(b)
        if self.config.kv_gate == "future":
            return self.running(b).margin(self.now(), budget, self._capacity(b)).free()
        return self._peaks(b, budget).free()

    def _peaks(self, b: Backend, budget: Budget) -> Margin:
        """``kv_gate: peaks``: what ``budget`` leaves beside this replica's requests, each at its largest."""
        kept = self._peak_margins.get(b.name)
        if kept is None or kept[0] is not budget or kept[1] != b.inflight_tokens:
            aged = budget.aged(self.now())
            margin = Margin([], np.zeros(0), b.inflight_tokens, budget.curve, aged, self._capacity(b),
                            slack=slack(aged))
            kept = self._peak_margins[b.name] = (budget, b.inflight_tokens, margin)
        return kept[2]

    def running(self, b: Backend) -> FutureKV:
        """``b``'s requests from this replica, as the gate counts them."""
        kv = self._running.get(b.name)
        if kv is None:
            kv = self._running[b.name] = FutureKV()
        return kv

    def committed(self, b: Backend) -> int:
        """The KV tokens this replica's requests hold on ``b`` as the gate counts them: the sum of their
        reservations (``peaks``), or the most they will hold together at any future iteration (``future``)."""
        if self._future(b):
            return min(b.inflight_tokens, self.running(b).committed(self.now()))
        return b.inflight_tokens

    def headroom(self, b: Backend, ticket: Ticket) -> bool:
        other_count = self.shared.inflight.get(b.name, (0, 0))[1] if self.shared is not None else 0
        inflight = b.inflight + other_count
        if inflight == 0:
            return True  # never leave a backend idle while something waits
        if b.waiting > 0:
            return False  # it already queues on its own: the gateway's order would not be the order that runs
        if b.max_num_seqs is not None and inflight >= b.max_num_seqs:
            return False
        if not b.kv_capacity:
            return inflight < self.config.max_inflight
        budget = self.budget(b)
        if budget is None:
            return self._fits(b, ticket, self.room(b))
        if not self._fits_budget(b, ticket, budget):
            if b.name not in self._wanted:
                self._wanted.add(b.name)
                self.shared.wake()
            return False
        # while a sync is out (its budget may be cut to what it said), and since one failed
        held = (self.shared.holding.get(b.name), self.shared.kept.get(b.name))
        return all(self._fits_budget(b, ticket, x) for x in held if x is not None)

    def _fits_budget(self, b: Backend, ticket: Ticket, budget: Budget) -> bool:
        """``ticket`` fits beside this replica's requests on ``b`` within its budget curve at every step."""
        if self.config.kv_gate != "future":  # (every request at its largest from the start, for good)
            return self._peaks(b, budget).free() >= ticket.kv_tokens
        running = self.running(b)
        margin = running.margin(self.now(), budget, self._capacity(b))
        if not ticket.streamed:  # (no progress to read: at its largest, from the start)
            return margin.free() >= ticket.kv_tokens
        end, start, copies = _items(ticket)
        return margin.fits(end + running.since_view(self.now()), start, copies)

    def _fits(self, b: Backend, ticket: Ticket, room: int) -> bool:
        """``ticket`` fits beside this replica's requests on ``b`` within ``room`` KV tokens."""
        if self.config.kv_gate != "future":
            return b.inflight_tokens + ticket.kv_tokens <= room
        running = self.running(b)
        profile = running.profile(self.now(), room)
        if not ticket.streamed:  # (no progress to read: at its largest, from the start)
            return running.committed(self.now()) + ticket.kv_tokens <= room
        end, start, copies = _items(ticket)
        end += running.since_view(self.now())
        if copies == 1:
            return profile.fits(end, start)
        trial = KVProfile(list(zip(profile.ends, profile.starts)) + [(end, start)] * copies, profile.capacity)
        return trial.peak() <= profile.capacity
