"""A small policy written against the contract in ``fairgate/policies/scheduler.py`` (the docs' example):
round robin over clients — each dispatch goes to the client served least recently, its earliest request
first. It charges nothing (no counters), throttles nothing and does not pick per backend, so it declares
none of the capabilities and keeps the base class's no-op hooks. Pure: time is passed in."""

from __future__ import annotations

from collections import OrderedDict, deque

from fairgate.policies.scheduler import Eligible, Scheduler
from fairgate.policies.views import RequestView


class ClientRoundRobin(Scheduler):
    name = "client-rr"

    def __init__(self) -> None:
        super().__init__()
        self._queues: OrderedDict[str, deque[RequestView]] = OrderedDict()  # least recently served first

    def add(self, req: RequestView, now: float) -> bool:
        self._queues.setdefault(req.client, deque()).append(req)
        return True

    def peek(self, now: float, eligible: Eligible | None = None, backend: str = "",
             queued: Eligible | None = None) -> RequestView | None:
        for q in self._queues.values():  # O(clients) at worst, O(1) when the first one is eligible
            if eligible is None or eligible(q[0]):
                return q[0]
        return None

    def pop(self, req: RequestView, now: float, backend: str = "") -> None:
        q = self._queues.pop(req.client)
        q.remove(req)
        if q:
            self._queues[req.client] = q  # to the back of the line

    def remove(self, req: RequestView, now: float) -> None:
        q = self._queues.get(req.client)
        if q is not None and req in q:
            q.remove(req)
            if not q:
                del self._queues[req.client]

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting_clients(self):
        return iter(self._queues)

    def waiting_by_client(self) -> dict[str, int]:
        return {c: len(q) for c, q in self._queues.items()}
