"""VTC, the Virtual Token Counter (the VTC paper, Algorithm 2, §4; docs/policies/vtc.md): the scheduler every
VTC variant (policies/vtc_variants.py) and the two-level policy (policies/two_level.py) build on. The contract it
keeps is ``Scheduler``'s (policies/scheduler.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from fairgate.accounting.cost import CostFunction
from fairgate.policies.backlog import Backlog
from fairgate.policies.counters import CounterStore, MemoryCounters
from fairgate.policies.scheduler import Eligible, Scheduler, Weights
from fairgate.policies.views import RequestView


@dataclass(slots=True)
class _Charged:
    """What a running request has been charged so far (n_p, and the n_q its charge covers)."""

    client: str
    n_p: int
    n_q_charged: float  # output tokens already paid for (the prediction, for VTC(predict))
    generated: int = 0


class VTC(Scheduler):
    """Virtual Token Counter, Algorithm 2 of the VTC paper (§4.1; docs/policies/vtc.md), with a custom cost h
    (§4.2, Alg. 4) and weights (§4.3): every charge to client i is divided by w_i.

    - counter lift: a client (re)joining the waiting queue Q gets c ← max(c, min_{i∈Q} c_i); if Q is empty,
      c ← max(c, c[last_left]) so an idle period does not reset a deficit;
    - the client with the smallest counter goes next (ties: the one served less before it joined, then the one
      that joined first: ``policies/backlog.py``), its earliest request;
    - input is charged when the request is admitted, h(n_p, 0); each output token as it is generated,
      h(n_p, n_q) − h(n_p, n_q − 1).

    The choice is the least-served backlog (``policies/backlog.py``, shared with WSC and the two-level
    policy): a decision costs O(log n), not a scan of every client.
    """

    name = "vtc"
    keeps_counters = True
    lift = True
    # The VTC artifact does not charge a prefill's token (docs/policies/vtc.md#artifact-charging); the paper
    # does. False reproduces the artifact (``fairgate simulate --artifact-quirks``).
    charge_prefill_token = True

    def __init__(self, cost: CostFunction | None = None, weights: Weights | None = None,
                 counters: CounterStore | None = None):
        super().__init__(cost, weights)
        self._backlog = Backlog(counters or MemoryCounters())
        self._queues: dict[str, deque[RequestView]] = {}
        self._n = 0
        self._gone: set[str] = set()
        self._charged: dict[str, _Charged] = {}
        self.on_charge: Callable[[str, float], None] | None = None  # (client, amount): two-level fairness

    @property
    def counters(self) -> CounterStore:
        return self._backlog.counters

    @counters.setter
    def counters(self, store: CounterStore) -> None:  # a live policy switch hands the family's store over
        self._backlog.counters = store

    # -- queue ---------------------------------------------------------------------------------------
    def min_waiting_counter(self) -> float | None:
        return self._backlog.min_counter()

    def touched(self, req: RequestView) -> None:
        self._backlog.charged(req.client)

    def waiting_ahead(self, req: RequestView) -> int:
        """A client already waiting: its own requests, and each other waiting client about once (the base's
        estimate, in O(1)). A client joining: the waiting clients the backlog puts before it once lifted,
        counted from the top of its heap (O(answer · log n)); past 256 of them, the estimate again."""
        own = len(self._queues.get(req.client, ()))
        estimate = min(len(self), own + len(self._backlog) - (req.client in self._backlog))
        if own or req.client in self._backlog:
            return estimate
        ahead = self._backlog.ahead_of(req.client, lift=self.lift)
        return estimate if ahead is None else ahead

    def add(self, req: RequestView, now: float) -> bool:
        q = self._queues.setdefault(req.client, deque())
        q.append(req)
        if len(q) == 1:  # the client (re)joins the backlog: the counter lift (unless LCF)
            self._backlog.join(req.client, lift=self.lift)
        self._n += 1
        return True

    def peek(self, now: float, eligible: Eligible | None = None, backend: str = "",
             queued: Eligible | None = None) -> RequestView | None:
        """The least-served client's earliest request; with ``eligible``, the least-served client whose earliest
        request it accepts (clients passed over are put back in the heap as they were)."""
        for client in self._backlog.ascending():
            q = self._queues[client]
            while q and q[0].request_id in self._gone:
                self._gone.discard(q.popleft().request_id)
                self._n -= 1
            if not q:
                self._backlog.leave(client)
                continue
            if eligible is None or eligible(q[0]):
                return q[0]
            # its earliest request the gate accepts (one model's wait never holds another's back)
            later = next((r for r in q if r.request_id not in self._gone and eligible(r)), None)
            if later is not None:
                return later
        return None

    def pop(self, req: RequestView, now: float, backend: str = "") -> None:
        q = self._queues[req.client]
        if q and q[0] is req:
            q.popleft()
        else:  # peek passed over earlier requests of this client that the gate could not place yet
            q.remove(req)
        self._n -= 1
        self._admit_charge(req)
        if not q:
            self._backlog.leave(req.client)

    def remove(self, req: RequestView, now: float) -> None:
        self._gone.add(req.request_id)

    def __len__(self) -> int:
        return self._n - len(self._gone)

    def waiting_clients(self) -> Iterator[str]:
        return (c for c, q in self._queues.items() if q)

    def waiting_by_client(self) -> dict[str, int]:
        return {c: len(q) for c, q in self._queues.items() if q}

    # -- charging ------------------------------------------------------------------------------------
    def _charge(self, client: str, amount: float) -> None:
        """``amount`` to the client's counter, divided by its weight (§4.3). A counter that rose keeps its place
        in the backlog until it reaches the top (``Backlog.charged``): only a fall is reported."""
        if amount:
            self._backlog.counters.add(client, amount / self.weight(client))
            if amount < 0:
                self._backlog.charged(client)
            if self.on_charge is not None:
                self.on_charge(client, amount)

    def charge_clients(self, amounts: dict[str, float]) -> None:
        """Each client's amount to its counter (``_charge``)."""
        for client, amount in amounts.items():
            self._charge(client, amount)

    def _admit_charge(self, req: RequestView) -> None:
        self._charged[req.request_id] = _Charged(req.client, req.prompt_tokens, 0)
        self._charge(req.client, self.cost.h(req.prompt_tokens, 0))

    def on_tokens(self, req: RequestView, generated: int, now: float) -> None:
        """One request's tokens so far (a streamed read): ``on_step`` for one request, without its sums per client."""
        st = self._charged.get(req.request_id)
        if st is not None and (due := self._due(st, generated)):
            self._charge(req.client, due)

    def on_step(self, emitted: Iterable[tuple[RequestView, int]], now: float) -> None:
        """One engine step's tokens: what each request's output so far adds to its client's charge, summed per
        client first (a step of b requests from k clients updates k counters, not b)."""
        state_of, due_of = self._charged.get, self._due
        per_client: dict[str, float] = {}
        for req, generated in emitted:
            st = state_of(req.request_id)
            if st is not None and (due := due_of(st, generated)):
                per_client[req.client] = per_client.get(req.client, 0.0) + due
        self.charge_clients(per_client)

    def _due(self, st: _Charged, generated: int) -> float:
        """What a request's output so far adds to its charge, h(n_p, n_q) − h(n_p, charged), its state moved on
        (0: nothing new, or tokens charged up front: VTC(predict))."""
        if generated <= st.generated:
            return 0.0
        if st.generated == 0 and not self.charge_prefill_token:
            st.n_q_charged = max(st.n_q_charged, 1)  # the first token rides free (artifact)
        st.generated = generated
        paid = st.n_q_charged
        if generated <= paid:
            return 0.0
        st.n_q_charged = generated
        per_token = self.cost.per_output_token  # (a linear h: delta inlined)
        return per_token * (generated - paid) if per_token is not None else self.cost.delta(st.n_p, paid, generated)

    def run_charges(self, emitted: list[tuple[RequestView, int]], steps: int) -> dict[str, float] | None:
        """The same amounts at every step where each output token costs the same (a linear h) and every request
        of the batch was charged for its tokens so far, none paid up front: the sum per client of
        ``cost.delta`` for one token, as ``on_step`` makes it."""
        if self.cost.per_output_token is None:
            return None
        charged, delta, held = self._charged, self.cost.delta, []
        for req, generated in emitted:
            st = charged.get(req.request_id)
            if st is not None:
                if st.generated != generated or st.n_q_charged != generated:
                    return None
                held.append(st)
        per_client: dict[str, float] = {}
        for st in held:
            due = delta(st.n_p, st.generated, st.generated + 1)
            st.generated = st.n_q_charged = st.generated + steps
            if due:
                per_client[st.client] = per_client.get(st.client, 0.0) + due
        return per_client

    def on_finish(self, req: RequestView, generated: int, now: float, prompt_tokens: int | None = None,
                  cached_tokens: int | None = None) -> None:
        self.on_tokens(req, generated, now)
        st = self._charged.pop(req.request_id, None)
        if st is not None:
            self._reconcile_prompt(st, prompt_tokens)

    def charge_again(self, req: RequestView) -> None:
        """The artifact's second `update_counter` on a step where some request finished: every request of
        that step pays for its last token twice (docs/policies/vtc.md#artifact-charging; simulator only)."""
        st = self._charged.get(req.request_id)
        if st is not None and st.generated:
            self._charge(st.client, self.cost.delta(st.n_p, st.generated - 1, st.generated))

    def _reconcile_prompt(self, st: _Charged, prompt_tokens: int | None) -> None:
        if prompt_tokens is not None and prompt_tokens != st.n_p:
            q = st.n_q_charged
            self._charge(st.client, self.cost.h(prompt_tokens, q) - self.cost.h(st.n_p, q)
                         if prompt_tokens else -self.cost.h(st.n_p, q))
            st.n_p = prompt_tokens

    def counter(self, client: str) -> float:
        return self.counters.get(client)
