"""Latency targets in a workload, and whether each request met them (Aladdin §2; docs/simulator/index.md#slos).

A workload's ``slo: {ttft_s, atgt_s}`` is every client's default; a client's own ``slo:`` replaces it. Either
target may be left out (no bound on it). For a request:

- TTFT is from its arrival at the gateway to its first token (AMBIG-12, docs/policies/aladdin.md#open-choices: queueing counts);
- ATGT, the average token generation time, is its decode time over the tokens decoded, (finish − first token)
  / (generated − 1); a request of one token has none to average and meets any ATGT target;
- it *attains* its SLO when it finished and met both. A request refused, given up or never finished did not.

Attainment is the fraction of the requests that had an SLO (and were sent: a call its interaction never
released is not counted) that attained it. A prompt longer than the model's context is refused with a 400 on
any placement and any number of workers: the client's error, counted apart (``over_context``), not judged.
Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

OVER_CONTEXT = "context_length_exceeded"  # a request's reason when its prompt leaves no room for a token


class SloError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = math.inf
    atgt_s: float = math.inf


def parse(spec: Any, where: str = "slo") -> Slo | None:
    """``{ttft_s, atgt_s}`` (either may be absent) → an Slo; None or absent → None. Anything else is refused."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or not spec or set(spec) - {"ttft_s", "atgt_s"}:
        raise SloError(f"{where}: a mapping with ttft_s and/or atgt_s (seconds), got {spec!r}")
    values = {}
    for name, value in spec.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise SloError(f"{where}.{name}: a positive number of seconds, got {value!r}")
        values[name] = float(value)
    return Slo(**values)


def targets_of(w, client: str) -> dict[str, float | None]:
    """A client's latency targets as its requests carry them (``RequestView`` ttft_s, atgt_s; None: no bound)."""
    slo = w.slo_for(client)
    if slo is None:
        return {}
    return {"ttft_s": slo.ttft_s if math.isfinite(slo.ttft_s) else None,
            "atgt_s": slo.atgt_s if math.isfinite(slo.atgt_s) else None}


def ttft(r) -> float | None:
    return None if r.first_token is None else r.first_token - r.arrival


def atgt(r) -> float | None:
    if r.finished is None or r.first_token is None:
        return None
    return (r.finished - r.first_token) / (r.generated - 1) if r.generated > 1 else 0.0


def attained(r, slo: Slo) -> bool:
    if r.finished is None or r.rejected or r.abandoned:
        return False
    return ttft(r) <= slo.ttft_s and atgt(r) <= slo.atgt_s


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]


def summary(reqs: Iterable, slo_for: Callable[[str], Slo | None]) -> dict[str, Any]:
    """``{"attainment", "slos", "met", "ttft_p99_s", "atgt_p99_s"}`` over the requests with an SLO (the p99s
    over those that have the measure); ``{"attainment": 1.0, "slos": 0}`` when none has one."""
    judged = [(r, s) for r in reqs if not r.cancelled and (s := slo_for(r.client)) is not None]
    over = sum(r.throttle_reason == OVER_CONTEXT for r, _ in judged)
    judged = [(r, s) for r, s in judged if r.throttle_reason != OVER_CONTEXT] if over else judged
    if not judged:
        return {"attainment": 1.0, "slos": 0, **({"over_context": over} if over else {})}
    met = sum(attained(r, s) for r, s in judged)
    ttfts = [t for r, _ in judged if (t := ttft(r)) is not None]
    atgts = [a for r, _ in judged if (a := atgt(r)) is not None]
    return {"attainment": met / len(judged), "slos": len(judged), "met": met,
            "ttft_p99_s": _p99(ttfts), "atgt_p99_s": _p99(atgts), **({"over_context": over} if over else {})}


class TtftPredictions:
    """The gateway's calibrated p90 TTFT predictions, made in simulation as the live gateway makes them
    (accounting/calibration.py): at arrival, before the request joins the queue, the point (those waiting ahead
    of it at the recent dispatch rate, then its prefill on the profile's model) and its calibrated bound; at its
    first token, the observation. Every prediction is made before its request is seen (held back by
    construction); the report gives the fraction of first tokens within their bound."""

    def __init__(self, profiles: list, target: float = 0.9):
        from fairgate.accounting.calibration import CalibratedUpper, EventRate
        from fairgate.accounting.latency import BackendLatency

        self.calibration = CalibratedUpper(target)
        self.dispatches = EventRate()
        self._fits = [BackendLatency(p.latency) for p in profiles]  # per engine
        self._made: dict[int, tuple[float, float | None]] = {}
        self._prefilling: list[int] = [0] * len(profiles)  # per engine, prompt tokens handed to it before their
        self._on: dict[int, tuple[int, int]] = {}  # first token; request → (engine, its tokens)

    def arrive(self, request_id: int, ahead: int, prompt_tokens: int, now: float) -> None:
        from fairgate.accounting.calibration import ttft_point

        point = ttft_point(ahead, self.dispatches.per_s(now), prompt_tokens,
                           list(zip(self._fits, self._prefilling)))
        if point is not None:
            self._made[request_id] = (point, self.calibration.upper(point))

    def dispatched(self, request_id: int, engine: int, prompt_tokens: int, now: float) -> None:
        self.dispatches.event(now)
        self._prefilling[engine] += prompt_tokens
        self._on[request_id] = (engine, prompt_tokens)

    def gone(self, request_id: int) -> None:
        """Given up before its first token (a timeout): no observation; its prompt waits on no engine."""
        if (on := self._on.pop(request_id, None)) is not None:
            self._prefilling[on[0]] -= on[1]
        self._made.pop(request_id, None)

    def first_token(self, request_id: int, ttft_s: float) -> None:
        if (on := self._on.pop(request_id, None)) is not None:
            self._prefilling[on[0]] -= on[1]
        made = self._made.pop(request_id, None)
        if made is not None:
            self.calibration.observe(made[0], ttft_s, made[1])

    def report(self) -> dict[str, Any]:
        c = self.calibration
        return {"target": c.target, "coverage": c.coverage, "predictions": c.predictions, "unbounded": c.unbounded}
