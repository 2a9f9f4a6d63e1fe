"""Where virtual token counters live. The policy calls this small interface (``CounterStore``); the in-memory
store is the default, and the shared store (Redis, ``storage/shared_state.py``) satisfies the same Protocol."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class CounterStore(Protocol):
    def get(self, client: str) -> float: ...

    def add(self, client: str, amount: float) -> float: ...

    def lift(self, client: str, floor: float) -> float:
        """Counter lift (VTC §4.1): c ← max(c, floor)."""
        ...



class MemoryCounters:
    def __init__(self) -> None:
        self._c: dict[str, float] = {}

    def get(self, client: str) -> float:
        return self._c.get(client, 0.0)

    def add(self, client: str, amount: float) -> float:
        value = self._c.get(client, 0.0) + amount
        self._c[client] = value
        return value

    def lift(self, client: str, floor: float) -> float:
        """Counter lift: c ← max(c, floor)."""
        value = max(self._c.get(client, 0.0), floor)
        self._c[client] = value
        return value

    def items(self):
        return self._c.items()
