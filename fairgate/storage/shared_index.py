"""The approximate prefix index shared by gateway replicas through a Redis stream.

A replica's index learns from what *it* dispatches; without sharing, a replica would not know that another one
just put a tenant's document on backend 3. Each replica batches what it dispatched (backend, the prompt's block
hashes) and every ``interval_s`` appends one entry to the stream ``{<namespace>}:prefix`` (trimmed to about
``maxlen`` entries); every replica reads the stream and inserts the other replicas' blocks into its own index,
at its own clock. Block hashes are the same on every replica (``accounting/prefix.py``: salted, stable across
processes), so a match means the same thing everywhere.

The precise index needs none of this: every replica subscribes to the same backends' KV events.

Like the shared counters, the index degrades gracefully: with Redis down, a replica keeps its own view, drops
what it could not publish (a lost hint costs locality, never correctness) and reads on when Redis returns; the
log says so once per change. It does not make the gateway unready (the counters' sync does).

One stream, in the namespace's slot, also on a Redis Cluster: every replica reads every entry whatever
backend it names, so a stream per backend would spread the memory but not the work, and would cost a blocking
XREAD per backend (one XREAD over keys in several slots is refused). Its size is bounded by ``maxlen``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import orjson

from fairgate.accounting.prefix import PrefixIndex
from fairgate.storage.redis_client import ERRORS, Link, redacted, redis_client

log = logging.getLogger("fairgate.shared_index")


class SharedIndex:
    def __init__(self, url: str, namespace: str, index: PrefixIndex, replica: str | None = None,
                 interval_s: float = 0.05, maxlen: int = 100_000, max_pending: int = 10_000):
        self.redis = redis_client(url, timeout_s=2.0)  # > XREAD's block
        where = redacted(url)  # publishing and reading each log their own changes (one could work alone)
        self.publishing = Link(f"prefix index, publishing ({where})", log, "this replica's hints stay here")
        self.reading = Link(f"prefix index, reading ({where})", log, "the others' hints do not reach here")
        self.key = f"{{{namespace}}}:prefix"
        self.index, self.replica = index, replica or uuid.uuid4().hex[:12]
        self.interval_s, self.maxlen, self.max_pending = interval_s, maxlen, max_pending
        self._pending: list[tuple[str, tuple[int, ...]]] = []
        self._tasks: list[asyncio.Task] = []
        self.published = self.applied = self.dropped = 0

    def record(self, backend: str, blocks: tuple[int, ...]) -> None:
        """This replica dispatched a prompt with these blocks to ``backend`` (published with the next batch)."""
        if len(self._pending) < self.max_pending:
            self._pending.append((backend, blocks))
        else:
            self.dropped += 1

    async def start(self) -> None:
        try:  # read from now on: what others dispatched before this replica started is not worth replaying
            last = (await self.redis.xinfo_stream(self.key))["last-generated-id"]
        except ERRORS:  # no stream yet, or no Redis: the read loop says which
            last = "$"
        self._tasks = [asyncio.create_task(self._publish_loop(), name="prefix-publish"),
                       asyncio.create_task(self._read_loop(last), name="prefix-read")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.redis.aclose()

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self._pending:
                continue
            batch, self._pending = self._pending, []
            try:
                await self.redis.xadd(self.key, {"r": self.replica, "d": orjson.dumps(batch)},
                                      maxlen=self.maxlen, approximate=True)
                self.published += len(batch)
                self.publishing.worked()
            except ERRORS as e:  # a hint lost: locality, not correctness
                self.dropped += len(batch)
                self.publishing.failed(e)

    async def _read_loop(self, last: str | bytes) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                answer = await self.redis.xread({self.key: last}, count=100, block=1000)
                self.reading.worked()
            except ERRORS as e:
                self.reading.failed(e)
                await asyncio.sleep(1.0)
                continue
            for _stream, entries in answer or ():
                for entry_id, fields in entries:
                    last = entry_id
                    if fields.get(b"r", b"").decode() != self.replica:
                        self._apply(fields.get(b"d"), loop.time())

    def _apply(self, data: bytes | None, now: float) -> None:
        try:
            batch = orjson.loads(data or b"[]")
            for backend, blocks in batch:
                if isinstance(backend, str) and isinstance(blocks, list) and all(type(h) is int for h in blocks):
                    self.index.insert(blocks, backend, now)
                    self.applied += 1
        except (orjson.JSONDecodeError, TypeError, ValueError):
            log.warning("a malformed prefix index entry in %s was skipped", self.key)
