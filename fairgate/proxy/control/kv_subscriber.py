"""The precise prefix index's feed: one ZMQ SUB socket per backend that publishes vLLM KV events
(``backends[].kv_events``), each message folded into the index (``accounting/kv_events.py``)."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from fairgate.accounting.kv_events import EventFold, decode
from fairgate.accounting.prefix import PrefixIndex

log = logging.getLogger("fairgate.kv_events")


class KVEventSubscriber:
    def __init__(self, index: PrefixIndex, endpoints: dict[str, str]):
        self.index = index
        self.endpoints = endpoints  # backend name → the ZMQ endpoint its engine publishes on
        self.folds = {name: EventFold(index, name) for name in endpoints}
        self.received = 0
        self.malformed = 0
        self._sockets: list[zmq.asyncio.Socket] = []
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Subscribe to every endpoint (on the running loop)."""
        ctx = zmq.asyncio.Context.instance()
        for name, endpoint in self.endpoints.items():
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._sockets.append(sock)
            self._tasks.append(asyncio.create_task(self._run(name, sock), name=f"kv-events-{name}"))

    async def _run(self, name: str, sock: zmq.asyncio.Socket) -> None:
        fold, loop = self.folds[name], asyncio.get_running_loop()
        while True:
            frames = await sock.recv_multipart()
            try:
                seq, batch = decode(frames)
            except ValueError as e:  # another publisher's traffic on the endpoint, or a newer format
                self.malformed += 1
                if self.malformed <= 3:
                    log.warning("backend %s: unreadable KV event message: %s", name, e)
                continue
            self.received += 1
            fold.receive(seq, batch, loop.time())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in self._sockets:
            sock.close(0)
        self._tasks.clear()
        self._sockets.clear()
