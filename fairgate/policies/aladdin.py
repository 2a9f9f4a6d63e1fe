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
  decode step the model predicts (AMBIG-1 and -6, docs/policies/aladdin.md#open-choices: l_out is the tokens so far, len_s the total).

Among feasible backends, the paper takes the one with the largest capacity_norm = √((b / b_max)² + (ctx /
l_d(b))²) (the normalised variant of docs/policies/aladdin.md#open-choices, AMBIG-4; b_max = ``max_batch``): best fit, so that the fewest workers stay busy
and the rest can be released. A gateway in front of a fixed pool releases none, so by default j takes the
feasible backend with the *smallest* norm (worst fit): the same constraints, and the slack left on every backend
absorbs the length predictions' errors, which matters most when the pool is overloaded. ``pack=1`` restores the
paper's best fit, which keeps backends idle for the prompts only an idle one serves in time: with ``theta=0.5``
it meets 99 % of Table 2's targets on the Azure conversations with 0.30-0.43× least-load's workers, worst fit
with 0.84-0.91× (docs/policies/aladdin.md). None feasible: the request waits in the gateway (``choose``
returns None), unless it could not meet its targets even alone on an idle backend (then it goes to the least
loaded one: waiting would only block the queue behind it). Each backend has its own latency model
(``models(name)``: the live fits, or a profile per backend in the simulator), so backends of different speeds
each take what they can serve in time.

Cost (bench/aladdin.py). The paper runs Algorithm 1 once per scheduling heartbeat over a frozen view of the
workers; so does this: each backend's progress estimate (what is still prefilling, the least decode slack, and
the future-KV profile sorted by predicted end, built when (e) first reads it) is taken as of the heartbeat's
start, at most once per ``heartbeat_s``, kept up to date in place as requests are sent, retaken when one
finishes. Within a heartbeat a decision is O(B log n) over B backends with n requests each (a binary search in
each profile), plus O(n) array work on the chosen backend's profile; the sums of (b) are kept as requests come
and go. The first decision of a heartbeat retakes every backend's view, O(N log n) over the N requests in
flight: decisions further apart than a heartbeat each pay that (bench/aladdin.py --spacing-ms). A request
refused everywhere keeps each backend's refusal while it provably stands (``waits``, O(B); the bounds in
policies/aladdin_ledger.py): a view is a function of the ledger and the heartbeat, not of when a decision asks
for it, so a decision not made changes no later one (tests/test_aladdin.py compares with deciding afresh).
Algorithm 2 (rebalancing by prediction error) is kept in the only form a gateway that dispatches each
request at once can use: a request that outlives its predicted length is re-predicted in the next view
(its underestimate counted in (b) and (e)), one that finishes early leaves the ledger at once; there are no
placed-but-not-started requests to move. Pure: time is passed in.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

from fairgate.accounting.latency import LatencyModel
from fairgate.accounting.length import OutputLengths
from fairgate.policies.aladdin_ledger import Ledger, Sent
from fairgate.policies.placement import Placement
from fairgate.policies.views import BackendView, RequestView

