"""Aladdin's placement (Algorithm 1 of "Aladdin: Joint Placement and Scaling for SLO-Aware LLM Serving";
docs/policies/aladdin.md): best fit — the fullest backend on which the request still meets its targets.

For each backend the placement keeps a ledger of what it sent there and has not finished: each request's
input l_in, its predicted output l_pred (the conditional average for its app, stage and prompt length, learnt
from the outputs of finished requests, accounting/length.py; ``max_tokens`` or ``default_output`` until enough
are seen) and when it was sent. A backend is *feasible* for a request j when, with j added to its set S:

- (b) the ATGT context budget (§3.2, Eq. 4): Σ_{s∈S} (l_in + γ·len_s) ≤ θ · (T_dec − c3 − c2·b) / k2, b = |S|
  (for b = 1: the unbatched step k2·ctx + c2 + c3 ≤ T_dec), len_s the predicted total output;
- (e) the future-KV fit: in every future decode iteration k, Σ_{s still running at k} kv(l_in + gen_s + k) ≤ M,
  checked at each request's predicted last iteration (the sum only rises between completions), with
  kv(t) = h·t + j (Eq. 1; h = 1 token, j = 0) and gen_s estimated from the time since it was sent and the
  decode step the model predicts (AMBIG-1 and -6 of the note: l_out is the tokens so far, len_s the total).

- (c) the prefills waiting there, j's included, take at most T_pre: k1·P + c1 ≤ T_pre;
- (d) they fit in the slack every stream decoding there has against its ATGT: k1·P + c1 ≤ θ · min (T_dec·l_out
  − t_dec), since a prefill stalls the decodes (vLLM's default: a batch prefills or decodes).

Algorithm 2's rebalancing is not done yet. Among feasible backends,
the one with the largest capacity_norm = √((b / b_max)² + (ctx / l_d(b))²) (the note's normalised variant,
b_max = ``max_batch``) takes j; none feasible: the request waits in the gateway (``choose`` returns None),
unless it could not meet its targets even alone on an idle backend (then it goes to the least loaded one: waiting
would only block the queue behind it).
Pure: time is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from fairgate.accounting.length import OutputLengths
from fairgate.policies.placement import Placement
from fairgate.policies.views import BackendView, RequestView


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """A backend's decode step t_d = k2·L_tot + c2·b + c3 (Eq. 3) and prefill t_p = k1·Σl_in + c1 (Eq. 2)."""

    k1: float
    c1: float
    k2: float
    c2: float
    c3: float

    def step(self, batch: int, context: float) -> float:
        return self.k2 * context + self.c2 * batch + self.c3

    def context_budget(self, batch: int, atgt_s: float) -> float:
        """l_d(b): the total context a batch of b may hold with each step within ``atgt_s`` (Eq. 4)."""
        return (atgt_s - self.c3 - self.c2 * batch) / self.k2 if self.k2 > 0 else math.inf


@dataclass(slots=True)
class _Sent:
    l_in: int
    l_pred: int
    at: float


