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
reservation; a check is then a binary search, O(log n). Other replicas' requests, known only as totals
(storage/shared_state.py), count as a fixed load: what this replica publishes is its profile's peak, never less
than what its own requests will hold together at any iteration.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from fairgate.policies.kv_profile import KVProfile

if TYPE_CHECKING:
    from fairgate.proxy.control.backends import Backend
    from fairgate.proxy.pipeline.dispatcher import GateConfig, Ticket


class FutureKV:
    """One backend's running requests (their tickets), and their future-KV profile."""

    def __init__(self, heartbeat_s: float = 0.01):
        self.heartbeat_s = heartbeat_s
        self.tickets: dict[int, Ticket] = {}
        self._profile: KVProfile | None = None
        self._at = -math.inf
        self._capacity: int | None = None

    def add(self, ticket: Ticket) -> None:
        self.tickets[id(ticket)] = ticket
        self._profile = None

    def remove(self, ticket: Ticket) -> None:
        if self.tickets.pop(id(ticket), None) is not None:
            self._profile = None

    def changed(self) -> None:
        """A request's reservation grew."""
        self._profile = None

    def profile(self, now: float, capacity: int) -> KVProfile:
        if self._profile is None or now - self._at >= self.heartbeat_s or capacity != self._capacity:
            items = []
            for t in self.tickets.values():
                generated = min(t.generated, t.output)
                items.append((t.output - generated, t.kv_tokens - t.output + generated))
            self._profile, self._at, self._capacity = KVProfile(items, capacity), now, capacity
        return self._profile

    def peak(self, now: float) -> int:
        """The most KV its requests will hold together at any future iteration."""
        if not self.tickets:
            return 0
        if self._profile is None or now - self._at >= self.heartbeat_s:
            return self.profile(now, self._capacity or 0).peak()
        return self._profile.peak()


class Gate:
    """Whether a backend has room for a request now: never idle while something waits, never while it queues
    on its own (the gateway's order would not be the order that runs), within its batch cap, and within its KV
    as ``kv_gate`` counts it (the other replicas' requests as they publish them)."""

    def __init__(self, config: GateConfig, shared, now: Callable[[], float]):
        self.config, self.shared, self.now = config, shared, now
        self._running: dict[str, FutureKV] = {}

    def running(self, b: Backend) -> FutureKV:
        """``b``'s requests from this replica, as the gate counts them."""
        kv = self._running.get(b.name)
        if kv is None:
            kv = self._running[b.name] = FutureKV()
        return kv

    def committed(self, b: Backend) -> int:
        """The KV tokens this replica's requests hold on ``b`` as the gate counts them: the sum of their
        reservations (``peaks``), or the most they will hold together at any future iteration (``future``)."""
        if self.config.kv_gate == "future":
            return min(b.inflight_tokens, self.running(b).peak(self.now()))
        return b.inflight_tokens

    def headroom(self, b: Backend, ticket: Ticket) -> bool:
        kv_tokens = ticket.kv_tokens
        other_tokens, other_count = self.shared.inflight.get(b.name, (0, 0)) if self.shared else (0, 0)
        inflight, tokens = b.inflight + other_count, b.inflight_tokens + other_tokens
        if inflight == 0:
            return True  # never leave a backend idle while something waits
        if b.waiting > 0:
            return False  # it already queues on its own: the gateway's order would not be the order that runs
        if b.max_num_seqs is not None and inflight >= b.max_num_seqs:
            return False
        if b.kv_capacity and self.config.kv_gate == "future":
            room = int(b.kv_capacity * self.config.overcommit) - other_tokens
            return self.running(b).profile(self.now(), room).fits(ticket.output, kv_tokens - ticket.output)
        if b.kv_capacity:
            return tokens + kv_tokens <= b.kv_capacity * self.config.overcommit
        return inflight < self.config.max_inflight
