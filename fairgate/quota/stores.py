"""Where the meters live: the protocol the quota gate (proxy/pipeline/quota_gate.py) reserves and settles
through, and its one-process store, ``MemoryQuotas``; across replicas, ``quota/redis_store.py``."""

from __future__ import annotations

from typing import Protocol

from fairgate.quota.meters import Check, QuotaBook, Refusal


class Store(Protocol):
    synchronous: bool  # its ``local`` book is the whole truth: the gate reserves and settles there directly
    lost: dict[str, float]  # budget meters the store lost since they were seeded (Redis's), to be seeded again,
    # each with what it last held
    async def reserve(self, checks: list[Check], now: float,
                      amounts: list[float] | None = None) -> tuple[Refusal | None, list[float]]: ...

    async def apply(self, deltas: list[tuple[Check, float]], now: float) -> None: ...

    async def seed(self, check: Check, amount: float, now: float, floor: float = 0.0) -> bool: ...
    # (whether the store has it: False, to be seeded again)

    def kick(self) -> None: ...  # send what waits for a round trip (draws and settlements), if anything does


class MemoryQuotas:
    """One process's meters (no Redis): the gate calls its book directly, with no task or await."""

    up, replicas, synchronous = True, 1, True

    def __init__(self) -> None:
        self.local = QuotaBook()
        self.lost: dict[str, float] = {}  # (memory loses nothing while the process lives)

    async def reserve(self, checks: list[Check], now: float,
                      amounts: list[float] | None = None) -> tuple[Refusal | None, list[float]]:
        return self.local.reserve(checks, now, amounts)

    async def apply(self, deltas: list[tuple[Check, float]], now: float) -> None:
        self.local.apply(deltas, now)

    async def seed(self, check: Check, amount: float, now: float, floor: float = 0.0) -> bool:
        self.local.seed(check, max(amount, floor), now)
        return True

    def pending(self) -> int:
        return 0

    def kick(self) -> None:
        pass
