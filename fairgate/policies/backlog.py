"""The least-served backlog: the clients with something waiting, least served first — VTC's "client with the
smallest counter among those in the waiting queue" (Algorithm 2), WSC's least-served user, and the two-level
policy's least-served app share it.

A heap of (counter, counter before the lift, join order, client, version) with lazy invalidation: a client's
entry is replaced when it joins or leaves, and stale entries are dropped when they reach the top. A charge that
raises a counter is re-keyed lazily too: an entry whose key is at most its client's counter can only sit too
high in the heap, so the top is exact once the top's own key is current — a client whose entry reaches the top
with a counter that moved is pushed again where it now stands, and only then (a step charging k clients no
longer pushes k entries). A charge that lowers a counter (a prompt reconciled down) re-keys it at once.
Ties go to the client that was served less before it joined, then to the one that joined first: a light
client lifted to the smallest counter goes before the clients already at it, which were served up to it,
instead of waiting a turn of every one of them (an app naming 200 users whose counters stay equal would
otherwise delay it by 200 dispatches, whatever its own service). ``join`` applies the counter lift (VTC §4.1): a
client (re)joining gets c ← max(c, the smallest backlogged counter), or, with nobody backlogged, the counter of
the client that left last, so an idle period neither resets a debt nor banks a credit. Costs: join, leave and
the top O(log n) amortised; nothing walks the clients. Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterator

from fairgate.policies.counters import CounterStore

Entry = tuple[float, float, int, str, int]  # (counter, counter before the lift, join order, client, version)


class Backlog:
    def __init__(self, counters: CounterStore, key: Callable[[str], str] | None = None,
                 clock: Iterator[int] | None = None):
        """``key(client)``: the client's name in ``counters`` (None: the client itself); ``clock``: the join
        order's numbers, shared by backlogs over the same clients (WSC keeps two) so their ties break alike."""
        self.counters, self.key = counters, key
        self._clock = clock if clock is not None else itertools.count()
        self._joined: dict[str, tuple[float, int]] = {}  # each member's counter before its lift, join order
        self._heap: list[Entry] = []
        # each member's live entry; numbers are never reused, so an entry of a client that left and came back
        # is stale, not revived
        self._version: dict[str, int] = {}
        self._versions = itertools.count()
        self._members: set[str] = set()
        self._stale: set[str] = set()
        self.last_left: str | None = None

    def __contains__(self, client: str) -> bool:
        return client in self._members

    def __len__(self) -> int:
        return len(self._members)

    def counter(self, client: str) -> float:
        return self.counters.get(client if self.key is None else self.key(client))

    def _push(self, client: str) -> None:
        v = self._version[client] = next(self._versions)
        counter = self.counters.get(client if self.key is None else self.key(client))  # (inlined: hot)
        prior, joined = self._joined[client]
        heapq.heappush(self._heap, (counter, prior, joined, client, v))

    def join(self, client: str, lift: bool = True) -> None:
        """``client`` has something waiting again; with ``lift``, the counter lift first."""
        if client in self._members:
            return
        prior = self.counter(client)
        if lift:
            floor = self.min_counter()
            if floor is None and self.last_left is not None:
                floor = self.counter(self.last_left)
            if floor is not None:
                self.counters.lift(client if self.key is None else self.key(client), floor)
        self._members.add(client)
        self._joined[client] = (prior, next(self._clock))
        self._push(client)

    def leave(self, client: str) -> None:
        """``client`` has nothing waiting any more."""
        if client in self._members:
            self._members.discard(client)
            del self._joined[client]
            del self._version[client]
            self.last_left = client

    def charged(self, client: str, rose: bool = False) -> None:
        """``client``'s counter changed: re-keyed at the next decision; one that ``rose`` only if its entry
        reaches the top (module docstring)."""
        if not rose and client in self._members:
            self._stale.add(client)

    def top(self) -> str | None:
        """The least-served backlogged client (ties: the one served less before it joined, then the one that
        joined first)."""
        members = self._members
        if self._stale:
            for client in self._stale:
                if client in members:
                    self._push(client)
            self._stale.clear()
        heap, version, counters, key = self._heap, self._version, self.counters, self.key
        while heap:
            counter, prior, joined, client, v = heap[0]
            if v != version.get(client) or client not in members:
                heapq.heappop(heap)
            elif (now := counters.get(client if key is None else key(client))) > counter:  # (it rose since)
                v = version[client] = next(self._versions)
                heapq.heapreplace(heap, (now, prior, joined, client, v))
            else:
                return client
        return None

    def ahead_of(self, client: str, lift: bool = True, most: int = 256) -> int | None:
        """How many backlogged clients would go before ``client`` if it joined now (with ``lift``, lifted
        first), as ``top`` orders them; None if more than ``most`` would. Walks the heap from its top:
        O(min(answer, most) · log n)."""
        prior = mine = self.counter(client)
        if lift and (floor := self.min_counter()) is not None:
            mine = max(mine, floor)
        n = 0
        for c in self.ascending():
            if (self.counter(c), self._joined[c][0]) > (mine, prior):
                return n
            n += 1
            if n > most:
                return None
        return n

    def min_counter(self) -> float | None:
        client = self.top()
        return None if client is None else self.counter(client)

    def ascending(self) -> Iterator[str]:
        """The backlogged clients, least served first, for a caller that passes some over; the entries taken off
        to look further are put back when the iteration ends (a caller may ``leave`` the client it was given)."""
        taken: list[Entry] = []
        try:
            while (client := self.top()) is not None:
                yield client
                if self._heap and self._heap[0][3] == client:
                    taken.append(heapq.heappop(self._heap))
        finally:
            for entry in taken:
                heapq.heappush(self._heap, entry)
