"""The emulated vLLM's KV events: what its prefix cache stores and evicts, published over ZMQ exactly as vLLM
publishes them (``--kv-events-config`` with the zmq publisher; wire format in ``accounting/kv_events.py``)."""

from __future__ import annotations

import time
from typing import Sequence

import zmq

from fairgate.accounting.kv_events import BlockRemoved, BlockStored, Event, KVEventBatch, encode
from fairgate.engine.prefix_cache import PrefixCache, Stored


class KVEventPublisher:
    """A PUB socket bound to ``endpoint`` (``tcp://host:0``: any free port; ``self.endpoint`` says which).
    One batch per cache change; a slow subscriber loses messages past the high-water mark, as with vLLM, and
    sees the gap in the sequence numbers."""

    def __init__(self, endpoint: str, block_size: int, hwm: int = 100_000):
        self.block_size = block_size
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        if endpoint.endswith(":0"):
            port = self._socket.bind_to_random_port(endpoint.rsplit(":", 1)[0])
            endpoint = f"{endpoint.rsplit(':', 1)[0]}:{port}"
        else:
            self._socket.bind(endpoint)
        self.endpoint = endpoint
        self.seq = 0
        self.dropped = 0

    def attach(self, cache: PrefixCache) -> None:
        cache.on_store = self.stored
        cache.on_evict = self.removed

    def stored(self, run: Stored) -> None:
        if len(run.token_ids) != len(run.hashes) * self.block_size:
            return  # blocks without their tokens (the simulator's output blocks): nothing a router can use
        keys = [[run.salt] if run.salt else None] + [None] * (len(run.hashes) - 1)
        self._send(BlockStored(run.hashes, run.parent, list(run.token_ids), self.block_size, None, "GPU",
                               None, keys if run.salt else None))

    def removed(self, hashes: Sequence[int]) -> None:
        self._send(BlockRemoved(list(hashes), "GPU"))

    def _send(self, event: Event) -> None:
        frames = encode(KVEventBatch(time.time(), [event]), self.seq)
        self.seq += 1
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        self._socket.close(0)
