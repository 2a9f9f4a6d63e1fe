"""Aladdin's placement (Algorithm 1 of "Aladdin: Joint Placement and Scaling for SLO-Aware LLM Serving";
docs/policies/aladdin.md): best fit — the fullest backend on which the request still meets its targets.

For each backend the placement keeps a ledger of what it sent there and has not finished: each request's
input l_in, its predicted output l_pred (the conditional average for its app, stage and prompt length, learnt
from the outputs of finished requests, accounting/length.py; ``max_tokens`` or ``default_output`` until enough
are seen), its ATGT target and when it was sent. A backend is *feasible* for a request j when, with j added to
its set S:

- (b) the ATGT context budget (§3.2, Eq. 4): Σ_{s∈S} (l_in + γ·len_s) ≤ θ · (T_dec − c3 − c2·b) / k2, b = |S|
  (for b = 1: the unbatched step k2·ctx + c2 + c3 ≤ T_dec), len_s the predicted total output, T_dec the
  tightest ATGT target in S (every step of the batch must meet each of them);
- (c) the prefills waiting there, j's included, take at most j's TTFT target: k1·P + c1 ≤ T_pre (a prompt's
  cached prefix, as the prefix index predicts it, is not prefilled), plus, on a backend that holds requests,
  one decode step before j's prefill starts (and a c1 of its own behind prefills ahead): settled here, the
  paper's (c) counts prefills only, and a prompt just under the target then only meets it on an idle backend;
- (d) they fit in the slack every stream decoding there has against its ATGT: k1·P + c1 ≤ θ · min (T_dec·l_out
  − t_dec), since a prefill stalls the decodes (vLLM's default: a batch prefills or decodes);
- (e) the future-KV fit: in every future decode iteration k, Σ_{s still running at k} kv(l_in + gen_s + k) ≤ M,
  checked at each request's predicted last iteration (the sum only rises between completions), with
  kv(t) = h·t + j (Eq. 1; h = 1 token, j = 0) and gen_s estimated from the time since it was sent and the
  decode step the model predicts (AMBIG-1 and -6 of the note: l_out is the tokens so far, len_s the total).

Among feasible backends, the paper takes the one with the largest capacity_norm = √((b / b_max)² + (ctx /
l_d(b))²) (the note's normalised variant, b_max = ``max_batch``): best fit, so that the fewest workers stay busy
and the rest can be released. A gateway in front of a fixed pool releases none, so by default j takes the
feasible backend with the *smallest* norm (worst fit): the same constraints, and the slack left on every backend
absorbs the length predictions' errors, which matters most when the pool is overloaded. ``pack=1`` restores the
paper's best fit, which keeps backends idle for the prompts only an idle one serves in time: with ``theta=0.5``
it meets 99 % of Table 2's targets on the Azure conversations with 0.30-0.43× least-load's workers, worst fit
with 0.85-0.91× (docs/policies/aladdin.md). None feasible: the request waits in the gateway (``choose``
returns None), unless it could not meet its targets even alone on an idle backend (then it goes to the least
loaded one: waiting would only block the queue behind it). Each backend has its own latency model
(``models(name)``: the live fits, or a profile per backend in the simulator), so backends of different speeds
each take what they can serve in time.

Cost (bench/aladdin.py). The paper runs Algorithm 1 once per scheduling heartbeat over a frozen view of the
workers; so does this: each backend's progress estimate (what is still prefilling, the least decode slack, and
the future-KV profile sorted by predicted end) is taken once per ``heartbeat_s`` and kept up to date in place as
requests are sent and finish. Within a heartbeat a decision is O(B log n) over B backends with n requests each (a
binary search in each profile), plus O(n) array work on the chosen backend's profile; the sums of (b) are kept
as requests come and go. The first decision of a heartbeat retakes every backend's view, O(N log n) over the N
requests in flight: decisions further apart than a heartbeat each pay that (bench/aladdin.py --spacing-ms).
A request refused everywhere keeps its refusal for the rest of the heartbeat (``waits``, O(B)).
Algorithm 2 (rebalancing by prediction error) is kept in the only form a gateway that dispatches each
request at once can use: a request that outlives its predicted length is re-predicted in the next view
(its underestimate counted in (b) and (e)), one that finishes early leaves the ledger at once; there are no
placed-but-not-started requests to move. Pure: time is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from fairgate.accounting.length import OutputLengths
from fairgate.policies.kv_profile import KVProfile
from fairgate.policies.placement import Placement
from fairgate.policies.views import BackendView, RequestView

Match = Callable[[RequestView, str], int]


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
        """l_d(b): the total context a batch of b may hold with each step within ``atgt_s`` (Eq. 4); with a
        fitted k2 ≤ 0, any context if the rest of the step is within it, else none."""
        left = atgt_s - self.c3 - self.c2 * batch
        if self.k2 > 0:
            return left / self.k2
        return math.inf if left >= 0 else -math.inf


@dataclass(slots=True)
class _Sent:
    l_in: int  # prompt tokens it holds in KV
    prefill: int  # of them, those it computes (its predicted cached prefix excluded)
    l_pred: int  # its predicted total output (re-predicted when it outlives it)
    at: float
    atgt_s: float | None
    app: str = ""
    stage: int = 0
    cap: int | None = None  # its max_tokens, where the placement reads it (no re-prediction goes past it)


@dataclass(slots=True)
class _Ledger:
    """What the placement sent to one backend and has not seen finish, with the sums of constraint (b)."""

    sent: dict[str, _Sent] = field(default_factory=dict)
    sum_in: int = 0
    sum_pred: int = 0
    atgts: dict[float, int] = field(default_factory=dict)  # ATGT target → requests holding it
    # the heartbeat's view: when taken, the prefill tokens not yet computed, the least decode slack, each
    # request's (end, start) in the profile
    at: float = -math.inf
    pending: int = 0
    slack: float = math.inf
    profile: KVProfile | None = None
    shape: dict[str, tuple[int, int]] = field(default_factory=dict)
    prefilling: set[str] = field(default_factory=set)  # the requests ``pending`` counts

    def tightest(self) -> float | None:
        return min(self.atgts) if self.atgts else None


class Aladdin(Placement):
    name = "aladdin"
    keeps_refusals = True  # (``waits``; tests/test_sim_exact.py compares with False)

    def __init__(self, model: LatencyModel | Callable[[str], LatencyModel], atgt_s: float | None = None,
                 ttft_s: float | None = None, *, gamma: float = 0.5, theta: float = 0.9, max_batch: int = 256,
                 default_output: int = 256, lengths: OutputLengths | None = None, read_max_tokens: bool = True,
                 match: Match | None = None, heartbeat_s: float = 0.01, pack: float = 0.0,
                 progress: Callable[[str], int | None] | None = None):
        self.models = (lambda _name: model) if isinstance(model, LatencyModel) else model
        self.atgt_s, self.ttft_s, self.gamma, self.theta = atgt_s, ttft_s, gamma, theta  # defaults: a request's
        # own targets (its SLO class) come first
        self.max_batch, self.default_output = max_batch, default_output
        self.lengths = lengths if lengths is not None else OutputLengths()
        self._learns = lengths is None  # lengths given are fed by their owner (the gateway, at each call's end)
        self.read_max_tokens = read_max_tokens  # a client's cap bounds a prediction (not in the simulator,
        # whose requests carry their true output there)
        self.match = match
        self.heartbeat_s = heartbeat_s
        self.pack = bool(pack)  # the paper's best fit (else the least full feasible backend)
        self.progress = progress  # request → output tokens streamed so far (live); None: estimated from time
        self._ledgers: dict[str, _Ledger] = {}
        self._where: dict[str, str] = {}  # request → the backend whose ledger holds it
        self._version = 0  # the ledgers' and parameters' changes
        # the last refusal: (request, version, lengths' version, until, backends that refused it and would
        # take it alone) — it stands on those backends until then (``waits``)
        self._refusal: tuple | None = None

    def set_params(self, **params: float) -> None:
        self._version += 1
        if "pack" in params:
            self.pack = bool(params["pack"])
        for key in ("gamma", "theta"):
            if key in params:
                value = float(params[key])
                if not 0 <= value <= (1 if key == "gamma" else 10):
                    raise ValueError(f"aladdin's {key} is out of range: {value}")
                setattr(self, key, value)

    def ledger(self, backend: str) -> int:
        """Requests this placement has on ``backend`` and has not seen finish."""
        led = self._ledgers.get(backend)
        return len(led.sent) if led else 0

    def _cap(self, request: RequestView) -> int | None:
        return request.max_tokens if self.read_max_tokens and request.max_tokens else None

    def predicted(self, request: RequestView) -> int:
        return self.lengths.predict(request.app, request.stage, request.prompt_tokens, self._cap(request),
                                    self.default_output)

    def _targets(self, request: RequestView) -> tuple[float | None, float | None]:
        return (request.ttft_s if request.ttft_s is not None else self.ttft_s,
                request.atgt_s if request.atgt_s is not None else self.atgt_s)

    def _view(self, led: _Ledger, m: LatencyModel, capacity: int | None, now: float) -> None:
        """Take the heartbeat's view of ``led`` (if the last is older than a heartbeat or of another capacity):
        each prefill right after its request was sent, then one token per predicted step."""
        if led.profile is not None and now - led.at < self.heartbeat_s and led.profile.capacity == capacity:
            return
        step = max(m.step(len(led.sent), led.sum_in), 1e-6)
        pending, slack, shape, prefilling = 0, math.inf, {}, set()
        k1, c1, progress = m.k1, m.c1, self.progress
        for rid, s in led.sent.items():
            decoding = now - s.at - (k1 * s.prefill + c1)
            if decoding <= 0:
                pending += s.prefill
                prefilling.add(rid)
                gen = 0
            else:
                ran = int(decoding / step)  # tokens it has had time for
                got = progress(rid) if progress is not None else None
                done = got if got is not None else ran  # those it produced (live: streamed), else that estimate
                if done >= s.l_pred and (s.cap is None or s.l_pred < s.cap):  # it outlived its prediction
                    self._repredict(led, s, done)
                gen = min(s.l_pred - 1, done)  # (one more to come at least, whatever the prediction said)
                if s.atgt_s is not None:  # (from the time it had: a client reading slowly holds its stream
                    slack = min(slack, s.atgt_s * max(ran, 1) - decoding)  # back, and must not close the backend)
            shape[rid] = (s.l_pred - gen, s.l_in + gen)
        led.at, led.pending, led.slack, led.shape, led.prefilling = now, pending, slack, shape, prefilling
        led.profile = KVProfile(list(shape.values()), capacity)

    def _repredict(self, led: _Ledger, s: _Sent, ran: int) -> None:
        """Algorithm 2's underestimate (§4.3; the note's §1.6): a request still running past its predicted
        length l_pred is predicted anew, E[L | L > l, l_in], with l the tokens it produced (live: streamed; in
        the simulator: had time for), and the
        backend's constraints (b) and (e) count the extra from then on (an overestimate needs no correction
        here: the ledger drops a request as soon as it finishes). Without history that long, as much again."""
        self._version += 1
        mean = self.lengths.mean_beyond(s.app, s.stage, s.l_in, ran)
        new = max(ran + 1, round(mean) if mean is not None else ran + s.l_pred)
        if s.cap is not None:
            new = max(s.l_pred, min(new, s.cap))
        led.sum_pred += new - s.l_pred
        s.l_pred = new

    def _fits(self, led: _Ledger | None, m: LatencyModel, capacity: int | None, l_in: int, prefill: int,
              l_pred: int, ttft: float | None, atgt: float | None) -> tuple[bool, float]:
        """Whether a request (``l_in`` prompt tokens, ``prefill`` of them computed, ``l_pred`` predicted output)
        meets (b)-(e) beside what ``led`` holds (None: an idle backend), and the backend's norm with it."""
        pending, slack = (led.pending, led.slack) if led is not None else (0, math.inf)
        t_prefill = m.k1 * (pending + prefill) + m.c1
        if ttft is not None and t_prefill + (self._in_step(led, m) if led is not None else 0.0) > ttft:  # (c)
            return False, 0.0
        if t_prefill > self.theta * slack:  # (d): the new prefills stall every stream decoding there
            return False, 0.0
        b = 1 + (len(led.sent) if led is not None else 0)
        ctx = l_in + self.gamma * l_pred + (led.sum_in + self.gamma * led.sum_pred if led is not None else 0)
        held = led.tightest() if led is not None else None
        t_dec = atgt if held is None else held if atgt is None else min(atgt, held)
        budget = math.inf
        if t_dec is not None:
            if b == 1:
                if m.step(1, ctx) > t_dec:
                    return False, 0.0
            else:
                budget = self.theta * m.context_budget(b, t_dec)
                if ctx > budget:
                    return False, 0.0
        if led is not None and led.profile is not None and not led.profile.fits(l_pred, l_in):  # (e)
            return False, 0.0
        if led is None and capacity is not None and l_in + l_pred > capacity:
            return False, 0.0
        fill = ctx / budget if budget not in (0, math.inf) else 0.0
        return True, math.hypot(b / self.max_batch, fill)

    @staticmethod
    def _in_step(led: _Ledger, m: LatencyModel) -> float:
        """(c)'s wait, beyond the prefills ahead, before a new prefill can start on a backend that holds
        requests: one decode step (the step in progress where streams decode; after the prefills ahead, the
        decode step an engine runs before it admits again), and the fixed cost of a prefill of its own."""
        return m.step(len(led.sent), led.sum_in) + (m.c1 if led.pending else 0.0)

    def waits(self, request: RequestView, backends: Sequence[str], now: float) -> bool:
        """The last refusal was ``request``'s, nothing it rests on moved since (ledgers, parameters, length
        predictions), ``now`` is before the first heartbeat view it read expires and before its TTFT target
        could no longer be met even alone, and each of ``backends`` refused it then and would take it alone:
        (b), (d) and (e) read only the views, and (c) only tightens as it waits, so each refusal stands and the
        fallback cannot turn (it needs every backend to fail alone). At most a heartbeat old (a live model
        or capacity may move within it, as the views may). Not kept with prefix matches (caches move)."""
        r = self._refusal
        return (r is not None and r[0] is request and r[1] == self._version and r[2] == self.lengths.version
                and now < r[3] and all(name in r[4] for name in backends)
                and all(now - at < self.heartbeat_s for at in r[5]))  # (``_view``'s own test of its age)

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        if self._refusal is not None and self.waits(request, [v.name for v in backends], now):
            return None
        l_in, l_pred = request.prompt_tokens, self.predicted(request)
        ttft, atgt = self._targets(request)
        if ttft is not None:  # what is left of it: TTFT runs from the arrival (AMBIG-12), waiting included
            ttft -= max(0.0, now - request.arrival)
        spread = not self.pack or ttft is None and atgt is None  # the least full feasible backend (packing a
        # request with no target would only slow those that have one)
        best, best_norm, best_prefill = None, -math.inf, l_in
        until, seen = now + self.heartbeat_s, []  # (seen: when each view it reads was taken)
        for view in backends:
            m = self.models(view.name)
            led = self._ledgers.get(view.name)
            if led is not None and not led.sent:
                led = None
            if led is not None:
                self._view(led, m, view.kv_capacity, now)
                seen.append(led.at)
            prefill = max(0, l_in - self.match(request, view.name)) if self.match is not None else l_in
            ok, norm = self._fits(led, m, view.kv_capacity, l_in, prefill, l_pred, ttft, atgt)
            norm = -norm if spread else norm
            if ok and (norm > best_norm or norm == best_norm and best is not None and view.name < best.name):
                best, best_norm, best_prefill = view, norm, prefill
        if best is None and backends:
            alone = [v for v in backends
                     if self._fits(None, self.models(v.name), v.kv_capacity, l_in, l_in, l_pred, ttft, atgt)[0]]
            if not alone:
                # it could not meet its targets (or fit the KV) even alone on an idle backend: waiting would
                # only hold the queue back behind it (it is served late, on the least loaded backend; a
                # sheddable one is for the gate, a prompt too long for the backend is the backend's to refuse)
                best = min(backends, key=lambda v: (v.inflight, v.name))
            elif self.match is None and self.keeps_refusals:  # it stands until a view expires or (c) fails
                # alone somewhere
                if ttft is not None:  # (c) fails alone once the prefill outlasts what is left of its TTFT
                    deadline = request.arrival + (ttft + max(0.0, now - request.arrival))
                    for m in map(self.models, (v.name for v in alone)):
                        until = min(until, deadline - (m.k1 * l_in + m.c1) - 1e-9)  # (a nanosecond early)
                self._refusal = (request, self._version, self.lengths.version, until,
                                 frozenset(v.name for v in alone), seen)
        if best is not None:
            self._record(best.name, request.request_id, _Sent(l_in, best_prefill, l_pred, now, atgt, request.app,
                                                              request.stage, self._cap(request)), best, now)
        return best

    def _record(self, backend: str, rid: str, s: _Sent, view: BackendView, now: float) -> None:
        self._version += 1
        if rid in self._where:  # (placed again: it left wherever it was first)
            self._forget(self._where[rid], rid)
        led = self._ledgers.setdefault(backend, _Ledger())
        self._where[rid] = backend
        led.sent[rid] = s
        led.sum_in += s.l_in
        led.sum_pred += s.l_pred
        if s.atgt_s is not None:
            led.atgts[s.atgt_s] = led.atgts.get(s.atgt_s, 0) + 1
        if led.profile is not None and led.profile.capacity == view.kv_capacity and now - led.at < self.heartbeat_s:
            led.pending += s.prefill  # (kept in the heartbeat's view: it is prefilling now)
            led.prefilling.add(rid)
            led.shape[rid] = (s.l_pred, s.l_in)
            led.profile.add(s.l_pred, s.l_in)
        else:
            led.profile = None  # the next decision takes a fresh view

    def _forget(self, backend: str, rid: str) -> None:
        backend = self._where.pop(rid, backend)
        led = self._ledgers.get(backend)
        s = led.sent.pop(rid, None) if led is not None else None
        if s is None:
            return
        self._version += 1
        led.sum_in -= s.l_in
        led.sum_pred -= s.l_pred
        if s.atgt_s is not None:
            left = led.atgts[s.atgt_s] - 1
            if left:
                led.atgts[s.atgt_s] = left
            else:
                del led.atgts[s.atgt_s]
        shape = led.shape.pop(rid, None)
        if not led.sent:
            del self._ledgers[backend]
        elif shape is not None and led.profile is not None:
            led.profile.remove(*shape)
            if rid in led.prefilling:
                led.prefilling.discard(rid)
                led.pending -= s.prefill

    def on_finish(self, request: RequestView, backend: str, generated: int) -> None:
        self._forget(backend, request.request_id)
        if self._learns:
            self.lengths.observe(request.app, request.stage, request.prompt_tokens, generated)

    def refund(self, request: RequestView, backend: str) -> None:
        self._forget(backend, request.request_id)
