"""The least-served backlog: the clients with something waiting, least served first — VTC's "client with the
smallest counter among those in the waiting queue" (Algorithm 2), WSC's least-served user, and the two-level
policy's least-served app share it.

A heap of (counter, first-seen order, client, version) with lazy invalidation: a client's entry is replaced
when it joins, is charged or leaves, and stale entries are dropped when they reach the top. A charged client
is re-keyed once per decision, not once per streamed token. ``join`` applies the counter lift (VTC §4.1): a
client (re)joining gets c ← max(c, the smallest backlogged counter), or, with nobody backlogged, the counter of
the client that left last, so an idle period neither resets a debt nor banks a credit. Costs: join, leave and
the top O(log n) amortised; nothing walks the clients. Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterator

from fairgate.policies.counters import CounterStore

Entry = tuple[float, int, str, int]  # (counter, first-seen order, client, version)


class Backlog:
    def __init__(self, counters: CounterStore, key: Callable[[str], str] | None = None,
                 order: dict[str, int] | None = None):
        """``key(client)``: the client's name in ``counters`` (None: the client itself); ``order``: first-seen
        order, shared by backlogs over the same clients (WSC keeps two) so their ties break alike."""
        self.counters, self.key = counters, key
        self.order = order if order is not None else {}  # never shrinks: its size is the next number
        self._heap: list[Entry] = []
        self._version: dict[str, int] = {}
        self._members: set[str] = set()
        self._stale: set[str] = set()
        self.last_left: str | None = None

    def __contains__(self, client: str) -> bool:
        return client in self._members

    def __len__(self) -> int:
        return len(self._members)

    def seen(self, client: str) -> int:
        """The client's first-seen order (assigned now if it is new)."""
        n = self.order.get(client)
        if n is None:
            n = self.order[client] = len(self.order)
        return n

    def counter(self, client: str) -> float:
        return self.counters.get(client if self.key is None else self.key(client))

    def _push(self, client: str) -> None:
        v = self._version.get(client, 0) + 1
        self._version[client] = v
        order = self.order.get(client)
        counter = self.counters.get(client if self.key is None else self.key(client))  # (inlined: hot)
        heapq.heappush(self._heap, (counter, self.seen(client) if order is None else order, client, v))

    def join(self, client: str, lift: bool = True) -> None:
        """``client`` has something waiting again; with ``lift``, the counter lift first."""
        if client in self._members:
            return
        if lift:
            floor = self.min_counter()
            if floor is None and self.last_left is not None:
                floor = self.counter(self.last_left)
            if floor is not None:
                self.counters.lift(client if self.key is None else self.key(client), floor)
        self._members.add(client)
        self._push(client)

    def leave(self, client: str) -> None:
        """``client`` has nothing waiting any more."""
        if client in self._members:
            self._members.discard(client)
            self._version[client] = self._version.get(client, 0) + 1
            self.last_left = client

    def charged(self, client: str) -> None:
        """``client``'s counter changed: re-keyed at the next decision."""
        if client in self._members:
            self._stale.add(client)

    def top(self) -> str | None:
        """The least-served backlogged client (ties: the one seen first)."""
        members = self._members
        if self._stale:
            for client in self._stale:
                if client in members:
                    self._push(client)
            self._stale.clear()
        heap, version = self._heap, self._version
        while heap:
            _, _, client, v = heap[0]
            if v == version.get(client) and client in members:
                return client
            heapq.heappop(heap)
        return None

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
                if self._heap and self._heap[0][2] == client:
                    taken.append(heapq.heappop(self._heap))
        finally:
            for entry in taken:
                heapq.heappush(self._heap, entry)