Match = Callable[[RequestView, str], int]


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
        self._ledgers: dict[str, Ledger] = {}
        self._where: dict[str, str] = {}  # request → the backend whose ledger holds it
        self._changes = itertools.count()  # each ledger's version is the number of its last change
        self._params = 0  # the parameters' changes
        # the refusals kept for the request waiting at the head: (request, its prediction, parameters' version,
        # {backend: (its ledger's version, until)}): each stands on its backend until then (``waits``)
        self._standing: tuple | None = None
        self._predicted: tuple | None = None  # (request, lengths' version, its prediction)
        self._alone_memo: tuple | None = None  # (request, (its prediction, parameters' version),
        # {(backend, model, KV): alone})

    def set_params(self, **params: float) -> None:
        self._params += 1
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
        """Its predicted output (kept for the request waiting at the head until a length is learnt)."""
        memo = self._predicted
        if memo is not None and memo[0] is request and memo[1] == self.lengths.version:
            return memo[2]
        value = self.lengths.predict(request.app, request.stage, request.prompt_tokens, self._cap(request),
                                     self.default_output)
        self._predicted = (request, self.lengths.version, value)
        return value

    def _targets(self, request: RequestView) -> tuple[float | None, float | None]:
        return (request.ttft_s if request.ttft_s is not None else self.ttft_s,
                request.atgt_s if request.atgt_s is not None else self.atgt_s)

    def _tick(self, now: float) -> float:
        """The heartbeat ``now`` falls in (its start: ``tick × heartbeat_s``); with no heartbeat, ``now``."""
        return now // self.heartbeat_s if self.heartbeat_s > 0 else now

    def _tick_start(self, now: float) -> float:
        """When the heartbeat ``now`` falls in began (views are taken as of then); with no heartbeat, ``now``."""
        return self._tick(now) * self.heartbeat_s if self.heartbeat_s > 0 else now

    def _next_tick(self, now: float) -> float:
        """A moment no later than the next heartbeat's start (a nanosecond early: the float product may round
        up); with no heartbeat, ``now`` (a view at every decision)."""
        return (self._tick(now) + 1) * self.heartbeat_s - 1e-9 if self.heartbeat_s > 0 else now

    def _view(self, led: Ledger, m: LatencyModel, capacity: int | None, now: float) -> None:
        """Take the heartbeat's view of ``led`` (unless taken in this heartbeat, for this capacity), as of the
        heartbeat's start: each prefill right after its request was sent, then one token per predicted step. A
        view is a function of the ledger and the heartbeat, not of when a decision first asked for it (so a
        decision that is not made, ``waits``, changes no later one)."""
        tick = self._tick(now)
        if led.tick == tick and led.capacity == capacity:
            return
        at = self._tick_start(now)
        step = max(m.step(len(led.sent), led.sum_in), 1e-6)
        pending, slack, shape = 0, math.inf, []
        k1, c1, progress = m.k1, m.c1, self.progress
        for rid, s in led.sent.items():  # (rid: for ``progress``)
            decoding = at - s.at - (k1 * s.prefill + c1)
            if decoding <= 0:
                pending += s.prefill
                gen = 0
            else:
                ran = int(decoding / step)  # tokens it has had time for
                done = ran  # those it produced (live: streamed), else that estimate
                if progress is not None and (got := progress(rid)) is not None:
                    done = got
                if done >= s.l_pred and (s.cap is None or s.l_pred < s.cap):  # it outlived its prediction
                    self._repredict(led, s, done)
                gen = done if done < s.l_pred else s.l_pred - 1  # (one more to come at least, whatever the
                if s.atgt_s is not None:  # prediction said; the slack from the time it had: a client reading
                    left = s.atgt_s * (ran or 1) - decoding  # slowly holds its stream back, and must not close
                    if left < slack:  # the backend)
                        slack = left
            shape.append((s.l_pred - gen, s.l_in + gen))
        led.tick, led.capacity, led.pending, led.slack, led.shape, led.profile = tick, capacity, pending, slack, \
            shape, None

    def _repredict(self, led: Ledger, s: Sent, ran: int) -> None:
        """Algorithm 2's underestimate (§4.3): a request still running past its predicted
        length l_pred is predicted anew, E[L | L > l, l_in], with l the tokens it produced (live: streamed; in
        the simulator: had time for), and the
        backend's constraints (b) and (e) count the extra from then on (an overestimate needs no correction
        here: the ledger drops a request as soon as it finishes). Without history that long, as much again."""
        led.version = next(self._changes)
        mean = self.lengths.mean_beyond(s.app, s.stage, s.l_in, ran)
        new = max(ran + 1, round(mean) if mean is not None else ran + s.l_pred)
        if s.cap is not None:
            new = max(s.l_pred, min(new, s.cap))
        led.sum_pred += new - s.l_pred
        s.l_pred = new

    def _fits(self, led: Ledger | None, m: LatencyModel, capacity: int | None, l_in: int, prefill: int,
              l_pred: int, ttft: float | None, atgt: float | None) -> tuple[str, float]:
        """Whether a request (``l_in`` prompt tokens, ``prefill`` of them computed, ``l_pred`` predicted output)
        meets (b)-(e) beside what ``led`` holds (None: an idle backend): the constraint it fails first ("" if
        none), and the backend's norm with it."""
        pending, slack = (led.pending, led.slack) if led is not None else (0, math.inf)
        t_prefill = m.k1 * (pending + prefill) + m.c1
        if ttft is not None and t_prefill + (self._in_step(led, m) if led is not None else 0.0) > ttft:  # (c)
            return "c", 0.0
        if t_prefill > self.theta * slack:  # (d): the new prefills stall every stream decoding there
            return "d", 0.0
        b = 1 + (len(led.sent) if led is not None else 0)
        ctx = l_in + self.gamma * l_pred + (led.sum_in + self.gamma * led.sum_pred if led is not None else 0)
        held = led.tightest() if led is not None else None
        t_dec = atgt if held is None else held if atgt is None else min(atgt, held)
        budget = math.inf
        if t_dec is not None:
            if b == 1:
                if m.step(1, ctx) > t_dec:
                    return "b", 0.0
            else:
                budget = self.theta * m.context_budget(b, t_dec)
                if ctx > budget:
                    return "b", 0.0
        if led is not None and led.tick is not None and not led.future_kv().fits(l_pred, l_in):  # (e)
            return "e", 0.0
        if led is None and capacity is not None and l_in + l_pred > capacity:
            return "e", 0.0
        fill = ctx / budget if budget not in (0, math.inf) else 0.0
        return "", math.hypot(b / self.max_batch, fill)

    @staticmethod
    def _in_step(led: Ledger, m: LatencyModel) -> float:
        """(c)'s wait, beyond the prefills ahead, before a new prefill can start on a backend that holds
        requests: one decode step (the step in progress where streams decode; after the prefills ahead, the
        decode step an engine runs before it admits again), and the fixed cost of a prefill of its own."""
        return m.step(len(led.sent), led.sum_in) + (m.c1 if led.pending else 0.0)

    def waits(self, request: RequestView, backends: Sequence[str], now: float) -> bool:
        """Each of ``backends`` refused ``request`` before, would take it alone, and nothing its refusal rests
        on moved since (its ledger, the parameters, the request's prediction), and ``now`` is before the first
        moment a heartbeat's view could turn that refusal (``_stands``) or its TTFT target could no longer be
        met alone there: each refusal stands, and the fallback cannot turn (it needs every backend to fail
        alone). Views are a function of the ledgers and the heartbeat, so a decision not made changes no later
        one. Not kept with prefix matches (caches move). O(B)."""
        held = self._held(request)
        return bool(held) and all(self._stands_now(held, name, now) for name in backends)

    def _stands_now(self, held: dict[str, tuple[int, float]], backend: str, now: float) -> bool:
        """The refusal kept on ``backend`` still stands: its ledger unchanged since, and before its end."""
        x = held.get(backend)
        led = self._ledgers.get(backend)
        return x is not None and led is not None and led.version == x[0] and now < x[1]

    def _held(self, request: RequestView) -> dict[str, tuple[int, float]]:
        """The refusals kept for ``request`` under the present parameters and its present prediction."""
        st = self._standing
        if st is None or st[0] is not request or st[2] != self._params or st[1] != self.predicted(request):
            return {}
        return st[3]

    def _alone(self, request: RequestView, backends: Sequence[BackendView], l_pred: int, ttft: float | None,
               atgt: float | None) -> list[BackendView]:
        """The backends on which ``request`` would meet its targets alone, idle. Kept for the request while its
        prediction and the parameters (γ moves (b)) hold: of (b)-(e) alone only (c) moves, and only tightens,
        as it waits (a backend that passed is asked (c) again, one that failed stays out)."""
        memo = self._alone_memo
        if memo is None or memo[0] is not request or memo[1] != (l_pred, self._params):
            memo = self._alone_memo = (request, (l_pred, self._params), {})
        passed, l_in, out = memo[2], request.prompt_tokens, []
        for v in backends:
            m = self.models(v.name)
            ok = passed.get((v.name, m, v.kv_capacity))
            if ok is None:
                ok = passed[v.name, m, v.kv_capacity] = not self._fits(None, m, v.kv_capacity, l_in, l_in, l_pred,
                                                                      ttft, atgt)[0]
            elif ok and ttft is not None and m.k1 * l_in + m.c1 > ttft:  # ((c) alone, as ``_fits`` reads it)
                ok = passed[v.name, m, v.kv_capacity] = False
            if ok:
                out.append(v)
        return out

    def _stands(self, led: Ledger, m: LatencyModel, failed: str, prefill: int, now: float) -> float:
        """Until when ``led``'s backend refuses a request that failed ``failed`` in this heartbeat's view: at
        least to the next heartbeat (the view stands that long), beyond it as ``Ledger.refusal_stands`` proves
        (not with streamed progress, which no bound foresees; nor after (e), whose answer may turn as the
        streams advance: (b)-(d) held then, so no bound of theirs holds)."""
        nxt = self._next_tick(now)
        if self.heartbeat_s <= 0 or self.progress is not None or self.theta <= 0 or failed == "e":
            return nxt
        return max(nxt, led.refusal_stands(m, failed, prefill, self._tick_start(now), self.theta))

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        held = self._held(request)
        if held and all(self._stands_now(held, v.name, now) for v in backends):  # (``waits``)
            return None
        l_in, l_pred = request.prompt_tokens, self.predicted(request)
        ttft, atgt = self._targets(request)
        if ttft is not None:  # what is left of it: TTFT runs from the arrival (AMBIG-12), waiting included
            ttft -= max(0.0, now - request.arrival)
        spread = not self.pack or ttft is None and atgt is None  # the least full feasible backend (packing a
        # request with no target would only slow those that have one)
        best, best_norm, best_prefill = None, -math.inf, l_in
        refused = []  # (backend, ledger, model, constraint failed, prefill)
        for view in backends:
            if held and self._stands_now(held, view.name, now):
                continue  # its refusal stands (``waits``): no view, no decision
            led = self._ledgers.get(view.name)
            if led is not None and not led.sent:
                led = None
            m = self.models(view.name)
            if led is not None:
                self._view(led, m, view.kv_capacity, now)
            prefill = max(0, l_in - self.match(request, view.name)) if self.match is not None else l_in
            failed, norm = self._fits(led, m, view.kv_capacity, l_in, prefill, l_pred, ttft, atgt)
            norm = -norm if spread else norm
            if failed:
                refused.append((view.name, led, m, failed, prefill))
            elif norm > best_norm or norm == best_norm and best is not None and view.name < best.name:
                best, best_norm, best_prefill = view, norm, prefill
        if best is None and backends:
            alone = self._alone(request, backends, l_pred, ttft, atgt)
            if not alone:
                # it could not meet its targets (or fit the KV) even alone on an idle backend: waiting would
                # only hold the queue back behind it (it is served late, on the least loaded backend; a
                # sheddable one is for the gate, a prompt too long for the backend is the backend's to refuse)
                best = min(backends, key=lambda v: (v.inflight, v.name))
            elif self.match is None and self.keeps_refusals:  # each refusal stands while its reason does and
                # (c) holds alone there
                names = {v.name for v in alone}
                held = {name: x for name, x in held.items() if name in names}
                deadline = request.arrival + (ttft + max(0.0, now - request.arrival)) if ttft is not None else None
                for name, led, m, failed, prefill in refused:
                    if led is not None and name in names:
                        until = self._stands(led, m, failed, prefill, now)
                        if deadline is not None:  # (c) fails alone once the prefill outlasts what is left of its
                            until = min(until, deadline - (m.k1 * l_in + m.c1) - 1e-9)  # TTFT (a nanosecond early)
                        held[name] = (led.version, until)
                self._standing = (request, l_pred, self._params, held)
        if best is not None:
            self._record(best.name, request.request_id, Sent(l_in, best_prefill, l_pred, now, atgt, request.app,
                                                             request.stage, self._cap(request)), best, now)
        return best

    def _record(self, backend: str, rid: str, s: Sent, view: BackendView, now: float) -> None:
        if rid in self._where:  # (placed again: it left wherever it was first)
            self._forget(self._where[rid], rid)
        led = self._ledgers.setdefault(backend, Ledger())
        led.version = next(self._changes)
        self._where[rid] = backend
        led.sent[rid] = s
        led.sum_in += s.l_in
        led.sum_pred += s.l_pred
        if s.atgt_s is not None:
            led.atgts[s.atgt_s] = led.atgts.get(s.atgt_s, 0) + 1
        if led.tick == self._tick(now) and led.capacity == view.kv_capacity:
            led.pending += s.prefill  # (kept in the heartbeat's view: it is prefilling now)
            led.shape.append((s.l_pred, s.l_in))
            if led.profile is not None:
                led.profile.add(s.l_pred, s.l_in)
        else:
            led.tick = None  # the next decision takes a fresh view

    def _forget(self, backend: str, rid: str) -> None:
        backend = self._where.pop(rid, backend)
        led = self._ledgers.get(backend)
        s = led.sent.pop(rid, None) if led is not None else None
        if s is None:
            return
        led.version = next(self._changes)
        led.sum_in -= s.l_in
        led.sum_pred -= s.l_pred
        if s.atgt_s is not None:
            left = led.atgts[s.atgt_s] - 1
            if left:
                led.atgts[s.atgt_s] = left
            else:
                del led.atgts[s.atgt_s]
        if not led.sent:
            del self._ledgers[backend]
        else:
            led.tick = None  # the view is retaken, as of the same heartbeat's start (as if taken after this)

    def on_finish(self, request: RequestView, backend: str, generated: int) -> None:
        self._forget(backend, request.request_id)
        if self._learns:
            self.lengths.observe(request.app, request.stage, request.prompt_tokens, generated)

    def refund(self, request: RequestView, backend: str) -> None:
        self._forget(backend, request.request_id)
