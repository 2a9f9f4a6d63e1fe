"""Each request's calibrated p90 TTFT, predicted at admission (accounting/calibration.py;
docs/guide/slo.md#predictions): the point is the wait for those ahead of it in its policy's order at the rate
the gateway has been dispatching, then the fastest serving backend's fitted prefill of its prompt; the bound is
the point scaled by conformal calibration over the streams seen. Its usage row keeps the bound
(``predicted_ttft_ms``); a streamed answer's first token is the observation that calibrates the next ones (a
whole answer's "first token" is its last, and says nothing of TTFT). Made for requests of an app with an SLO
class (O(waiting tenants) at most, as shedding's estimate)."""

from __future__ import annotations

from typing import Iterable

from fairgate.accounting.calibration import CalibratedUpper, ttft_point
from fairgate.accounting.latency import BackendLatency


class TtftForecast:
    def __init__(self, target: float = 0.9):
        self.calibration = CalibratedUpper(target)
        self._points: dict[str, tuple[float, float | None]] = {}  # request id → (point, bound), until it ends

    def predict(self, call, ahead: int, rate: float, prompt_tokens: int,
                fits: Iterable[tuple[BackendLatency, int]]) -> float | None:
        """Record ``call``'s bound; the point it is made from (None: requests wait and none left yet)."""
        point = ttft_point(ahead, rate, prompt_tokens, fits)
        if point is None:
            return None
        upper = self.calibration.upper(point)
        self._points[call.request_id] = (point, upper)
        call.predicted_ttft_ms = None if upper is None else upper * 1000.0
        return point

    def settle(self, call, streamed: bool) -> None:
        """``call`` ended: its first token, if streamed, calibrates the bounds to come."""
        made = self._points.pop(call.request_id, None) if self._points else None
        if made is not None and streamed and (ttft := call.ttft_s()) is not None:
            self.calibration.observe(made[0], ttft, made[1])
