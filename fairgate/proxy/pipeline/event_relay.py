"""Answers whose streams are typed SSE events (``event: <type>`` and ``data: {…}``) relayed: the Responses API's
and Anthropic's Messages API's. Counted as they stream — each output delta a token — until the usage the
dialect reads (a response's terminal event; Anthropic's ``message_start`` and ``message_delta``). A Responses
answer has its response object named as the gateway's (pipeline/responses.py) and is stored before the client
gets its last event, so a follow-up on any replica finds it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from fairgate.http.messages import Request, Response, StreamResponse
from fairgate.proxy.call import Attempt, Call, Status, utcnow
from fairgate.proxy.control.watch import Watch
from fairgate.proxy.errors import APIError, ClientGone, anthropic_body
from fairgate.proxy.pipeline.responses import NAMED, TERMINAL, event_bytes, events
from fairgate.proxy.pipeline.upstream import UPSTREAM_ERRORS
from fairgate.accounting.tokenizer import count_text
from fairgate.proxy.pipeline.validate import ParsedRequest
from fairgate.storage.response_store import ResponseStore

if TYPE_CHECKING:
    from fairgate.proxy.pipeline.relay import Relay

log = logging.getLogger("fairgate.relay")
DELTA = b".delta"  # an event carrying a piece of output: output text, a function call's arguments, reasoning
MAX_OTHER_EVENTS = 256  # a stream's events beyond two per output token (items and parts opened and closed)


def _output_text(response: dict[str, Any]) -> str:
    """The text of a response's output items: messages' text parts, function calls' arguments, reasoning."""
    out = []
    for item in response.get("output") if isinstance(response.get("output"), list) else ():
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("arguments"), str):
            out.append(item["arguments"])
        for key in ("content", "summary"):
            for part in item[key] if isinstance(item.get(key), list) else ():
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    out.append(part["text"])
    return "".join(out)


class EventRelay:
    def __init__(self, relay: Relay, store: ResponseStore):
        self.relay, self.store = relay, store

    async def _save(self, call: Call, parsed: ParsedRequest, response: dict[str, Any]) -> None:
        """Store a finished response (``store``): its turn's input and its output items. If the database cannot
        take it, the client still gets its answer, saying ``store: false`` (it cannot be continued), and the log
        says why."""
        conv = parsed.conversation
        if not conv.store or response.get("status") == "failed":
            return
        output = response.get("output")
        try:
            await self.store.save(conv.response_id, call.app, call.user, conv.previous, conv.interaction,
                                  call.backend, conv.own_items, output if isinstance(output, list) else [],
                                  response, utcnow())
        except Exception as e:  # noqa: BLE001 — the answer is the client's whatever the store does
            log.warning("response %s of request %s not stored: %s", conv.response_id, call.request_id, e)
            response["store"] = False

    async def whole(self, call: Call, parsed: ParsedRequest, d: Attempt, headers: dict[str, str]) -> Response:
        response = parsed.conversation.named(d.first)
        call.tally.answered(response)
        if not call.tally.usage_seen:  # a backend without usage: the gateway counts the output it answered
            call.tally.completion_tokens = min(count_text(_output_text(response)), call.tally.completion_cap)
        self.relay.dispatcher.charge(d.ticket, call.tally.completion_tokens)
        await self._save(call, parsed, response)
        return Response(body=orjson.dumps(response), content_type="application/json", headers=headers)

    async def stream(self, request: Request, parsed: ParsedRequest, call: Call, d: Attempt,
                     headers: dict[str, str]) -> StreamResponse | Response:
        """Relay the events; the terminal one is held back (a response stored first), and it is the stream's
        last bytes, written by the edge once the usage row is journaled (as chat's usage and [DONE] are). For a
        client that did not ask for a stream (a response without ``max_output_tokens``, streamed so that it is
        charged as it goes), the events are read and the terminal one's response is the answer."""
        relay, tally = self.relay, call.tally
        dialect = Responses(self, call, parsed) if parsed.conversation is not None else Messages(call)
        watch = Watch(relay.config, d.started)
        resp = None
        if parsed.stream:
            resp = StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **headers})
            try:
                await resp.prepare(request)
            except ConnectionError as e:
                raise ClientGone(str(e)) from None
        data, seen, last = d.first_read, 0, b""
        now = waited = 0.0
        try:
            async with watch:
                while True:
                    out, terminal = [], None
                    for kind, ev, payload in events(data):
                        seen += 1
                        if dialect.terminal(kind):
                            terminal = (kind, ev)
                            break
                        if dialect.failed(kind, ev):
                            call.fail(Status.ERROR, 502, f"backend error mid-stream: {str(ev)[:1000]}")
                            break
                        out.append(event_bytes(kind, ev) if dialect.observe(kind, ev)  # (rewritten)
                                   else event_bytes(kind, None, payload))  # (as it came)
                    # each delta a token (a closing piece may be none), until the usage says
                    tally.report(tally.prompt_tokens, min(max(dialect.deltas, dialect.output),
                                                          tally.completion_cap), tally.cached_tokens)
                    if seen > 2 * tally.completion_cap + MAX_OTHER_EVENTS:  # (a backend that never ends)
                        relay._overrun(call, d)
                    if call.status is Status.ERROR:
                        break
                    relay.reservations.charge(call, parsed, d)
                    if call.hold is not None:
                        relay.quotas.progress(call)
                    if out and resp is not None:
                        watch.client()
                        try:
                            await resp.write(b"".join(out))
                        except ConnectionError as e:
                            raise ClientGone(str(e), resp) from None
                    if terminal is not None:
                        last = await dialect.finish(*terminal)
                        break
                    watch.backend()
                    asked = relay.dispatcher.now()
                    data = await d.stream.__anext__()
                    now = relay.dispatcher.now()
                    waited = now - asked
                    relay.latency.stream_read(d.backend, d, tally.completion_tokens, call.n, now, waited)
        except StopAsyncIteration:
            call.fail(Status.ERROR, 502, f"backend {d.backend.name} ended the stream without its terminal event")
        except ClientGone:
            raise
        except TimeoutError as e:  # (the watch's: a client that reads nothing, or a backend that sends nothing)
            relay.stream_failed(e, request, call, watch, resp)
        except UPSTREAM_ERRORS as e:
            call.fail(Status.ERROR, 502, f"backend {d.backend.name} failed mid-stream: {e or type(e).__name__}")
        except Exception as e:  # noqa: BLE001 — a bug must not write a fresh HTTP response into the stream
            relay.stream_failed(e, request, call, watch, resp)
        if resp is None:  # (folded for a client that asked for the whole response)
            if call.status is Status.ERROR:
                raise APIError(call.http_status or 502, call.error or "backend failed",
                               code="backend_timeout" if call.http_status == 504 else "backend_failed")
            return Response(body=orjson.dumps(dialect.response), content_type="application/json", headers=headers)
        if call.status is Status.ERROR and not last:
            code = "backend_timeout" if call.http_status == 504 else "backend_failed"
            last = event_bytes(b"error", dialect.error(APIError(call.http_status or 502, call.error or "backend failed",
                                                                code=code), seen))
        resp.end(last)
        return resp


