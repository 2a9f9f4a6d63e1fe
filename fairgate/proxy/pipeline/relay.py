"""Dispatch one request to a backend and relay its answer: retry before the first token, stream after it.

The request is committed to a backend when its first event arrives. Before that, a failing backend (refused
connection, 5xx, dropped stream, timeout) is marked down and the next one is tried; after it, a failure ends
the client's stream with an error event. A client that goes away closes the upstream response at once, so
the backend aborts the generation; what it generated until then is in the tally (running usage on every
chunk) and is charged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import orjson

from fairgate.accounting.tokenizer import count_text
from fairgate.http.client import UpstreamPool, UpstreamProtocolError
from fairgate.http.messages import Request, Response, StreamResponse
from fairgate.policies.views import RequestView
from fairgate.accounting.length import OutputLengths
from fairgate.proxy.call import Attempt, Call, Status, utcnow
from fairgate.proxy.control.latency_fits import LatencyFits
from fairgate.proxy.pipeline.reservation import Reservations
from fairgate.proxy.config import GatewayConfig
from fairgate.proxy.control.backends import Backend, BackendPool
from fairgate.proxy.control.metrics import GatewayMetrics
from fairgate.proxy.control.watch import Watch
from fairgate.proxy.errors import APIError, ClientGone, unavailable
from fairgate.proxy.pipeline.aggregate import Aggregator
from fairgate.storage.response_store import ResponseStore
from fairgate.proxy.pipeline.dispatcher import Dispatcher
from fairgate.proxy.pipeline.upstream import (ANSWERS, DONE, PATHS, UPSTREAM_ERRORS, BackendRejected, Retryable,
                                              ends, error_body, first_event, has_error, parse, read_whole, reads,
                                              relayable, running_usage, stream_end, upstream_body)
from fairgate.proxy.pipeline.quota_gate import QuotaGate
from fairgate.proxy.pipeline.event_relay import EventRelay
from fairgate.proxy.pipeline.validate import GENERATIVE, ParsedRequest

log = logging.getLogger("fairgate.relay")


def _text(choice: Any) -> Any:
    """A whole answer's choice's text (completions) or message content (chat); None if it has neither."""
    if not isinstance(choice, dict):
        return None
    message = choice.get("message")  # (an Anthropic content block has its "text" too)
    return choice.get("text") or (message.get("content") if isinstance(message, dict) else None)

def _events_of(data: bytes) -> list[dict[str, Any]]:
    """A read's events, for their running usage (a malformed one fails the call when the stream is parsed
    whole, at its end)."""
    try:
        return [ev for ev in parse(data) if ev is not DONE]
    except ValueError:
        return []


dumps = orjson.dumps



class Relay:
    def __init__(self, config: GatewayConfig, pool: BackendPool, dispatcher: Dispatcher, metrics: GatewayMetrics,
                 lengths: OutputLengths, latency: LatencyFits, quotas: QuotaGate | None = None,
                 store: ResponseStore | None = None):
        self.config, self.pool, self.dispatcher, self.metrics = config, pool, dispatcher, metrics
        self.quotas = quotas  # limits and budgets: a stream draws on its token limits as it outgrows them
        self.latency = latency  # each backend's latency models, fitted from its streams
        self.reservations = Reservations(config, dispatcher, lengths)
        self.upstream = UpstreamPool(config.connect_timeout_s)  # the backends' own calls (not aiohttp's client)
        self._clamp_logged: set[str] = set()
        self.events = EventRelay(self, store)  # (the Responses and Messages APIs' answers; responses stored)

    async def serve(self, request: Request, parsed: ParsedRequest, call: Call, view: RequestView,
                    extra_headers: dict[str, str]) -> Response | StreamResponse:
        d = await self._dispatch(request, parsed, call, view)
        try:
            if parsed.conversation is not None and d.stream is None:  # the Responses API (pipeline/event_relay.py)
                return await self.events.whole(call, parsed, d, extra_headers)
            if parsed.endpoint in ("responses", "messages") and d.stream is not None:  # (typed events)
                return await self.events.stream(request, parsed, call, d, extra_headers)
            if d.stream is None:  # the backend's whole answer, already read
                return self._whole(call, d, extra_headers)
            if parsed.stream:
                return await self._stream(request, parsed, call, d, extra_headers)
            return await self._collect(parsed, call, d, extra_headers)
        except BaseException:
            d.response.close()  # on a client disconnect this is what makes the backend abort
            raise
        finally:
            if call.status is Status.OK:  # all of it read: the connection serves the next request (no-op once closed)
                d.response.release()
            else:  # a failed stream: the backend stops at once
                d.response.close()
            t = call.tally
            self.dispatcher.finish(d.ticket, d.backend, t.completion_tokens,
                                   t.prompt_tokens if t.usage_seen else None,
                                   t.cached_tokens if t.usage_seen else None)
            call.counter_after = self.dispatcher.scheduler.counter(d.ticket.view.client)
            call.finished_at = utcnow()
            if t.clamped:
                self._clamped(d.backend)
            if t.disagreed:
                self.metrics.child(self.metrics.usage_disagreed, d.backend.name).inc()

    def _overrun(self, call: Call, d: Attempt) -> None:
        """The stream ran past n × max_tokens: it is cut (the client's stream ends with an error event) and
        billed at most what the request allows."""
        call.tally.clamped = True
        call.fail(Status.ERROR, 502, f"backend {d.backend.name} streamed past the request's max_tokens "
                                f"({call.tally.completion_cap} tokens): cut")

    def _clamped(self, backend: Backend) -> None:
        self.metrics.child(self.metrics.usage_clamped, backend.name).inc()
        if backend.name not in self._clamp_logged:  # once per backend: the metric counts the rest
            self._clamp_logged.add(backend.name)
            log.warning("backend %s reported usage outside what a request allows, or streamed past max_tokens: "
                        "clamped (fairgate_backend_usage_clamped counts each time)", backend.name)

    # -- before the first token: wait for a backend in the fair queue, connect, retry -------------------
    async def _dispatch(self, request: Request, parsed: ParsedRequest, call: Call, view: RequestView) -> Attempt:
        # a non-streaming client's request goes whole, unless it sets no max_tokens (a response, no
        # max_output_tokens): then it is streamed and folded, so that a client that leaves is billed what was
        # generated, not a guess (docs/guide/streaming.md) (embeddings and the others are answered whole; their
        # bodies are sent as the gateway made them)
        completion = parsed.endpoint in ("chat", "completions")
        folded = completion or parsed.endpoint == "responses"
        whole = call.whole = not parsed.stream and (not folded or self.config.nonstream_upstream == "json"
                                                    and parsed.max_tokens is not None)
        sent = parsed.body if whole or parsed.stream or completion else {**parsed.body, "stream": True}
        try:
            body = orjson.dumps(upstream_body(sent, stream=not whole) if completion else sent)
        except TypeError:  # (nesting past what JSON is written with: 254 levels)
            raise APIError(400, "the body is nested too deeply", code="invalid_value") from None
        wait_s = self.config.request_timeout_s if whole else self.config.first_token_timeout_s
        n = parsed.body.get("n") or 1
        call.prompts = parsed.prompts
        call.n = n * call.prompts
        output = self.reservations.initial(call, parsed, whole)  # the KV it holds (pipeline/reservation.py)
        kv_tokens = self.reservations.kv(call, parsed, output)
        max_events = call.tally.allow(call.prompts, n, parsed.max_tokens,
                                      parsed.context_limit)  # (Tally clamps to it)
        tried: set[str] = set()
        last_error = "no backend serves this model right now"
        bad_answer = False  # the last backend tried answered something that is not HTTP or not a completion
        while len(call.attempts) < self.config.max_attempts:
            try:
                ticket = await self.dispatcher.acquire(view, kv_tokens, tried, output=output, choices=call.n,
                                                       streamed=not whole)
            except APIError as e:
                if e.status == 503 and tried:  # nothing left to retry on
                    break
                raise
            backend = ticket.future.result()
            call.fairness_key = ticket.view.client  # (the key it waited under: its app's, past max_users_per_app)
            if whole:  # (no first token to see: its prompt does not count as waiting for a prefill there)
                self.dispatcher.started(ticket, backend)
            started = self.dispatcher.now()
            if call.dispatched_at is None:
                call.dispatched_at = utcnow()
                call.counter_before = ticket.counter_before
                call.queue_wait_s = self.dispatcher.now() - ticket.enqueued  # (observed with the row, after)
            tried.add(backend.name)
            attempt = Attempt(backend, started, ticket, max_events=max_events, reserved_output=output)
            call.attempts.append(attempt)
            call.backend = backend.name
            call.predicted_cached_tokens = ticket.predicted_cached
            try:
                async with asyncio.timeout(wait_s):  # (wait_for would run _open as a task of its own)
                    attempt.response, attempt.stream, attempt.first, attempt.first_read = \
                        await self._open(backend, parsed.endpoint, body, whole)
            except BackendRejected as e:
                self.dispatcher.abandon(ticket, backend)
                err = e.body["error"]
                param = err.get("param")
                raise APIError(e.status, str(err.get("message")), param=param if isinstance(param, str) else None,
                               code=err.get("code") if isinstance(err.get("code"), str) else None) from None
            except (Retryable, *UPSTREAM_ERRORS, asyncio.TimeoutError) as e:
                self.dispatcher.abandon(ticket, backend)
                if whole and isinstance(e, asyncio.TimeoutError):  # it may have run all along: not again
                    raise APIError(504, f"no answer within request_timeout_s ({wait_s:.0f} s)",
                                   code="backend_timeout") from None
                last_error = attempt.error = f"backend {backend.name}: {e or type(e).__name__}"[:2000]
                bad_answer = isinstance(e, UpstreamProtocolError)
                log.warning("%s failed before its first token: %s", call.request_id, last_error)
                self.pool.failed(backend, last_error)
                self.metrics.upstream_retries.inc()
                continue
            except BaseException:  # the client went away (cancellation): never leak the backend slot
                call.ran = True  # (the backend may have read its prompt: billed, never a way to prefill free)
                if whole and request.conn.cut:  # the gateway stopped it (the drain's end): nothing was answered,
                    self.dispatcher.finish(ticket, backend, 0, None)  # and no client chose when: no output billed
                elif whole:  # its client left: it may have generated all it could, billed that, not nothing
                    call.tally.completion_tokens = most = self.reservations.most(call, parsed)
                    self.dispatcher.finish(ticket, backend, most, None)
                else:
                    self.dispatcher.abandon(ticket, backend)
                raise
            call.first_token_at, call.ran = utcnow(), True
            self.dispatcher.started(ticket, backend)
            if not whole:  # the first event of a stream: the prefill of its uncached prompt
                now = self.dispatcher.now()
                self.latency.first_event(backend, max(0, call.tally.estimated_prompt - (ticket.predicted_cached or 0)),
                                         now - started, now)
            self.pool.succeeded(backend)
            return attempt
        if bad_answer:
            raise APIError(502, f"the backend's answer was not a completion: {last_error}", code="bad_gateway")
        raise unavailable(f"no backend could serve model {parsed.model!r}: {last_error}",
                          self.config.retry_after_s)

    async def _open(self, backend: Backend, endpoint: str, body: bytes, whole: bool = False):
        self.upstream.connect_timeout_s = self.config.connect_timeout_s
        resp = await self.upstream.post(backend.url, PATHS[endpoint], body)
        try:
            if resp.status >= 500 or resp.status == 404:  # 404: this backend lost the model; try another
                raise Retryable(f"HTTP {resp.status}: {(await error_body(resp))['error']['message']}")
            if 400 <= resp.status < 500:
                raise BackendRejected(resp.status, await error_body(resp))
            if resp.status != 200:  # a 204, 304 or 3xx is no completion: never relayed as a final answer
                raise UpstreamProtocolError(f"HTTP {resp.status} where a completion was expected")
            if whole and resp.content_type != "text/event-stream":  # (a backend may stream regardless)
                raw = await read_whole(resp, self.config.max_event_bytes)
                doc = orjson.loads(raw)
                if (not isinstance(doc, dict) or not isinstance(doc.get(ANSWERS[endpoint]), list)
                        or doc.get("error") is not None):
                    raise Retryable(f"not an answer to {PATHS[endpoint]}: {raw[:200]!r}")
                return resp, None, doc, raw
            stream = reads(resp, self.config.max_event_bytes).__aiter__()
            first_read = await stream.__anext__()
            while (first := first_event(first_read)) is None:  # comments or blank lines only, so far
                first_read = await stream.__anext__()
            if first is DONE:
                raise Retryable("empty stream")
            if "error" in first:
                raise Retryable(f"error event: {str(first['error'])[:1000]}")
            return resp, stream, first, first_read
        except StopAsyncIteration:
            resp.close()
            raise Retryable("stream ended before the first token") from None
        except BaseException:
            resp.close()
            raise

    # -- after the first token ---------------------------------------------------------------------------
    async def _relay(self, d: Attempt, call: Call, parsed: ParsedRequest, watch: Watch,
                     send: Callable[[bytes], Awaitable[None]]) -> dict[str, Any] | None:
        """The stream's reads, each counted and charged as it arrives, then written with ``send`` (one write a
        read), until ``[DONE]``; marks the call failed (and stops) if the backend sends an error or breaks off
        mid-stream. ``watch`` times each wait for the backend. A read in vLLM's shape (``upstream.relayable``)
        is sent as the backend wrote it, less its running usage: its events are not parsed. Returns the final
        usage-only chunk, held back: sent at the end if the client asked for it."""
        data, seen, now, waited, tally = d.first_read, 0, self.dispatcher.now(), 0.0, call.tally
        usage_chunk = None
        try:
            while True:
                fast, tail = relayable(data) if call.n == 1 else None, b""
                if fast is None and call.n == 1:  # the stream's end: the usage-only chunk and [DONE], parsed
                    head, tail = stream_end(data)
                    fast = relayable(head) if head and tail else None
                if fast is not None:
                    raw, events, prompt, completion, cached = fast
                    tally.report(tally.prompt_tokens if prompt is None else prompt, completion, cached)
                    seen += events
                    batch = parse(tail) if tail else []
                elif data is d.first_read and data.count(b"data:") == 1:
                    raw, batch = b"", [d.first]  # parsed for its first event already
                else:
                    raw, batch = b"", parse(data)
                seen += len(batch)
                if seen > d.max_events:
                    self._overrun(call, d)
                    return usage_chunk
                out, end, observed = [], None, 0
                for ev in batch:
                    if ev is DONE:
                        end = "done"
                        break
                    if "error" in ev:
                        end = f"backend error mid-stream: {str(ev['error'])[:1000]}"
                        break
                    tally.observe(ev)
                    observed += 1
                    if "usage" in ev:
                        if not ev.get("choices"):
                            usage_chunk = ev  # the final usage-only chunk: held back, sent at the end if asked
                            continue
                        del ev["usage"]  # running usage the gateway asked for; the client did not
                    out.append(b"data: " + dumps(ev) + b"\n\n")
                if raw or observed:
                    self.reservations.charge(call, parsed, d)  # once per read
                    if call.hold is not None:
                        self.quotas.progress(call)
                    self.latency.stream_read(d.backend, d, tally.completion_tokens, call.n, now, waited)
                    if out:
                        raw += b"".join(out)
                    if raw:
                        await send(raw)  # (one write a read: its bytes as they came, then its parsed events)
                if end is not None:
                    if end != "done":
                        call.fail(Status.ERROR, 502, end)
                    return usage_chunk
                watch.backend()
                asked = self.dispatcher.now()
                data = await d.stream.__anext__()
                now = self.dispatcher.now()
                waited = now - asked
        except StopAsyncIteration:
            call.fail(Status.ERROR, 502, f"backend {d.backend.name} ended the stream without [DONE]")
        except UPSTREAM_ERRORS as e:
            call.fail(Status.ERROR, 502, f"backend {d.backend.name} failed mid-stream: {e or type(e).__name__}")
        return usage_chunk

    async def _stream(self, request: Request, parsed: ParsedRequest, call: Call, d: Attempt,
                      extra_headers: dict[str, str]) -> Response | StreamResponse:
        """Relay as SSE. Once the response has started, whatever fails (the backend, a timeout, a bug) ends
        the stream with an SSE ``error`` event: never raw HTTP inside the event stream."""
        resp = StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       **extra_headers})
        watch = Watch(self.config, d.started)

        async def send(data: bytes) -> None:
            watch.client()
            try:
                await resp.write(data)
            except ConnectionError as e:
                raise ClientGone(str(e), resp) from None

        try:
            await resp.prepare(request)
        except ConnectionError as e:
            raise ClientGone(str(e)) from None

        usage_chunk = None
        try:
            async with watch:
                usage_chunk = await self._relay(d, call, parsed, watch, send)
        except ClientGone:
            raise
        except Exception as e:  # noqa: BLE001 — a bug must not write a fresh HTTP response into the stream
            self.stream_failed(e, request, call, watch, resp)
        # the last events (the usage, [DONE]) are the edge's to write once this request's row is journaled: a
        # process killed as they go loses no row of an answer its client has (proxy/app.py, Gateway._handle)
        resp.end(self._end_stream(call, parsed, d, usage_chunk))
        return resp

    def stream_failed(self, e: Exception, request: Request, call: Call, watch: Watch, resp: StreamResponse) -> None:
        """A started stream that failed: a client that read nothing for ``write_timeout_s`` is dropped (its
        backend aborted); a timeout waiting for the backend fails the call 504, anything else (a bug) 500."""
        if isinstance(e, TimeoutError):
            if watch.waiting == "client" and not watch.past_deadline():
                request.conn.abort()  # it reads nothing: stop waiting for it, and abort the backend
                raise ClientGone(f"the client read nothing for {self.config.write_timeout_s:.0f} s", resp) from None
            call.fail(Status.ERROR, 504, watch.expired())
            return
        log.exception("request %s failed mid-stream", call.request_id)
        call.fail(Status.ERROR, 500, f"internal error mid-stream: {type(e).__name__}")

    def _end_stream(self, call: Call, parsed: ParsedRequest, d: Attempt, usage_chunk) -> bytes:
        if call.status is Status.ERROR:
            code = "backend_timeout" if call.http_status == 504 else "backend_failed"
            err = APIError(call.http_status or 502, call.error or "backend failed", code=code).body()
            return b"data: " + orjson.dumps(err) + b"\n\n"
        if not parsed.include_usage:
            return b"data: [DONE]\n\n"
        head = d.first
        usage_chunk = usage_chunk or {"id": head.get("id"), "object": head.get("object"),
                                      "created": head.get("created"), "model": head.get("model"), "choices": []}
        usage_chunk["usage"] = call.tally.usage()
        return b"data: " + orjson.dumps(usage_chunk) + b"\n\ndata: [DONE]\n\n"

    def _whole(self, call: Call, d: Attempt, extra_headers: dict[str, str]) -> Response:
        """The backend's non-streamed answer, passed on as it came; its usage is the count."""
        call.tally.answered(d.first)
        if not call.tally.usage_seen and call.endpoint in GENERATIVE:  # a backend without usage: the gateway
            # counts the text it answered (a pooling request's prompt stays the gateway's count)
            answer = d.first.get("content" if call.endpoint == "messages" else "choices")
            call.tally.completion_tokens = min(sum(count_text(_text(c)) for c in answer), call.tally.completion_cap)
        self.dispatcher.charge(d.ticket, call.tally.completion_tokens)
        return Response(body=d.first_read, content_type="application/json", headers=extra_headers)

    async def _collect(self, parsed: ParsedRequest, call: Call, d: Attempt,
                       extra_headers: dict[str, str]) -> Response:
        """A non-streaming client: the stream's reads are kept as bytes while it runs, and only its running
        usage is read from each (a byte scan: exact at any moment, so a client that leaves is charged what was
        generated); the events are parsed once, at the end, and folded into one response."""
        watch = Watch(self.config, d.started)
        tally, reads_ = call.tally, [d.first_read]
        data, seen = d.first_read, 0
        try:
            async with watch:
                while True:
                    if call.n == 1:
                        prompt, done = running_usage(data)
                        if done is not None:
                            tally.report(tally.prompt_tokens if prompt is None else prompt, done,
                                         tally.cached_tokens)
                    else:  # each choice's running usage is its own: every event is read (upstream.py)
                        for ev in _events_of(data):
                            tally.observe(ev)
                        done = tally.completion_tokens if tally.usage_seen else None
                    if done is not None:
                        self.reservations.charge(call, parsed, d)  # once per read
                        if call.hold is not None:
                            self.quotas.progress(call)
                        now = self.dispatcher.now()  # (nothing but the backend holds this loop up)
                        self.latency.stream_read(d.backend, d, tally.completion_tokens, call.n, now, now)
                    if ends(data) or has_error(data) and any("error" in ev for ev in parse(data)):
                        break
                    seen += data.count(b"\ndata:") + data.startswith(b"data:")  # (JSON holds no raw newline)
                    if seen > d.max_events:
                        self._overrun(call, d)
                        break
                    watch.backend()
                    data = await d.stream.__anext__()
                    reads_.append(data)
        except TimeoutError:
            call.fail(Status.ERROR, 504, watch.expired())
        except StopAsyncIteration:
            call.fail(Status.ERROR, 502, f"backend {d.backend.name} ended the stream without [DONE]")
        except UPSTREAM_ERRORS as e:
            call.fail(Status.ERROR, 502, f"backend {d.backend.name} failed mid-stream: {e or type(e).__name__}")
        except BaseException:  # its client left
            self._cut(call, reads_)
            raise
        agg = Aggregator(parsed.endpoint)
        if call.status is not Status.ERROR:
            try:
                agg.add_all(self._settle(call, parse(b"".join(reads_))))
            except ValueError as e:
                call.fail(Status.ERROR, 502, f"backend {d.backend.name} sent a malformed event: {e}")
        if call.status is Status.ERROR:
            self._cut(call, reads_)
            raise APIError(call.http_status or 502, call.error or "backend failed",
                           code="backend_timeout" if call.http_status == 504 else "backend_failed")
        return Response(body=orjson.dumps(agg.result(tally.usage())), content_type="application/json",
                        headers=extra_headers)

    @staticmethod
    def _cut(call: Call, reads_: list[bytes]) -> None:
        """A folded stream cut before its end, from a backend that reports no running usage: billed its
        content-bearing chunks so far (as a streaming client's is), not nothing."""
        if call.n == 1 and not call.tally.usage_seen:
            for ev in _events_of(b"".join(reads_)):
                call.tally.observe(ev)

    def _settle(self, call: Call, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The whole stream's events: the last usage is the count; a backend without usage is counted by
        its content-bearing chunks; an error event fails the call."""
        if events and events[-1] is DONE:
            events.pop()
        for k, ev in enumerate(events):
            if "error" in ev:
                call.fail(Status.ERROR, 502, f"backend error mid-stream: {str(ev['error'])[:1000]}")
                return events[:k]
        with_usage = [ev for ev in events if ev.get("usage")]
        for ev in with_usage[-1:] or (events if call.n == 1 else ()):  # (several choices: each read was counted)
            call.tally.observe(ev)
        return events
