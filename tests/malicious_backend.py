"""A backend that attacks the gateway, on raw sockets: the model a request names picks the attack.

- ``endless-error``: HTTP 500 with a chunked body that never ends;
- ``endless-header``: a status line, then a header line that never ends;
- ``endless-trailer``: a whole stream, then a trailer section that never ends;
- ``interim``: 100 Continue and 103 Early Hints before the answer (legitimate: to be skipped);
- ``switch``: 101 Switching Protocols; ``no-content``: 204; ``not-modified``: 304;
- ``negative-usage``, ``huge-usage``: a stream whose usage is -1,000 or 10^19 tokens;
- ``endless-stream``: events forever, whatever max_tokens says;
- ``not-object``: a first event that is JSON but not an object; ``data-text``: three events whose text is
  "data: data: data:" (legitimate: text is not framing);
- anything else: three events, usage, [DONE].
``GET /v1/models`` lists them (max_model_len 4,096), so the gateway's health check marks the backend up.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import orjson

MODELS = ("endless-error", "endless-header", "endless-trailer", "interim", "switch", "no-content", "not-modified",
          "negative-usage", "huge-usage", "endless-stream", "not-object", "data-text", "ok")
CONTEXT = 4096


def event(i: int, prompt: int = 5, completion: int | None = None, text: str = "tok ") -> bytes:
    ev = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m",
          "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
          "usage": {"prompt_tokens": prompt, "completion_tokens": i + 1 if completion is None else completion}}
    return b"data: " + orjson.dumps(ev) + b"\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class MaliciousBackend:
    def __init__(self) -> None:
        self.bytes_sent = 0  # of the endless answers
        self.closed = 0  # endless answers whose reader (the gateway) gave up

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await r.readexactly(length)
                if head.startswith(b"GET /v1/models"):
                    cards = [{"id": m, "object": "model", "max_model_len": CONTEXT} for m in MODELS]
                    data = orjson.dumps({"object": "list", "data": cards})
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                            % (len(data), data))
                elif head.startswith(b"POST"):
                    if not await self._attack(orjson.loads(body)["model"], w):
                        return
                else:
                    w.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                await w.drain()
        w.close()

    async def _endless(self, w: asyncio.StreamWriter, start: bytes, piece: bytes) -> bool:
        w.write(start)
        try:
            for _ in range(100_000):  # bounded: 100,000 pieces (the gateway stops reading long before)
                w.write(piece)
                self.bytes_sent += len(piece)
                await w.drain()
        except ConnectionError:
            self.closed += 1
        return False

    async def _attack(self, model: str, w: asyncio.StreamWriter) -> bool:
        """Write the answer ``model`` asks for; False when the connection is done."""
        if model == "endless-error":
            return await self._endless(w, b"HTTP/1.1 500 Internal Server Error\r\nTransfer-Encoding: chunked\r\n\r\n",
                                       chunk(b"e" * 65536))
        if model == "endless-header":
            return await self._endless(w, b"HTTP/1.1 200 OK\r\nX-Endless: ", b"h" * 65536)
        if model == "endless-trailer":
            return await self._endless(w, SSE + chunk(event(0)) + chunk(b"data: [DONE]\n\n") + b"0\r\nX-T: ",
                                       b"t" * 65536)
        if model == "endless-stream":
            return await self._endless(w, SSE, chunk(event(0) * 64))
        if model in ("switch", "no-content", "not-modified"):
            status = {"switch": b"101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade",
                      "no-content": b"204 No Content", "not-modified": b"304 Not Modified"}[model]
            w.write(b"HTTP/1.1 " + status + b"\r\n\r\n")
            return model != "switch"
        if model == "not-object":
            w.write(SSE + chunk(b"data: 1\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return True
        prompt, completion = {"negative-usage": (-1000, -50), "huge-usage": (10**19, 10**19)}.get(model, (5, None))
        interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\nContent-Length: 999999\r\n\r\n"
        w.write((interim if model == "interim" else b"") + SSE)
        text = "data: data: data:" if model == "data-text" else "tok "
        w.write(b"".join(chunk(event(i, prompt, completion, text)) for i in range(3)))
        w.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return True


@contextlib.asynccontextmanager
async def malicious_backend() -> AsyncIterator[tuple[MaliciousBackend, str]]:
    backend = MaliciousBackend()
    server = await asyncio.start_server(backend._serve, "127.0.0.1", 0)
    try:
        yield backend, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
