"""The listener: a listening socket, its connections (``connection.py``) and their handlers (``routing.py``).

``Edge`` admits connections within ``max_connections`` and ``max_connections_per_client``; when either is full, a
newcomer takes the place of the connection that has been idle longest among those that never carried an
authenticated request (``Request.trust``), and is refused only if there is none: holding slots open takes a key.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

from fairgate.http.connection import Connection
from fairgate.http.messages import HTTPError, Refused, Request, Response, StreamResponse
from fairgate.http.routing import NotRouted, Router

log = logging.getLogger("fairgate.http")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 << 20
    max_head_bytes: int = 16 << 10  # request line and header fields; the trailer section counts with them
    max_headers: int = 100  # header and trailer fields
    header_timeout_s: float = 30.0  # to deliver a head; and an authenticated connection's keep-alive idle
    anonymous_idle_s: float = 5.0  # the keep-alive idle of a connection that never carried an authenticated request
    anonymous_rate: float = 50.0  # requests a second (and burst) such a connection is served; 0: unpaced
    max_connections: int = 10_000
    max_connections_per_client: int = 1_000  # per client address
    write_buffer_bytes: int = 64 << 10  # a client's socket buffer's high-water mark
    write_timeout_s: float = 60.0  # for a client to read a response before the next pipelined one is served
    linger_s: float = 2.0  # closing: how long what the client still sends is read and dropped
    linger_bytes: int = 256 << 10  # and how much of it


class _Seats:
    """Connections by client address, and the idle anonymous ones (evictable) oldest first: O(1) each."""

    def __init__(self) -> None:
        self.all: set[Connection] = set()
        self.per_client: collections.Counter[str] = collections.Counter()
        self.idle: collections.OrderedDict[Connection, None] = collections.OrderedDict()
        self.idle_per_client: dict[str, collections.OrderedDict[Connection, None]] = {}

    def add(self, c: Connection) -> None:
        self.all.add(c)
        self.per_client[c.peer] += 1

    def remove(self, c: Connection) -> bool:
        if c not in self.all:
            return False
        self.all.discard(c)
        self.per_client[c.peer] -= 1
        if self.per_client[c.peer] <= 0:
            del self.per_client[c.peer]
        self.busy(c)
        return True

    def idle_now(self, c: Connection) -> None:
        if c in self.all and not c.trusted:
            self.idle[c] = None
            self.idle_per_client.setdefault(c.peer, collections.OrderedDict())[c] = None

    def busy(self, c: Connection) -> None:
        if self.idle.pop(c, 0) is None:
            mine = self.idle_per_client[c.peer]
            del mine[c]
            if not mine:
                del self.idle_per_client[c.peer]

    def evict(self, peer: str | None = None) -> bool:
        """Close the longest-idle anonymous connection (of ``peer``, if given); False if there is none."""
        pool = self.idle if peer is None else self.idle_per_client.get(peer)
        if not pool:
            return False
        victim = next(iter(pool))
        self.remove(victim)
        victim.abort()
        return True


class Edge:
    """A listening socket serving ``router``'s handlers; ``listener`` names it to the handlers (``Request``).
    Errors the listener answers itself (404, 405, a refused head or body, a handler's bug: 500) are rendered by
    ``error_type`` (an ``HTTPError`` subclass: the gateway's renders OpenAI's error shape)."""

    def __init__(self, router: Router, limits: Limits = Limits(), listener: str = "public",
                 error_type: type[HTTPError] = HTTPError):
        self.router, self.limits, self.listener, self.error_type = router, limits, listener, error_type
        self.seats = _Seats()
        self.server: asyncio.AbstractServer | None = None
        self.stopping = False
        self._warned = 0.0

    @property
    def connections(self) -> set[Connection]:
        return self.seats.all

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: Connection(self), host, port, reuse_port=reuse_port or None,
                                               backlog=1024)
        return self.server.sockets[0].getsockname()[1]

    # -- seats ---------------------------------------------------------------------------------------------
    def admit(self, c: Connection) -> bool:
        s, lim = self.seats, self.limits
        if s.per_client[c.peer] >= lim.max_connections_per_client and not s.evict(c.peer):
            self._warn(f"{c.peer} holds {lim.max_connections_per_client} connections (max_connections_per_client)")
            return False
        if len(s.all) >= lim.max_connections and not s.evict():
            self._warn(f"connection limit ({lim.max_connections}) reached, none of them idle and anonymous")
            return False
        s.add(c)
        s.idle_now(c)
        return True

    def forget(self, c: Connection) -> None:
        self.seats.remove(c)

    def busy(self, c: Connection) -> None:
        self.seats.busy(c)

    def idle(self, c: Connection) -> None:
        self.seats.idle_now(c)

    def _warn(self, what: str) -> None:
        now = time.monotonic()
        if now - self._warned >= 1.0:  # at most once a second: a flood must not flood the log
            self._warned = now
            log.warning("a new connection is refused: %s", what)

    # -- answers -------------------------------------------------------------------------------------------
    def error(self, e: HTTPError) -> Response:
        return self.error_type(e.status, e.message, code=e.code, headers=e.headers).response()

    def encode(self, request: Request, response: Response, keep: bool) -> tuple[bytes, bool]:
        """The response's bytes, and whether the connection may stay open after them."""
        try:
            return response.encode(keep), keep
        except ValueError:  # a header value with a line break, a status that is no answer: a bug, never sent
            log.exception("a response to %s %s could not be encoded", request.method, request.path)
            return self.error(HTTPError(500, "internal error in the gateway")).encode(False), False

    async def handle(self, request: Request) -> Response | StreamResponse:
        """The route's answer; no traceback ever reaches a client."""
        try:
            handler, request.match_info = self.router.resolve(request.method, request.path)
            return await handler(request)
        except NotRouted as e:
            return self.error(HTTPError(e.status, str(e), headers={"Allow": ", ".join(e.allow)} if e.allow else None))
        except Refused as e:
            return self.error(e)
        except HTTPError as e:
            return e.response() if isinstance(e, self.error_type) else self.error(e)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("unhandled error on %s", request.path)
            return self.error(HTTPError(500, "internal error in the gateway"))

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
        cut = [c for c in self.connections if c._task is not None]
        tasks = [c._task for c in cut]
        for c in cut:
            c.cut = True  # (its handler's cancellation is the server's: ``Connection.cut``)
            c._task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for c in list(self.connections):
            c.abort()
