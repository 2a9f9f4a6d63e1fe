"""How many backends the traffic needs (Aladdin §3.6-3.7, Eqs. 6-7, from the live fits; docs/operations/
metrics.md#backends-needed): one backend sustains b* / (l_out · t_d(b*) + t_p(l_in)) requests per second, where
the batch b* is the least of what its KV holds (M / (l_in + l_out)), what keeps a step within the ATGT target
(Eq. 4 solved for b at the mean context l_in + l_out / 2), and its batch cap; the traffic needs its arrival
rate over that, summed over the backends' own rates (backends of different speeds count for what each does).
A planning figure, not a guarantee: means, not distributions (``fairgate plan`` simulates those). Pure."""

from __future__ import annotations

import math

from fairgate.accounting.latency import BackendLatency


def backend_rate(fit: BackendLatency, kv_capacity: int | None, mean_in: float, mean_out: float,
                 atgt_s: float | None = None, max_batch: int = 256) -> float:
    """Requests per second one backend sustains for requests of these mean lengths."""
    c = fit.model()
    mean_in, mean_out = max(1.0, mean_in), max(1.0, mean_out)
    context = mean_in + mean_out / 2.0  # a request's mean context over its life
    batch = float(max_batch)
    if kv_capacity:
        batch = min(batch, kv_capacity / (mean_in + mean_out))
    if atgt_s is not None:
        per_request = c.k2 * context + c.c2
        if per_request > 0:
            batch = min(batch, (atgt_s - c.c3) / per_request)
    batch = max(1.0, batch)
    step = max(fit.step_time(round(batch), round(batch * context))[0], 1e-6)
    prefill = max(fit.prefill_time(round(mean_in))[0], 0.0)
    return batch / (mean_out * step + prefill)


def backends_needed(arrival_rate: float, rates: list[float]) -> float:
    """Backends (of the pool's mean speed) that ``arrival_rate`` requests per second need."""
    if arrival_rate <= 0 or not rates:
        return 0.0
    mean = sum(rates) / len(rates)
    return arrival_rate / mean if mean > 0 else math.inf
