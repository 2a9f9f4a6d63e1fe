"""Waiting for what a protocol's callbacks deliver (a request's body, an upstream answer's bytes): one future at a
time, awaited by the reader and set by the connection's side."""

from __future__ import annotations

import asyncio


class Arrival:
    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future | None = None

    async def _arrival(self) -> None:
        """Until the connection's side calls ``_wake``."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
