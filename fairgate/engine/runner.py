"""Drives the engine model in real time for the emulated vLLM server (the simulator drives it in virtual time)."""

from __future__ import annotations

import asyncio
import contextlib

from fairgate.engine.batching import Engine, EngineRequest

DONE = -1  # sentinel put on a request's queue when it finishes


class EngineRunner:
    """Runs ``engine.step`` back to back, sleeping each step's duration divided by ``speed``.

    Each submitted request gets an ``asyncio.Queue`` that receives its cumulative token count after every
    step that gave it a token, then ``DONE``.
    """

    def __init__(self, engine: Engine, speed: float = 1.0):
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.engine = engine
        self.speed = speed
        self._queues: dict[EngineRequest, asyncio.Queue[int]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._t0 = 0.0

    def now(self) -> float:
        """Engine time in the profile's seconds."""
        return (asyncio.get_running_loop().time() - self._t0) * self.speed

    async def start(self) -> None:
        self._t0 = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._run(), name="engine-runner")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, req: EngineRequest) -> asyncio.Queue[int]:
        self.engine.add(req)  # may raise RequestTooLarge
        q: asyncio.Queue[int] = asyncio.Queue()
        self._queues[req] = q
        self._wake.set()
        return q

    def cancel(self, req: EngineRequest) -> None:
        if self._queues.pop(req, None) is not None and not req.done:
            self.engine.abort(req)
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            step = self.engine.step(self.now())
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Sleep to the step's end on the real clock, so per-step overheads do not accumulate as drift.
            end = self._t0 + (step.start + step.duration) / self.speed
            await asyncio.sleep(max(0.0, end - loop.time()))
            for r in step.emitted:
                q = self._queues.get(r)
                if q is not None:
                    q.put_nowait(r.generated)
            for r in step.finished:
                q = self._queues.pop(r, None)
                if q is not None:
                    q.put_nowait(DONE)
