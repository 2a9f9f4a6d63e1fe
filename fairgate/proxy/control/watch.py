"""The timer of a response after its first event: the backend's silence, the client's, and the whole request."""

from __future__ import annotations

import asyncio

from fairgate.proxy.config import GatewayConfig


class Watch:
    """One timer for a response after its first event: the wait for the backend's next event (idle timeout),
    for the client to take what was written (write timeout), and the whole request (from dispatch).

    Marking activity is an attribute write; a check armed on the loop wakes at the earliest moment a wait could
    run out (the last activity + the shorter of the two waits, or the deadline), and only then looks at the
    clock: rescheduling a timer on every event cost more than the event itself."""

    def __init__(self, config: GatewayConfig, started: float):
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.deadline = started + config.request_timeout_s
        self.waiting = "backend"
        self._wait = config.idle_timeout_s
        self._shortest = min(config.idle_timeout_s, config.write_timeout_s)
        self._since = self.loop.time()
        self._timer = asyncio.timeout(None)
        self._check: asyncio.TimerHandle | None = None
        self._active = False

    async def __aenter__(self) -> "Watch":
        await self._timer.__aenter__()
        self._active = True
        self._since = self.loop.time()
        self._check = self.loop.call_at(min(self._since + self._shortest, self.deadline), self._fire)
        return self

    async def __aexit__(self, *exc) -> bool | None:
        self._active = False
        if self._check is not None:
            self._check.cancel()
            self._check = None
        return await self._timer.__aexit__(*exc)

    def _fire(self) -> None:
        self._check = None
        if not self._active:
            return
        now = self.loop.time()
        due = min(self._since + self._wait, self.deadline)
        if now >= due:
            self._timer.reschedule(now)  # run out: the timeout cancels the block and raises TimeoutError
            return
        # no wait can run out before the last activity + the shorter wait; a longer one before ``due``
        nxt = min(self._since + self._shortest, self.deadline)
        self._check = self.loop.call_at(nxt if nxt > now else due, self._fire)

    def backend(self) -> None:
        self.waiting = "backend"
        self._wait = self.config.idle_timeout_s
        self._since = self.loop.time()

    def client(self) -> None:
        self.waiting = "client"
        self._wait = self.config.write_timeout_s
        self._since = self.loop.time()

    def past_deadline(self) -> bool:
        return self.loop.time() >= self.deadline

    def expired(self) -> str:
        if self.past_deadline():
            return f"the request exceeded request_timeout_s ({self.config.request_timeout_s:.0f} s)"
        return f"the backend sent nothing for {self.config.idle_timeout_s:.0f} s mid-stream (idle_timeout_s)"
