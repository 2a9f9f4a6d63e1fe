"""A request's counts and observations, gathered in dicts and folded into the Prometheus series when they are
read, expose exactly what the same increments and observations made one by one on the series expose."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from fairgate.proxy.control.metrics import LATENCY_BUCKETS, GatewayMetrics


def test_folded_series_expose_what_direct_updates_expose():
    m = GatewayMetrics()
    ref = CollectorRegistry()
    tokens = Counter("fairgate_tokens", "", ["app", "model", "kind"], registry=ref)
    ttft = Histogram("fairgate_ttft_seconds", "", ["model"], buckets=LATENCY_BUCKETS, registry=ref)
    wait = Histogram("fairgate_queue_wait_seconds", "", buckets=LATENCY_BUCKETS, registry=ref)
    values = [0.0, 0.005, 0.0051, 0.3, 2.5, 1e9, 0.01]  # on bounds, between them, past the last
    for i, v in enumerate(values):
        m.add(m.tokens, ("chat", "m", "prompt"), i)
        tokens.labels("chat", "m", "prompt").inc(i)
        m.observe(m.ttft, ("m",), v)
        ttft.labels("m").observe(v)
        m.observe(m.queue_wait, (), v)
        wait.observe(v)
        if i == 3:
            m.fold()  # a scrape midway: what came before is not folded twice

    def samples(text: bytes, name: str) -> list[str]:
        return sorted(line for line in text.decode().splitlines()
                      if line.startswith(name) and "_created" not in line)

    got, want = m.exposition(), generate_latest(ref)
    for name in ("fairgate_tokens_total", "fairgate_ttft_seconds", "fairgate_queue_wait_seconds"):
        assert samples(got, name) == samples(want, name) != []
