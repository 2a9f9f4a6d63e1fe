"""What a handler of the listener (``server.py``) sees and returns: a request, a whole response, or a stream.

A request is handed over as soon as its headers are in; its body follows (``read()``), so a handler can refuse a
request (its key, its declared length) before the body has arrived, and time the body's arrival itself.
A stream's headers leave with its first write, so the status and the first events reach the client in one packet.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import orjson
from multidict import CIMultiDictProxy

from fairgate.http.arrival import Arrival

if TYPE_CHECKING:
    from fairgate.http.connection import Connection

REASONS = {s.value: s.phrase for s in HTTPStatus} | {499: "Client Closed Request"}
NO_BODY = frozenset({204, 304})  # RFC 9110 §15.3.5, §15.4.5: never a body (1xx: never sent as a final answer)


class HTTPError(Exception):
    """An answer a handler gives by raising: ``status``, a message, and headers to send with it. ``response()``
    renders it (JSON ``{"error": {"message", "code"}}``; a user of the library may subclass to change the
    shape, as the gateway does for OpenAI's)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = headers or {}

    def response(self, request_id: str | None = None) -> "Response":
        return Response(status=self.status, body=orjson.dumps({"error": {"message": self.message,
                                                                         "code": self.code}}),
                        headers=self.headers)


class Refused(HTTPError):
    """What the listener cannot take: a head (malformed: 400; too large: 431; a transfer coding other than
    chunked: 501; an HTTP version other than 1.1 and 1.0: 505) or a body (beyond the limit as it arrived: 413; its framing broken or its trailers too large:
    400, 431)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(status, message, code="request_too_large" if status == 413 else None, headers=headers)


class Request(Arrival):
    __slots__ = ("method", "path", "query_string", "headers", "http_11", "listener", "match_info", "conn",
                 "keep_alive", "_body", "_size", "complete", "_error", "expect_continue")

    def __init__(self, method: str, path: str, query_string: str, headers: CIMultiDictProxy[str], http_11: bool,
                 listener: str, conn: "Connection"):
        self.method, self.path, self.query_string, self.headers = method, path, query_string, headers
        self.http_11, self.listener, self.conn = http_11, listener, conn
        self.match_info: dict[str, str] = {}
        self.keep_alive = http_11
        self._body: list[bytes] = []
        self._size = 0
        self.complete = False  # the whole body arrived
        self._error: BaseException | None = None
        self.expect_continue = False  # an HTTP/1.1 client waits for "100 Continue" before sending its body
        super().__init__(conn.loop)

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        if value is None:
            return None
        value = value.strip(" \t")  # (llhttp passes the field's trailing whitespace on)
        return int(value) if value.isascii() and value.isdigit() else None

    def trust(self) -> None:
        """The handler has authenticated this request: its connection keeps the long idle timeout and is not
        evicted for a newcomer when the listener is full (``Limits``)."""
        self.conn.trusted = True

    async def read(self) -> bytes:
        """The whole body, once it has arrived (raises ``Refused``, or ``ConnectionResetError`` if the client
        went away first). A client that sent ``Expect: 100-continue`` is told to send it now: only a handler
        that reads the body asks for it (after authenticating, say), never the listener on its own."""
        if self.expect_continue:
            self.expect_continue = False
            if not self.complete:
                self.conn.send_continue()
        while not self.complete:
            if self._error is not None:
                raise self._error
            await self._arrival()
        return self.body()

    def body(self) -> bytes:
        """The whole body, which has arrived (``complete``)."""
        if self._error is not None:
            raise self._error
        return self._body[0] if len(self._body) == 1 else b"".join(self._body)

    # -- the connection's side -------------------------------------------------------------------------------
    def _feed(self, data: bytes, limit: int) -> None:
        if self._error is not None:
            return
        self._size += len(data)
        if self._size > limit:
            self._body.clear()
            self._fail(Refused(413, f"request body exceeds {limit} bytes"))
            return
        self._body.append(data)

    def _done(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._wake()


_date: list = [0, b""]  # the Date header line, made once a second


def _date_line() -> bytes:
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, b"Date: %s\r\n" % formatdate(now, usegmt=True).encode()
    return _date[1]


def _head(status: int, headers: dict[str, str], framing: bytes) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, "Unknown").encode()), _date_line()]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:  # never a header split by a value
            raise ValueError(f"a line break in response header {name!r}")
        lines.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
    lines.append(framing)
    return b"".join(lines)


class Response:
    """A whole response: status, headers and body, sent in one write."""

    __slots__ = ("status", "body", "headers")

    def __init__(self, *, status: int = 200, body: bytes = b"", headers: dict[str, str] | None = None,
                 content_type: str = "application/json"):
        self.status, self.body = status, body
        self.headers = {"Content-Type": content_type, **(headers or {})}

    def encode(self, keep_alive: bool) -> bytes:
        """Status line, headers and body; a status that cannot be a final answer (1xx, or not three digits)
        raises ``ValueError``, and a 204 or 304 is sent without its body (RFC 9110 §15.3.5, §15.4.5)."""
        close = b"" if keep_alive else b"Connection: close\r\n"
        if not 200 <= self.status <= 999:
            raise ValueError(f"status {self.status} is not a final response")
        if self.status in NO_BODY:
            return _head(self.status, self.headers, close + b"\r\n")
        return _head(self.status, self.headers, b"Content-Length: %d\r\n%s\r\n" % (len(self.body), close)) + self.body


def json_response(data: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status=status, body=orjson.dumps(data), headers=headers)


class StreamResponse:
    """A response written as it is produced (chunked; to an HTTP/1.0 client, until the connection closes).
    ``write`` waits while the client's socket buffer is full, and raises ``ConnectionResetError`` once the client
    has gone. A handler may leave its last events to the edge (``end``): they are written, with the end of the
    body, once the handler has returned."""

    __slots__ = ("status", "headers", "conn", "chunked", "started", "eof", "tail")

    def __init__(self, *, status: int = 200, headers: dict[str, str] | None = None):
        self.status, self.headers = status, dict(headers or {})
        self.conn: "Connection | None" = None
        self.chunked = True
        self.started = self.eof = False
        self.tail: bytes | None = None

    async def prepare(self, request: Request) -> None:
        if request.conn.closing:
            raise ConnectionResetError("the client has gone")
        self.conn, self.chunked = request.conn, request.http_11

    def _headed(self, out: bytes) -> bytes:
        """``out`` behind the status line and headers if none were sent yet: they leave with the first events."""
        if self.started:
            return out
        self.started = True
        framing = b"Transfer-Encoding: chunked\r\n\r\n" if self.chunked else b"Connection: close\r\n\r\n"
        return _head(self.status, self.headers, framing) + out

    def _framed(self, data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data

    async def write(self, data: bytes) -> None:
        assert self.conn is not None, "prepare() first"
        if not data:
            return
        await self.conn.send(self._headed(self._framed(data)))

    def end(self, tail: bytes) -> None:
        """``tail`` is the last data: the edge writes it and ends the body after the handler returns."""
        self.tail = tail

    def ending(self) -> bytes:
        """The tail and the end of the body, framed (the edge's to write, at once)."""
        self.eof = True
        tail, self.tail = self.tail or b"", None
        return self._headed((self._framed(tail) if tail else b"") + (b"0\r\n\r\n" if self.chunked else b""))

    async def write_eof(self) -> None:
        if self.eof or self.conn is None:
            return
        self.eof = True
        out = self._headed(b"0\r\n\r\n" if self.chunked else b"")
        if out:
            await self.conn.send(out)
