"""Request limits an admin sets (`fairgate admin limit set --user U|--app A --rpm N`), held under every
scheduling policy: a request over its user's or its app's limit — requests *accepted* in the sliding
60-second window — is refused at arrival with a 429 and an honest ``retry-after``, before it is tokenized or
queued. Refused requests do not count, so a client retrying in a loop is not locked out for good.

The ``fairserve`` policy applies the same limits as FairServe's OIT does (policies/oit.py: T_user and T_app,
only under overload and never to an interaction's continuation), so this limiter stands aside under it;
``rpm`` additionally limits every client without a limit of its own to ``rpm_limit``. Pure: time is passed
in; the windows are ``MemoryWindows`` on one process, Redis-backed ones across replicas. A check trims and
reads two windows: O(1) amortised, independent of how many requests others have queued.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairgate.policies.oit import Limit
from fairgate.policies.windows import MemoryWindows, WindowStore


@dataclass(frozen=True, slots=True)
class Limited:
    reason: str  # user_rpm | app_rpm
    retry_after_s: float  # until the window admits one more
    limit: int

    @property
    def message(self) -> str:
        who = "user" if self.reason == "user_rpm" else "app"
        return (f"Rate limit reached: this {who} is limited to {self.limit} requests per minute "
                f"(`fairgate admin limit set`); retry in {max(1, round(self.retry_after_s))} s")


class RequestLimits:
    """``user_limit(user_key)`` / ``app_limit(app)``: requests per window, or None for none."""

    def __init__(self, user_limit: Limit, app_limit: Limit, windows: WindowStore | None = None, window_s: float = 60.0):
        self.user_limit, self.app_limit = user_limit, app_limit
        self.windows = windows if windows is not None else MemoryWindows(window_s)
        self.refused = {"user_rpm": 0, "app_rpm": 0}

    def keys(self, user: str | None, app: str) -> list[tuple[str, str, int]]:
        """The windows a request of ``user`` (its key: ``app/name``) in ``app`` is counted in: (reason, window,
        limit), for the limits that are set."""
        out = []
        if user is not None and (n := self.user_limit(user)) is not None:
            out.append(("user_rpm", "u:" + user, n))
        if (n := self.app_limit(app)) is not None:
            out.append(("app_rpm", "a:" + app, n))
        return out

    def admit(self, checks: list[tuple[str, str, int]], now: float) -> Limited | None:
        """Count the request in its windows if every limit has room; else what refused it (counted nowhere)."""
        for reason, window, limit in checks:
            if self.windows.count(window, now) >= limit:
                self.refused[reason] += 1
                return Limited(reason, self.windows.retry_after(window, now, limit), limit)
        for _reason, window, _limit in checks:
            self.windows.hit(window, now)
        return None
