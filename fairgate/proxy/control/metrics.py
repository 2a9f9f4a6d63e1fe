"""The gateway's own Prometheus metrics (``fairgate_`` prefix; vLLM's names are never re-exported)."""

from __future__ import annotations

import bisect
import hashlib
import os
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from fairgate.printable import printable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def multiprocess() -> bool:
    """``serve --workers N`` set $PROMETHEUS_MULTIPROC_DIR (cli/workers.py): every worker writes its metrics
    there, and a scrape of any worker reads them all (prometheus-client's multiprocess mode)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


# How a gauge of the workers of one `serve --workers N` adds up (ignored with one process): what each worker holds
# sums ("livesum": queues, in flight); what they share through Redis, or each sees of the same thing, is the latest
# any live worker set ("livemostrecent": counters, health, fairness).
SUM, LATEST = "livesum", "livemostrecent"


class GatewayMetrics:
    """One registry per gateway app, so several gateways can live in one process (tests).

    Per-tenant series are capped: the first ``max_tenants`` fairness keys get their own label value, the rest
    share ``other``, so a flood of user ids cannot blow up the time-series count. With ``hash_tenants`` a label
    is a short hash of the fairness key (end users are not named in the monitoring system)."""

    def __init__(self, max_tenants: int = 200, hash_tenants: bool = False) -> None:
        self.max_tenants, self.hash_tenants = max_tenants, hash_tenants
        self._tenants: dict[str, str] = {}  # fairness key → label
        self._children: dict[tuple, object] = {}  # (metric, label values) → its child
        # what requests added since the series were last read (fold): (metric, label values) → amount, or a
        # histogram's count per bucket and, last, the sum of its observations
        self._adds: dict[tuple, float] = {}
        self._observed: dict[tuple, list[float]] = {}
        # under --workers a scrape reaches one worker and reads every worker's files: each update goes there at
        # once, or a scrape would miss what the other workers gathered since their last fold
        self._at_once = multiprocess()
        self._shared_up: Callable[[], bool] | None = None
        self._limits_up: Callable[[], bool] | None = None
        r = self.registry = CollectorRegistry()
        self.requests = Counter("fairgate_requests", "Requests by outcome.",
                                ["app", "model", "endpoint", "status", "code"], registry=r)
        self.slo_requests = Counter("fairgate_slo_requests", "Requests of apps with an SLO class, by whether they "
                                    "met its targets (attainment: met / all).", ["app", "slo_class", "met"], registry=r)
        self.slo_goodput = Counter("fairgate_slo_goodput_tokens", "Completion tokens of requests that met their SLO.",
                                   ["app", "slo_class"], registry=r)
        self.ttft_coverage = Gauge("fairgate_ttft_prediction_coverage", "Fraction of streamed first tokens that "
                                   "came within the p90 TTFT predicted at admission (calibrated to 0.9).",
                                   registry=r, multiprocess_mode=LATEST)
        self.auth_failures = Counter("fairgate_auth_failures", "Requests refused for a bad or missing key.",
                                     registry=r)
        self.tokens = Counter("fairgate_tokens", "Tokens served, by kind (prompt, cached, completion).",
                              ["app", "model", "kind"], registry=r)
        self.duration = Histogram("fairgate_request_duration_seconds", "Arrival to last byte.", ["model"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("fairgate_ttft_seconds", "Arrival to first token.", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.limited = Counter("fairgate_rate_limited", "Requests refused by a limit or a budget (admin limit|budget "
                               "set), by which: {app,user,key}_{rpm,tpm,concurrency,budget_tokens,budget_usd}.",
                               ["reason"], registry=r)
        self.upstream_retries = Counter("fairgate_upstream_retries", "Backends abandoned before a first token.",
                                        registry=r)
        self.client_disconnects = Counter("fairgate_client_disconnects", "Clients gone before the end.",
                                          registry=r)
        self.backend_up = Gauge("fairgate_backend_up", "1 if the backend passed its last health check.",
                                ["backend"], registry=r, multiprocess_mode=LATEST)
        self.backend_inflight = Gauge("fairgate_backend_inflight", "Requests in flight per backend.",
                                      ["backend"], registry=r, multiprocess_mode=SUM)
        self.backend_inflight_tokens = Gauge("fairgate_backend_inflight_tokens",
                                             "KV tokens committed per backend by the gateway.", ["backend"],
                                             registry=r, multiprocess_mode=SUM)
        self.queue_wait = Histogram("fairgate_queue_wait_seconds", "Time in the gateway's fair queue.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("fairgate_queue_depth", "Requests waiting in the gateway's fair queue.",
                                 registry=r, multiprocess_mode=SUM)
        self.tenant_counter = Gauge("fairgate_tenant_counter", "Virtual token counter per tenant.", ["tenant"],
                                    registry=r, multiprocess_mode=LATEST)
        self.tenant_queue_depth = Gauge("fairgate_tenant_queue_depth", "Requests waiting per tenant.", ["tenant"],
                                        registry=r, multiprocess_mode=SUM)
        self.tenant_queue_wait = Histogram("fairgate_tenant_queue_wait_seconds", "Queue wait per tenant.",
                                           ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.tenant_service = Counter("fairgate_tenant_service", "Service received per tenant, in the policy's "
                                      "cost (weighted tokens by default).", ["tenant"], registry=r)
        self.tenant_refusals = Counter("fairgate_tenant_refusals", "Requests refused with a 429 per tenant, by the "
                                       "limit that refused it ({app,user,key}_{rpm,tpm,concurrency,budget_tokens,"
                                       "budget_usd}) or the error code (user_limit, app_limit, slo_unattainable, "
                                       "tenant_queue_full, …).", ["tenant", "reason"], registry=r)
        self.counter_gap = Gauge("fairgate_counter_gap", "Largest counter difference among backlogged tenants.",
                                 registry=r, multiprocess_mode=LATEST)
        self.jain = Gauge("fairgate_jain_index", "Jain's index of weighted service among backlogged tenants.",
                          registry=r, multiprocess_mode=LATEST)
        self.latency_coefficient = Gauge("fairgate_backend_latency_coefficient", "A backend's fitted latency model "
                                         "(prefill k1·l_in + c1, decode step k2·L + c2·b + c3; seconds, per token or "
                                         "per request).", ["backend", "coefficient"], registry=r,
                                         multiprocess_mode=LATEST)
        self.latency_error = Gauge("fairgate_backend_latency_error_seconds", "The residual spread of a backend's "
                                   "latency fit (a 90 % interval is ±1.645 of it).", ["backend", "stage"], registry=r,
                                   multiprocess_mode=LATEST)
        self.latency_samples = Gauge("fairgate_backend_latency_samples", "Observations a backend's latency fit has "
                                     "learnt from.", ["backend", "stage"], registry=r, multiprocess_mode=LATEST)
        self.backends_needed = Gauge("fairgate_backends_needed", "Backends the arrival rate needs at the tightest "
                                     "ATGT target, from the latency fits and the mean lengths (a planning figure: "
                                     "ceil it; summed over workers).", registry=r, multiprocess_mode=SUM)
        self.backend_headroom = Gauge("fairgate_backend_headroom_tokens", "KV tokens the gate may still reserve.",
                                      ["backend"], registry=r, multiprocess_mode=LATEST)
        self.backend_budget = Gauge("fairgate_backend_kv_budget_tokens", "The KV a replica's requests may hold on "
                                    "a backend now, across replicas (its budget curve from the last sync with "
                                    "Redis, at the current step; summed over workers).", ["backend"], registry=r, multiprocess_mode=SUM)
        self.prefix_tokens = Counter("fairgate_prefix_tokens", "Prompt tokens per backend by kind: prompt, cached "
                                     "(the backend's report), predicted (the prefix index's guess at dispatch); "
                                     "the hit rate is cached / prompt.", ["backend", "kind"], registry=r)
        self.tenant_prefix_tokens = Counter("fairgate_tenant_prefix_tokens", "Prompt tokens per tenant by kind "
                                            "(prompt, cached).", ["tenant", "kind"], registry=r)
        self.prefix_index_blocks = Gauge("fairgate_prefix_index_blocks", "Blocks the prefix index believes each "
                                         "backend caches.", ["backend"], registry=r, multiprocess_mode=LATEST)
        self.tenant_deficit = Gauge("fairgate_tenant_deficit", "DLPM's deficit q_i per tenant and backend (D²LPM's "
                                    "Q^w deficit with placement d2lpm).", ["tenant", "backend"], registry=r, multiprocess_mode=LATEST)
        self.usage_pending = Gauge("fairgate_usage_rows_pending", "Usage rows waiting to be written.", registry=r, multiprocess_mode=SUM)
        self.usage_clamped = Counter("fairgate_backend_usage_clamped", "Answers whose reported usage was outside "
                                     "what the request allows (clamped), or whose stream ran past max_tokens "
                                     "(cut).", ["backend"], registry=r)
        self.usage_disagreed = Counter("fairgate_backend_usage_disagreed", "Streams of several choices whose "
                                       "final usage was below the sum of the choices' running counts (the "
                                       "larger is billed).", ["backend"], registry=r)

    def add(self, metric, labels: tuple[str, ...], amount: float) -> None:
        """``metric.labels(*labels).inc(amount)`` when the series are next read (``fold``): a request ends with a
        dozen of these, and a dict's addition costs a fraction of a Prometheus child's locked one (under
        ``--workers``, at once)."""
        key = (metric, labels)
        if self._at_once:
            self.child(metric, *labels).inc(amount)
            return
        self._adds[key] = self._adds.get(key, 0.0) + amount

    def observe(self, metric, labels: tuple[str, ...], value: float) -> None:
        """``metric.labels(*labels).observe(value)`` when the series are next read (``LATENCY_BUCKETS`` only)."""
        key = (metric, labels)
        if self._at_once:
            self.child(metric, *labels).observe(value)
            return
        counts = self._observed.get(key)
        if counts is None:
            counts = self._observed[key] = [0.0] * (len(LATENCY_BUCKETS) + 2)  # the buckets, +Inf, the sum
        counts[bisect.bisect_left(LATENCY_BUCKETS, value)] += 1  # as Histogram.observe: the first bound ≥ it
        counts[-1] += value

    def fold(self) -> None:
        """Into the Prometheus series, what ``add`` and ``observe`` gathered (at a scrape)."""
        adds, self._adds = self._adds, {}
        for (metric, labels), amount in adds.items():
            self.child(metric, *labels).inc(amount)
        observed, self._observed = self._observed, {}
        for (metric, labels), counts in observed.items():
            child = self.child(metric, *labels)
            # prometheus-client keeps a histogram as a count per bucket (cumulated when exposed) and a sum
            for bucket, n in zip(child._buckets, counts):
                if n:
                    bucket.inc(n)
            child._sum.inc(counts[-1])

    def exposition(self) -> bytes:
        """The text a scrape gets: this registry's, or with ``--workers`` every worker's (multiprocess)."""
        self.fold()
        if multiprocess():
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)

    def shared_state(self, up: Callable[[], bool]) -> None:
        """With Redis only: ``fairgate_shared_state_up``, read at each scrape."""
        self.shared_state_up = Gauge("fairgate_shared_state_up", "1 while this replica's shared state is in "
                                     "sync with Redis; 0 while the sync fails (it serves on its own "
                                     "counters, and is not ready).", registry=self.registry,
                                     multiprocess_mode="livemin")  # --workers: 0 if any worker is out of sync
        self._shared_up = up
        self.shared_state_up.set(1.0 if up() else 0.0)

    def limits_shared(self, up: Callable[[], bool]) -> None:
        """With Redis only: ``fairgate_limits_shared_up``, read at each scrape."""
        self.limits_shared_up = Gauge("fairgate_limits_shared_up", "1 while limits and budgets are checked in "
                                      "Redis for the fleet; 0 while this replica enforces its share of each on its "
                                      "own.", registry=self.registry, multiprocess_mode="livemin")
        self._limits_up = up
        self.limits_shared_up.set(1.0 if up() else 0.0)

    def refresh(self) -> None:
        """Gauges read from the state at a scrape (and every second under --workers), and the requests' series
        folded."""
        self.fold()
        if self._shared_up is not None:
            self.shared_state_up.set(1.0 if self._shared_up() else 0.0)
        if self._limits_up is not None:
            self.limits_shared_up.set(1.0 if self._limits_up() else 0.0)

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, kept: labels() builds and locks on every call, a request records seven."""
        key = (metric, labels)
        got = self._children.get(key)
        if got is None:
            got = metric.labels(*labels) if labels else metric
            if len(self._children) < 10_000:  # label values are bounded upstream; this bound is a backstop
                self._children[key] = got
        return got

    def tenant(self, key: str) -> str:
        """The label value for a tenant (capped cardinality)."""
        label = self._tenants.get(key)
        if label is not None:
            return label
        if len(self._tenants) < self.max_tenants:
            label = self._tenants[key] = self.name(key)
            return label
        return "other"

    def name(self, key: str) -> str:
        """What a tenant is shown as (its label, had it one): the console names tenants past the labels' cap."""
        return "t-" + hashlib.sha256(key.encode()).hexdigest()[:12] if self.hash_tenants else printable(key)

    def tenants(self):
        """(fairness key, label) of every tenant with its own series."""
        return self._tenants.items()

    def has_series(self, key: str) -> bool:
        """Whether the tenant ``key`` has its own series already. O(1)."""
        return key in self._tenants


