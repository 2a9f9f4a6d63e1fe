"""A stream's middle reads pass as the backend wrote them, less the running usage the gateway asked for: what the
client gets is what parsing every event and writing it again would give, and the usage read by a byte scan is
the last event's, whatever text the model produced."""

from __future__ import annotations

import re

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.proxy.pipeline.upstream import DONE, _whole_events, parse, relayable


def event(i: int, content: str, usage: bool = True, cached: int | None = None, choices: bool = True) -> bytes:
    ev = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
          "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}] if choices else []}
    if usage:
        ev["usage"] = {"prompt_tokens": 12, "total_tokens": 12 + i, "completion_tokens": i}
        if cached is not None:
            ev["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
    return b"data: " + orjson.dumps(ev) + b"\n\n"


def slow(data: bytes) -> list[dict]:
    """What the event-by-event path sends: every event parsed, its running usage dropped."""
    out = []
    for ev in parse(data):
        assert ev is not DONE
        ev.pop("usage", None)
        out.append(ev)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=40), min_size=1, max_size=6), st.none() | st.integers(0, 12))
def test_a_vllm_shaped_read_passes_as_bytes_less_its_running_usage(contents, cached):
    data = b"".join(event(i + 1, c, cached=cached) for i, c in enumerate(contents))
    got = relayable(data)
    assert got is not None
    raw, events, prompt, completion, cached_seen = got
    assert events == len(contents) and (prompt, completion, cached_seen) == (12, len(contents), cached)
    assert [orjson.loads(line[len(b"data: "):]) for line in raw.split(b"\n\n")[:-1]] == slow(data)
    assert b'"usage":' not in raw


WHOLE_EVENTS = re.compile(rb"(?:data: \{[^\n]*\}\n\n)+")  # the shape, as a pattern reads it


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from([b"data: {", b"}", b"\n", b"\n\n", b"}\n\n", b"x", b"data: ", b"{", b":"]),
                max_size=12))
def test_the_shape_scan_agrees_with_the_pattern(parts):
    data = b"".join(parts)
    whole = WHOLE_EVENTS.fullmatch(data) is not None
    assert bool(_whole_events(data)) == whole
    if whole:
        assert _whole_events(data) == data.count(b"\n\ndata: ") + 1


def test_what_must_be_read_event_by_event_is():
    assert relayable(event(1, "a") + b"data: [DONE]\n\n") is None  # the end
    assert relayable(event(1, "a") + event(2, "", choices=False)) is None  # the usage-only chunk, held back
    assert relayable(event(1, "a", usage=False)) is None  # no running usage: content chunks are counted
    assert relayable(b'data: {"error":{"message":"boom"}}\n\n') is None  # an error event fails the call
    assert relayable(b": keep-alive\n\n" + event(1, "a")) is None  # not only events
    moved = b'data: {"id":"x","usage":{"prompt_tokens":1,"completion_tokens":1},"choices":[{"index":0}]}\n\n'
    assert relayable(moved) is None  # usage not the last key: the pattern does not take it, parse
    assert relayable(b'data: {"choices":[{"delta":{"content":"x"}}],"usage":{"completion_tokens":"9"}}\n\n') is None


def test_a_backend_that_reports_megabytes_of_digits_is_clamped_not_converted():
    from fairgate.accounting.tally import Tally

    huge = (b'data: {"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":3,"completion_tokens":'
            + b"9" * 1_000_000 + b"}}\n\n")
    _, events, prompt, completion, _ = relayable(huge)
    tally = Tally(3)
    tally.allow(prompts=1, n=1, max_tokens=16, context=4096)
    tally.report(prompt, completion)
    assert (events, tally.completion_tokens, tally.clamped) == (1, 16, True)


def test_a_read_with_a_malformed_event_is_parsed_event_by_event():
    assert relayable(event(1, "a") + b'data: {"choices":[{"delta":{"content":"x"}}]"usage":{"completion_tokens":2}}\n\n'
                     ) is None
    assert relayable(b'data: {"choices":[1,}],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n') is None
    usage = b',"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
    assert relayable(b'data: {"choices":[{"delta":{"content":"\xff"}}]' + usage) is None  # not UTF-8
    assert relayable(b'data: {"choices":[{"delta":{"content":"\\q"}}]' + usage) is None  # no such escape
    assert relayable(b'data: {"choices":' + b"[" * 100_000 + b"]" * 100_000 + usage) is None  # too deep
    assert relayable(b'data: {"choices":[{"delta":{"content":"\xc3\xa9"}}]' + usage) is not None  # UTF-8


def test_the_last_usage_is_decoded_and_numbers_no_backend_writes_are_scanned():
    def usage(body: bytes) -> tuple | None:
        got = relayable(event(1, "a") + b'data: {"choices":[{"delta":{"content":"x"}}],"usage":' + body + b"}\n\n")
        return got and got[2:]

    assert usage(b'{"prompt_tokens":7,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":3}}') == (7, 2, 3)
    assert usage(b'{"completion_tokens":2}') == (None, 2, None)  # (the tally keeps the prompt it had)
    assert usage(b'{"prompt_tokens":7,"completion_tokens":2.0}') == (7, 2, None)  # a float: scanned, as always
    assert usage(b'{"prompt_tokens":7,"completion_tokens":-2}') is None  # no count: parsed, and clamped there
    assert usage(b'{"prompt_tokens":7}') is None  # no completion count: parsed


async def test_reads_are_cut_at_a_line_end_and_an_unfinished_line_waits_for_the_next():
    from fairgate.proxy.pipeline.upstream import LineTooLong, reads

    class Pieces:
        def __init__(self, *pieces: bytes):
            self.pieces = list(pieces)

        async def readany(self) -> bytes:
            return self.pieces.pop(0) if self.pieces else b""

    async def got(*pieces: bytes, limit: int = 1 << 20) -> list[bytes]:
        return [r async for r in reads(Pieces(*pieces), limit)]

    assert await got(b"data: 1\n\n", b"data: 2\n\n") == [b"data: 1\n\n", b"data: 2\n\n"]
    assert await got(b"data: 1\n\nda", b"ta: 2\n", b"\n") == [b"data: 1\n\n", b"data: 2\n", b"\n"]
    assert await got(b"da", b"ta", b": 1\n\ndata: 2") == [b"data: 1\n\n"]  # (an unfinished line at the end: dropped)
    with pytest.raises(LineTooLong):
        await got(b"x" * 100, b"y" * 100, limit=150)