class Aladdin(Placement):
    name = "aladdin"

    def __init__(self, model: LatencyModel, atgt_s: float | None = None, ttft_s: float | None = None, *,
                 gamma: float = 0.5, theta: float = 0.9, max_batch: int = 256, default_output: int = 256,
                 lengths: OutputLengths | None = None, read_max_tokens: bool = True):
        self.model, self.atgt_s, self.ttft_s, self.gamma, self.theta = model, atgt_s, ttft_s, gamma, theta
        self.max_batch, self.default_output = max_batch, default_output
        self.lengths = lengths if lengths is not None else OutputLengths()
        self.read_max_tokens = read_max_tokens  # a client's cap bounds a prediction (not in the simulator,
        # whose requests carry their true output there)
        self._sent: dict[str, dict[str, _Sent]] = {}  # backend → request id → what was sent there

    def predicted(self, request: RequestView) -> int:
        mean = self.lengths.mean(request.app, request.stage, request.prompt_tokens)
        cap = request.max_tokens if self.read_max_tokens and request.max_tokens else None
        if mean is None:
            return cap or self.default_output
        return max(1, round(mean) if cap is None else min(cap, round(mean)))

    def _running(self, backend: str, now: float) -> tuple[list[tuple[int, int, int]], int, float]:
        """What runs on ``backend``: (l_in, tokens generated so far, predicted total) of each, the input tokens
        still to prefill, and the least slack of those decoding against their ATGT (T_dec·l_out − t_dec, §3.2
        (d)). Progress is estimated: each prefill right after it was sent, then one token per predicted step."""
        sent = self._sent.get(backend, {})
        if not sent:
            return [], 0, math.inf
        m = self.model
        step = max(m.step(len(sent), sum(s.l_in for s in sent.values())), 1e-6)
        out, pending, slack = [], 0, math.inf
        for s in sent.values():
            decoding = now - s.at - (m.k1 * s.l_in + m.c1)
            if decoding <= 0:
                pending += s.l_in
                out.append((s.l_in, 0, s.l_pred))
                continue
            gen = min(s.l_pred - 1, int(decoding / step))
            out.append((s.l_in, gen, s.l_pred))
            if self.atgt_s is not None:
                slack = min(slack, self.atgt_s * max(gen, 1) - decoding)
        return out, pending, slack

    def _fits(self, batch: list[tuple[int, int, int]], capacity: int | None, prefill: int = 0,
              slack: float = math.inf) -> tuple[bool, float]:
        """Whether ``batch`` meets (b)-(e) on a backend of KV ``capacity`` (``prefill``: input tokens to prefill
        there, the new request's included; ``slack``: the least of its decoding requests'), and its norm."""
        t_prefill = self.model.k1 * prefill + self.model.c1
        if self.ttft_s is not None and t_prefill > self.ttft_s:  # (c)
            return False, 0.0
        if t_prefill > self.theta * slack:  # (d): the new prefills stall every stream decoding there
            return False, 0.0
        b = len(batch)
        ctx = sum(l_in + self.gamma * total for l_in, _, total in batch)
        budget = math.inf
        if self.atgt_s is not None:
            if b == 1:
                if self.model.step(1, ctx) > self.atgt_s:
                    return False, 0.0
            else:
                budget = self.theta * self.model.context_budget(b, self.atgt_s)
                if ctx > budget:
                    return False, 0.0
        if capacity is not None and not _future_kv_fits(batch, capacity):
            return False, 0.0
        fill = ctx / budget if budget not in (0, math.inf) else 0.0
        return True, math.hypot(b / self.max_batch, fill)

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        new = (request.prompt_tokens, 0, self.predicted(request))
        best, best_norm = None, -1.0
        for view in backends:
            running, pending, slack = self._running(view.name, now)
            ok, norm = self._fits([*running, new], view.kv_capacity, pending + request.prompt_tokens, slack)
            if ok and (norm > best_norm or norm == best_norm and best is not None and view.name < best.name):
                best, best_norm = view, norm
        if best is None and backends and not self._fits([new], None, request.prompt_tokens)[0]:
            # it could not meet its targets even alone on an idle backend: waiting would only hold the queue
            # back behind it (it is served late, on the least loaded backend; a sheddable one is for the gate)
            best = min(backends, key=lambda v: (v.inflight, v.name))
        if best is not None:
            self._sent.setdefault(best.name, {})[request.request_id] = _Sent(request.prompt_tokens, new[2], now)
        return best

    def on_finish(self, request: RequestView, backend: str, generated: int) -> None:
        self._sent.get(backend, {}).pop(request.request_id, None)
        self.lengths.observe(request.app, request.stage, request.prompt_tokens, generated)

    def refund(self, request: RequestView, backend: str) -> None:
        self._sent.get(backend, {}).pop(request.request_id, None)


def _future_kv_fits(batch: list[tuple[int, int, int]], capacity: int) -> bool:
    """(e): Σ over the requests still running at iteration k of kv(l_in + gen + k) ≤ capacity for every k ≥ 0,
    checked where it peaks: at each request's last iteration, in one sweep. O(b log b). A request with l_in, gen
    tokens so far and a predicted total output runs iterations k = 0 … total − gen, holding kv(l_in + gen + k) in
    each: w_j = [kv(l_in), …, kv(l_in + l_pred)] for a new one (the note's vector)."""
    ends = sorted(((total - gen, l_in + gen) for l_in, gen, total in batch), reverse=True)
    # at iteration k the running set is those with end ≥ k: walking ends from the last, keep Σ start and count
    start_sum, count = 0, 0
    for end, start in ends:
        start_sum += start
        count += 1
        if start_sum + count * end > capacity:  # the set still running at iteration ``end``, at that iteration
            return False
    return True
