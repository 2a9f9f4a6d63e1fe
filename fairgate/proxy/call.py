"""One request's record as it goes through the gateway; becomes its usage row."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from fairgate.accounting.usage import Tally

_ID_PREFIX = secrets.token_hex(8)  # per process: ids from two gateways (or workers) never meet
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """The gateway's own request id: unique (a random 64-bit prefix per process, then a counter), 32 hex digits
    like a UUID's, at a counter's cost instead of a syscall for random bytes per request."""
    return f"req-{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(slots=True)
class Call:
    request_id: str
    endpoint: str
    arrival: datetime = field(default_factory=utcnow)
    app: str = ""
    user: str | None = None
    key_id: int | None = None
    interaction: str = ""
    stage: int = 0
    model: str | None = None
    stream: bool = False
    tally: Tally = field(default_factory=lambda: Tally(0))
    backend: str | None = None
    attempts: int = 0
    dispatched_at: datetime | None = None
    first_token_at: datetime | None = None
    finished_at: datetime | None = None
    status: str = "ok"
    http_status: int = 200
    error: str | None = None
    throttle_reason: str | None = None
    client_retry: int = 0
    fairness_key: str | None = None
    policy: str | None = None
    queue_wait_s: float | None = None
    counter_before: float | None = None
    counter_after: float | None = None
    client_request_id: str | None = None  # the client's x-request-id: recorded and echoed, never a key
    predicted_cached_tokens: int | None = None  # the prefix index's guess for the backend it went to

    def fail(self, status: str, http_status: int, error: str) -> None:
        self.status, self.http_status, self.error = status, http_status, error[:2000]

    def row(self) -> dict[str, Any]:
        t = self.tally
        return {
            "request_id": self.request_id, "user": self.user, "app": self.app, "key_id": self.key_id,
            "interaction": self.interaction or self.request_id, "stage": self.stage, "endpoint": self.endpoint,
            "model": self.model, "backend": self.backend, "stream": self.stream,
            "prompt_tokens": t.prompt_tokens if (t.usage_seen or self.dispatched_at) else 0,
            "system_tokens": t.system_tokens, "cached_tokens": t.cached_tokens,
            "completion_tokens": t.completion_tokens, "estimated_prompt_tokens": t.estimated_prompt,
            "arrival": self.arrival, "dispatched_at": self.dispatched_at, "first_token_at": self.first_token_at,
            "finished_at": self.finished_at or utcnow(), "status": self.status, "http_status": self.http_status,
            "error": self.error, "throttle_reason": self.throttle_reason, "attempts": self.attempts,
            "client_retry": self.client_retry, "fairness_key": self.fairness_key, "policy": self.policy,
            "queue_wait_ms": None if self.queue_wait_s is None else self.queue_wait_s * 1000.0,
            "counter_before": self.counter_before, "counter_after": self.counter_after,
            "client_request_id": self.client_request_id,
            "predicted_cached_tokens": self.predicted_cached_tokens,
        }
