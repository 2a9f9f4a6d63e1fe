"""The edge (fairgate's HTTP/1.1 listener) on raw sockets: what a hostile or unusual client can send, and what a
handler relies on (cancellation when the client goes, pipelined requests in order, streams with flow control).
The gateway's own behaviour over the edge is the rest of the suite (errors, shutdown, fuzz, the openai client)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest

from fairgate.http.messages import Request, Response, StreamResponse, json_response
from fairgate.http.routing import Router
from fairgate.http.server import Edge, Limits
from fairgate.proxy.errors import APIError
from tests.rawhttp import error_code, exchange, peek, post


class App:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.seen: list[str] = []

    async def echo(self, request: Request) -> Response:
        body = await request.read()
        self.seen.append(body.decode())
        return json_response({"path": request.path, "query": request.query_string, "body": body.decode(),
                              "ua": request.headers.get("user-agent"), "model": request.match_info.get("model")})

    async def slow(self, request: Request) -> Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Response(body=b"{}")

    async def stream(self, request: Request) -> StreamResponse:
        resp = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(b"data: %d\n\n" % i)
        await resp.write_eof()
        return resp

    async def big(self, request: Request) -> StreamResponse:
        resp = StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await resp.prepare(request)
        for _ in range(64):  # 64 MiB: far beyond any socket buffer, so writes must wait for the reader
            await resp.write(b"x" * (1 << 20))
        await resp.write_eof()
        return resp

    async def refuse(self, request: Request) -> Response:
        raise APIError(429, "slow down", code="rate_limit_exceeded", headers={"retry-after": "1"})

    async def crash(self, request: Request) -> Response:
        raise RuntimeError("a bug")

    async def header_split(self, request: Request) -> Response:
        return Response(headers={"x-evil": "a\r\nSet-Cookie: pwned=1"})


@pytest.fixture
async def edge() -> AsyncIterator[tuple[Edge, App, int]]:
    app, r = App(), Router()
    r.add("POST", "/echo", app.echo)
    r.add("GET", "/echo", app.echo)
    r.add("GET", "/slow", app.slow)
    r.add("GET", "/stream", app.stream)
    r.add("GET", "/big", app.big)
    r.add("GET", "/refuse", app.refuse)
    r.add("GET", "/crash", app.crash)
    r.add("GET", "/split", app.header_split)
    r.add_prefix("GET", "/models/", "model", app.echo)
    e = Edge(r, Limits(max_body_bytes=1000, header_timeout_s=0.5, max_connections=4, max_head_bytes=2048,
                       max_headers=20, anonymous_rate=0), error_type=APIError)
    port = await e.start("127.0.0.1", 0)
    yield e, app, port
    await e.shutdown(1.0)


async def test_pipelined_requests_are_answered_in_order_on_one_connection(edge):
    _, app, port = edge
    raw = b"".join(post("/echo", f"request {i}".encode()) for i in range(5))
    answer = await exchange(port, raw + b"GET /echo?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.count(b"HTTP/1.1 200 OK") == 6 and answer.count(b"\r\nDate: ") == 6
    assert app.seen == [f"request {i}" for i in range(5)] + [""]
    assert answer.index(b"request 0") < answer.index(b"request 4") < answer.index(b'"query":"x=1"')
    burst = b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n" * 599  # ~20 KiB in one write (over the head limit), far over 8 queued
    answer = await exchange(port, burst + b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.count(b"HTTP/1.1 200 OK") == 600


async def test_requests_pipelined_behind_a_running_one_are_not_read_beyond_one(edge):
    e, app, port = edge
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + b"".join(post("/echo", b"z" * 900) for _ in range(2000)))
    await asyncio.sleep(0.3)
    [conn] = e.connections
    # what one network read brought is parsed (≤ 256 KiB), then reading stops: ~1.9 MB stay with the client
    assert 1 <= len(conn._queue) <= 300
    w.close()  # (unread, the connection's end is seen when reading resumes or the answer is written)


async def test_a_chunked_body_arrives_whole_and_one_beyond_the_limit_gets_413(edge):
    _, _, port = edge
    chunked = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    answer = await exchange(port, chunked + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    assert b'"body":"hello world"' in answer
    big = b"".join(b"100\r\n" + b"y" * 256 + b"\r\n" for _ in range(5))  # 1,280 bytes > 1,000
    status, err = error_code(await exchange(port, chunked + big + b"0\r\n\r\n"))
    assert status == 413 and err["code"] == "request_too_large"


async def test_malformed_and_oversized_heads_get_400_and_431_then_the_connection_closes(edge):
    _, _, port = edge
    status, err = error_code(await exchange(port, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400 and err["type"] == "invalid_request_error"
    status, _ = error_code(await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4000 + b"\r\n\r\n"))
    assert status == 431
    # a header line that never ends is refused as it grows, not buffered until it ends
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /echo HTTP/1.1\r\nX-Endless: ")
    answer = b""
    for _ in range(40):
        w.write(b"a" * 1024)
        await asyncio.sleep(0.005)
        if answer := await peek(r):
            break
    assert answer.startswith(b"HTTP/1.1 431")
    w.close()
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(30))
    status, _ = error_code(await exchange(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n"))
    assert status == 431
    # a good request, then garbage: the good one is answered, then the error, then the close
    answer = await exchange(port, post("/echo", b"fine") + b"\x00\x01garbage\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 400" in answer


async def test_routes_errors_and_no_header_injection(edge):
    _, _, port = edge
    close = "Connection: close\r\n"
    assert error_code(await exchange(port, f"GET /nowhere HTTP/1.1\r\nHost: x\r\n{close}\r\n".encode()))[0] == 404
    assert error_code(await exchange(port, f"DELETE /echo HTTP/1.1\r\nHost: x\r\n{close}\r\n".encode()))[0] == 405
    answer = await exchange(port, f"GET /refuse HTTP/1.1\r\nHost: x\r\n{close}\r\n".encode())
    assert error_code(answer) == (429, {"message": "slow down", "type": "rate_limit_error", "param": None,
                                        "code": "rate_limit_exceeded"}) and b"retry-after: 1\r\n" in answer
    status, err = error_code(await exchange(port, f"GET /crash HTTP/1.1\r\nHost: x\r\n{close}\r\n".encode()))
    assert status == 500 and "a bug" not in err["message"]  # no traceback, no internals
    answer = await exchange(port, f"GET /split HTTP/1.1\r\nHost: x\r\n{close}\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 500") and b"Set-Cookie" not in answer  # refused, never sent split
    answer = await exchange(port, f"GET /models/org%2Fname HTTP/1.1\r\nHost: x\r\n{close}\r\n".encode())
    assert b'"model":"org/name"' in answer
    status, err = error_code(await exchange(port, f"GET /models/%FF HTTP/1.1\r\nHost: x\r\n{close}\r\n".encode()))
    assert status == 404 and err["message"]  # not UTF-8 once decoded: no such model (was: no answer, a traceback)


async def test_a_client_that_goes_away_cancels_its_handler(edge):
    _, app, port = edge
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.1)
    w.close()
    await asyncio.wait_for(app.cancelled.wait(), 2)


async def test_streams_are_chunked_to_http11_and_close_delimited_to_http10(edge):
    _, _, port = edge
    answer = await exchange(port, b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head and body.endswith(b"0\r\n\r\n") and body.count(b"data: ") == 3
    answer = await exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"chunked" not in head and body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_a_slow_reader_makes_the_stream_wait_not_the_memory_grow(edge):
    _, _, port = edge
    r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
    w.write(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await asyncio.sleep(0.5)  # read nothing for a while: the handler must be parked on its write, not buffering
    [conn] = edge[0].connections
    assert conn.transport.get_write_buffer_size() < 4 << 20
    received = 0
    while chunk := await asyncio.wait_for(r.read(1 << 20), 10):
        received += len(chunk)
    assert received > 64 << 20  # all of it, with the chunk framing


async def test_expect_100_continue_is_answered_before_the_body(edge):
    _, _, port = edge
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    assert await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2) == b"HTTP/1.1 100 Continue\r\n\r\n"
    w.write(b"ping")
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2)
    assert head.startswith(b"HTTP/1.1 200")
    w.close()


async def test_slow_headers_idle_connections_and_too_many_connections_are_closed(edge):
    _, _, port = edge
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n")  # and never the end of the headers
    assert await asyncio.wait_for(r.read(), 2) == b""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(6)]  # the limit is 4
    await asyncio.sleep(0.1)
    closed = 0
    for cr, cw in conns:
        cw.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            got = await asyncio.wait_for(cr.read(1), 1)
        except (ConnectionError, asyncio.TimeoutError):
            got = b""
        closed += got == b""
        cw.close()
    assert closed == 2


async def test_shutdown_lets_a_running_request_finish_and_closes_idle_connections(edge):
    e, _, port = edge
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(0.05)
    await e.shutdown(1.0)
    assert await asyncio.wait_for(idle_r.read(), 2) == b""
    answer = await asyncio.wait_for(r.read(), 2)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"0\r\n\r\n")
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
