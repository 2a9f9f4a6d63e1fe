"""Writes usage rows behind the hot path, in batches; a database hiccup delays rows, never drops them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from sqlalchemy.ext.asyncio import async_sessionmaker

from fairgate.storage.models import UsageLog

log = logging.getLogger("fairgate.usage")
USAGE_INSERT = UsageLog.__table__.insert()


class UsageWriter:
    def __init__(self, sessions: async_sessionmaker, batch_size: int = 500, interval_s: float = 0.05):
        self.sessions = sessions
        self.batch_size = batch_size
        self.interval_s = interval_s
        self._buf: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self.written = 0
        self.failures = 0

    @property
    def pending(self) -> int:
        return len(self._buf)

    def submit(self, row: dict[str, Any]) -> None:
        """Queue one row (never blocks, never raises)."""
        self._buf.append(row)
        if len(self._buf) >= self.batch_size:
            self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-writer")

    async def _run(self) -> None:
        backoff = self.interval_s
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), backoff)
            self._wake.clear()
            backoff = self.interval_s if await self.flush() else min(5.0, backoff * 2)

    async def flush(self) -> bool:
        """Write everything queued; on failure keep the rows for the next attempt. True if all went."""
        async with self._lock:  # the background loop and an explicit flush must not write a batch twice
            while self._buf:
                rows, self._buf = self._buf[: self.batch_size], self._buf[self.batch_size:]
                try:
                    async with self.sessions.begin() as s:
                        await s.execute(USAGE_INSERT, rows)  # Core executemany, not the ORM's bulk path
                except BaseException as e:  # keep the rows (in order) for the next round
                    self._buf[:0] = rows
                    if not isinstance(e, Exception):
                        raise
                    self.failures += 1
                    log.warning("usage log write of %d rows failed (%s); will retry", len(rows), e)
                    return False
                self.written += len(rows)
            return True

    async def close(self, timeout_s: float = 10.0) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.flush() and loop.time() < deadline:
            await asyncio.sleep(0.2)
        if self._buf:
            log.error("usage log: %d rows could not be written at shutdown", len(self._buf))