class Responses:
    """The Responses API's events: deltas until the terminal event (``response.completed``, ``.incomplete``
    or ``.failed``), whose response holds the usage; every response object named as the gateway's."""

    def __init__(self, relay: EventRelay, call: Call, parsed: ParsedRequest):
        self.relay, self.call, self.parsed, self.conv = relay, call, parsed, parsed.conversation
        self.deltas = self.output = 0
        self.response: dict[str, Any] = {}  # the terminal event's, named: a folded request's answer

    def terminal(self, kind: bytes) -> bool:
        return kind in TERMINAL

    def failed(self, kind: bytes, ev: dict[str, Any]) -> bool:
        return kind == b"error" or "error" in ev and not isinstance(ev.get("response"), dict)

    def observe(self, kind: bytes, ev: dict[str, Any]) -> bool:
        if kind.endswith(DELTA):
            self.deltas += 1
        elif kind.decode() in NAMED and isinstance(ev.get("response"), dict):
            self.conv.named(ev["response"])
            return True
        return False

    async def finish(self, kind: bytes, ev: dict[str, Any]) -> bytes:
        tally = self.call.tally
        response = self.response = ev.get("response") if isinstance(ev.get("response"), dict) else {}
        self.conv.named(response)
        streamed = tally.completion_tokens
        tally.answered(response)  # (the usage; what was streamed, if it says less)
        tally.completion_tokens = max(tally.completion_tokens, streamed)
        if kind == b"response.failed":  # (incomplete: an answer cut at max_output_tokens)
            self.call.fail(Status.ERROR, 502, f"the backend's response failed: {str(response)[:500]}")
        await self.relay._save(self.call, self.parsed, response)
        return event_bytes(kind, ev)

    @staticmethod
    def error(e: APIError, seen: int) -> dict[str, Any]:
        err = e.body()["error"]
        return {"type": "error", "code": err.get("code"), "message": err.get("message"), "param": None,
                "sequence_number": seen}


class Messages:
    """Anthropic's Messages events: ``message_start`` holds the prompt's count, ``content_block_delta`` a
    piece of output, ``message_delta`` the output's count so far, ``message_stop`` the end."""

    def __init__(self, call: Call):
        self.call = call
        self.deltas = self.output = 0

    def terminal(self, kind: bytes) -> bool:
        return kind == b"message_stop"

    def failed(self, kind: bytes, ev: dict[str, Any]) -> bool:
        return kind == b"error"

    def observe(self, kind: bytes, ev: dict[str, Any]) -> bool:
        if kind == b"content_block_delta":
            self.deltas += 1
        elif kind in (b"message_start", b"message_delta"):
            message = ev.get("message") if kind == b"message_start" else ev
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                tally = self.call.tally
                if kind == b"message_start" and usage.get("input_tokens") is not None:
                    tally.report(usage.get("input_tokens"), tally.completion_tokens,
                                 usage.get("cache_read_input_tokens") or 0)
                if kind == b"message_delta" and type(usage.get("output_tokens")) is int:
                    self.output = max(self.output, min(usage["output_tokens"], tally.completion_cap))
        return False

    async def finish(self, kind: bytes, ev: dict[str, Any]) -> bytes:
        return event_bytes(kind, ev)

    @staticmethod
    def error(e: APIError, seen: int) -> dict[str, Any]:
        return anthropic_body(e)
