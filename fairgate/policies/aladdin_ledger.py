"""What Aladdin's placement (policies/aladdin.py) keeps per backend: its latency model (Eqs. 2-3), the
requests it sent there, the sums of constraint (b) and the heartbeat's view of them, and how long a refusal
read from that view provably stands (``Ledger.refusal_stands``). Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fairgate.accounting.latency import LatencyModel
from fairgate.policies.kv_profile import KVProfile


@dataclass(slots=True)
class Sent:
    l_in: int  # prompt tokens it holds in KV
    prefill: int  # of them, those it computes (its predicted cached prefix excluded)
    l_pred: int  # its predicted total output (re-predicted when it outlives it)
    at: float
    atgt_s: float | None
    app: str = ""
    stage: int = 0
    cap: int | None = None  # its max_tokens, where the placement reads it (no re-prediction goes past it)


@dataclass(slots=True)
class Ledger:
    """What the placement sent to one backend and has not seen finish, with the sums of constraint (b)."""

    sent: dict[str, Sent] = field(default_factory=dict)
    sum_in: int = 0
    sum_pred: int = 0
    atgts: dict[float, int] = field(default_factory=dict)  # ATGT target → requests holding it
    # the heartbeat's view, as of the heartbeat's start (``tick``: which heartbeat; None: none taken since a
    # request left): for which KV capacity, the prefill tokens not yet computed, the least decode slack, each
    # request's (end, start)
    tick: float | None = None
    capacity: int | None = None
    version: int = -1  # (``Aladdin._changes`` at its last change: a request sent, finished or predicted anew)
    pending: int = 0
    slack: float = math.inf
    shape: list[tuple[int, int]] = field(default_factory=list)
    profile: KVProfile | None = None  # the view's profile, built from ``shape`` when (e) first reads it

    def tightest(self) -> float | None:
        return min(self.atgts) if self.atgts else None

    def future_kv(self) -> KVProfile:
        """The view's future-KV profile (built once per view: most decisions end before (e), which reads it)."""
        if self.profile is None:
            self.profile = KVProfile(list(self.shape), self.capacity)
        return self.profile

    def refusal_stands(self, m: LatencyModel, failed: str, prefill: int, at: float, theta: float) -> float:
        """Until when this backend refuses a request that failed its ``failed`` constraint in the view taken at
        ``at`` (a heartbeat's start), with the view retaken at every heartbeat since and nothing sent or finished
        here (each ends a kept refusal), under model ``m`` and Aladdin's θ: only until a view could re-predict a
        request (a re-prediction moves what later views hold), and while one of:

        - (b) failed: it reads only the ledger and the request's prediction (a re-prediction only tightens it);
        - (c) failed: until a prefill waiting there completes (the prefills ahead only shrink then; what is left
          of the TTFT only shrinks);
        - (d) holds: some stream decoding there keeps its slack under what a prefill of this request alone
          costs, k1·prefill + c1 ≥ θ·(a·max(⌊d/step⌋, 1) − d) for its ATGT a after d seconds of decoding: always
          if a ≤ step, else until d = (k1·prefill + c1)/θ · step/(a − step) (streams that start decoding later
          only lower the least slack). O(n) over its n requests."""
        step = max(m.step(len(self.sent), self.sum_in), 1e-6)
        k1, c1 = m.k1, m.c1
        completes, repredicts, latest = math.inf, math.inf, {}  # latest: ATGT → the last decode start
        for s in self.sent.values():
            ready = s.at + (k1 * s.prefill + c1)  # (its decode starts: the view's expression, rearranged)
            if at - s.at - (k1 * s.prefill + c1) <= 0:
                completes = min(completes, ready)
            elif s.atgt_s is not None and ready > latest.get(s.atgt_s, -math.inf):
                latest[s.atgt_s] = ready
            if s.cap is None or s.l_pred < s.cap:
                repredicts = min(repredicts, ready + s.l_pred * step * (1 - 1e-9))
        stands = completes if failed == "c" else math.inf if failed == "b" else -math.inf
        alone = (k1 * prefill + c1) / theta  # (d)'s bound on the least slack, with no prefill ahead
        for a, start in latest.items():  # (a margin of 1e-6 token for the float floor of d/step)
            if a * (1 + 1e-6) < alone:
                stands = max(stands, math.inf if a <= step else start + (alone - a * 1e-6) * step / (a - step))
        return min(stands, repredicts) - 1e-9

