"""The same bytes, two parsers: fairgate's listener (``fairgate.http.connection``, driven through a fake transport)
and h11, each asked where the requests in a byte stream begin and end, and whether it refuses the stream.

A verdict is the requests served (method, target, body) before a refusal, and whether there was one. The
documented, deliberate differences are normalised away here, each named (``DELIBERATE``); any other difference is
a disagreement the test reports.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import h11

from fairgate.http.connection import Connection
from fairgate.http.messages import Refused, Request, Response
from fairgate.http.routing import Router
from fairgate.http.server import Edge, Limits

HEAD_LIMIT = 16 << 10  # fairgate's max_head_bytes, and h11's max_incomplete_event_size: the same bound
BODY_LIMIT = 1 << 20

# Where fairgate answers differently from h11 on purpose (README, "The edge"). A stream that uses one of these is
# tagged with its name where it is made (the test's generator, the corpus), and its verdicts are not compared.
DELIBERATE = {
    "upgrade": "a request asking for a protocol upgrade is served as a plain one and the connection then closes "
               "(one with a body is refused); h11 leaves the connection to the application",
    "http/1.0 keep-alive": "an HTTP/1.0 request with 'Connection: keep-alive' keeps the connection; h11 closes "
                           "every HTTP/1.0 connection after its answer",
    "unknown method": "llhttp knows the registered methods only (an unknown one is a 400); h11 takes any token",
    "absolute-form": "a target in absolute form is served by its path; h11 passes the target as sent",
    "length and chunked": "both Content-Length and Transfer-Encoding: refused (llhttp; RFC 9112 §6.3 allows it); "
                          "h11 reads the body as chunked and keeps the connection",
    "duplicate length": "two Content-Length values (two fields, or a list), even equal: refused (llhttp); h11 "
                        "takes equal ones as one",
    "obs-fold": "a folded header line: refused (RFC 9112 §5.2 allows it); h11 unfolds it",
    "bare LF": "a line ending in LF alone: refused (llhttp strict); h11 accepts it (RFC 9112 §2.2 allows both)",
    "bare CR": "a CR not followed by LF: refused at once; h11 waits for more bytes before refusing",
    "huge length": "a Content-Length or chunk size past 64 bits: refused at once; h11 waits for the bytes",
    "chunk-size whitespace": "whitespace after a chunk's size: refused (llhttp); h11 allows it (RFC 9112 §7.1.1 "
                             "allows it only before a chunk extension)",
    "other version": "a request of another HTTP version (HTTP/2.0 in an HTTP/1 request line) is refused with 505; "
                     "h11 reads it as HTTP/1.1",
    "refuses sooner": "bytes that can begin no request are refused as they arrive; h11 waits for more, and "
                      "refuses them when the connection ends (compared as agreement)",
    "empty lines": "CR and LF between requests are skipped (RFC 9112 §2.2: a server SHOULD ignore empty lines "
                   "before a request line); h11 refuses them, so what follows is compared no further",
    "head over the limit": "a head or trailer section over 16 KiB is refused even when it arrives whole; h11 bounds "
                           "only what it buffers incomplete",
}


@dataclass
class Verdict:
    requests: list[tuple[bytes, bytes, bytes]] = field(default_factory=list)  # (method, target, body)
    refused: bool = False
    refused_at_eof: bool = False  # (h11) bytes wait unparsed, and the connection's end would refuse them
    at_empty_line: bool = False  # (h11) refused a CR or LF where a request line would begin
    pending_method: bytes | None = None  # (h11) the method of a request begun and not yet whole
    closes_after: list[bool] = field(default_factory=list)  # each request ends the connection (h11's view)


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []
        self.paused = self.closed = False

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data) -> None:
        self.out.append(bytes(data))

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class _Recorder(Edge):
    """Every request is answered 200 with its body read (no routes: any method, any target)."""

    def __init__(self) -> None:
        super().__init__(Router(), Limits(max_body_bytes=BODY_LIMIT, max_head_bytes=HEAD_LIMIT, max_headers=1000,
                                           anonymous_rate=0))
        self.seen: list[tuple[bytes, bytes, bytes]] = []

    async def handle(self, request: Request) -> Response:
        try:
            body = await request.read()
        except Refused as e:  # its framing broke, or its trailers are too large
            return self.error(e)
        target = request.path + (f"?{request.query_string}" if request.query_string else "")
        self.seen.append((request.method.encode(), target.encode("latin-1"), body))
        return Response(body=b"")


async def fairgate_verdict(pieces: list[bytes]) -> Verdict:
    edge = _Recorder()
    conn, transport = Connection(edge), _Transport()
    conn.connection_made(transport)
    pending = list(pieces)
    for _ in range(len(pieces) * 4 + 100):
        if pending and not transport.paused and not transport.closed:
            conn.data_received(pending.pop(0))
        for _ in range(4):  # the handlers run, answers go out, held bytes are parsed
            await asyncio.sleep(0)
        if (not pending or transport.closed) and conn.idle:
            break
    conn.connection_lost(None)
    statuses = [int(out.split(b" ", 2)[1]) for out in transport.out if out.startswith(b"HTTP/1.1 ")]
    return Verdict(list(edge.seen), any(s >= 400 for s in statuses))


def h11_verdict(pieces: list[bytes]) -> Verdict:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
    v = Verdict()
    current: list = []
    for piece in pieces:
        conn.receive_data(piece)
        while True:
            try:
                ev = conn.next_event()
            except h11.RemoteProtocolError as e:
                v.refused = True
                v.at_empty_line = conn.trailing_data[0][:1] in (b"\r", b"\n") or "no request line" in str(e)
                return v
            if ev is h11.NEED_DATA or ev is h11.PAUSED:
                break
            if isinstance(ev, h11.Request):
                current = [ev.method, ev.target, b""]
                v.pending_method = bytes(ev.method)
            elif isinstance(ev, h11.Data):
                current[2] += ev.data
                if len(current[2]) > BODY_LIMIT:
                    v.refused = True
                    return v
            elif isinstance(ev, h11.EndOfMessage):
                v.requests.append((bytes(current[0]), bytes(current[1]), current[2]))
                v.pending_method = None
                conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
                conn.send(h11.EndOfMessage())
                v.closes_after.append(conn.our_state is h11.MUST_CLOSE)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return v  # the connection ends here: what follows is not read
                conn.start_next_cycle()
    if conn.trailing_data[0]:
        conn.receive_data(b"")
        try:
            while conn.next_event() not in (h11.NEED_DATA, h11.PAUSED, h11.ConnectionClosed):
                pass
        except h11.RemoteProtocolError:
            v.refused_at_eof = True
    return v


def compare(fg: Verdict, ref: Verdict) -> str | None:
    """None if the verdicts agree; else what differs."""
    if fg.requests == ref.requests and (fg.refused == ref.refused or fg.refused and ref.refused_at_eof):
        return None  # (the second: "refuses sooner")
    n = len(fg.requests)
    if fg.refused and ref.requests[:n] == fg.requests and len(ref.requests) > n \
            and ref.requests[n][0] not in KNOWN_METHODS:
        return None  # "unknown method" (here from bytes past a body, which h11 reads as a request line)
    if fg.refused and fg.requests == ref.requests and ref.pending_method not in (None, *KNOWN_METHODS):
        return None  # "unknown method", h11 waiting for the rest of that request
    if ref.at_empty_line and not fg.refused and fg.requests[:len(ref.requests)] == ref.requests:
        return None  # "empty lines": h11 has no verdict past them
    return f"fairgate {fg} vs h11 {ref}"


KNOWN_METHODS = {m.encode() for m in ("DELETE", "GET", "HEAD", "POST", "PUT", "CONNECT", "OPTIONS", "TRACE", "PATCH",
                                      "PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "BIND",
                                      "REBIND", "UNBIND", "ACL", "REPORT", "MKACTIVITY", "CHECKOUT", "MERGE",
                                      "M-SEARCH", "NOTIFY", "SUBSCRIBE", "UNSUBSCRIBE", "PURGE", "MKCALENDAR",
                                      "LINK", "UNLINK", "SOURCE", "QUERY")}


def split(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    return [stream[a:b] for a, b in zip(points, points[1:]) if b > a]
