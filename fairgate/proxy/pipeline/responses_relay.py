"""A Responses API answer relayed: whole or as its SSE events (``event: <type>`` and ``data: {…}``), counted as
it streams — each output delta a token, until the terminal event (``response.completed``, ``.incomplete`` or
``.failed``) brings the usage —, its response object named as the gateway's (pipeline/responses.py), and
stored before the client gets its last event, so a follow-up on any replica finds it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from fairgate.http.messages import Request, Response, StreamResponse
from fairgate.proxy.call import Attempt, Call, Status, utcnow
from fairgate.proxy.control.watch import Watch
from fairgate.proxy.errors import APIError, ClientGone
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


class ResponsesRelay:
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
                     headers: dict[str, str]) -> StreamResponse:
        """Relay the events; the terminal one is held back, the response stored, and it is the stream's last
        bytes, written by the edge once the usage row is journaled (as chat's usage and [DONE] are)."""
        conv, relay, tally = parsed.conversation, self.relay, call.tally
        resp = StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
        watch = Watch(relay.config, d.started)
        try:
            await resp.prepare(request)
        except ConnectionError as e:
            raise ClientGone(str(e)) from None
        data, deltas, seen, last = d.first_read, 0, 0, b""
        now = waited = 0.0
        try:
            async with watch:
                while True:
                    out, terminal = [], None
                    for kind, ev, payload in events(data):
                        seen += 1
                        if kind in TERMINAL:
                            terminal = (kind, ev)
                            break
                        if kind == b"error" or "error" in ev and not isinstance(ev.get("response"), dict):
                            call.fail(Status.ERROR, 502, f"backend error mid-stream: {str(ev)[:1000]}")
                            break
                        if kind.endswith(DELTA):
                            deltas += 1
                        elif kind.decode() in NAMED and isinstance(ev.get("response"), dict):
                            conv.named(ev["response"])
                            out.append(event_bytes(kind, ev))
                            continue
                        out.append(event_bytes(kind, None, payload))  # (as it came: it names no response)
                    # each delta a token (a closing piece may be none), until the terminal event's usage
                    tally.report(tally.prompt_tokens, min(deltas, tally.completion_cap), tally.cached_tokens)
                    if seen > 2 * tally.completion_cap + MAX_OTHER_EVENTS:  # (a backend that never ends)
                        relay._overrun(call, d)
                    if call.status is Status.ERROR:
                        break
                    relay.reservations.charge(call, parsed, d)
                    if call.hold is not None:
                        relay.quotas.progress(call)
                    if out:
                        watch.client()
                        try:
                            await resp.write(b"".join(out))
                        except ConnectionError as e:
                            raise ClientGone(str(e), resp) from None
                    if terminal is not None:
                        kind, ev = terminal
                        response = ev.get("response") if isinstance(ev.get("response"), dict) else {}
                        conv.named(response)
                        streamed = tally.completion_tokens
                        tally.answered(response)  # (the usage; what was streamed, if it says less)
                        tally.completion_tokens = max(tally.completion_tokens, streamed)
                        if kind == b"response.failed":  # (incomplete: an answer cut at max_output_tokens)
                            call.fail(Status.ERROR, 502, f"the backend's response failed: {str(response)[:500]}")
                        await self._save(call, parsed, response)
                        last = event_bytes(kind, ev)
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
        if call.status is Status.ERROR and not last:
            code = "backend_timeout" if call.http_status == 504 else "backend_failed"
            err = APIError(call.http_status or 502, call.error or "backend failed", code=code).body()["error"]
            last = event_bytes(b"error", {"type": "error", "code": err.get("code"), "message": err.get("message"),
                                          "param": None, "sequence_number": seen})
        resp.end(last)
        return resp
