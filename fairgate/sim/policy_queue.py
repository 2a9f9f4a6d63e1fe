"""Engine mode's waiting queue: the policy itself, inside the engine (the VTC paper's setting)."""

from __future__ import annotations

from fairgate.policies.scheduler import Scheduler
from fairgate.policies.views import RequestView
from fairgate.engine.batching import EngineRequest


class PolicyQueue:
    """Adapts a scheduler to the engine's waiting-queue interface (engine mode)."""

    def __init__(self, scheduler: Scheduler, views: dict[str, RequestView], by_id: dict[str, EngineRequest]):
        self.s, self.views, self.by_id = scheduler, views, by_id

    def push(self, er: EngineRequest, now: float) -> bool:
        return self.s.add(self.views[er.id], now)

    def peek(self, now: float, fits=None) -> EngineRequest | None:
        """The policy's next request; a policy that ``skips_unfit`` (DLPM) is asked for the next that fits."""
        eligible = None
        if fits is not None and self.s.skips_unfit:
            eligible = lambda v: fits(self.by_id[v.request_id])  # noqa: E731
        v = self.s.peek(now, eligible)
        return None if v is None else self.by_id[v.request_id]

    def pop(self, er: EngineRequest, now: float) -> None:
        self.s.pop(self.views[er.id], now)

    def __len__(self) -> int:
        return len(self.s)
