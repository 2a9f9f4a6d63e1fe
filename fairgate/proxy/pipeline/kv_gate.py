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

Across replicas each replica gates a backend against its KV *budget* there (storage/shared_state.py): it
publishes the most its requests there will hold at any future step, how many they are and whether its gate
wanted more room; before its first budget it counts the others' budgets as a fixed load.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

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

    def add(self, ticket: Ticket) -> None:
        self.tickets[id(ticket)] = ticket
        if not ticket.streamed:
            self.whole += ticket.kv_tokens
        elif self._profile is not None:
            shape = self._shape[id(ticket)] = _items(ticket)
            self._profile.add(*shape)

    def remove(self, ticket: Ticket) -> None:
        if self.tickets.pop(id(ticket), None) is None:
            return
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
            items, shapes, stale, fastest = [], {}, 0, 0.0
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
            self.rate = fastest
            self._profile, self._at, self._shape, self._stale = KVProfile(items, None), now, shapes, stale
        return self._profile

    def since_view(self, now: float) -> int:
        """Decode steps its requests may have taken since the view was taken (at the fastest stream's read rate):
        a newcomer checked against the view is checked as if it had come that much earlier, ending that much
        later (it then holds at least what it will at each step)."""
        return math.ceil(self.rate * max(0.0, now - self._at) - 1e-9)


class Gate:
    """Whether a backend has room for a request now: never idle while something waits, never while it queues
    on its own (the gateway's order would not be the order that runs), within its batch cap, and within its KV
    as ``kv_gate`` counts it: alone, the backend's; across replicas, this replica's budget there."""

    def __init__(self, config: GateConfig, shared, now: Callable[[], float]):
        self.config, self.shared, self.now = config, shared, now
        self._running: dict[str, FutureKV] = {}
        self._wanted: set[str] = set()  # backends that refused a request for KV within the budget
        self._claimed: set[str] = set()  # those told at a sync whose answer has not come yet
        self._placed: dict[str, int] = {}  # KV of the requests placed on each backend since the last claims

    def place(self, b: Backend, ticket: Ticket) -> None:
        """``ticket`` now runs on ``b``."""
        self.running(b).add(ticket)
        self._placed[b.name] = self._placed.get(b.name, 0) + ticket.kv_tokens
        if self.shared is not None:
            self.shared.touch()

    def claims(self, backends) -> dict[str, tuple[int, int, int, bool]]:
        """What this replica tells the others at a sync of each backend: what its requests there hold (the most
        they will hold together at any future step), how many they are, the KV the gate may fill there in all
        (0: unknown), and whether it wanted more room since the last sync that went through.

        A replica holds itself to what it claims until the answer comes (storage/kv_budgets.py), so the claim
        adds, within its budget, the KV it placed there since its last claim: at the pace it places requests,
        what it needs while the answer is on its way. Claiming only what its requests held shut the gate during
        every sync: under load a third of a replica's requests waited in the queue, 30 ms at the 99th
        percentile (tests/test_replicas.py)."""
        claims = {}
        for b in backends:
            if b.name in self._wanted:
                self._wanted.discard(b.name)
                self._claimed.add(b.name)
            capacity = self._capacity(b) if b.kv_capacity else 0
            holds = self.committed(b)
            placed = self._placed.pop(b.name, 0)
            if placed and (budget := self.budget(b)) is not None:
                holds = max(holds, min(budget, holds + placed))
            claims[b.name] = (holds, b.inflight, capacity, b.name in self._claimed)
        return claims

    def synced(self) -> None:
        """A sync went through: what it told the others of wanting room is known to them."""
        self._claimed.clear()

    def _future(self, b: Backend) -> bool:
        return self.config.kv_gate == "future" and bool(b.kv_capacity) and bool(self.running(b).tickets)

    def budget(self, b: Backend) -> int | None:
        """The KV this replica's requests may hold on ``b``: its budget from the last sync across replicas, and
        while a sync is out or since one failed, no more than it said they hold (None: no budget yet)."""
        if self.shared is None or (budget := self.shared.kv.budget.get(b.name)) is None:
            return None
        held = (self.shared.kv.holding.get(b.name), self.shared.kv.kept.get(b.name))
        return min([budget, *(x for x in held if x is not None)])

    def _capacity(self, b: Backend) -> int:
        return int(b.kv_capacity * self.config.overcommit)

    def room(self, b: Backend) -> int:
        """The KV the requests of this replica may hold on ``b`` (which has a known capacity): its budget, or
        before one is known, its capacity (times ``overcommit``) less the other replicas' budgets."""
        budget = self.budget(b)
        if budget is not None:
            return min(budget, self._capacity(b))
        room = self._capacity(b)
        if self.shared is not None:
            room -= self.shared.kv.inflight.get(b.name, (0, 0))[0]
        return room

    def free(self, b: Backend) -> float:
        """The KV this replica could still commit on ``b`` at every future step (the headroom gauge)."""
        return self.room(b) - self.committed(b)

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

    def _inflight(self, b: Backend) -> int:
        """Requests on ``b``: this replica's and, with shared budgets, the other replicas'."""
        return b.inflight + (self.shared.kv.inflight.get(b.name, (0, 0))[1] if self.shared is not None else 0)

    def seat_freed(self, b: Backend) -> None:
        """A request on ``b`` ended normally (called before it leaves). If every seat (``max_num_seqs``) was
        taken, the request the backend had waiting — if the last scrape saw one — takes the seat it frees: a
        count read between a send and the backend's next step would otherwise hold the gate shut
        (``waiting > 0``) until the next scrape, with a seat idle while the gateway's queue waits. Below the
        seat limit a waiting request may wait for KV this end does not free: the count is kept."""
        if b.max_num_seqs is not None and self._inflight(b) >= b.max_num_seqs:
            b.waiting = max(0, b.waiting - 1)

    def headroom(self, b: Backend, ticket: Ticket) -> bool:
        inflight = self._inflight(b)
        if inflight == 0:
            return True  # never leave a backend idle while something waits
        if b.waiting > 0:
            return False  # it already queues on its own: the gateway's order would not be the order that runs
        if b.max_num_seqs is not None and inflight >= b.max_num_seqs:
            return False
        if not b.kv_capacity:
            return inflight < self.config.max_inflight
        if self._fits(b, ticket, self.room(b)):
            return True
        if self.budget(b) is not None and b.name not in self._wanted:  # (room it has no budget for: sync soon)
            self._wanted.add(b.name)
            self.shared.wake()
        return False

    def _fits(self, b: Backend, ticket: Ticket, room: int) -> bool:
        """``ticket`` fits beside this replica's requests on ``b`` within ``room`` KV tokens."""
        if self.config.kv_gate != "future":
            return b.inflight_tokens + ticket.kv_tokens <= room
        running = self.running(b)
        if not ticket.streamed:  # (no progress to read: at its largest, from the start)
            return running.committed(self.now()) + ticket.kv_tokens <= room
        profile = running.profile(self.now(), room)
        end, start, copies = _items(ticket)
        end += running.since_view(self.now())
        if copies == 1:
            return profile.fits(end, start)
        trial = KVProfile(list(zip(profile.ends, profile.starts)) + [(end, start)] * copies, profile.capacity)
        return trial.peak() <= profile.capacity
