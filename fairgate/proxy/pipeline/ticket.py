"""What a request holds while it waits for a backend and runs there (``Ticket``), and the gate's settings: the
plain data the dispatcher (pipeline/dispatcher.py) and the gate (pipeline/kv_gate.py) share."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fairgate.policies.placement import Placement
from fairgate.policies.scheduler import Scheduler
from fairgate.policies.views import RequestView


@dataclass(eq=False)
class Ticket:
    view: RequestView
    kv_tokens: int
    exclude: set[str]
    future: asyncio.Future
    enqueued: float
    counter_before: float = 0.0
    scheduler: Scheduler | None = None  # the one that admitted it settles its charges, even after a switch
    placement: Placement | None = None  # and the one that placed it hears of its end
    placed_on: str | None = None  # the backend its placement charged (where it was pinned, else where it went)
    held_since: float | None = None
    predicted_cached: int | None = None  # prompt tokens the prefix index expected the backend to hold
    prefilling: int = 0  # its prompt tokens counted in its backend's ``prefilling`` until its first token
    output: int = 0  # of kv_tokens, the output reserved (the rest: its prompt), and the output generated so far
    generated: int = 0
    choices: int = 1  # choices generated side by side (n × prompts): its KV grows by that many tokens a step
    streamed: bool = True  # its progress is read as it streams (else, fetched whole or of too many choices
    # for the gate's profile: pipeline/kv_gate.py, it counts at its largest)
    charged_at: float = 0.0  # loop time of its last progress (its dispatch, then each read)
    rate: float = 0.0  # tokens a second its stream has been read at since its first: how far on it may be
    first_read: tuple[float, int] | None = None  # (loop time, tokens) at the first read that had any


@dataclass
class GateConfig:
    overcommit: float = 1.0  # fraction of a backend's KV capacity the gateway may reserve
    max_inflight: int = 64  # per backend when its capacity is unknown
    queue_timeout_s: float = 600.0
    retry_after_s: int = 1
    hold_max_s: float = 0.1  # longest a replica defers to a less-served client queued on another replica
    max_queued: int = 10_000  # requests waiting in this gateway, all tenants (503 beyond)
    max_queued_per_tenant: int = 1_000  # requests one fairness key may have waiting (429 beyond)
    max_queued_per_app: int = 2_500  # requests one app may have waiting, all its users (429 beyond)
    # under fairness_key user: an app's users that wait as themselves, at most (None: no bound; the rest wait as
    # the app); not under a policy that limits each client's requests (its limits stay the user's)
    max_users_per_app: int | None = None
    recheck_s: float = 0.01  # a placement's heartbeat: how soon a request it held back is offered again
    kv_gate: str = "future"  # how reservations add up on a backend: future | peaks (pipeline/kv_gate.py)


@dataclass
class DispatchStats:
    dispatched: int = 0
    rejected: int = 0
    throttled: int = 0
