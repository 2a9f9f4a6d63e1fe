"""Each client's best candidate per backend, kept in a heap per backend, so a DLPM decision does not walk every
waiting request's chain for every backend, nor even visit every client (bench/locality.py).

A client's *best* on a backend is its windowed request with the longest match there (the earliest among ties),
as ``DLPM._client_best`` computes it. It is remembered until the match source says it may have changed (the
client's queue changed, or blocks of a chain one of its requests starts with appeared on or left the backend),
or for ``memo_s`` of policy time (blocks that expire by TTL only shorten matches: a stale entry overstates its
client, rises to the top and is recomputed there). Heap entries are invalidated lazily by a stamp. Pure.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable

from fairgate.policies.views import RequestView

Key = tuple[int, int]  # (match, -arrival sequence): larger is better
Compute = Callable[[str, str], "tuple[RequestView | None, Key | None]"]


class ClientBest:
    def __init__(self, memo_s: float = 1.0):
        self.memo_s = memo_s
        self._memo: dict[str, dict[str, tuple[Key, RequestView, float, int]]] = {}  # client → backend → best
        self._heaps: dict[str, list[tuple[int, int, int, str]]] = {}  # backend → (-match, seq, stamp, client)
        self._dirty: dict[str, set[str]] = {}  # backend → clients to recompute there
        self._stamp = itertools.count()

    def client_changed(self, client: str) -> None:
        self._memo.pop(client, None)
        for dirty in self._dirty.values():
            dirty.add(client)

    def blocks_changed(self, backend: str, clients: Iterable[str] | None, everyone: Iterable[str]) -> None:
        """Blocks changed on ``backend`` under chains these clients' requests start with (None: all of them)."""
        if backend not in self._heaps:
            return
        for client in (everyone if clients is None else clients):
            per_backend = self._memo.get(client)
            if per_backend:
                per_backend.pop(backend, None)
            self._dirty[backend].add(client)

    def _push(self, client: str, backend: str, now: float, compute: Compute) -> None:
        r, key = compute(client, backend)
        if r is None:
            self._memo.get(client, {}).pop(backend, None)
            return
        stamp = next(self._stamp)
        self._memo.setdefault(client, {})[backend] = (key, r, now, stamp)
        heapq.heappush(self._heaps[backend], (-key[0], -key[1], stamp, client))

    def pick(self, backend: str, now: float, waiting: Callable[[], Iterable[str]], credited: Callable[[str], bool],
             compute: Compute, eligible: Callable[[RequestView], bool] | None,
             fallback: Callable[[str], "tuple[RequestView | None, Key | None]"]) -> RequestView | None:
        """The best request on ``backend`` among credited clients (with ``eligible``, the best it accepts: a
        client whose best it refuses is scanned by ``fallback``, and the heap is read on while its top could
        still beat what that found)."""
        heap = self._heaps.get(backend)
        if heap is None:
            heap = self._heaps[backend] = []
            self._dirty[backend] = set(waiting())
        dirty = self._dirty[backend]
        for client in dirty:
            self._push(client, backend, now, compute)
        dirty.clear()
        aside: list[tuple[int, int, int, str]] = []
        best: RequestView | None = None
        best_key: Key | None = None
        try:
            while heap:
                neg_match, neg_seq, stamp, client = heap[0]
                memo = self._memo.get(client, {}).get(backend)
                if memo is None or memo[3] != stamp:
                    heapq.heappop(heap)  # superseded
                    continue
                key, r, at, _ = memo
                if best_key is not None and key <= best_key:
                    break  # nothing below can beat what a fallback found
                if now - at > self.memo_s:
                    heapq.heappop(heap)
                    self._push(client, backend, now, compute)
                    continue
                if not credited(client):
                    aside.append(heapq.heappop(heap))
                    continue
                if eligible is None or eligible(r):
                    return r if best_key is None or key > best_key else best
                aside.append(heapq.heappop(heap))
                r2, key2 = fallback(client)
                if r2 is not None and (best_key is None or key2 > best_key):
                    best, best_key = r2, key2
            return best
        finally:
            for entry in aside:
                heapq.heappush(heap, entry)
            if len(heap) > 4 * len(self._memo) + 64:
                self._compact(backend)

    def _compact(self, backend: str) -> None:
        heap = [(-m[0][0], -m[0][1], m[3], c) for c, per in self._memo.items() if (m := per.get(backend))]
        heapq.heapify(heap)
        self._heaps[backend] = heap
