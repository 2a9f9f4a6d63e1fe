"""The gateway's operations routes: /health, /ready (with its reasons for operators), /metrics (to operators
only, unless opened on purpose), and the optional operations listener (``ops_port``). A component of
``Gateway`` (``proxy/app.py``), reading its parts."""

from __future__ import annotations

import hmac

from fairgate.accounting.capacity import backend_rate, backends_needed
from fairgate.http.messages import Request, Response, json_response
from fairgate.http.routing import Router
from fairgate.proxy.control.locality_settings import locality_gauges
from fairgate.proxy.control.metrics import backend_gauges, fairness_gauges
from fairgate.proxy.errors import APIError


class Operations:
    def __init__(self, gateway):
        self.gateway = gateway

    def _backends_needed(self) -> float:
        """fairgate_backends_needed: the arrival rate over what each serving backend sustains at the tightest
        ATGT target of the SLO classes (accounting/capacity.py)."""
        targets = [c.atgt_ms for c in self.gateway.tenants.slo_classes().values() if c.atgt_ms is not None]
        atgt = min(targets) / 1000.0 if targets else None
        mean_in, mean_out = self.gateway.mean_lengths or (512.0, 256.0)  # (nothing served yet: a guess)
        rates = [backend_rate(self.gateway.latency.of(b), b.kv_capacity, mean_in, mean_out, atgt, b.max_num_seqs or 256)
                 for b in self.gateway.pool.backends if b.up]
        if not rates:  # none up: a backend of the seed profile's speed (so a scaler can start from zero)
            rates = [backend_rate(self.gateway.latency.seed(), None, mean_in, mean_out, atgt)]
        return backends_needed(self.gateway.dispatcher.arrivals.per_s(self.gateway.dispatcher.now()), rates)

    def router(self) -> Router:
        """The operations port (``ops_port``): /metrics and /ready with backend details, for the monitoring
        network only."""
        r = Router()
        r.add("GET", "/metrics", self.prometheus)
        r.add("GET", "/ready", self.ready)
        console = self.gateway.console  # (proxy/control/console.py: the operations listener's alone)
        r.add("GET", "/console", console.page)
        r.add("GET", "/console/events", console.events)
        r.add("GET", "/console/access", console.access)
        r.add_prefix("GET", "/console/", "asset", console.page)
        return r

    def _operator(self, request: Request) -> bool:
        """The caller may see operational detail: it came in on the operations port, or it sent ops_token."""
        if request.listener == "ops":
            return True
        token = self.gateway.config.ops_token
        if token is None:
            return False
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
            request.trust()  # an operator's connection (a scraper's) is not paced or evicted
            return True
        return False

    async def health(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """503 until a backend is up, and while the shared state's sync with Redis fails (the replica serves
        on its own counters: not fair with the others). Backends and reasons for operators (``_operator``)."""
        reasons = [] if any(b.up for b in self.gateway.pool.backends) else ["no backend is up"]
        if self.gateway.shared is not None and not self.gateway.shared.up:
            reasons.append(f"shared state: {self.gateway.shared.problem}")
        if self.gateway.shared is not None and not (quotas := self.gateway.quotas.store).up:
            reasons.append(f"limits and budgets: {quotas.link.reason}; each enforced at this replica's share "
                           f"(1/{quotas.replicas})")
        if (journal := self.gateway.writer.journal) is not None and journal.error:
            reasons.append(f"usage journal: {journal.error}; rows are not safe from a crash")
        body: dict = {"ready": not reasons}
        if self._operator(request):
            fits = {row.pop("backend"): row for row in self.gateway.latency.rows()}  # (its latency fit, once seen)
            body["backends"] = {b.name: {"up": b.up, "models": sorted(b.models), "error": b.last_error,
                                         **({"latency": fits[b.name]} if b.name in fits else {})}
                                for b in self.gateway.pool.backends}
            body["reasons"] = reasons
        return json_response(body, status=503 if reasons else 200)

    async def prometheus(self, request: Request) -> Response:
        if not self._operator(request):  # it names every tenant: not for any caller unless opened on purpose
            if self.gateway.config.ops_token is not None:
                raise APIError(401, "/metrics needs the operations token: 'Authorization: Bearer <ops_token>'",
                               code="invalid_api_key")
            if not self.gateway.config.metrics_public:
                raise APIError(403, "/metrics is served to operators only: set ops_token (and send it), ops_port, "
                               "or metrics_public: true", code="metrics_not_public")
        self._gauges()
        return Response(body=self.gateway.metrics.exposition(), content_type="text/plain; version=0.0.4")

    async def set_gauges(self) -> None:
        self._gauges()

    def _gauges(self) -> None:
        """Set the gauges from the state now (at a scrape; every second under `serve --workers`, so a scrape
        of one worker reads the others' fresh)."""
        m = self.gateway.metrics
        m.refresh()
        backend_gauges(m, self.gateway.pool.backends, self.gateway.dispatcher.gate)
        m.usage_pending.set(self.gateway.writer.pending)
        m.queue_depth.set(len(self.gateway.dispatcher))
        fairness_gauges(m, self.gateway.scheduler, self.gateway.service, self.gateway.tenants.weight)
        self.gateway.latency.export(m)
        if (coverage := self.gateway.forecast.calibration.coverage) is not None:
            m.ttft_coverage.set(coverage)
        m.backends_needed.set(self._backends_needed())
        locality_gauges(self.gateway.metrics, self.gateway.live.index, [b.name for b in self.gateway.pool.backends], self.gateway.scheduler,
                        self.gateway.dispatcher.placement)
