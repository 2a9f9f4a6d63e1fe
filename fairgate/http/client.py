"""The upstream client: HTTP/1.1 to the backends on the request's path: kept-alive connections per backend, requests written as
one buffer, responses parsed by httptools (llhttp, as uvicorn and so vLLM's own server use).

aiohttp's client spent ~160 µs of CPU a request on building and tracking a request (measured: 185 µs a POST
and its answer against 21 µs here, the kernel's share included in both); the gateway talks to its backends
in one shape only — a JSON POST, an answer whole or streamed — so it needs none of that.

What the relay relies on:
- a response's body arrives as it is read from the network (``readany``), at most ``high_water`` bytes
  buffered before reading pauses;
- ``close()`` before the body's end closes the connection: that is what makes vLLM abort the generation;
  after it, a connection the backend keeps alive goes back to the pool;
- a kept-alive connection the backend closed meanwhile is retried once on a fresh one, before any byte of an
  answer, so a stale connection never counts as a failing backend;
- failures are ``ConnectionError`` (refused, dropped, connect timeout) or ``ValueError`` (not HTTP): the
  relay's upstream errors;
- a backend is trusted less than we hoped: its head (status line and fields) and its trailers are bounded
  together by ``max_head_bytes`` and ``max_headers`` as they arrive (a line that never ends too), an interim
  1xx is skipped, a 101 is a protocol error, and the body is never buffered beyond ``high_water``.
Timeouts other than the connect's are the relay's (``asyncio.timeout``, ``Watch``).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from urllib.parse import urlsplit

import httptools

from fairgate.http.arrival import Arrival
from fairgate.http.bounds import HeadBounds


class UpstreamProtocolError(ValueError):
    """The backend's answer is not HTTP/1.1 as expected."""


class ConnectTimeout(ConnectionError):
    """No connection within ``connect_timeout_s`` (a backend that is down, not a slow answer)."""


