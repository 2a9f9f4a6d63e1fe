"""Each client's best candidate per backend, kept so that a DLPM decision costs the same whatever the depth of
the queues: it neither walks every waiting request's chain for every backend nor visits every client
(bench/decisions.py).

A client's *window* is its first ``window`` waiting requests (DLPM considers no others); its *best* on a
backend is the windowed request with the longest match there, the earliest among ties. Kept per (client,
backend):

- each windowed request's match, computed once, when the request enters the window or when the match source
  says that match may have changed (``blocks_changed`` with a predicate from the prefix index: blocks added
  right after where the request's match stops, or removed inside it);
- a heap of those matches, so the best after a pop or a departure is the next valid entry (stale entries are
  dropped lazily), and a new entrant costs one match and one push.

Per backend, a heap of each client's best (invalidated lazily by a stamp) gives the best credited client in
O(log clients) per decision; a client's entry is recomputed when its window or its matches there changed.
Blocks that expire by TTL tell no one, but they only shorten matches: a kept match that overstates rises to
the top, where ``verify`` finds it out before it is chosen. So a decision is O(changed × log), never
O(clients × window), and it is the full scan's decision. Pure: no I/O; time is passed in.

A match source that reports nothing (the simulator's engines) gets the full scan instead (``scanned``), each
client's answer kept while its window and the caller's fit checks (their version) stand.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable

from fairgate.accounting.prefix import Affects
from fairgate.policies.views import RequestView

Key = tuple[int, int]  # (match, -arrival sequence): larger is better


class _Kept:
    """One client's windowed requests on one backend: their matches, a heap of them, and what is yet to match."""

    __slots__ = ("match", "heap", "pending")

    def __init__(self, pending: list[RequestView]):
        self.match: dict[str, int] = {}  # request id → its match there (tokens)
        self.heap: list[tuple[int, int, str]] = []  # (-match, arrival sequence, request id); stale entries lazily
        self.pending = pending  # windowed requests whose match is to be (re)computed


