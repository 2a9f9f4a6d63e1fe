"""Deficit Longest Prefix Match (DLPM, Algorithm 1 of "Locality-aware Fair Scheduling in LLM Serving";
docs/policies/locality.md) and its limit LPM (SGLang's longest prefix match first, Q^u = ∞).

Requests are considered in longest-prefix-match order (the cached tokens of each request on *this* backend,
longest first, arrival order among ties); a request is admitted only while its client's deficit q_i > 0.
Admission charges the client w_e · extend tokens (its uncached input, line 24); every output token charges
w_q (line 27). When no client with a waiting request has a positive deficit, every client of the list l with
q_i ≤ 0 gets the quantum Q^u once (CHECKREFILL, lines 3–8). Invariant A1: −U < q_i ≤ Q^u.

The choices the paper leaves open (docs/policies/locality.md#choices, AMBIG-1..6), settled here:
- one admission pass per scheduling point, re-sorted every time (AMBIG-1): ``peek`` answers "which request
  next for this backend" against the cache as it is now;
- a request that does not fit is skipped and the scan goes on (AMBIG-2, the printed ``continue``):
  ``skips_unfit``, and ``peek(eligible=…)`` names the next request that fits;
- a client leaves l when it has nothing waiting and nothing running on the backend (AMBIG-3); while out of
  l it gets no refill and blocks none, and it rejoins with the q it left with (frozen), not at 0. Banking
  stays bounded (q ≤ Q^u when it left, so property 2's δ grows by one quantum at most), and neither its debt
  (DLPM charges after admission: a client leaves overdrawn by up to U) nor its credit is lost. In a gateway a
  closed-loop client leaves for the milliseconds between a stream's answer and its next question, on every
  backend where it ran nothing just then: a reset to 0 forgave the debt each time (measured live,
  tests/test_locality_live.py: 16 streams got 25-45 % more service than 32); dropping only the credit cost
  the client with fewer streams each time instead. A recorded choice;
- the refill is repeated until some waiting client is positive (AMBIG-4), in closed form, so a small Q^u never
  leaves an empty batch behind a waiting queue (A5, work conservation). A recorded deviation. "Waiting"
  means waiting *for this backend* (``peek(queued=…)``: routed here or not routed, room aside): under D²LPM
  a client whose requests are pinned to other workers is not in this worker's queue, and its credit here
  does not stop a refill, while a client whose request waits here for room does;
- the match is computed when the request is considered, against the cache at that time (AMBIG-5); extend
  tokens are charged at admission whatever chunked prefill does later (AMBIG-6).

Weights: client i's quantum is Q^u · w_i (weighted DRR); a request's charge is not divided.

Deficits are kept per backend (each worker has its own q_i, as each SGLang worker runs its own DLPM): the
simulator gives each engine its own DLPM and uses the backend "" ; the gateway runs one DLPM over the pool
and names the backend with headroom in ``peek(now, eligible, backend)``. ``match(view, backend)`` says how many
prompt tokens that backend caches for the request: the engine's own cache in the simulator, the prefix index
in the gateway.

A decision considers, for each client with credit, its first ``window`` waiting requests (a client's
requests are otherwise served in arrival order). When the match source says what changed (``on_blocks``, the
prefix index's listener), each windowed request's match per backend is kept, and each client's best per
backend in a heap (policies/dlpm_best.py): a request is matched when it enters the window and again only when
blocks added or removed on that backend may have moved its match. A decision is then O(what changed × log),
whatever the depth of the queues (bench/decisions.py), and it is the decision the full scan makes.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

from fairgate.accounting.prefix import Affects
from fairgate.policies.dlpm_best import ClientBest
from fairgate.policies.scheduler import Eligible, Scheduler, Weights, nothing, version_of
from fairgate.policies.views import RequestView

Match = Callable[[RequestView, str], int]


def _no_match(_req: RequestView, _backend: str) -> int:
    return 0


@dataclass(slots=True)
class _Running:
    client: str
    backend: str
    generated: int = 0
    extend: int = 0


class DLPM(Scheduler):
    name = "dlpm"
    skips_unfit = True

    def __init__(self, quantum: float = 4000.0, *, w_e: float = 1.0, w_q: float = 2.0,
                 weights: Weights | None = None, match: Match | None = None, window: int = 32, cost=None):
        super().__init__(cost, weights)
        if quantum <= 0:
            raise ValueError("the quantum Q^u must be positive")
        self.quantum, self.w_e, self.w_q, self.window = float(quantum), w_e, w_q, max(1, int(window))
        self.match: Match = match or _no_match
        self._window: dict[str, dict[str, RequestView]] = {}  # client → its first ``window`` waiting requests
        self._later: dict[str, deque[RequestView]] = {}  # client → its waiting requests past the window
        self._gone: set[str] = set()  # requests given up while past the window (dropped from _later lazily)
        self._count: dict[str, int] = {}  # client → its waiting requests
        self._seq: dict[str, int] = {}
        self._counter = itertools.count()
        self._n = 0
        self._gen = 0  # changes with the queues (and parameters); _bgen[backend] with that backend's deficits
        self._bgen: dict[str, int] = {}
        self._deficit: dict[str, dict[str, float]] = {}  # backend → client → q_i
        self._away: dict[str, dict[str, float]] = {}  # backend → client out of l → the q it left with
        self._running: dict[str, dict[str, int]] = {}  # backend → client → running requests
        self._charged: dict[str, _Running] = {}
        self._service: dict[str, float] = {}  # actual service (w_e·extend + w_q·output), cumulative
        self.refills = 0
        self.on_charge: Callable[[str, float, str], None] | None = None  # (client, amount, backend)
        self.memo = False  # set by on_blocks: the match source reports its changes, so bests can be kept
        self._bests = ClientBest(self._window, self._seq, self)
        self._roots: dict[int, dict[str, int]] = {}  # chain root → client → its waiting requests with that root

    # -- parameters (live: fairgate admin policy set …) ---------------------------------------------
    def set_params(self, quantum: float | None = None, window: int | None = None) -> None:
        self._gen += 1
        self._bgen.clear()  # (a backend's count only grows otherwise: cleared with _gen bumped, no repeat)
        if quantum is not None:
            if quantum <= 0:
                raise ValueError("the quantum Q^u must be positive")
            self.quantum = float(quantum)
            for bq in (*self._deficit.values(), *self._away.values()):  # keep A1 (q ≤ Q^u) under a smaller
                for c, q in bq.items():  # quantum, for the clients away from l too
                    bq[c] = min(q, self.quantum * self.weight(c))
        if window is not None and max(1, int(window)) != self.window:
            self.window = max(1, int(window))
            for client in list(self._window):  # the windows cut again at the new size
                later = self._later.pop(client, deque())
                waiting = list(self._window.pop(client).values())
                waiting += [r for r in later if r.request_id not in self._gone]
                self._gone.difference_update(r.request_id for r in later)
                self._window[client] = {r.request_id: r for r in waiting[:self.window]}
                if waiting[self.window:]:
                    self._later[client] = deque(waiting[self.window:])
            self._bests.reset()

    # -- queue ------------------------------------------------------------------------------------
    def on_blocks(self, backend: str, root: int | None, affects: Affects | None = None) -> None:
        """The match source changed on ``backend`` for chains starting at ``root`` (None: everything);
        ``affects(blocks, match)``, when given, says which requests' matches may have moved."""
        self.memo = True
        self._bgen[backend] = self._bgen.get(backend, 0) + 1
        clients = None if root is None else list(self._roots.get(root, ()))
        self._bests.blocks_changed(backend, clients, root, affects)

    def _rooted(self, req: RequestView, delta: int) -> None:
        n = self._count.get(req.client, 0) + delta
        if n > 0:
            self._count[req.client] = n
        else:
            self._count.pop(req.client, None)
        if not req.blocks:
            return
        clients = self._roots.setdefault(req.blocks[0], {})
        n = clients.get(req.client, 0) + delta
        if n > 0:
            clients[req.client] = n
        else:
            clients.pop(req.client, None)
            if not clients:
                del self._roots[req.blocks[0]]

    def add(self, req: RequestView, now: float) -> bool:
        self._rooted(req, 1)
        self._seq[req.request_id] = next(self._counter)
        self._n += 1
        window = self._window.setdefault(req.client, {})
        if len(window) < self.window:  # a window with room has nothing waiting past it
            window[req.request_id] = req
            self._bests.entered(req)
            self._gen += 1
        else:  # behind a full window: no pick reads it yet (the generation stays)
            self._later.setdefault(req.client, deque()).append(req)
        return True

    def _unqueue(self, req: RequestView) -> None:
        """``req`` stops waiting (dispatched or given up): out of its window, the next one in."""
        window = self._window[req.client]
        if req.request_id in window:
            del window[req.request_id]
            later = self._later.get(req.client)
            while later:
                r = later.popleft()
                if r.request_id in self._gone:
                    self._gone.discard(r.request_id)
                    continue
                window[r.request_id] = r
                self._bests.entered(r)
                break
            if later is not None and not later:
                del self._later[req.client]
            if not window:
                del self._window[req.client]
            self._bests.left(req)
            self._gen += 1
        else:  # (given up behind the window: nothing a pick reads changed)
            self._gone.add(req.request_id)
        del self._seq[req.request_id]
        self._n -= 1
        self._rooted(req, -1)

    def deficits(self, backend: str = "") -> dict[str, float]:
        return self._deficit.setdefault(backend, {})

    def peek(self, now: float, eligible: Eligible | None = None, backend: str = "",
             queued: Eligible | None = None) -> RequestView | None:
        """The request with the longest cached prefix on ``backend`` among those of clients with credit there
        (after CHECKREFILL if none has any); with ``eligible``, the best one it accepts (those that fit).
        ``queued`` says which requests wait for this backend at all (routed here, or not routed), room aside:
        only their clients' credit holds back a refill."""
        bq = self.deficits(backend)
        version = version_of(eligible)
        for _ in range(2):
            best, best_key = None, None
            if self.memo:
                best = self._pick(bq, backend, eligible)
            for client in [] if self.memo else list(self._window):
                if client not in bq:
                    self._join(client, backend)
                if bq[client] <= 0 or eligible is nothing:
                    continue
                r, key = self._bests.scanned(client, backend, eligible, version)
                if r is not None and (best_key is None or key > best_key):
                    best, best_key = r, key
            if best is not None:
                return best
            if not self._refill(bq, queued, backend):  # no credit came: the same pick would find nothing (A5)
                return None
        return None

    def generation(self, backend: str = "") -> tuple[int, int]:
        """Changes whenever ``peek(…, backend)`` could answer differently, the answers of ``eligible`` and
        of the match source aside: the queues, the parameters, or who has credit on that backend (a charge
        that leaves the sign of a deficit as it was changes nothing a pick reads: the pick looks only at who
        has credit, and a refill, which reads how much, happens only once no waiting client has any)."""
        return self._gen, self._bgen.get(backend, 0)

    def _pick(self, bq: dict[str, float], backend: str, eligible: Eligible | None) -> RequestView | None:
        """``peek``'s scan, through the kept bests (the same answer while the match source reports changes)."""
        if eligible is nothing:  # the clients it would meet join l all the same
            self._bests.refresh(backend, self._joined)
            return None
        while True:
            r = self._bests.pick(backend, lambda c: bq.get(c, 0.0) > 0, eligible, self._joined)
            if r is None or self._bests.verify(r, backend):
                return r

    def _joined(self, client: str, backend: str) -> None:
        bq = self.deficits(backend)
        if client not in bq:
            self._join(client, backend, bq)

    def _join(self, client: str, backend: str, bq: dict[str, float] | None = None) -> None:
        """Line 12: the client joins l at 0, or with the q it left with (AMBIG-3, see the module's text)."""
        bq = self.deficits(backend) if bq is None else bq
        bq[client] = q = self._away.get(backend, {}).pop(client, 0.0)
        self._bgen[backend] = self._bgen.get(backend, 0) + 1
        if q > 0:
            self._bests.credited(backend, client)

    def _refill(self, bq: dict[str, float], queued: Eligible | None = None, backend: str = "") -> bool:
        """CHECKREFILL, repeated until a waiting client is positive: k rounds at once (AMBIG-4). The clients
        waiting *here* are those with a request ``queued`` for this worker: a client whose requests are all
        pinned to other backends (D²LPM routes at arrival) is not in this worker's queue, and its credit here
        must not hold back the refill of the clients that are. A client whose request waits here but does not
        fit yet does hold it back (the paper's rule): refilling past it would let small requests take every
        freed slot and starve a large one."""
        waiting = (c for c, window in self._window.items()
                   if queued is None or any(queued(r) for r in window.values()))
        if math.isinf(self.quantum):
            if next(waiting, None) is None or all(q == math.inf for q in bq.values()):
                return False
            for c in bq:
                bq[c] = math.inf
            self._bgen[backend] = self._bgen.get(backend, 0) + 1
            self._bests.credited(backend)
            return True

        def rounds(c: str) -> int:  # refills client c needs to become positive (none if it is: a refund can
            return max(0, int(-bq[c] // (self.quantum * self.weight(c))) + 1)  # leave q above Q^u)

        k = None
        for c in waiting:  # stops at the first waiting client with credit: then there is nothing to refill
            need = rounds(c)
            if need == 0:
                return False
            k = need if k is None else min(k, need)
        if k is None:
            return False
        for c, q in bq.items():
            if q <= 0:
                bq[c] = q + min(k, rounds(c)) * self.quantum * self.weight(c)
        self.refills += k
        self._bgen[backend] = self._bgen.get(backend, 0) + 1
        self._bests.credited(backend)
        return True

    def pop(self, req: RequestView, now: float, backend: str = "") -> None:
        self._unqueue(req)
        extend = max(0, req.prompt_tokens - self.match(req, backend))
        self._charged[req.request_id] = _Running(req.client, backend, 0, extend)
        running = self._running.setdefault(backend, {})
        running[req.client] = running.get(req.client, 0) + 1
        self._charge(req.client, backend, self.w_e * extend)  # line 24: extend tokens only

    def remove(self, req: RequestView, now: float) -> None:
        if req.request_id in self._seq:
            self._unqueue(req)
            self._leave_if_idle(req.client)

    def __len__(self) -> int:
        return self._n

    def waiting_clients(self) -> Iterator[str]:
        return iter(list(self._count))

    def waiting_by_client(self) -> dict[str, int]:
        return dict(self._count)

    def waiting_ahead(self, req: RequestView) -> int:  # (the base's estimate in O(1))
        return min(len(self), self._count.get(req.client, 0) + len(self._count) - (req.client in self._count))

    # -- charging ----------------------------------------------------------------------------------
    def _charge(self, client: str, backend: str, amount: float) -> None:
        if not amount:
            return
        bq = self._deficit.get(backend)
        if bq is None or client not in bq:
            bq = self.deficits(backend)
            self._join(client, backend, bq)
        before = bq[client]
        bq[client] = after = before - amount
        if (before > 0) != (after > 0):  # peek reads only who has credit (a refill, how much: it runs
            self._bgen[backend] = self._bgen.get(backend, 0) + 1  # only once nobody waiting has any)
            if after > 0:  # a refund
                self._bests.credited(backend, client)
        self._service[client] = self._service.get(client, 0.0) + amount
        if self.on_charge is not None:
            self.on_charge(client, amount, backend)

    def on_tokens(self, req: RequestView, generated: int, now: float) -> None:
        st = self._charged.get(req.request_id)
        if st is not None and generated > st.generated:
            self._charge(st.client, st.backend, self.w_q * (generated - st.generated))  # line 27
            st.generated = generated

    def on_finish(self, req: RequestView, generated: int, now: float, prompt_tokens: int | None = None,
                  cached_tokens: int | None = None) -> None:
        """Settles the output; ``cached_tokens`` (the backend's report) corrects the extend charge the index
        predicted; ``prompt_tokens`` = 0 refunds the input (it never ran)."""
        self.on_tokens(req, generated, now)
        st = self._charged.pop(req.request_id, None)
        if st is None:
            return
        if prompt_tokens == 0:
            self._charge(st.client, st.backend, -self.w_e * st.extend)
        elif cached_tokens is not None:
            actual = max(0, (prompt_tokens or req.prompt_tokens) - cached_tokens)
            self._charge(st.client, st.backend, self.w_e * (actual - st.extend))
        running = self._running.get(st.backend, {})
        left = running.get(st.client, 1) - 1
        if left > 0:
            running[st.client] = left
        else:
            running.pop(st.client, None)
        self._leave_if_idle(st.client)

    def _leave_if_idle(self, client: str) -> None:
        """AMBIG-3: a client with nothing waiting and nothing running on a backend leaves that backend's l."""
        if client in self._window:
            return
        for backend, bq in self._deficit.items():
            if not self._running.get(backend, {}).get(client):
                q = bq.pop(client, None)
                if q is not None:
                    self._away.setdefault(backend, {})[client] = q
                    self._bgen[backend] = self._bgen.get(backend, 0) + 1

    def counter(self, client: str) -> float:
        return self._service.get(client, 0.0)


class LPM(DLPM):
    """Longest prefix match first with no fairness: DLPM with an infinite quantum
    (docs/policies/locality.md#baselines)."""

    name = "lpm"

    def __init__(self, *, weights: Weights | None = None, match: Match | None = None, window: int = 32,
                 cost=None, **_ignored):
        super().__init__(math.inf, weights=weights, match=match, window=window, cost=cost)
