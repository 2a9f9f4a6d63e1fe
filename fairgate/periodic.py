"""A background task that runs a coroutine every few seconds until stopped (health checks, refreshes, syncs)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable

log = logging.getLogger("fairgate")


class Periodic:
    """Runs ``step`` every ``interval_s``; ``wake()`` brings the next run forward, to no sooner than ``soonest_s``
    after the last one since."""

    def __init__(self, name: str, interval_s: float, step: Callable[[], Awaitable[object]],
                 soonest_s: float | None = None):
        self.name, self.interval_s, self.step = name, interval_s, step
        self.soonest_s = interval_s if soonest_s is None else soonest_s
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._woken: asyncio.Event | None = None

    def start(self) -> None:
        self._woken = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name=self.name)

    def wake(self) -> None:
        if self._woken is not None:
            self._woken.set()

    async def stop(self) -> None:
        if self._task:
            self._stopping = True  # (a step whose client swallows the cancellation still ends the loop)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            since = loop.time()
            if self.soonest_s >= self.interval_s:
                await asyncio.sleep(self.interval_s)
            else:
                await self._wait(loop, since)
            try:
                await self.step()
            except Exception as e:  # keep running on the last good state; the step logs what it knows
                log.warning("%s failed: %s", self.name, e)

    async def _wait(self, loop: asyncio.AbstractEventLoop, since: float) -> None:
        """Until ``interval_s`` after ``since``, or ``soonest_s`` after it once woken."""
        deadline = since + self.interval_s
        while (left := deadline - loop.time()) > 0:
            if self._woken.is_set():
                self._woken.clear()
                deadline = min(deadline, since + self.soonest_s)
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._woken.wait(), left)
