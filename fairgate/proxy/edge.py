"""The gateway's HTTP/1.1 listener: httptools (llhttp, Node's parser) under a small server of its own.

aiohttp's server cost most of what the gateway added to a request: at concurrency 1, a relay on httptools added
0.23-0.32 ms to a stream's first chunk where the same relay on aiohttp's server and client added 0.77-0.88 ms
(``bench/hotpath.py``, README). This server keeps what a listener facing many tenants needs:

- ``max_connections``: a connection beyond the limit is closed as it is accepted;
- ``header_timeout_s``: from a connection's start, and from each response's end, a client has that long to deliver
  a request's headers (slowloris), and an idle keep-alive connection is closed after it;
- a request's head (line and headers) is bounded in bytes and in count (431); a malformed one gets 400;
- the body is bounded as it arrives (``messages.Refused``); its arrival is timed by the handler;
- requests pipelined on one connection are served in order, one at a time (reading pauses while one waits);
- a client that goes away cancels its handler (what aborts the backend); writes wait while its buffer is full;
- ``shutdown``: stop accepting, close idle connections, let handlers finish for ``drain_s``, cancel the rest.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable
from urllib.parse import unquote

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from fairgate.proxy.errors import APIError
from fairgate.proxy.messages import Refused, Request, Response, StreamResponse

log = logging.getLogger("fairgate")

Handler = Callable[[Request], Awaitable["Response | StreamResponse"]]
# requests waiting behind the running one before the connection stops being read: what one read brought (at most
# uvloop's 256 KiB) is parsed whole, so a connection holds that much of pipelined requests, and one body
MAX_PIPELINED = 1


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 << 20  # (the defaults are GatewayConfig's; the gateway passes its own)
    header_timeout_s: float = 30.0
    max_connections: int = 10_000
    max_head_bytes: int = 16 << 10
    max_headers: int = 100


class Router:
    """Exact paths, and prefixes whose rest is a named parameter (``/v1/models/{model}``)."""

    def __init__(self) -> None:
        self.exact: dict[str, dict[str, Handler]] = {}
        self.prefixes: list[tuple[str, str, dict[str, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        self.exact.setdefault(path, {})[method] = handler

    def add_prefix(self, method: str, prefix: str, name: str, handler: Handler) -> None:
        for p, n, methods in self.prefixes:
            if (p, n) == (prefix, name):
                methods[method] = handler
                return
        self.prefixes.append((prefix, name, {method: handler}))

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        methods, match = self.exact.get(path), {}
        if methods is None:
            for prefix, name, ms in self.prefixes:
                if path.startswith(prefix) and len(path) > len(prefix):
                    methods, match = ms, {name: path[len(prefix):]}
                    break
        if methods is None:
            raise APIError(404, "Not Found")
        handler = methods.get(method)
        if handler is None:
            raise APIError(405, "Method Not Allowed")
        return handler, match


class Connection(asyncio.Protocol):
    """One client connection: parses requests as bytes arrive, serves them one at a time."""

    def __init__(self, edge: "Edge"):
        self.edge = edge
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closing = False
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._head_bytes = 0  # of the head's line and headers parsed so far
        self._in_head = self._began = False
        self._head_raw = 0  # bytes received while the head is unfinished
        self._current: Request | None = None  # the request whose body is arriving
        self._queue: collections.deque[Request] = collections.deque()  # requests waiting for their turn
        self._task: asyncio.Task | None = None  # the handler running
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False  # the client's socket buffer is full
        self._paused_reading = False  # requests wait behind the running one: the client is not read
        self._drain: asyncio.Future | None = None
        self._broken = False  # the parser refused what came: no request after the ones already queued
        self._refusal: Refused | None = None  # the head it refused, answered once the queue is served

    # -- the transport's side --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not asyncio's class)
        if len(self.edge.connections) >= self.edge.limits.max_connections:
            log.warning("connection limit (%d) reached: a new connection is closed", self.edge.limits.max_connections)
            self.closing = True
            transport.abort()
            return
        self.edge.connections.add(self)  # (TCP_NODELAY: uvloop's and asyncio's transports set it)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.closing or self._broken:
            return
        try:
            self._began = False
            self.parser.feed_data(data)
            if self._in_head:  # httptools holds an unfinished header line itself: bound what a head may buffer
                self._head_raw = 0 if self._began else self._head_raw + len(data)  # (a head begun in this read
                if self._head_raw > self.edge.limits.max_head_bytes:  # holds at most the read's size of it)
                    raise self._head_too_large()
        except Refused as refused:
            self._refuse(refused)
        except httptools.HttpParserUpgrade:
            self._refuse(Refused(400, "protocol upgrades are not supported"))
        except httptools.HttpParserError as e:
            cause = e.__context__
            self._refuse(cause if isinstance(cause, Refused) else Refused(400, f"malformed HTTP request: {e}"))

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closing = True
        self.edge.connections.discard(self)
        self._disarm()
        gone = ConnectionResetError("the client has gone")
        for r in (self._current, *self._queue):
            if r is not None:
                r._fail(gone)
        if self._task is not None:
            self._task.cancel()  # the handler stops; this is what aborts the backend's generation
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(gone)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- the parser's callbacks ------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._head_bytes = b"", [], 0
        self._in_head = self._began = True

    def _head_too_large(self) -> Refused:
        return Refused(431, f"request line and headers exceed {self.edge.limits.max_head_bytes} bytes")

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.edge.limits.max_head_bytes:
            raise self._head_too_large()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        if len(self._headers) >= self.edge.limits.max_headers:
            raise Refused(431, f"more than {self.edge.limits.max_headers} request headers")
        self._headers.append((name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        self._in_head = False
        url = self._url
        if not url.startswith(b"/"):  # absolute form (a proxy's), or garbage
            parsed = httptools.parse_url(url)
            url = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
        raw_path, _, query = url.partition(b"?")
        path = raw_path.decode("utf-8", "surrogateescape")
        if "%" in path:
            path = unquote(path, errors="surrogateescape")
        p = self.parser
        request = Request(p.get_method().decode("ascii", "replace"), path, query.decode("latin-1"),
                          CIMultiDictProxy(CIMultiDict(self._headers)), p.get_http_version() == "1.1",
                          self.edge.listener, self)
        request.keep_alive = p.should_keep_alive()
        self._current = request
        self._queue.append(request)
        if self._task is None:
            self._next()
        elif len(self._queue) >= MAX_PIPELINED and self.transport is not None and not self._paused_reading:
            self._paused_reading = True
            self.transport.pause_reading()

    def on_body(self, body: bytes) -> None:
        if self._current is not None:
            self._current._feed(body, self.edge.limits.max_body_bytes)

    def on_message_complete(self) -> None:
        if self._current is not None:
            self._current._done()
            self._current = None

    # -- serving -------------------------------------------------------------------------------------------
    def _next(self) -> None:
        self._disarm()
        request = self._queue.popleft()
        if self._paused_reading and len(self._queue) < MAX_PIPELINED and not self._broken and not self.closing:
            self._paused_reading = False
            self.transport.resume_reading()
        if request.headers.get("Expect", "").lower() == "100-continue" and not request.complete:
            length = request.content_length
            if length is None or length <= self.edge.limits.max_body_bytes:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._task = self.loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        try:
            response = await self.edge.handle(request)
            if self.closing:
                return
            if isinstance(response, StreamResponse):
                if not response.eof or not response.chunked:  # a stream broken off, or one that ends by closing
                    self.close()
                    return
                keep = request.keep_alive and request.complete
            else:
                keep = request.keep_alive and request.complete and not self.edge.stopping
                try:
                    data = response.encode(keep)
                except ValueError:  # a header value with a line break: a bug, never sent as a split header
                    log.exception("a response to %s %s could not be encoded", request.method, request.path)
                    data, keep = APIError(500, "internal error in the gateway", type="server_error").response(
                        ).encode(False), False
                self.transport.write(data)
            if not keep or self.edge.stopping:
                self.close()
        except asyncio.CancelledError:
            self.close()
            raise
        except ConnectionError:  # the client went away as its answer was written
            self.close()
        except Exception:  # noqa: BLE001 — a response that cannot be written: the connection is given up
            log.exception("a response to %s %s could not be written", request.method, request.path)
            self.close()
        finally:
            self._task = None
            if not self.closing:
                if self._queue:
                    self._next()
                elif self._broken:
                    self._answer_refusal()
                else:
                    self._arm()

    async def send(self, data: bytes) -> None:
        """For a stream: write, then wait while the client's buffer is full."""
        if self.closing or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client has gone")
        self.transport.write(data)
        if self._paused:
            self._drain = self.loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None

    def _refuse(self, refused: Refused) -> None:
        """What came cannot be parsed: the stream of requests has lost its framing. A body in progress fails (its
        handler answers 400 or 413); a refused head is answered once the requests before it are; then the
        connection closes."""
        self._broken = True
        if self.transport is not None and not self._paused_reading:
            self._paused_reading = True
            self.transport.pause_reading()
        if self._current is not None:
            self._current._fail(refused)
            self._current = None
        else:
            self._refusal = refused
        if self._task is None:
            self._answer_refusal()

    def _answer_refusal(self) -> None:
        if self._refusal is not None and self.transport is not None and not self.closing:
            self.transport.write(APIError(self._refusal.status, str(self._refusal)).response().encode(False))
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closing:
            self.closing = True
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- the header timer (slowloris, idle keep-alive) -----------------------------------------------------------
    def _arm(self) -> None:
        self._disarm()
        self._timer = self.loop.call_later(self.edge.limits.header_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self._task is None:
            self.close()

    @property
    def idle(self) -> bool:
        return self._task is None and not self._queue


class Edge:
    """A listening socket serving ``router``'s handlers; ``listener`` names it to the handlers (``Request``)."""

    def __init__(self, router: Router, limits: Limits = Limits(), listener: str = "public"):
        self.router, self.limits, self.listener = router, limits, listener
        self.connections: set[Connection] = set()
        self.server: asyncio.AbstractServer | None = None
        self.stopping = False

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: Connection(self), host, port, reuse_port=reuse_port or None,
                                               backlog=1024)
        return self.server.sockets[0].getsockname()[1]

    async def handle(self, request: Request) -> Response | StreamResponse:
        """The route's answer; no traceback ever reaches a client (OpenAI-shaped errors)."""
        try:
            handler, request.match_info = self.router.resolve(request.method, request.path)
            return await handler(request)
        except APIError as e:
            return e.response()
        except Refused as e:
            return APIError(e.status, str(e), code=e.code).response()
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("unhandled error on %s", request.path)
            return APIError(500, "internal error in the gateway", type="server_error").response()

    async def shutdown(self, drain_s: float) -> None:
        """Stop accepting; idle connections close now, busy ones after their response, or are cancelled after
        ``drain_s`` (their handlers' ``finally`` still runs)."""
        self.stopping = True
        if self.server is not None:
            self.server.close()
        for c in list(self.connections):
            if c.idle:
                c.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_s
        while any(not c.idle for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        tasks = [c._task for c in self.connections if c._task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for c in list(self.connections):
            c.abort()
