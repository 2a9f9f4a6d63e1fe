"""A background task that runs a coroutine every few seconds until stopped (health checks, refreshes, syncs)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable

log = logging.getLogger("fairgate")


class Periodic:
    def __init__(self, name: str, interval_s: float, step: Callable[[], Awaitable[object]]):
        self.name, self.interval_s, self.step = name, interval_s, step
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        if self._task:
            self._stopping = True  # (a step whose client swallows the cancellation still ends the loop)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except Exception as e:  # keep running on the last good state; the step logs what it knows
                log.warning("%s failed: %s", self.name, e)
