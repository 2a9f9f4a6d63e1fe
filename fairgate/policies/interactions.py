"""Interaction state (FairServe §4.2): which interactions are in progress, so their calls count as continuations.

An interaction is *open* from its first admitted call until its final call finishes (when the caller knows
it) or until it has been idle for ``ttl_s`` (an abandoned agent run expires;
docs/policies/fairserve.md#ambiguity-a4). The memory store below is the single-process default; the Redis
store mirrors the same interface across replicas.
Pure: time is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class InteractionStore(Protocol):
    """What WSC reads and writes of interactions; ``storage/shared_fairserve.py``'s Redis store satisfies it."""

    def is_open(self, interaction: str, now: float) -> bool: ...

    def calls(self, interaction: str) -> int: ...  # its calls admitted (by this replica, for a shared store)

    def open(self, interaction: str, user: str, app: str, stage: int, now: float) -> None: ...

    def touch(self, interaction: str, now: float) -> None: ...

    def close(self, interaction: str) -> None: ...

    def __len__(self) -> int: ...


@dataclass(slots=True)
class OpenInteraction:
    user: str
    app: str
    stage: int  # the highest stage admitted so far
    started: float
    last: float  # last activity (a call admitted or finished)
    calls: int = 0


class MemoryInteractions:
    def __init__(self, ttl_s: float = 300.0):
        self.ttl_s = ttl_s
        self._open: OrderedDict[str, OpenInteraction] = OrderedDict()  # least recently active first
        self.expired = 0

    def _expire(self, now: float) -> None:
        while self._open:
            x, st = next(iter(self._open.items()))
            if now - st.last <= self.ttl_s:
                return
            del self._open[x]
            self.expired += 1

    def is_open(self, interaction: str, now: float) -> bool:
        self._expire(now)
        return interaction in self._open

    def calls(self, interaction: str) -> int:
        st = self._open.get(interaction)
        return 0 if st is None else st.calls

    def get(self, interaction: str, now: float) -> OpenInteraction | None:
        self._expire(now)
        return self._open.get(interaction)

    def open(self, interaction: str, user: str, app: str, stage: int, now: float) -> None:
        """A call of the interaction was admitted (the first one opens it)."""
        st = self._open.pop(interaction, None) or OpenInteraction(user, app, stage, now, now)
        st.stage, st.last, st.calls = max(st.stage, stage), now, st.calls + 1
        self._open[interaction] = st

    def touch(self, interaction: str, now: float) -> None:
        st = self._open.pop(interaction, None)
        if st is not None:
            st.last = now
            self._open[interaction] = st

    def close(self, interaction: str) -> None:
        self._open.pop(interaction, None)

    def __len__(self) -> int:
        return len(self._open)
