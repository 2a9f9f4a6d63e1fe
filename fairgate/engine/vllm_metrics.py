"""vLLM's Prometheus names for the emulated server, rendered from the engine's state at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fairgate.engine.batching import Engine


class _EngineCollector:
    def __init__(self, engine: Engine, model: str):
        self.engine, self.model = engine, model

    def collect(self):
        e, labels, values = self.engine, ["model_name", "engine"], [self.model, "0"]

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", len(e.running))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", e.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, a fraction 0..1.", e.kv_usage)
        hits = e.cache.hits if e.cache else 0
        queries = e.cache.queries if e.cache else 0
        yield counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", hits)
        yield counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", queries)
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", e.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Generation tokens processed.", e.generation_tokens_total)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", e.preemptions_total)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the cache config.",
                                 labels=["block_size", "enable_prefix_caching", "num_gpu_blocks",
                                         "kv_cache_size_tokens", "max_num_seqs", "engine"])
        bs = e.profile.block_size
        info.add_metric([str(bs), str(e.cache is not None), str(e.kv_tokens // bs), str(e.kv_tokens),
                         str(e.max_num_seqs), "0"], 1.0)
        yield info


def engine_metrics_text(engine: Engine, model: str) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine, model))
    return generate_latest(registry).decode()
