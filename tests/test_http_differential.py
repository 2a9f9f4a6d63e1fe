"""fairgate's request parser against h11: the same byte streams, split at random points, must get the
same verdict — the same requests (method, target, body) and the same refusal — from both, but for the documented,
deliberate differences (``tests/differential.py``: ``DELIBERATE``). Streams are drawn by hypothesis from the
pieces smuggling and desync attacks are made of, and a corpus of known cases is run as well."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from tests.differential import DELIBERATE, compare, fairgate_verdict, h11_verdict, split

CASES = 1_500  # generated streams (each cut at random places), all compared with h11

# -- the pieces of a request, each tagged with the deliberate difference it touches (tests/differential.py) ----
def tagged(*options: tuple[bytes, str | None], weights: tuple[int, ...] | None = None):
    """One of ``options``: (bytes, tag or None)."""
    pool = [o for o, w in zip(options, weights or (1,) * len(options)) for _ in range(w)]
    return st.sampled_from(pool)


OK = None
METHODS = tagged((b"GET", OK), (b"POST", OK), (b"PUT", OK), (b"HEAD", OK), (b"OPTIONS", OK), (b"G ET", OK),
                 (b"", OK), (b"get", "unknown method"), (b"FOO", "unknown method"), weights=(16, 16, 1, 1, 1, 1, 1, 1, 1))
TARGETS = st.sampled_from([b"/", b"/v1/chat/completions", b"/a?b=c", b"/%2e%2e/x", b"*", b"/a b", b"/\x00",
                           b"/caf\xc3\xa9", b"/\x7f", b"", b"/" + b"x" * 300])
VERSIONS = tagged((b"HTTP/1.1", OK), (b"HTTP/1.0", OK), (b"HTTP/2.0", "other version"), (b"HTTP/1.10", OK),
                  (b"http/1.1", OK), (b"HTTP/1.1 ", OK), (b"HTTP/1", OK), weights=(24, 6, 1, 1, 1, 1, 1))
NAMES = tagged((b"Host", OK), (b"X-A", OK), (b"Content-Type", OK), (b"Connection", OK), (b"Accept", OK), (b"X A", OK),
               (b"X-A ", OK), (b"X\x00A", OK), (b"", OK), (b"X-\xff", OK), (b"Expect", OK), (b" X-A", "obs-fold"),
               weights=(3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1))
VALUES = st.sampled_from([b"x", b"", b" padded ", b"close", b"keep-alive", b"a\x00b", b"a\rb", b"\xff\xfe",
                          b"100-continue", b"v" * 200, b"a\tb"])
LENGTHS = tagged((b"0", OK), (b"5", OK), (b"+5", OK), (b"-1", OK), (b"5 ", OK), (b" 5", OK), (b"05", OK),
                 (b"5, 5", "duplicate length"), (b"5,6", OK), (b"0x5", OK), (b"", OK), (b"4", OK),
                 (b"99999999999999999999", "huge length"))
CODINGS = st.sampled_from([b"chunked", b"Chunked", b" chunked", b"chunked ", b"gzip, chunked", b"chunked, gzip",
                           b"identity", b"xchunked", b"chunked\x00", b"", b"chunked,chunked"])
EOLS = tagged((b"\r\n", OK), (b"\n", "bare LF"), (b"\r", "bare CR"), (b"\r\r\n", "bare CR"), weights=(40, 1, 1, 1))


@st.composite
def chunked_body(draw, tags: set[str]) -> bytes:
    out = b""
    for _ in range(draw(st.integers(0, 3))):
        data = draw(st.binary(max_size=12))
        size, tag = draw(tagged((b"%x" % len(data), OK), (b"%X" % len(data), OK), (b"%x;ext=1" % len(data), OK),
                                (b"0%x" % len(data), OK), (b"-1", OK), (b"g", OK),
                                (b"%x " % len(data), "chunk-size whitespace"), (b"ffffffffffffffffff", "huge length"),
                                weights=(20, 3, 2, 2, 1, 1, 1, 1)))
        tags.update([tag] if tag else [])
        eols = [draw(EOLS), draw(EOLS)]
        tags.update(t for _, t in eols if t)
        out += size + eols[0][0] + data + eols[1][0]
    last, tag = draw(tagged((b"0\r\n\r\n", OK), (b"0\r\nT: v\r\n\r\n", OK), (b"0\r\n", OK), (b"0\n\n", "bare LF"),
                            (b"0\r\nT v\r\n\r\n", OK), (b"0;x\r\n\r\n", OK),
                            weights=(20, 2, 1, 1, 1, 1)))
    if tag:
        tags.add(tag)
    return out + last


@st.composite
def request(draw) -> tuple[bytes, frozenset[str]]:
    tags: set[str] = set()
    eol, tag = draw(EOLS)
    (method, mtag), (version, vtag) = draw(METHODS), draw(VERSIONS)
    tags.update(t for t in (tag, mtag, vtag) if t)
    headers = []
    if draw(st.integers(0, 9)):  # usually a Host, sometimes two or none
        headers.append(b"Host: example" + (eol + b"Host: other" if not draw(st.integers(0, 9)) else b""))
    for _ in range(draw(st.integers(0, 3))):
        (name, ntag), value = draw(NAMES), draw(VALUES)
        tags.update([ntag] if ntag else [])
        headers.append(name + draw(st.sampled_from([b": ", b":", b" : ", b""])) + value)
        if headers[-1][:1] in (b" ", b"\t"):  # a line that begins with whitespace continues the one before
            tags.add("obs-fold")
        if version == b"HTTP/1.0" and value == b"keep-alive":
            tags.add("http/1.0 keep-alive")
    framing = draw(st.sampled_from(["none"] * 6 + ["length"] * 6 + ["chunked"] * 6 + ["both", "two-lengths"]))
    body = draw(st.binary(max_size=16))
    if framing in ("length", "both"):
        length, ltag = (b"%d" % len(body), OK) if draw(st.booleans()) else draw(LENGTHS)
        headers.append(b"Content-Length: " + length)
        tags.update([ltag] if ltag else [])
    if framing == "two-lengths":
        length, ltag = draw(LENGTHS)
        headers += [b"Content-Length: %d" % len(body), b"Content-Length: " + length]
        tags.update(["duplicate length"] + ([ltag] if ltag else []))
    if framing in ("chunked", "both"):
        headers.append(b"Transfer-Encoding: " + draw(CODINGS))
        body = draw(chunked_body(tags))
    if framing == "both":
        tags.add("length and chunked")
    if draw(st.integers(0, 19)) == 0:
        headers.append(b"X-Folded: a" + eol + draw(st.sampled_from([b" b", b"\tb"])))
        tags.add("obs-fold")
    raw = method + b" " + draw(TARGETS) + b" " + version + eol + b"".join(h + eol for h in headers) + eol
    return raw + (b"" if framing == "none" else body), frozenset(tags)


STREAMS = st.lists(request(), min_size=1, max_size=3).map(
    lambda rs: (b"".join(r for r, _ in rs), frozenset().union(*(t for _, t in rs))))
SPLITS = st.lists(st.integers(0, 1 << 16), max_size=6)

CORPUS = [  # known smuggling and desync shapes: (stream, the deliberate difference it shows, if one)
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /x HTTP/1.1\r\nHost: a\r\n\r\n", 'length and chunked'),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n", 'length and chunked'),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", 'duplicate length'),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello", 'duplicate length'),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", None),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n", None),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", None),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", None),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n", 'obs-fold'),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\nhello", None),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5x\r\n\r\nhello", None),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 18446744073709551621\r\n\r\nhello", 'huge length'),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff1\r\nx\r\n0\r\n\r\n", "huge length"),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\n0\n\n", 'bare LF'),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n", None),
    (b"GET / HTTP/1.1\nHost: a\n\n", 'bare LF'),
    (b"GET / HTTP/1.1\rHost: a\r\r", 'bare CR'),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX: a\rb\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\nHost : a\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\n Host: a\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\n\r\n", None),
    (b"GET /\x00 HTTP/1.1\r\nHost: a\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * (17 << 10) + b"\r\n\r\n", 'head over the limit'),
    (b"GET / HTTP/1.1\r\nHost: a\r\n\r\n" * 50, None),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-T: " + b"t" * (17 << 10) + b"\r\n\r\n", 'head over the limit'),
    (b"GET / HTTP/1.0\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\nGET /after HTTP/1.1\r\nHost: a\r\n\r\n", None),
]


def _check(stream: bytes, cuts: list[int], tags: frozenset[str] | set[str]) -> bool:
    """Both verdicts on ``stream`` split at ``cuts``; compared unless the stream shows a deliberate difference.
    True if compared."""
    pieces = split(stream, cuts)
    fg = asyncio.run(fairgate_verdict(pieces))
    ref = h11_verdict(pieces)
    if tags:
        assert set(tags) <= set(DELIBERATE)
        return False
    disagreement = compare(fg, ref)
    assert disagreement is None, f"{stream!r} split {[len(p) for p in pieces]}: {disagreement}"
    return True


@pytest.mark.parametrize("stream, tag", CORPUS, ids=range(len(CORPUS)))
def test_known_smuggling_and_desync_cases_get_h11s_verdict(stream, tag):
    """Where fairgate differs on purpose, it is the stricter: it refuses the stream."""
    for cuts in ([], [len(stream) // 2], list(range(0, len(stream), 7))):
        if not _check(stream, cuts, {tag} if tag else set()):
            assert asyncio.run(fairgate_verdict(split(stream, cuts))).refused, tag


@settings(max_examples=CASES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(STREAMS, SPLITS)
def test_generated_streams_get_h11s_verdict(stream, cuts):
    assume(not stream[1])  # (the streams that show a deliberate difference: the test below)
    assert _check(stream[0], cuts, stream[1])


LOOSER = {"upgrade", "http/1.0 keep-alive", "absolute-form"}  # where fairgate may serve what h11 does not


@settings(max_examples=CASES // 5, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.data_too_large,
                                                                      HealthCheck.filter_too_much])
@given(STREAMS, SPLITS)
def test_where_fairgate_differs_on_purpose_it_serves_no_more_than_h11(stream, cuts):
    """A stream with a deliberate difference: fairgate serves a prefix of what h11 serves (it refuses sooner),
    unless the difference is one where it keeps a connection h11 would end."""
    raw, tags = stream
    assume(tags and not tags & LOOSER)
    pieces = split(raw, cuts)
    fg, ref = asyncio.run(fairgate_verdict(pieces)), h11_verdict(pieces)
    assert fg.requests == ref.requests[:len(fg.requests)], (raw, tags, fg, ref)