class Response(Arrival):
    """One answer: status and headers once they came, then the body as it arrives."""

    def __init__(self, conn: "_Connection"):
        self._conn = conn
        self.status = 0
        self.content_type = ""
        self.content_length: int | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        super().__init__(conn.loop)
        self._error: BaseException | None = None
        self.complete = False  # the whole body arrived
        self.closed = False

    # -- the connection's side -----------------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > self._conn.pool.high_water:
            self._conn.pause()
        self._wake()

    def _end(self, error: BaseException | None = None) -> None:
        if error is None:
            self.complete = True
        elif not self.complete:
            self._error = error
        self._wake()

    # -- the reader's side ---------------------------------------------------------------------------------
    async def readany(self) -> bytes:
        """What arrived of the body since the last read (waiting for some); b"" at its end."""
        while not self._chunks:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._arrival()
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self._conn.resume()
        return data

    async def read(self) -> bytes:
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Done with it, whatever is left: the connection back to the pool if the whole answer came, else
        closed (the backend stops generating)."""
        if not self.closed:
            self.closed = True
            self._conn.finished(self)

    def release(self) -> None:
        """Done with it, all that mattered read (a stream's ``[DONE]``): the connection goes back to the pool
        when the body's end arrives, which may follow the last event by a moment; closed if it does not."""
        if self.closed:
            return
        self.closed = True
        if self.complete or self._error is not None:
            self._conn.finished(self)
        else:
            self._conn.linger(self)


class _Connection(HeadBounds, asyncio.Protocol):
    def __init__(self, pool: "UpstreamPool", key: tuple[str, int, bool]):
        self.pool, self.key = pool, key
        self.loop = asyncio.get_running_loop()  # (once: asking for it again is a system call a time)
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self._headers: asyncio.Future | None = None
        self.keep_alive = True
        self.dead = False
        self.got_bytes = False
        self.idle_since = 0.0
        self._paused = False
        self._interim = False  # the message is a 1xx: skipped
        self.max_head_bytes, self.max_fields = pool.max_head_bytes, pool.max_headers
        self._bounds_clear()

    # -- asyncio.Protocol ----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (TCP_NODELAY: the loop's transports set it)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            in_trailers = self._feeding()
            self.parser.feed_data(data)
            self._fed(len(data), in_trailers)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocolError("the backend upgraded the connection"))
        except httptools.HttpParserError as e:
            cause = e.__context__
            self._fail(cause if isinstance(cause, UpstreamProtocolError)
                       else UpstreamProtocolError(f"not an HTTP/1.1 answer: {e}"))
        except UpstreamProtocolError as e:
            self._fail(e)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.dead = True
        r = self.response
        if r is not None and not r.complete and self._headers is not None and self._headers.done() \
                and r.content_length is None and not self.parser.should_keep_alive() and exc is None:
            r._end()  # a body delimited by the connection's end
        self._fail(ConnectionResetError(f"the backend closed the connection{f': {exc}' if exc else ''}"))
        self.parser = None  # type: ignore[assignment]  # (a cycle with this protocol: freed now, not by the GC)

    # -- httptools callbacks -------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._interim = False
        self._bounds_start()

    def _over(self, what: str) -> UpstreamProtocolError:
        return UpstreamProtocolError(f"a response {what}")

    def on_status(self, status: bytes) -> None:
        self._count(len(status))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._field(len(name) + len(value))
        r = self.response
        if r is None or not self._in_head:  # (a trailer: bounded, not read)
            return
        name = name.lower()
        if name == b"content-type":
            r.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        elif name == b"content-length" and value.strip().isdigit():
            r.content_length = int(value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:
                raise UpstreamProtocolError("the backend switched protocols (101)")
            self._interim = True  # 100 Continue, 103 Early Hints: the answer follows
            if self.response is not None:  # (their fields are not the answer's)
                self.response.content_type, self.response.content_length = "", None
            return
        r = self.response
        if r is not None:
            r.status = status
            self.keep_alive = self.parser.should_keep_alive()
            if self._headers is not None and not self._headers.done():
                self._headers.set_result(r)

    def on_body(self, body: bytes) -> None:
        self._after_chunk_header = False
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        self._after_chunk_header = False
        if self._interim:
            self._interim = False
            return
        r = self.response
        if r is not None:
            self.keep_alive = self.keep_alive and self.parser.should_keep_alive()
            r._end()
            if r.closed:
                self.finished(r)

    # -- the pool's side -----------------------------------------------------------------------------------
    def _fail(self, error: BaseException) -> None:
        if self._headers is not None and not self._headers.done():
            self._headers.set_exception(error)
        if self.response is not None:
            self.response._end(error)
        self.close()

    async def send(self, head: bytes, body: bytes) -> Response:
        self.response = Response(self)
        self._headers = self.loop.create_future()
        self.got_bytes = False
        assert self.transport is not None
        self.transport.write(head + body)
        try:
            return await self._headers
        except BaseException:
            self.response = None
            self.close()  # cancelled or failed before the headers: this connection is in an unknown state
            raise

    def finished(self, r: Response) -> None:
        if self.response is not r:
            return
        if r.complete and self.keep_alive and not self.dead:
            self.response, self._headers = None, None
            self.resume()
            self.pool.release(self)
        else:
            self.close()

    def linger(self, r: Response, wait_s: float = 1.0) -> None:
        self.loop.call_later(wait_s, self._give_up, r)

    def _give_up(self, r: Response) -> None:
        if self.response is r:  # its end never came
            self.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.dead:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.dead = True
        if self.transport is not None:
            self.transport.close()


class UpstreamPool:
    """Kept-alive connections to each backend (any number in use; idle ones reused, newest first). ``https://``
    backends are verified against ``ssl_context`` (the system's CAs by default)."""

    def __init__(self, connect_timeout_s: float = 10.0, keepalive_s: float = 30.0, high_water: int = 1 << 20,
                 ssl_context: ssl.SSLContext | None = None, max_head_bytes: int = 64 << 10, max_headers: int = 100):
        self.connect_timeout_s, self.keepalive_s, self.high_water = connect_timeout_s, keepalive_s, high_water
        self.max_head_bytes, self.max_headers = max_head_bytes, max_headers
        self._ssl = ssl_context
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._heads: dict[tuple[str, str], tuple[tuple[str, int, bool], bytes]] = {}

    def _target(self, base_url: str, path: str) -> tuple[tuple[str, int, bool], bytes]:
        got = self._heads.get((base_url, path))
        if got is None:
            u = urlsplit(base_url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ValueError(f"backend URL must be http(s)://host[:port]: {base_url!r}")
            tls = u.scheme == "https"
            key = (u.hostname, u.port or (443 if tls else 80), tls)
            prefix = u.path.rstrip("/")
            head = (f"POST {prefix}{path} HTTP/1.1\r\nHost: {u.netloc.rpartition('@')[2]}\r\n"
                    f"Content-Type: application/json\r\nAccept: */*\r\nContent-Length: ").encode("latin-1")
            got = self._heads[(base_url, path)] = (key, head)
        return got

    async def post(self, base_url: str, path: str, body: bytes) -> Response:
        """POST ``body`` (JSON) and wait for the answer's status and headers."""
        key, head = self._target(base_url, path)
        head += b"%d\r\n\r\n" % len(body)
        conn = self._take(key)
        if conn is not None:
            try:
                return await conn.send(head, body)
            except ConnectionError:
                if conn.got_bytes:
                    raise
                # a kept-alive connection the backend had closed: once more, on a fresh one
        conn = await self._connect(key)
        return await conn.send(head, body)

    def _take(self, key: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.dead and conn.loop.time() - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), host, port,
                                                       ssl=self._ssl if tls else None)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {host}:{port} within {self.connect_timeout_s:.0f} s") from None
        except ssl.SSLError as e:
            raise ConnectionRefusedError(f"TLS with {host}:{port} failed: {e}") from None
        except ConnectionError:
            raise
        except OSError as e:  # (a name that no longer resolves, no route, no port or file descriptor left: the
            # backend cannot be reached, which callers handle as a refused connection, not as their own failure)
            raise ConnectionRefusedError(f"no connection to {host}:{port}: {e}") from None
        return conn

    def release(self, conn: _Connection) -> None:
        conn.idle_since = conn.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