def backend_gauges(m: GatewayMetrics, backends, gate) -> None:
    """Each backend's state as the gate sees it: up, in flight (requests, tokens), KV headroom (what this
    replica may still commit there at every future step: its budget curve, or before one its capacity less the
    other replicas' budgets, less what the gate counts as committed: ``kv_gate``) and its budget now."""
    for b in backends:
        m.backend_up.labels(b.name).set(1 if b.up else 0)
        m.backend_inflight.labels(b.name).set(b.inflight)
        m.backend_inflight_tokens.labels(b.name).set(b.inflight_tokens)
        if b.kv_capacity:
            m.backend_headroom.labels(b.name).set(gate.free(b))
        if (budget := gate.budget(b)) is not None:
            m.backend_budget.labels(b.name).set(budget)


def fairness_gauges(m: GatewayMetrics, scheduler, service: dict[str, float], weight) -> None:
    """Per-tenant counters and queue depth, and the fairness of service among backlogged tenants."""
    waiting = scheduler.waiting_by_client()
    depth = dict.fromkeys((label for _key, label in m.tenants()), 0)
    depth["other"] = 0  # (the tenants past the labels' cap, summed)
    for client, n in waiting.items():
        label = m.tenant(client)
        depth[label] = depth.get(label, 0) + n
    for label, n in depth.items():
        m.tenant_queue_depth.labels(label).set(n)
    for key, label in m.tenants():
        m.tenant_counter.labels(label).set(scheduler.counter(key))
    counters = [scheduler.counter(c) for c in waiting]
    m.counter_gap.set(max(counters) - min(counters) if counters else 0.0)
    shares = [service.get(m.tenant(c), 0.0) / weight(c) for c in waiting]
    m.jain.set(sum(shares) ** 2 / (len(shares) * sum(x * x for x in shares)) if any(shares) else 1.0)
