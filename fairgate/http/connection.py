"""One client connection of the listener (``server.py``): bytes in, requests out, served one at a time.

Parsing is httptools (llhttp). What it does not bound, this does (the limits are ``server.Limits``):
- a head still arriving, and the last chunk's trailer section (``bounds.HeadBounds``): ``max_head_bytes`` and
  ``max_headers`` together, plus at most one slice;
- pipelining: between requests, bytes are parsed a slice (4 KiB) at a time, and once a request waits behind the
  running one the rest of the read is held unparsed and the socket is not read; a connection holds at most one
  read (uvloop's 256 KiB), one slice's requests, and one response beyond its socket buffer's high-water mark;
- a response is not followed by the next pipelined one until the client has read it down to the high-water mark
  (``write_buffer_bytes``), within ``write_timeout_s``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from fairgate.http.bounds import HeadBounds, Pace
from fairgate.http.messages import Refused, Request, StreamResponse

if TYPE_CHECKING:
    from fairgate.http.server import Edge

log = logging.getLogger("fairgate.http")
SLICE = 4096  # bytes parsed at a time outside a body of known length
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
BROKEN_LINGER = 64 << 10


class Connection(HeadBounds, asyncio.Protocol):
    def __init__(self, edge: "Edge"):
        self.edge = edge
        self.limits = edge.limits
        self.max_head_bytes, self.max_fields = self.limits.max_head_bytes, self.limits.max_headers
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer = ""  # the client's address (its host): what the per-client connection cap counts
        self.trusted = False  # a handler authenticated a request on it (``Request.trust``)
        self.cut = False  # the listener cancelled its handler at the end of a drain (not its client's doing)
        self.parser = httptools.HttpRequestParser(self)
        self.closing = False
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._bounds_clear()
        self._hosts = self._codings = 0  # Host and Transfer-Encoding fields of the head
        self._body_left: int | None = None  # of a body with a Content-Length
        self._current: Request | None = None  # the request whose body is arriving
        self._queue: collections.deque[Request] = collections.deque()  # requests waiting for their turn
        self._held = b""  # read, not parsed: a request waits behind the running one
        self._task: asyncio.Task | None = None  # the handler running
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False  # the client's socket buffer is over its high-water mark
        self._paused_reading = False
        self._drain: asyncio.Future | None = None
        self._broken = False  # the parser refused what came (or the connection upgraded): no request after these
        self._refusal: Refused | None = None  # the head it refused, answered once the queue is served
        self._linger_left = -1  # ≥ 0: closing, what the client still sends is read and dropped up to this
        self._linger_until = 0.0
        self._deferred: asyncio.TimerHandle | None = None  # an anonymous connection's next request, waiting its turn
        self._pace = Pace(self.limits.anonymous_rate, self.loop.time())  # this connection's, while anonymous

    # -- the transport's side --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not asyncio's class)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer or "")
        if not self.edge.admit(self):
            self.closing = True
            transport.abort()
            return
        transport.set_write_buffer_limits(high=self.limits.write_buffer_bytes)  # type: ignore[attr-defined]
        self._arm(self.limits.header_timeout_s)  # (TCP_NODELAY: uvloop's and asyncio's transports set it)

    def data_received(self, data: bytes) -> None:
        if self._linger_left >= 0:
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self.abort()
            return
        if self.closing or self._broken:
            return
        if self._held:  # (reading is paused while bytes are held; a transport may deliver what it had)
            self._held += data
            return
        self._parse(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closing = True
        self.edge.forget(self)
        self._disarm()
        gone = ConnectionResetError("the client has gone")
        for r in (self._current, *self._queue):
            if r is not None:
                r._fail(gone)
        if self._task is not None:
            self._task.cancel()  # the handler stops; this is what aborts the backend's generation
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(gone)
        if self._deferred is not None:
            self._deferred.cancel()
        # the parser and this protocol refer to each other: freed now by reference counting, not at the next
        # full collection (under a flood of short connections, hundreds of dead ones waited for it)
        self.parser = None  # type: ignore[assignment]
        self._held = b""

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- parsing ---------------------------------------------------------------------------------------------
    def _parse(self, data: bytes) -> None:
        """Feed ``data`` a slice at a time (a known-length body's rest at once); stop, holding the rest, once a
        request waits behind the running one (its body too: it is read when its turn comes, after its key)."""
        view, at = memoryview(data), 0  # (slices of a view copy nothing)
        try:
            while at < len(view):
                if self._queue:
                    self._hold(bytes(view[at:]))
                    return
                n = self._body_left if self._current is not None and self._body_left else SLICE
                self._feed(view[at:at + n])
                at += n
        except Refused as refused:
            self._refuse(refused)
        except httptools.HttpParserUpgrade:  # the upgrade request was served as a plain one; nothing follows
            self._broken = True
            self._stop_reading()
        except httptools.HttpParserError as e:
            cause = e.__context__
            self._refuse(cause if isinstance(cause, Refused) else Refused(400, f"malformed HTTP request: {e}"))

    def _feed(self, piece: memoryview) -> None:
        in_trailers = self._feeding()
        self.parser.feed_data(piece)
        self._fed(len(piece), in_trailers)

    def _hold(self, data: bytes) -> None:
        self._held = data
        self._stop_reading()

    def _stop_reading(self) -> None:
        if self.transport is not None and not self._paused_reading:
            self._paused_reading = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        """The requests ahead were served: parse what was held, and read again."""
        data, self._held = self._held, b""
        if data:
            self._parse(data)
        if not self._held and self._paused_reading and not self._broken and not self.closing:
            self._paused_reading = False
            self.transport.resume_reading()

    # -- the parser's callbacks ------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers = b"", []
        self._hosts = self._codings = 0
        self._bounds_start()
        self._body_left = None

    def _over(self, what: str) -> Refused:
        return Refused(431, f"request {what}")

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._field(len(name) + len(value))
        if not self._in_head:  # a trailer field: bounded above, never merged into the request's headers
            return
        lower = name.lower()
        if lower == b"host":
            self._hosts += 1
        elif lower == b"transfer-encoding":  # RFC 9112 §6.1: only chunked is implemented (h11 answers 501 too)
            self._codings += 1
            if self._codings > 1 or value.strip().lower() != b"chunked":
                raise Refused(501, "a Transfer-Encoding other than chunked is not implemented")
        self._headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        self._in_head = False
        p = self.parser
        version = p.get_http_version()
        if version not in ("1.1", "1.0"):  # RFC 9110 §15.6.6
            raise Refused(505, f"HTTP/{version} is not supported: HTTP/1.1 or HTTP/1.0")
        http_11 = version == "1.1"
        if self._hosts != 1 and (http_11 or self._hosts > 1):  # RFC 9112 §3.2
            raise Refused(400, "an HTTP/1.1 request needs exactly one Host header")
        url = self._url
        if not url.startswith(b"/"):  # absolute form (a proxy's), or garbage
            parsed = httptools.parse_url(url)
            url = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
        raw_path, _, query = url.partition(b"?")
        headers = CIMultiDictProxy(CIMultiDict(self._headers))
        request = Request(p.get_method().decode("ascii", "replace"), raw_path.decode("latin-1"),
                          query.decode("latin-1"), headers, http_11, self.edge.listener, self)
        request.keep_alive = p.should_keep_alive()
        length = request.content_length if not self._codings else None
        has_body = bool(self._codings or length)
        if p.should_upgrade():  # served as a plain request, then the connection closes (its bytes are not HTTP)
            if has_body:
                raise Refused(400, "a request asking for a protocol upgrade may not carry a body here")
            request.keep_alive = False
        self._body_left = length
        if http_11 and has_body and headers.get("Expect", "").lower() == "100-continue":
            request.expect_continue = length is None or length <= self.limits.max_body_bytes
        self._current = request
        self._queue.append(request)
        if self._task is None and self._deferred is None:
            self._next()

    def on_body(self, body: bytes) -> None:
        self._after_chunk_header = False
        if self._body_left is not None:
            self._body_left -= len(body)
        if self._current is not None:
            self._current._feed(body, self.limits.max_body_bytes)

    def on_message_complete(self) -> None:
        self._after_chunk_header = False
        self._body_left = None
        if self._current is not None:
            self._current._done()
            self._current = None

    # -- serving -------------------------------------------------------------------------------------------
    def _next(self) -> None:
        self._disarm()
        self.edge.busy(self)
        # an anonymous connection's requests are paced (``Limits.anonymous_rate``)
        if not self.trusted and (wait := self._pace.wait(self.loop.time())) > 0:
            self._deferred = self.loop.call_later(wait, self._due)
            return
        request = self._queue.popleft()
        self._task = self.loop.create_task(self._serve(request))
        if self._held and not self._queue:  # (never inside a feed: bytes are held only between feeds)
            self._resume()

    def _due(self) -> None:
        self._deferred = None
        if not self.closing and self._queue and self._task is None:
            self._next()

    async def _serve(self, request: Request) -> None:
        try:
            response = await self.edge.handle(request)
            if self.closing:
                return
            if isinstance(response, StreamResponse):
                if response.tail is not None and response.conn is self:  # its last events, left to the edge
                    if self.transport is None or self.transport.is_closing():
                        raise ConnectionResetError("the client has gone")
                    self.transport.write(response.ending())
                if not response.eof or not response.chunked:  # a stream broken off, or one that ends by closing
                    self.finish()
                    return
                keep = request.keep_alive and request.complete
            else:
                keep = request.keep_alive and request.complete and not self.edge.stopping
                data, keep = self.edge.encode(request, response, keep)
                self.transport.write(data)
            if not keep or self.edge.stopping:
                self.finish()
            elif self._paused:  # the next request waits until this answer is read down to the high-water mark
                await self._drained(self.limits.write_timeout_s)
        except asyncio.CancelledError:
            self.close()
            raise
        except TimeoutError:  # the client reads nothing while it pipelines more
            self.abort()
        except ConnectionError:  # the client went away as its answer was written
            self.close()
        except Exception:  # noqa: BLE001 — a response that cannot be written: the connection is given up
            log.exception("a response to %s %s could not be written", request.method, request.path)
            self.close()
        finally:
            self._task = None
            if not self.closing:
                if self._queue:
                    self._next()  # (it parses what was held once nothing more waits)
                elif self._broken:
                    self._answer_refusal()
                else:
                    self._arm(self.limits.header_timeout_s if self.trusted else self.limits.anonymous_idle_s)
                    self.edge.idle(self)
                    self._resume()

    async def _drained(self, timeout_s: float | None) -> None:
        self._drain = self.loop.create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self._drain
        finally:
            self._drain = None

    async def send(self, data: bytes) -> None:
        """For a stream: write, then wait while the client's buffer is over its high-water mark."""
        if self.closing or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client has gone")
        self.transport.write(data)
        if self._paused:
            await self._drained(None)  # (a stream's writes are timed by its handler)

    def send_continue(self) -> None:
        if not self.closing and self.transport is not None:
            self.transport.write(CONTINUE)

    def _refuse(self, refused: Refused) -> None:
        """What came cannot be parsed: the stream of requests has lost its framing. A body in progress fails (its
        handler answers 400, 413 or 431); a refused head is answered once the requests before it are; then the
        connection closes."""
        self._broken = True
        self._held = b""
        refused = refused.with_traceback(None)  # its frames hold the read's bytes
        refused.__context__ = None
        self._stop_reading()
        if self._current is not None:
            self._current._fail(refused)
            self._current = None
        else:
            self._refusal = refused
        if self._task is None and self._deferred is None:
            self._answer_refusal()

    def _answer_refusal(self) -> None:
        if self._refusal is not None and self.transport is not None and not self.closing:
            self.transport.write(self.edge.error(self._refusal).encode(False))
        self.finish()

    def finish(self) -> None:
        """Close after the answer: the write side now (FIN after what is buffered), the read side after the
        client's own close or ``linger_s``, dropping what it still sends (up to ``linger_bytes``). Closing both at
        once would reset a client still sending a body we refused, and a reset can destroy the answer before
        the client has read it (RFC 9112 §9.6)."""
        t = self.transport
        if t is None or self.closing:
            return
        if not t.can_write_eof():
            self.close()
            return
        self.closing = True
        self._held = b""
        # after a stream that lost its framing, at most one read is dropped: what follows is no request's body
        self._linger_left = min(self.limits.linger_bytes, BROKEN_LINGER) if self._broken else self.limits.linger_bytes
        self._linger_until = self.loop.time() + self.limits.write_timeout_s  # for the answer to be read
        t.write_eof()
        if self._paused_reading:
            self._paused_reading = False
            t.resume_reading()
        self._arm(self.limits.linger_s)

    def close(self) -> None:
        if self.transport is not None and not self.closing:
            self.closing = True
            self.transport.close()

    def abort(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    # -- the timer: a head's arrival (slowloris), an idle keep-alive, a lingering close -------------------------
    def _arm(self, timeout_s: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        t = self.transport
        if self._linger_left >= 0:  # lingering: once the answer has left (within write_timeout_s), linger_s more
            if t is not None and t.get_write_buffer_size() and self.loop.time() < self._linger_until:
                self._arm(self.limits.linger_s)
            else:
                self.abort()
        elif self._task is None:
            if t is not None and t.get_write_buffer_size():  # (close() would wait for a reader that never reads)
                self.abort()
            else:
                self.close()

    @property
    def idle(self) -> bool:
        return self._task is None and not self._queue
