"""Each backend's latency models, fitted from what the gateway sees of its streams (accounting/latency.py;
docs/operations/metrics.md#latency-models): a stream's first event, from the dispatch, is a prefill of its
uncached prompt; each later window of reads spanning ``WINDOW`` tokens per choice is that many decode steps of a
batch of the backend's running requests over its KV in use (vLLM's gauges when scraped, else the gateway's own
count and reservations). Seeded with the engine profile ``latency_profile``; exported as gauges."""

from __future__ import annotations

from dataclasses import asdict

from fairgate.accounting.latency import BackendLatency, LatencyModel
from fairgate.engine.profiles import get_profile
from fairgate.proxy.control.backends import Backend
from fairgate.proxy.control.metrics import GatewayMetrics


class LatencyFits:
    def __init__(self, profile: str):
        p = get_profile(profile)
        self._seed = p.latency
        self._range = (p.max_model_len, p.kv_tokens, min(p.max_num_seqs, 256))
        self._fits: dict[str, BackendLatency] = {}

    def seed(self) -> BackendLatency:
        """A backend's fit before it has been seen: the profile's."""
        max_prompt, max_context, max_batch = self._range
        return BackendLatency(self._seed, max_prompt=max_prompt, max_context=max_context, max_batch=max_batch)

    def of(self, backend: Backend) -> BackendLatency:
        fit = self._fits.get(backend.name)
        if fit is None:
            max_prompt, max_context, max_batch = self._range
            fit = self._fits[backend.name] = BackendLatency(self._seed, max_prompt=max_prompt,
                                                            max_context=backend.kv_capacity or max_context,
                                                            max_batch=max_batch)
        return fit

    def model(self, backend: str) -> LatencyModel:
        """``backend``'s latency model as it stands (the profile's until it has been seen): Aladdin's."""
        fit = self._fits.get(backend)
        return fit.model() if fit is not None else self._seed

    def first_event(self, backend: Backend, uncached_prompt: int, seconds: float, now: float | None = None) -> None:
        self.of(backend).observe_prefill(uncached_prompt, seconds, now)

    def read(self, backend: Backend, steps: float, seconds: float, now: float | None = None) -> None:
        """``steps`` decode steps (tokens per choice) arrived over ``seconds`` on ``backend``."""
        if steps <= 0:
            return
        batch = max(backend.running, backend.inflight, 1)  # (the scrape's, or the gateway's own count)
        context = (int(backend.kv_usage * backend.kv_capacity) if backend.kv_usage and backend.kv_capacity
                   else backend.inflight_tokens)  # (kv_usage is clamped to [0, 1] where it is scraped)
        self.of(backend).observe_step(batch, context, seconds / steps, now)

    WINDOW = 8  # decode steps a stream's observation spans: one fit update per eight reads of a stream that
    # reads token by token, not one per read (the fit's sums and its refit are most of a read's cost)

    def stream_read(self, backend: Backend, attempt, generated: int, choices: int, now: float,
                    waited: float) -> None:
        """A read of ``attempt``'s stream brought its output to ``generated`` tokens (over ``choices``). Once
        the reads since the last observation span ``WINDOW`` decode steps, they are one: their steps over
        their time — unless the client held the relay up for more of it than the backend did (``waited``, each
        read's wait for the backend, summed): the reads then returned what had piled up, and say nothing of
        the backend's pace. The first read (the prefill's) starts the first window; a stream's last window,
        shorter, is not observed."""
        if not attempt.last_read:
            attempt.last_read, attempt.last_generated, attempt.waited = now, generated, 0.0
            return
        attempt.waited += waited
        steps = (generated - attempt.last_generated) / choices
        if steps < self.WINDOW:
            return
        since = now - attempt.last_read
        if attempt.waited >= since / 2:
            self.read(backend, steps, since, now)
        attempt.last_read, attempt.last_generated, attempt.waited = now, generated, 0.0

    def export(self, m: GatewayMetrics) -> None:
        for name, fit in self._fits.items():
            c = fit.model()
            for coef, value in (("k1", c.k1), ("c1", c.c1), ("k2", c.k2), ("c2", c.c2), ("c3", c.c3)):
                m.latency_coefficient.labels(name, coef).set(value)
            m.latency_error.labels(name, "prefill").set(fit.prefill.sigma())
            m.latency_error.labels(name, "decode").set(fit.decode.sigma())
            m.latency_samples.labels(name, "prefill").set(fit.prefill.samples)
            m.latency_samples.labels(name, "decode").set(fit.decode.samples)

    def rows(self) -> list[dict]:
        """Per backend: its coefficients, residual spreads and samples (``/ready`` to its token holder)."""
        return [{"backend": name, **asdict(fit.model()), "prefill_sigma_s": fit.prefill.sigma(),
                 "decode_sigma_s": fit.decode.sigma(), "prefill_samples": fit.prefill.samples,
                 "decode_samples": fit.decode.samples} for name, fit in sorted(self._fits.items())]

