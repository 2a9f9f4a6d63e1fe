"""Waiting for what a protocol's callbacks deliver (a request's body, an upstream answer's bytes): one future at a
time, awaited by the reader and set by the connection's side."""

from __future__ import annotations

import asyncio


class Arrival:
    __slots__ = ("_waiter", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._waiter: asyncio.Future | None = None
        self._loop = loop  # (the connection's: asking asyncio for the running loop is a system call a time)

    async def _arrival(self) -> None:
        """Until the connection's side calls ``_wake``."""
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
