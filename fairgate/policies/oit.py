"""OIT — Overload- and Interaction-driven Throttling (FairServe §4.2, Alg. 1 l.19-25; notes/fairserve.md §2.4).

A call is throttled only if (1) the pool is overloaded, (2) it would *start* a new interaction (a continuation
is never throttled: it waits in the queue), and (3) its user is over the per-user limit — checked first — or
its app over the app's limit, in a sliding window. Every arrival counts in the windows, throttled or not.
Throttling a first call refuses the whole interaction before any of its tokens are spent, so OIT wastes none.

Overload (the paper's "KV cache overloaded" is not quantified, ambiguity A6): the pool's committed KV
load reaches ``kv_threshold``, or at least ``queue_threshold`` requests wait for headroom. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from fairgate.policies.views import BackendView, RequestView
from fairgate.policies.windows import MemoryWindows

Limit = Callable[[str], "int | None"]


@dataclass(frozen=True, slots=True)
class Throttle:
    reason: str  # user_limit | app_limit
    retry_after_s: float  # when the window will admit one more (an honest Retry-After)
    count: int
    limit: int

    @property
    def message(self) -> str:
        who = "user" if self.reason == "user_limit" else "app"
        return (f"the gateway is overloaded and this {who} is over its limit of {self.limit} new interactions "
                f"per window ({self.count} seen); calls of interactions already in progress are not throttled")


@dataclass(frozen=True, slots=True)
class OverloadConfig:
    kv_threshold: float = 0.9  # committed KV tokens / capacity, pool-wide
    queue_threshold: int = 1  # requests waiting in the gateway for headroom


def overloaded(backends: Sequence[BackendView], queued: int, cfg: OverloadConfig) -> bool:
    """The pool is overloaded when requests wait for headroom, or its KV load (the gateway's committed
    tokens, or vLLM's own kv_cache_usage_perc if higher) reaches the threshold."""
    if cfg.queue_threshold > 0 and queued >= cfg.queue_threshold:
        return True
    if any(b.waiting > 0 for b in backends):
        return True
    known = [b for b in backends if b.kv_capacity]
    if not known:
        return False
    capacity = sum(b.kv_capacity for b in known)  # type: ignore[misc]
    used = sum(max(b.inflight_tokens, b.kv_usage * b.kv_capacity) for b in known)  # type: ignore[operator]
    return used >= cfg.kv_threshold * capacity


class OIT:
    """``user_limit(user)`` / ``app_limit(app)``: requests per window, or None for no limit."""

    def __init__(self, user_limit: Limit, app_limit: Limit, windows=None, window_s: float = 60.0):
        self.user_limit, self.app_limit = user_limit, app_limit
        self.windows = windows if windows is not None else MemoryWindows(window_s)
        self.throttled = {"user_limit": 0, "app_limit": 0}

    def check(self, req: RequestView, continuation: bool, overloaded: bool, now: float) -> Throttle | None:
        ukey, akey = "u:" + req.client, "a:" + req.app
        n_user = self.windows.hit(ukey, now)  # Alg. 1 l.19: count every arrival
        n_app = self.windows.hit(akey, now)
        if not overloaded or continuation:  # P1, P2: no throttling without overload, never mid-interaction
            return None
        for reason, key, n, limit in (("user_limit", ukey, n_user, self.user_limit(req.client)),  # P3: user
                                      ("app_limit", akey, n_app, self.app_limit(req.app))):  # first, then app
            if limit is not None and n > limit:  # strict: the count includes this call (notes §2.6)
                self.throttled[reason] += 1
                return Throttle(reason, self.windows.retry_after(key, now, limit), n, limit)
        return None