class ClientBest:
    def __init__(self, window: dict[str, dict[str, RequestView]], seq: dict[str, int], policy):
        self._window, self._seq = window, seq  # DLPM's: client → request id → request; request id → arrival
        self._policy = policy  # its ``match(request, backend)``, which the caller may set at any time
        self._kept: dict[str, dict[str, _Kept]] = {}  # client → backend → its kept matches
        self._memo: dict[str, dict[str, tuple[Key, RequestView, int]]] = {}  # client → backend → (best, stamp)
        self._heaps: dict[str, list[tuple[int, int, int, str]]] = {}  # backend → (-match, seq, stamp, client)
        self._dirty: dict[str, set[str]] = {}  # backend → clients to recompute there
        self._parked: dict[str, set[str]] = {}  # backend → clients found without credit there: out of its heap
        self._stamp = itertools.count()
        self._version: dict[str, int] = {}  # client → its window's version (from _stamp: never reused)
        self._found: dict[str, dict[str, tuple]] = {}  # client → backend → (window version, eligible's version,
        # best, key): ``scanned``'s answer while both stand

    # -- what changed ----------------------------------------------------------------------------------
    def _touched(self, client: str) -> None:
        self._version[client] = next(self._stamp)
        for dirty in self._dirty.values():
            dirty.add(client)

    def entered(self, req: RequestView) -> None:
        """``req`` joined its client's window: one match per backend, when next asked."""
        per_backend = self._kept.get(req.client, {})
        window = len(self._window.get(req.client, ()))
        for backend, kept in list(per_backend.items()):
            kept.pending.append(req)
            if len(kept.pending) > window:  # a backend not asked for a while: rebuilt when it is
                del per_backend[backend]
        self._touched(req.client)

    def left(self, req: RequestView) -> None:
        """``req`` left its client's window (dispatched or given up)."""
        if not self._window.get(req.client):  # nothing waiting: nothing to keep, anywhere
            self._kept.pop(req.client, None)
            self._memo.pop(req.client, None)
            self._version.pop(req.client, None)
            self._found.pop(req.client, None)
            for backend, dirty in self._dirty.items():
                dirty.discard(req.client)
                self._parked[backend].discard(req.client)
            return
        for kept in self._kept.get(req.client, {}).values():
            kept.match.pop(req.request_id, None)
        self._touched(req.client)

    def credited(self, backend: str, client: str | None = None) -> None:
        """``client`` (None: every client) may have credit on ``backend`` again: back into its heap."""
        parked = self._parked.get(backend)
        if not parked:
            return
        for c in (list(parked) if client is None else [client] if client in parked else []):
            parked.discard(c)
            memo = self._memo.get(c, {}).get(backend)
            if memo is not None:
                heapq.heappush(self._heaps[backend], (-memo[0][0], -memo[0][1], memo[2], c))

    def reset(self) -> None:
        """Everything is to be recomputed (the window's size changed)."""
        self._kept.clear()
        self._found.clear()
        for dirty in self._dirty.values():
            dirty.update(c for c, w in self._window.items() if w)

    def blocks_changed(self, backend: str, clients: Iterable[str] | None, root: int | None,
                       affects: Affects | None) -> None:
        """Blocks changed on ``backend`` under chains starting at ``root`` (None: anything) of these clients'
        requests (None: every client); ``affects`` narrows it to the requests whose match may have moved."""
        if backend not in self._heaps:
            return
        for client in (self._window if clients is None else clients):
            kept = self._kept.get(client, {}).get(backend)
            if kept is None:
                continue
            window, changed = self._window[client], False
            for rid, m in list(kept.match.items()):
                r = window[rid]
                if (root is None or r.blocks and r.blocks[0] == root) and (affects is None or affects(r.blocks, m)):
                    del kept.match[rid]
                    kept.pending.append(r)
                    changed = True
            if changed:
                self._dirty[backend].add(client)

    # -- the client's best ------------------------------------------------------------------------------
    def _kept_on(self, client: str, backend: str) -> _Kept:
        per_backend = self._kept.setdefault(client, {})
        kept = per_backend.get(backend)
        if kept is None:
            kept = per_backend[backend] = _Kept(list(self._window.get(client, {}).values()))
        return kept

    def best(self, client: str, backend: str) -> tuple[RequestView | None, Key | None]:
        """The client's windowed request with the longest match on ``backend`` (the earliest among ties)."""
        window = self._window.get(client)
        if not window:
            return None, None
        kept = self._kept_on(client, backend)
        if kept.pending:
            seq, match = self._seq, self._policy.match
            for r in kept.pending:
                rid = r.request_id
                if rid in window and rid not in kept.match:
                    m = kept.match[rid] = match(r, backend)
                    heapq.heappush(kept.heap, (-m, seq[rid], rid))
            kept.pending.clear()
        heap, matches = kept.heap, kept.match
        if len(heap) > 2 * len(matches) + 8:  # entries of requests that left below the top
            heap[:] = [(-m, self._seq[rid], rid) for rid, m in matches.items()]
            heapq.heapify(heap)
        while heap:
            neg_match, s, rid = heap[0]
            if matches.get(rid) == -neg_match:
                return window[rid], (-neg_match, -s)
            heapq.heappop(heap)
        return None, None

    def scanned(self, client: str, backend: str, eligible: Callable[[RequestView], bool] | None,
                version: object | None) -> tuple[RequestView | None, Key | None]:
        """The client's best on ``backend`` (among what ``eligible`` accepts) by a scan of its window, for a match
        source that does not report its changes (the simulator's engines); kept while the client's window and
        ``eligible``'s ``version`` (scheduler.version_of) stand, so a caller that versions its fit checks
        rescans only the clients whose window changed."""
        if version is not None:
            found, window_version = self._found.setdefault(client, {}), self._version.get(client)
            kept = found.get(backend)
            if kept is not None and kept[0] == window_version and kept[1] == version:
                return kept[2], kept[3]
        best, best_key = None, None
        seq, match = self._seq, self._policy.match
        for r in self._window.get(client, {}).values():
            key = (match(r, backend), -seq[r.request_id])
            if best_key is not None and key <= best_key:
                continue  # (asked only of those that would win: ``eligible`` may cost a fit check)
            if eligible is None or eligible(r):
                best, best_key = r, key
        if version is not None:
            found[backend] = (window_version, version, best, best_key)
        return best, best_key

    def best_eligible(self, client: str, backend: str,
                      eligible: Callable[[RequestView], bool]) -> tuple[RequestView | None, Key | None]:
        """The client's best on ``backend`` among the windowed requests ``eligible`` accepts."""
        self.best(client, backend)  # every windowed request's match is kept
        kept = self._kept.get(client, {}).get(backend)
        if kept is None:
            return None, None
        best, best_key, window, seq = None, None, self._window[client], self._seq
        for rid, m in kept.match.items():
            key = (m, -seq[rid])
            if (best_key is None or key > best_key) and eligible(r := window[rid]):
                best, best_key = r, key
        return best, best_key

    # -- the best credited client on a backend ----------------------------------------------------------
    def _push(self, client: str, backend: str, joined: Callable[[str, str], None]) -> None:
        r, key = self.best(client, backend)
        if r is None:
            self._forget(client, backend)
            return
        joined(client, backend)
        per_backend = self._memo.setdefault(client, {})
        memo = per_backend.get(backend)
        if memo is not None and memo[1] is r and memo[0] == key:
            return  # the same best: its heap entry stands
        stamp = next(self._stamp)
        per_backend[backend] = (key, r, stamp)
        if client not in self._parked[backend]:
            heapq.heappush(self._heaps[backend], (-key[0], -key[1], stamp, client))

    def refresh(self, backend: str, joined: Callable[[str, str], None]) -> list:
        """Recompute the bests of the clients whose window or matches on ``backend`` changed; its heap."""
        heap = self._heaps.get(backend)
        if heap is None:
            heap = self._heaps[backend] = []
            self._dirty[backend] = {c for c, w in self._window.items() if w}
            self._parked[backend] = set()
        dirty = self._dirty[backend]
        for client in dirty:
            self._push(client, backend, joined)
        dirty.clear()
        return heap

    def pick(self, backend: str, credited: Callable[[str], bool],
             eligible: Callable[[RequestView], bool] | None, joined: Callable[[str, str], None]) -> RequestView | None:
        """The best request on ``backend`` among credited clients (with ``eligible``, the best it accepts: a
        client whose best it refuses is looked at whole, and the heap is read on while its top could still
        beat what that found). ``joined(client, backend)``: a client found with a request there."""
        heap = self.refresh(backend, joined)
        aside: list[tuple[int, int, int, str]] = []
        best: RequestView | None = None
        best_key: Key | None = None
        try:
            while heap:
                neg_match, neg_seq, stamp, client = heap[0]
                memo = self._memo.get(client, {}).get(backend)
                if memo is None or memo[2] != stamp:
                    heapq.heappop(heap)  # superseded
                    continue
                key, r, _ = memo
                if best_key is not None and key <= best_key:
                    break  # nothing below can beat what was found
                if not credited(client):  # parked until ``credited`` says otherwise
                    heapq.heappop(heap)
                    self._parked[backend].add(client)
                    continue
                if eligible is None or eligible(r):
                    return r if best_key is None or key > best_key else best
                aside.append(heapq.heappop(heap))
                r2, key2 = self.best_eligible(client, backend, eligible)
                if r2 is not None and (best_key is None or key2 > best_key):
                    best, best_key = r2, key2
            return best
        finally:
            for entry in aside:
                heapq.heappush(heap, entry)
            if len(heap) > 4 * len(self._memo) + 64:
                self._compact(backend)

    def verify(self, req: RequestView, backend: str) -> bool:
        """Is the kept match of ``req`` (a pick) still its match? Blocks that expire by TTL tell no one, and only
        shorten matches: a kept match that overstates its request rises to the top, is found out here, and its
        client is matched afresh on that backend (so the pick is the full scan's, TTL or not)."""
        kept = self._kept.get(req.client, {}).get(backend)
        if kept is not None and kept.match.get(req.request_id) == self._policy.match(req, backend):
            return True
        self._kept.get(req.client, {}).pop(backend, None)
        self._forget(req.client, backend)
        self._dirty[backend].add(req.client)
        return False

    def _forget(self, client: str, backend: str) -> None:
        per_backend = self._memo.get(client)
        if per_backend is not None:
            per_backend.pop(backend, None)
            if not per_backend:
                del self._memo[client]

    def _compact(self, backend: str) -> None:
        parked = self._parked[backend]
        heap = [(-m[0][0], -m[0][1], m[2], c) for c, per in self._memo.items()
                if (m := per.get(backend)) and c not in parked]
        heapq.heapify(heap)
        self._heaps[backend] = heap
