"""One request's record as it goes through the gateway; becomes its usage row."""

from __future__ import annotations

import itertools
import operator
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, AsyncIterator

from fairgate.accounting.tally import Tally
from fairgate.accounting.slo import met, observed_atgt_s
from fairgate.storage.models import Status, UsageLog

if TYPE_CHECKING:
    from fairgate.http.client import Response as UpstreamResponse
    from fairgate.proxy.control.backends import Backend
    from fairgate.proxy.pipeline.ticket import Ticket

_ID_PREFIX = secrets.token_hex(8)  # per process: ids from two gateways (or workers) never meet
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """The gateway's own request id: unique (a random 64-bit prefix per process, then a counter), 32 hex digits
    like a UUID's, at a counter's cost instead of a syscall for random bytes per request."""
    return f"req-{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(slots=True)
class Attempt:
    """One try at a backend. It starts at the dispatcher's grant (``ticket``: the slot it holds until the
    dispatcher's ``finish`` or ``abandon``) and either fails before its first event (``error``; the next
    backend is then tried, up to ``max_attempts``) or opens: then it carries what the relay reads (the
    backend's ``response``, its ``stream`` of whole lines, the ``first`` event and the ``first_read`` that
    brought it) and ``max_events``, the bound on the events the answer may hold."""

    backend: Backend
    started: float  # loop time of the grant (request_timeout_s counts from here)
    ticket: Ticket | None = None
    error: str | None = None  # why it ended before its first event
    response: UpstreamResponse | None = None
    stream: AsyncIterator[bytes] | None = None  # one piece per network read; None: the answer came whole
    first: dict[str, Any] = field(default_factory=dict)  # the first event (or the whole answer)
    first_read: bytes = b""
    max_events: int = 0  # n × max_tokens, each choice's role and finish, usage, [DONE]
    reserved_output: int = 0  # output tokens (all choices) its KV reservation holds, grown as a stream outlives it
    last_read: float = 0.0  # loop time of its stream's latest observed read, the output tokens then, and the
    last_generated: int = 0  # time spent waiting for the backend since (latency fits)
    waited: float = 0.0


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
    attempts: list[Attempt] = field(default_factory=list)  # one per try at a backend, in order
    dispatched_at: datetime | None = None
    # a backend took it (answered, or its client left while one had it): its prompt is billed; a request every
    # backend refused or failed before answering ran nowhere and is not
    ran: bool = False
    continuable: bool = False  # its interaction is one the client named (a later request may continue it)
    first_token_at: datetime | None = None
    finished_at: datetime | None = None
    status: Status = Status.OK
    http_status: int = 200
    error: str | None = None
    throttle_reason: str | None = None
    limit: str | None = None  # the limit that refused it (app_rpm, user_tpm, key_concurrency, …: the console's)
    client_retry: int = 0
    fairness_key: str | None = None
    policy: str | None = None
    queue_wait_s: float | None = None
    counter_before: float | None = None
    counter_after: float | None = None
    client_request_id: str | None = None  # the client's x-request-id: recorded and echoed, never a key
    predicted_cached_tokens: int | None = None  # the prefix index's guess for the backend it went to
    n: int = 1  # choices asked for, over all its prompts (prompts × n)
    prompts: int = 1  # prompts in it (a completion may batch several)
    max_output: int = 0  # all the output it may produce (an output that reached it was cut, not a natural length)
    output_capped: bool = False  # max_output is a cap (its max_tokens, or its model's context), not a first guess
    whole: bool = False  # the backend's answer came whole (not streamed): no first token apart from the last
    slo_class: str | None = None  # its app's SLO class (accounting/slo.py), with this request's targets
    slo_ttft_ms: float | None = None
    slo_atgt_ms: float | None = None
    predicted_ttft_ms: float | None = None  # its calibrated p90 TTFT at admission (pipeline/forecast.py)
    hold: Any = None  # what it reserved of its limits and budgets (pipeline/quota_gate.py's Hold)

    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else (self.first_token_at - self.arrival).total_seconds()

    def atgt_s(self) -> float | None:
        if self.first_token_at is None or self.finished_at is None or self.whole:
            return None
        return observed_atgt_s((self.finished_at - self.first_token_at).total_seconds(), self.tally.completion_tokens)

    def slo_met(self) -> bool | None:
        """Whether it met its class's targets: None without a class, or for a request refused as malformed (the
        client's error, not the service's); any other that did not end well (throttled, failed, cancelled) did not."""
        if self.slo_class is None or self.status is Status.REJECTED:
            return None
        # (a whole answer's "first token" is its last: its TTFT is judged by an upper bound, its ATGT unknown)
        return self.status is Status.OK and met(self.ttft_s(), self.atgt_s(), self.slo_ttft_ms,
                                                None if self.whole else self.slo_atgt_ms)

    def fail(self, status: Status, http_status: int, error: str) -> None:
        self.status, self.http_status, self.error = status, http_status, error[:2000]

    def row(self) -> dict[str, Any]:
        """Its usage row: every column of ``UsageLog`` (but the key), from the attribute of that name unless
        derived below, so a column added to the model without a value here fails at once (tests/test_call.py)."""
        t = self.tally
        row = dict(zip(_DIRECT, _direct(self)))
        row["interaction"] = self.interaction or self.request_id
        row["prompt_tokens"] = t.prompt_tokens if (t.usage_seen or self.ran) else 0
        row["system_tokens"], row["cached_tokens"] = t.system_tokens, t.cached_tokens
        row["completion_tokens"], row["estimated_prompt_tokens"] = t.completion_tokens, t.estimated_prompt
        row["reasoning_tokens"] = t.reasoning_tokens
        row["finished_at"] = self.finished_at or utcnow()
        row["status"], row["attempts"] = self.status.value, len(self.attempts)
        row["queue_wait_ms"] = None if self.queue_wait_s is None else self.queue_wait_s * 1000.0
        row["atgt_ms"] = None if (atgt := self.atgt_s()) is None else atgt * 1000.0
        row["slo_met"] = self.slo_met()
        return row


ROW_COLUMNS = tuple(c.name for c in UsageLog.__table__.columns if not c.primary_key)
_DERIVED = ("interaction", "prompt_tokens", "system_tokens", "cached_tokens", "completion_tokens",
            "reasoning_tokens", "estimated_prompt_tokens", "finished_at", "status", "attempts", "queue_wait_ms", "atgt_ms", "slo_met")
_DIRECT = tuple(c for c in ROW_COLUMNS if c not in _DERIVED)  # the columns named as its attributes
_direct = operator.attrgetter(*_DIRECT)
