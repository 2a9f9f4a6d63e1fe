"""Limits and budgets in the simulator (`fairgate replay --limits`): each arriving request reserves on the meters of
its app's and its user's limits as the gateway's quota gate does — the same checks (quota/plans.py) on the same
meters (quota/meters.py) — and is refused, with the limit's reason (``app_tpm``, ``user_rpm``, …), when one would
pass its cap; what it holds of a concurrency cap and of a budget's in-flight meter is given back when it ends.

Differences from the gateway, each on the side of simplicity: the output a request reserves is what it produced
(the log knows it; the gateway reserves a prediction and settles to the count), so a token meter stands as the
gateway's stands once settled; a refused client does not retry; a request its client gave up keeps its
charge; a budget starts the replayed window unspent (the gateway seeds it with the period's spend from the
usage log); money budgets are not replayed (the replayed requests carry no model to price). Pure: time is
passed in, as the log's clock (epoch seconds: budgets' periods are calendar ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fairgate.accounting.cost import CostFunction
from fairgate.quota.meters import INFLIGHT, Limits, QuotaBook
from fairgate.quota.plans import HELD, Hold, QuotaPlans


MOST = 10**15  # the largest limit a file may give (a meter's arithmetic is in floats)


@dataclass
class LimitTable:
    """The limits set, as quota/plans.py reads them of the tenants: each target's (``app:A``, ``user:A/U``, or
    ``user:U`` for a user shared among apps) limits and token budget, and its request limit."""

    quotas: dict[str, Limits] = field(default_factory=dict)
    rpm: dict[str, int] = field(default_factory=dict)
    version: int = 0
    prices: dict = field(default_factory=dict, init=False)  # (no money budget is replayed: nothing to price)

    def app_limit(self, app: str) -> int | None:
        return self.rpm.get("app:" + app)

    def own_limit(self, client: str) -> int | None:
        return self.rpm.get(client)

    def shared(self, app: str, user: str) -> bool:
        """The user is one an admin shared among apps (its limits go by its name alone)."""
        return f"user:{app}/{user}" not in self.quotas and f"user:{app}/{user}" not in self.rpm \
            and (f"user:{user}" in self.quotas or f"user:{user}" in self.rpm)

    def __bool__(self) -> bool:
        return bool(self.quotas or self.rpm)

    @classmethod
    def parse(cls, doc: Any) -> LimitTable:
        """From a mapping of target → {rpm, tpm, tpm_kind, concurrency, budget_tokens, budget_period} (a
        ``--limits`` file); ValueError naming what is wrong."""
        if not isinstance(doc, dict):
            raise ValueError("a mapping of app:NAME or user:APP/NAME to its limits")
        table = cls()
        fields = set(Limits.__dataclass_fields__)
        for target, spec in doc.items():
            if not isinstance(target, str) or not target.startswith(("app:", "user:")) or len(target) > 512:
                raise ValueError(f"{str(target)[:80]!r}: a target is app:NAME or user:APP/NAME")
            if not isinstance(spec, dict) or not set(spec) <= fields:
                raise ValueError(f"{target}: limits are a mapping of {', '.join(sorted(fields))}")
            for name in ("rpm", "tpm", "concurrency", "budget_tokens"):
                value = spec.get(name)
                if value is not None and (type(value) is not int or not 0 < value <= MOST):
                    raise ValueError(f"{target}: {name} is a positive whole number (at most {MOST:.0e})")
            if spec.get("budget_usd") is not None:
                raise ValueError(f"{target}: budget_usd: money budgets are not replayed (a token budget is)")
            if spec.get("tpm_kind", "total") not in ("total", "input", "output", "weighted"):
                raise ValueError(f"{target}: tpm_kind is total, input, output or weighted")
            if spec.get("budget_period", "month") not in ("day", "week", "month", "total"):
                raise ValueError(f"{target}: budget_period is day, week, month or total")
            limits = Limits(**spec)
            if limits.rpm:
                table.rpm[target] = limits.rpm
            table.quotas[target] = limits
        return table


@dataclass(slots=True)
class _Caller:
    """What quota/plans.py reads of a call."""

    app: str
    user: str | None
    key_id: int | None = None
    model: str = ""


class SimLimits:
    """The meters of every limit in ``table``, for requests arriving on the simulator's clock ``t`` (the log's
    epoch seconds ``epoch0 + t / speed``). ``request_limits``: apps' and users' request limits apply (not under
    ``fairserve``, which applies them its own way). O(checks) a request: at most ten."""

    def __init__(self, table: LimitTable, cost: CostFunction, epoch0: float, speed: float = 1.0,
                 request_limits: bool = True):
        self.table, self.epoch0, self.speed, self.request_limits = table, epoch0, speed, request_limits
        self.plans = QuotaPlans(table, cost)  # type: ignore[arg-type]  (the tenants' part it reads)
        self.book = QuotaBook()
        self._held: dict[int, Hold] = {}  # request → what it reserved

    def admit(self, r, t: float) -> str | None:
        """Reserve request ``r``'s amounts (its prompt and the output it produced) on its limits at ``t``, or
        the reason of the first limit it would pass (nothing reserved then)."""
        now = self.epoch0 + t / self.speed
        user = r.user or None
        call = _Caller(r.app, user)
        plan = self.plans.plan(call, user is not None and self.table.shared(r.app, user),  # type: ignore[arg-type]
                               self.request_limits, False, now)
        if not plan:
            return None
        hold = self.plans.checks(call, plan, r.prompt_len, r.output_len, r.output_len)  # type: ignore[arg-type]
        refusal, _ = self.book.reserve(hold.checks, now, hold.held)
        if refusal is not None:
            return refusal.check.reason
        self._held[r.id] = hold
        return None

    def refused(self, r, t: float) -> None:
        """Request ``r``, admitted by its limits, was refused after (the policy throttled it): all it reserved
        is given back, as the gateway settles a refused request to nothing."""
        hold = self._held.pop(r.id, None)
        if hold is not None:
            self.book.apply([(c, -amount) for c, amount in zip(hold.checks, hold.held)],
                            self.epoch0 + t / self.speed)

    def ended(self, r, t: float) -> None:
        """Request ``r`` finished or was given up: its concurrency and in-flight holds are given back."""
        hold = self._held.pop(r.id, None)
        if hold is not None:
            back = [(c, -amount) for c, amount, what in zip(hold.checks, hold.held, hold.what)
                    if c.kind == INFLIGHT or what.startswith(HELD)]
            if back:
                self.book.apply(back, self.epoch0 + t / self.speed)
