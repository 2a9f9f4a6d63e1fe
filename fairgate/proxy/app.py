"""The gateway application: the composition root and the request pipeline (see ``Gateway``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import re
from typing import TYPE_CHECKING, AsyncIterator, Sequence

import aiohttp

from fairgate.accounting.cost import make_cost
from fairgate.accounting.length import OutputLengths
from fairgate.accounting.slo import SLO_HEADERS, SloError
from fairgate.accounting.tokenizer import INLINE_BYTES, Tokenizer, anthropic_messages, off_the_loop, response_messages
from fairgate.http.messages import Request, Response, StreamResponse, json_response
from fairgate.http.routing import Router
from fairgate.http.server import Edge, Limits
from fairgate.logs import ACCESS_LOG
from fairgate.periodic import Periodic
from fairgate.policies.bands import STANDARD
from fairgate.policies.scheduler import Scheduler
from fairgate.policies.views import RequestView
from fairgate.proxy.call import Call, Status, new_request_id, utcnow
from fairgate.proxy.config import BackendConfig, ConfigError, GatewayConfig
from fairgate.proxy.control.backends import BackendPool, OutlierConfig
from fairgate.proxy.control.fairserve import FairServeRuntime
from fairgate.proxy.control.kv_subscriber import KVEventSubscriber
from fairgate.proxy.control.latency_fits import LatencyFits
from fairgate.proxy.live_settings import LiveSettings
from fairgate.proxy.control.locality_settings import record_prefix, request_blocks
from fairgate.proxy.control.metrics import GatewayMetrics, multiprocess
from fairgate.proxy.control.console import Console, refusal_labels
from fairgate.proxy.control.ops import Operations
from fairgate.proxy.control.tenants import Tenants
from fairgate.proxy.errors import APIError, ClientGone, anthropic_response, model_not_found
from fairgate.proxy.pipeline.caller import KeyCache, StageCounter, authenticate, resolve
from fairgate.proxy.pipeline.forecast import TtftForecast
from fairgate.proxy.pipeline.forward import backend_body, cache_salt
from fairgate.proxy.pipeline.quota_gate import QuotaGate
from fairgate.proxy.pipeline.relay import Relay
from fairgate.proxy.pipeline.responses import converse, known_shape
from fairgate.proxy.stored_responses import StoredResponses
from fairgate.proxy.token_routes import TokenRoutes
from fairgate.proxy.pipeline.shedding import expected_from, refusal
from fairgate.proxy.pipeline.validate import ParsedRequest, body_of, parse
from fairgate.quota.redis_store import SharedQuotas
from fairgate.quota.spend import spent_since
from fairgate.quota.stores import MemoryQuotas
from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
from fairgate.storage.identity import user_key
from fairgate.storage.response_store import ResponseStore
from fairgate.storage.shared_state import SharedState
from fairgate.storage.usage_journal import Journal, JournalBusy
from fairgate.storage.usage_writer import UsageWriter

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from fairgate.engine.serve import Emulator

log = logging.getLogger("fairgate")
REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")


class Gateway:
    """The composition root: every component built up front, in dependency order, awaiting nothing (what must
    be awaited first — the schema, the database's settings, the embedded backends — ``open`` does before);
    ``running`` starts them, then stops them in order. A request's walk is ``_handle``: admitted (``_admit``:
    authenticated, parsed, limited, counted), queued and relayed (``relay.serve``), settled (``settle``: its
    usage row, its limits, metrics and statistics)."""

    def __init__(self, config: GatewayConfig, tenants: Tenants, db: AsyncEngine, emulators: Sequence[Emulator] = ()):
        c = self.config = config
        self.db, self.sessions, self.tenants, self.emulators = db, tenants.sessions, tenants, list(emulators)
        self._loop: asyncio.AbstractEventLoop | None = None  # (known from the first request's end on)
        self.keys = KeyCache(self.sessions, c.identity_cache_ttl_s)
        try:
            journal = Journal(c.journal_path(), c.usage_journal_fsync_s,
                              legacy=c.legacy_usage_paths())  # (and an earlier version's rows)
        except JournalBusy as e:
            raise ConfigError(str(e)) from None
        self.writer = UsageWriter(self.sessions, dead_letter=c.dead_letter_path(), journal=journal)
        self.metrics = GatewayMetrics(hash_tenants=c.hash_tenant_labels)
        self.stages = StageCounter()
        self._tokenizers: dict[str, Tokenizer] = {}
        self.tokenizer(c.tokenizer)  # the encoding loaded now, not on the first request
        self.cost = make_cost(c.cost)
        self.latency = LatencyFits(c.latency_profile)  # each backend's latency models, fitted from its streams
        self.forecast = TtftForecast()  # each classed request's calibrated p90 TTFT
        self.lengths = OutputLengths()  # per replica: the outputs seen per app, stage and prompt (reservations)
        self.mean_lengths: tuple[float, float] | None = None  # served requests' prompt and output per choice
        self.service: dict[str, float] = {}  # weighted service received per tenant label (this process)
        backends = list(c.backends) or [BackendConfig(url=emu.url, name=f"emulated-{i}", kv_events=emu.kv_events)
                                        for i, emu in enumerate(self.emulators)]
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))
        self.pool = BackendPool(backends, self.session, c.health_interval_s, OutlierConfig(
            c.outlier_consecutive_failures, c.outlier_ejection_s))
        self.shared = SharedState(c.redis_url, c.redis_namespace, interval_s=c.redis_sync_s) if c.redis_url else None
        store = MemoryQuotas()  # the limits' meters: this process's, or the fleet's (beside the sync)
        if self.shared is not None:
            store = SharedQuotas(self.shared.redis, self.shared.tag, self.shared.replica, self.shared.ttl_s,
                                 deferred=True, holds_s=c.queue_timeout_s + c.request_timeout_s)
            self.shared.riders.append(store)
            self.metrics.shared_state(lambda: self.shared.up)
            self.metrics.limits_shared(lambda: store.up)
        self.fairserve = FairServeRuntime(c.fairserve, self.sessions, self.tenants, c.rpm_limit,
                                          self.shared.stats() if self.shared else None)
        self.live = LiveSettings(c, self.pool, self.tenants, self.fairserve, self.cost, self.latency,
                                 self.lengths, self.shared)  # the policy and placement in force, and the index
        self.dispatcher = self.live.dispatcher
        index = self.live.index
        self.kv_events = (KVEventSubscriber(index, {b.name: cfg.kv_events for b, cfg in  # every backend's
                                                    zip(self.pool.backends, backends) if cfg.kv_events})
                          if index is not None and index.precise else None)  # KV events, folded into the index
        self.quotas = QuotaGate(self.tenants, store, self.cost, self.lengths, c.budget_timezone, c.budget_overdraw,
                                self.metrics, functools.partial(spent_since, self.sessions))
        self.responses = ResponseStore(self.db, c.response_retention_s, c.response_max_turns)
        self.relay = Relay(c, self.pool, self.dispatcher, self.metrics, self.lengths, self.latency, self.quotas,
                           self.responses)
        self.stored = StoredResponses(self)  # the routes that read, list and delete stored responses
        self.tokens = TokenRoutes(self)  # /tokenize and /detokenize, sent to a backend of the model
        self._purge = Periodic("responses-purge", 600.0, self._purge_responses)  # (past retention: forgotten)
        self.console = Console(self)  # (a live page on the operations listener, when there is one)
        self._stored_bytes = Periodic("responses-bytes", c.settings_refresh_s, self.responses.refresh)  # (the
        # fleet's totals by app: what other replicas stored)
        self.ops = Operations(self)
        self.pool.on_refresh.append(self.dispatcher.pump)
        self.tenants.on_settings.append(self.live.apply)
        self.live.apply(self.tenants.settings)
        self._calls = 0  # requests between authentication and their usage row

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, config: GatewayConfig) -> AsyncIterator[Gateway]:
        """A gateway built and running: the schema checked, the database's settings read, the embedded backends
        started when none is named."""
        db = make_engine(config.database_url)
        emulators: list[Emulator] = []
        try:
            await ensure_schema(db)
            tenants = Tenants(sessionmaker(db), config.settings_refresh_s, config.rpm_limit)
            await tenants.refresh()
            if not config.backends:
                from fairgate.engine.serve import start_emulated  # the emulator only when no backend is named

                emulators = await start_emulated(config.emulated, config.locality.index == "precise")
            gateway = cls(config, tenants, db, emulators)
            await gateway.responses.refresh()  # (what each app's stored responses take)
        except BaseException:
            for emu in emulators:
                await emu.stop()
            await db.dispose()
            raise
        async with gateway.running():
            yield gateway

    @property
    def scheduler(self) -> Scheduler:
        """The policy in force."""
        return self.dispatcher.scheduler

    # -- lifecycle -----------------------------------------------------------------------------------
    def router(self) -> Router:
        r = Router()
        r.add("POST", "/v1/chat/completions", functools.partial(self._handle, endpoint="chat"))
        r.add("POST", "/v1/completions", functools.partial(self._handle, endpoint="completions"))
        r.add("POST", "/v1/embeddings", functools.partial(self._handle, endpoint="embeddings"))
        for path, endpoint in (("/v1/rerank", "rerank"), ("/rerank", "rerank"), ("/v1/score", "score"),
                               ("/score", "score")):  # (vLLM serves both paths)
            r.add("POST", path, functools.partial(self._handle, endpoint=endpoint))
        r.add("POST", "/v1/responses", functools.partial(self._handle, endpoint="responses"))
        r.add("POST", "/v1/messages", functools.partial(self._handle, endpoint="messages"))
        r.add("POST", "/v1/messages/count_tokens", self.tokens.count_message_tokens)
        r.add("POST", "/v1/responses/input_tokens", self.stored.input_tokens)
        r.add("POST", "/tokenize", self.tokens.tokenize)
        r.add("POST", "/detokenize", self.tokens.detokenize)
        r.add_prefix("GET", "/v1/responses/", "rest", self.stored.read)
        r.add_prefix("DELETE", "/v1/responses/", "rest", self.stored.delete)
        r.add_prefix("POST", "/v1/responses/", "rest", self.stored.cancel)
        r.add("GET", "/v1/models", self.list_models)
        r.add_prefix("GET", "/v1/models/", "model", self.get_model)
        r.add("GET", "/health", self.ops.health)
        r.add("GET", "/ready", self.ops.ready)
        if self.config.ops_port is None:  # else /metrics is served on the operations port only
            r.add("GET", "/metrics", self.ops.prometheus)
        return r

    def edge(self, router: Router | None = None, listener: str = "public") -> Edge:
        """The listener for ``router`` (the public routes by default), with the configured limits."""
        c = self.config
        limits = Limits(max_body_bytes=c.max_body_bytes, header_timeout_s=c.header_timeout_s,
                        max_connections=c.max_connections, max_connections_per_client=c.max_connections_per_client,
                        anonymous_idle_s=c.anonymous_idle_s, anonymous_rate=c.anonymous_rate,
                        write_timeout_s=c.write_timeout_s)
        return Edge(router or self.router(), limits, listener=listener, error_type=APIError)

    async def _last_rows(self, timeout_s: float = 5.0) -> None:
        """Requests cancelled at the end of the drain record their rows as their cancellation runs: let them,
        before the usage writer closes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._calls and loop.time() < deadline:
            await asyncio.sleep(0.01)

    @contextlib.asynccontextmanager
    async def running(self):
        """Every component started; stopped in order on the way out (after the listener's drain)."""
        c = self.config
        await self.writer.start()
        await self.tenants.start()
        await self.fairserve.start()
        if self.kv_events is not None:
            self.kv_events.start()
        await self.live.share_index()
        if self.shared is not None:
            await self.shared.start()
        await self.pool.start()
        self._purge.start()
        self._stored_bytes.start()
        gauges = Periodic("metrics-gauges", 1.0, self.ops.set_gauges) if multiprocess() else None
        if gauges is not None:
            gauges.start()
        ops = None
        if c.ops_port is not None:  # under --workers every worker listens (SO_REUSEPORT): each scrape sees all
            ops = self.edge(self.ops.router(), listener="ops")
            await ops.start(c.ops_host, c.ops_port, reuse_port=multiprocess())
            self.console.start()
        try:
            yield self
        finally:
            if gauges is not None:
                await gauges.stop()
            await self._stop(ops)

    async def _stop(self, ops: Edge | None) -> None:
        # every step runs whatever the others do: a failing snapshot must not keep the usage rows from disk
        steps = [self._last_rows] + ([self.console.stop, functools.partial(ops.shutdown, 1.0)] if ops is not None
                                     else [])
        steps += [self._stop_dispatch, self._purge.stop, self._stored_bytes.stop, self.quotas.drain, self.fairserve.stop,
                  *([self.shared.stop] if self.shared else []), self.tenants.stop,
                  *([self.kv_events.stop] if self.kv_events else []), self.live.stop, self.pool.stop,
                  self.session.close, self.relay.upstream.close,
                  lambda: self.writer.close(self.config.usage_flush_at_stop_s),
                  *(emu.stop for emu in self.emulators), self.db.dispose]
        for step in steps:
            try:
                await step()
            except Exception:
                log.exception("shutdown step %s failed", getattr(step, "__qualname__", step))

    async def _purge_responses(self) -> None:
        if (n := await self.responses.purge(utcnow())) > 0:
            log.info("forgot %d stored responses past their retention", n)

    async def _stop_dispatch(self) -> None:
        self.dispatcher.close()

    def tokenizer(self, model: str) -> Tokenizer:
        enc = self.config.tokenizers.get(model, self.config.tokenizer)
        if enc not in self._tokenizers:
            self._tokenizers[enc] = Tokenizer(enc, self.config.prompt_media_tokens)
        return self._tokenizers[enc]

    # -- OpenAI routes -------------------------------------------------------------------------------
    async def _handle(self, request: Request, endpoint: str) -> Response | StreamResponse:
        # the client's x-request-id is recorded and echoed, never a key: the gateway's own id is unique
        request_id = new_request_id()
        given = request.headers.get("x-request-id")
        client_request_id = given if given is not None and REQUEST_ID.match(given) else None
        echo = client_request_id or request_id
        try:
            key = await authenticate(request, self.keys)
        except APIError as e:
            if e.status == 401:
                self.metrics.auth_failures.inc()
            return anthropic_response(e, echo) if endpoint == "messages" else e.response(echo)
        request.trust()  # the connection is a tenant's: it keeps its slot (fairgate.http.server)
        call = Call(request_id, endpoint, app=key.app, user=key.user, key_id=key.key_id,
                    client_request_id=client_request_id)
        self._calls += 1
        retry = request.headers.get("x-stainless-retry-count", "0")
        if retry.isascii() and retry.isdigit():  # informational: clamped, never refused
            call.client_retry = min(int(retry) if len(retry) <= 3 else 100, 100)
        try:
            parsed, view, headers = await self._admit(request, endpoint, call, key, echo)
            return await self.relay.serve(request, parsed, call, view, headers)  # queued, then relayed
        except APIError as e:
            status = Status.THROTTLED if e.status == 429 else Status.REJECTED if e.status < 500 else Status.ERROR
            call.fail(status, e.status, e.message)
            if status is Status.THROTTLED:
                call.throttle_reason = e.code
            response = anthropic_response(e, echo) if endpoint == "messages" else e.response(echo)
            for name, value in (call.hold.headers if call.hold is not None else  # (the client's limits)
                                self.quotas.last_headers(call.key_id)).items():
                response.headers.setdefault(name, value)
            return response
        except asyncio.CancelledError:
            if request.conn.cut:  # (the drain's end, not the client)
                call.fail(Status.CANCELLED, 503,
                          f"the gateway stopped before it ended (drain_s {self.config.drain_s:g} s)")
            else:
                call.fail(Status.CANCELLED, 499, "client disconnected")
                self.metrics.client_disconnects.inc()
            raise
        except ClientGone as gone:  # nothing more can reach the client; the edge closes the connection
            call.fail(Status.CANCELLED, 499, "client disconnected")
            self.metrics.client_disconnects.inc()
            return gone.response or Response(status=499)
        except Exception as e:
            log.exception("request %s failed", request_id)
            call.fail(Status.ERROR, 500, f"internal error: {type(e).__name__}")
            e = APIError(500, "internal error in the gateway", type="server_error")
            return anthropic_response(e, echo) if endpoint == "messages" else e.response(echo)
        finally:
            self._calls -= 1
            self.settle(call)

    async def _admit(self, request: Request, endpoint: str, call: Call, key,
                     echo: str) -> tuple[ParsedRequest, RequestView, dict[str, str]]:
        """A request made ready to queue, or refused (an ``APIError``): its body read and parsed, its caller
        resolved, its SLO targets, its prompt counted (and its blocks, for the prefix index), its limits and
        budget reserved. Returns what the relay needs: the request, its view for the policy, its headers."""
        raw = await body_of(request, self.config.max_body_bytes, self.config.body_timeout_s)
        parsed = parse(raw, endpoint)
        call.model, call.stream = parsed.model, parsed.stream
        caller = resolve(request, key, parsed.user, call.request_id, self.stages, self.tenants.is_shared)
        call.user, call.interaction, call.stage = caller.user, caller.interaction, caller.stage
        call.continuable = caller.named_interaction
        call.fairness_key = caller.fairness_key(self.config.fairness_key)  # (a refusal's too: whose it was)
        self.quotas.precheck(call, caller.user_shared, request_limits=self.config.policy != "fairserve",
                             continues=endpoint == "responses" and known_shape(parsed.body.get("previous_response_id")))
        if endpoint == "responses":  # its conversation: the chain it continues, read before it queues
            caller = await converse(parsed, caller, self.responses, self.config)
            call.interaction, call.stage = caller.interaction, caller.stage
            call.continuable = caller.named_interaction  # (a conversation's turns all key it alike)
        if (slo := self.tenants.slo_class(caller.app)) is not None:  # its targets: the class's, tightened
            allowed = SLO_HEADERS in self.tenants.allowed_fields(caller.app)  # by its headers if allowed
            call.slo_class = slo.name
            try:
                call.slo_ttft_ms, call.slo_atgt_ms = slo.targets(request.headers if allowed else None)
            except SloError as e:
                raise APIError(400, str(e), code="invalid_slo_header") from None
        if parsed.model not in self.pool.known_models():
            raise model_not_found(parsed.model)
        parsed.context_limit = limit = self.pool.context_limit(parsed.model)
        if limit is not None and parsed.max_tokens is not None and parsed.max_tokens >= limit:
            # never queued: it could never run, and waiting for an empty backend would stall the queue
            raise APIError(400, f"This model's maximum context length is {limit} tokens; max_tokens "
                           f"{parsed.max_tokens} leaves no room for the prompt.", param="max_tokens",
                           code="context_length_exceeded")
        tok = self.tokenizer(parsed.model)
        if endpoint == "responses":  # the whole conversation, as the backend will render it
            conv = parsed.conversation
            parsed.body = {**parsed.body, "input": conv.expanded(), "store": False}
            parsed.body.pop("previous_response_id", None)
            counting = functools.partial(tok.count_chat, response_messages(parsed.body.get("instructions"),
                                                                     parsed.body["input"]),
                                         (caller.app, caller.user), parsed.body)
        elif endpoint == "messages":  # (Anthropic's: as the chat template renders its turns)
            counting = functools.partial(tok.count_chat, anthropic_messages(parsed.body.get("system"),
                                                                            parsed.body["messages"]),
                                         (caller.app, caller.user), parsed.body)
        elif endpoint == "chat":
            counting = functools.partial(tok.count_chat, parsed.body["messages"], (caller.app, caller.user),
                                         parsed.body)
        else:
            counting = functools.partial(tok.count_completion, parsed.prompt)
        # a large prompt is tokenized in a thread (tiktoken releases the GIL), not on the loop every stream uses
        size = len(raw) + (conv.previous.chain_bytes if endpoint == "responses" and conv.previous else 0)
        count = await off_the_loop(counting, size)
        call.tally.estimated_prompt = call.tally.prompt_tokens = count.prompt_tokens
        call.tally.system_tokens = count.system_tokens
        salt = cache_salt(self.config.cache_salt, caller.app,
                          user_key(caller.app, caller.user, caller.user_shared) if caller.user else None)
        parsed.body = backend_body(parsed.body, self.tenants.allowed_fields(caller.app), salt, endpoint)
        blocks: tuple[int, ...] = ()
        if self.live.index is not None and parsed.generates:  # the prompt's blocks under the tenant's salt
            blocks, model_count = await request_blocks(self.config.locality, tok, endpoint, parsed.body, salt,
                                                       size > INLINE_BYTES, self.session,
                                                       self.pool.candidates(parsed.model))
            if model_count is not None:  # the model's own count (its tokenizer, via /tokenize): exact
                count = dataclasses.replace(count, prompt_tokens=model_count)
                call.tally.estimated_prompt = call.tally.prompt_tokens = model_count
        client, call.policy = call.fairness_key, self.config.policy
        view = RequestView(call.request_id, client, caller.app, parsed.model, count.prompt_tokens,
                           parsed.max_tokens, caller.scoped_interaction, caller.stage,
                           arrival=self.dispatcher.now(), system_tokens=count.system_tokens, blocks=blocks,
                           band=STANDARD if slo is None else slo.rank,
                           ttft_s=None if call.slo_ttft_ms is None else call.slo_ttft_ms / 1000,
                           atgt_s=None if call.slo_atgt_ms is None else call.slo_atgt_ms / 1000)
        if slo is not None:  # its calibrated p90 TTFT; a sheddable one is served late, or refused now
            fits = [(self.latency.of(b), b.prefilling) for b in self.pool.candidates(parsed.model)]
            ahead, rate = self.scheduler.waiting_ahead(view), self.dispatcher.rate.per_s(self.dispatcher.now())
            point = self.forecast.predict(call, ahead, rate, count.prompt_tokens, fits)
            if slo.sheddable and call.slo_ttft_ms is not None and (shed := refusal(
                    expected_from(ahead, point), call.slo_ttft_ms, self.config.retry_after_s)) is not None:
                raise shed
        # limits and budgets (pipeline/quota_gate.py): reserved last, so nothing refused later holds them
        await self.quotas.admit(call, parsed, caller.user_shared, request_limits=self.config.policy != "fairserve")
        return parsed, view, {"x-request-id": echo, **(call.hold.headers if call.hold is not None else {})}

    def settle(self, call: Call) -> None:
        """A request's end, once, whatever it was: its usage row queued and journaled before the edge writes the
        response, or a stream's last events (the usage, [DONE]), so a process killed at any point loses no row
        of an answer its client has; its limits, metrics and statistics after the response is written
        (``_record``: not the client's to wait for)."""
        row = call.row()
        self.writer.submit(row)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._record, call, row)

    def _record(self, call: Call, row: dict) -> None:
        """After the response: its limits settled, its access record, its statistics."""
        self.quotas.settle(call)
        ACCESS_LOG.record(row, call.interaction or None, call.first_token_at)
        self._observe(call, row)

    def _observe(self, call: Call, row: dict) -> None:
        """What a request's end adds to the metrics, and teaches the gateway: FairServe's app statistics, the
        mean lengths, the output lengths its reservations predict, the TTFT forecasts' calibration."""
        self.fairserve.observe(call)
        m, tally = self.metrics, call.tally
        # a model label only for a model the pool serves: a client naming random models must not add series
        model = call.model if call.backend or call.model in self.pool.known_models() else "unknown"
        if call.fairness_key and call.dispatched_at:
            tenant = m.tenant(call.fairness_key)
            if call.ran:  # (its service: what a backend ran, as billed)
                served = self.cost.h(tally.prompt_tokens, tally.completion_tokens)
                self.service[tenant] = self.service.get(tenant, 0.0) + served
                m.add(m.tenant_service, (tenant,), served)
            if call.queue_wait_s is not None:
                m.observe(m.queue_wait, (), call.queue_wait_s)
                m.observe(m.tenant_queue_wait, (tenant,), call.queue_wait_s)
        m.add(m.requests, (call.app, model, call.endpoint, call.status.value, str(call.http_status)), 1)
        if call.status is Status.THROTTLED:  # (who was refused, and why: the console's)
            m.add(m.tenant_refusals, refusal_labels(m, call), 1)
        if call.status is Status.OK and tally.completion_tokens:  # the mean lengths (fairgate_backends_needed)
            seen = (tally.prompt_tokens / call.prompts, tally.completion_tokens / call.n)
            was = self.mean_lengths or seen  # (moving means; the first sets them)
            self.mean_lengths = (0.98 * was[0] + 0.02 * seen[0], 0.98 * was[1] + 0.02 * seen[1])
        if call.status is Status.OK and 0 < tally.completion_tokens and call.max_output:
            # its length per choice, keyed as predicted; one that reached all it could produce was cut (censored)
            self.lengths.observe(call.app, call.stage, tally.estimated_prompt // call.prompts,
                                 tally.completion_tokens // call.n,
                                 cut=call.output_capped and tally.completion_tokens >= call.max_output)
        self.forecast.settle(call, streamed=call.status is Status.OK and not call.whole)
        if (met := call.slo_met()) is not None:  # (apps and classes are an admin's: bounded)
            m.add(m.slo_requests, (call.app, call.slo_class, "true" if met else "false"), 1)
            if met:
                m.add(m.slo_goodput, (call.app, call.slo_class), tally.completion_tokens)
        m.add(m.tokens, (call.app, model, "prompt"), row["prompt_tokens"])
        m.add(m.tokens, (call.app, model, "cached"), tally.cached_tokens)
        m.add(m.tokens, (call.app, model, "completion"), tally.completion_tokens)
        if call.backend and tally.usage_seen:
            record_prefix(self.metrics, call)
        if call.first_token_at:
            m.observe(m.ttft, (model,), (call.first_token_at - call.arrival).total_seconds())
        if call.finished_at:
            m.observe(m.duration, (model,), (call.finished_at - call.arrival).total_seconds())

    async def list_models(self, request: Request) -> Response:
        await authenticate(request, self.keys)  # as OpenAI: 401 without a key
        data = [self._card(m) for m in sorted(self.pool.models())]
        return json_response({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        await authenticate(request, self.keys)
        model = request.match_info["model"]
        if model not in self.pool.known_models():
            raise model_not_found(model)
        return json_response(self._card(model))

    def _card(self, model: str) -> dict:
        """OpenAI's model object, with vLLM's ``max_model_len`` (the context its backends accept) when known."""
        card = {"id": model, "object": "model", "created": 0, "owned_by": "fairgate"}
        if (limit := self.pool.context_limit(model)) is not None:
            card["max_model_len"] = limit
        return card
