"""Limits and budgets across replicas (quota/meters.py's meters, in Redis): one Lua script
(quota/quota_lua.py) reserves a request's amounts on all its meters at once, all or nothing, or applies draws
and settlements — check and write in one atomic step, so replicas racing for the last tokens of a minute cannot
both win them. Operations that arrive while a call is on its way go together in the next (one round trip for
all of them; none waits when Redis is idle). With ``deferred`` (a gateway's store, storage/shared_state.py),
draws and settlements wait for the next reservation's round trip or the fairness sync's tick (``kick``), at
most ``KICK_S`` (20 ms) whether the sync runs or not: a request's limits cost the fleet one round trip of their
own, at its admission.

Meters are hashes {u: used, t: ms of that value}; a rate meter drains at its rate as it is read, and lives at
least until its debt drained. A concurrency meter is a hash replica → that replica's requests in flight, written
as an absolute count (a lost reply cannot leave a slot taken), summed over the replicas still beating in the
shared state's ``replicas`` set (a replica that died holds nothing). A budget is kept the same way: its meter
is what was spent, and its hold meter (``hold:…``) a hash replica → what that replica's requests in flight
reserved of it, so a replica that dies with requests in flight leaves nothing held once a request's longest
life has passed (it may have been cut off from Redis, still serving them); a reservation counts the
spend and the live replicas' holds against the cap (the gate's book keeps the two added up: ``_as_spend``
translates). A budget's meter is marked seeded once read from the usage log (``s``), so a reservation can
tell that Redis lost it. Keys carry the namespace's hash tag: one Redis Cluster slot.

Batches are numbered per replica, and Redis keeps the number and the outcome of each replica's last one. A
batch whose reply was lost is never sent again as it was: its callers were answered from the local book, and
when Redis answers again the replica asks what became of that batch and settles the difference once
(a reservation Redis made that the replica refused is given back; one the replica admitted that Redis did not
make is applied; draws and settlements are applied unless Redis had them).

When Redis does not answer, the replica keeps enforcing every limit on its own book at its share of each cap
(storage's QuotaBook: the cap over the replicas it last saw), says so in /ready and the metrics, and keeps what
it reserved and settled meanwhile; when Redis answers again that is applied there, once, before anything else
(a rate meter's part less what it would have drained since). The local book mirrors this replica's own use all
along, so its share is counted from its recent use, not from zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

from fairgate.quota.meters import BUDGET, INFLIGHT, RATE, Check, QuotaBook, Refusal
from fairgate.quota.plans import HELD
from fairgate.quota.quota_lua import QUOTA_LUA
from fairgate.storage.redis_client import ERRORS, Link

log = logging.getLogger("fairgate.quota")

KIND = {RATE: "r", BUDGET: "b", INFLIGHT: "i"}
MAX_LOST = 16384  # budget meters remembered (their spend as last seen, or as lost by Redis), the least recent
# forgotten beyond it
NOT_SENT = None  # an operation Redis never saw (kept, and applied when it answers)


def _as_spend(checks: list[Check], amounts: list[float]) -> tuple[list[Check], list[float]]:
    """An operation's amounts as Redis keeps a budget: its meter is its spend, and its hold meter what each
    replica's requests in flight reserved of it. A budget's amount in the gate's book (reservations and spend)
    becomes its spend's, less what its hold meter takes in the same operation; a budget missing beside its hold
    meter is added. O(its checks)."""
    holds = {c.key[len(HELD):]: (c, a) for c, a in zip(checks, amounts) if c.key.startswith(HELD)}
    if not holds:
        return checks, amounts
    out_checks, out_amounts = list(checks), list(amounts)
    for i, c in enumerate(checks):
        if c.kind == BUDGET and c.key in holds:
            out_amounts[i] -= holds.pop(c.key)[1]
    for key, (hold, amount) in holds.items():  # (its budget's spend did not move in the gate's book)
        if amount:
            out_checks.append(dataclasses.replace(hold, key=key))
            out_amounts.append(-amount)
    return out_checks, out_amounts


def _remember(d: dict[str, float], key: str, value: float) -> None:
    """``d[key] = value``, most recent last, the least recent forgotten past MAX_LOST."""
    d.pop(key, None)
    d[key] = value
    if len(d) > MAX_LOST:
        del d[next(iter(d))]


class Unknown:
    """An operation sent in a batch whose reply was lost: Redis may have run it or not."""


UNKNOWN = Unknown()


@dataclass(slots=True)
class _Op:
    op: str  # reserve | apply | seed
    checks: list[Check]
    amounts: list[float]
    now: float
    done: asyncio.Future | None = None
    local_ok: bool = True  # a reservation the local book made when Redis's answer was lost
    outcome: tuple | None = None  # a reservation's (refusal, used), booked as its answer came
    floor: float = 0.0  # a seed's: the spend a budget Redis lost had when last seen, added back to what it holds


class SharedQuotas:
    """``reserve`` and ``apply`` across replicas; ``now`` is wall-clock seconds (replicas on several hosts
    agree, NTP assumed)."""

    synchronous = False
    RETRY_S = 1.0  # after a failure, requests use the local book this long before Redis is tried again
    MAX_BATCH = 256  # operations in one round trip
    KICK_S = 0.02  # the longest a draw or settlement waits for a round trip (the fairness sync's interval)

    def __init__(self, redis, tag: str, replica: str, live_s: float = 10.0, deferred: bool = False,
                 holds_s: float = 4200.0):
        self.redis, self.tag, self.replica, self.live_s = redis, tag, replica, live_s
        # how long a budget's hold counts the part of a replica that stopped beating (after it last wrote it):
        # a request's longest life (queue_timeout_s + request_timeout_s), as one cut off from Redis may still run
        self.holds_s = holds_s
        self.deferred = deferred  # draws and settlements ride on the next round trip (``kick``)
        self._later: list[_Op] = []  # those waiting for it
        self._kick: asyncio.TimerHandle | None = None  # their latest send, if nothing goes sooner
        self._script = redis.register_script(QUOTA_LUA)
        self.local = QuotaBook()  # this replica's own use: its share while Redis is away
        self.replicas = 1  # live replicas, as Redis last said
        self._pending: dict[str, tuple[Check, float, float]] = {}  # (check, amount, since) Redis never saw
        self._unacked: tuple[int, list[_Op]] | None = None  # the batch whose reply was lost
        self._batch = int(time.time() * 1000)  # (numbers only grow, across restarts of this replica too)
        self._retry_at = 0.0
        self._queue: list[_Op] = []  # waiting for the next round trip
        self._pump_task: asyncio.Task | None = None
        self.batches = 0  # round trips that went through
        self.link = Link("limits and budgets", log, "enforcing each limit at this replica's share")
        self.fallbacks = 0  # operations served by the local book
        # budget meter → its spend when this replica last saw it seeded, for those a reservation then found
        # unseeded: Redis lost them (a restart without persistence, a flush, a failover to a replica behind),
        # until the gate reads their spend from the usage log again; the seed adds it back to what the meter
        # took since (the log's latest rows may still be on their way)
        self.lost: dict[str, float] = {}
        self._seen: dict[str, float] = {}  # budget meter → its spend as last seen seeded (least recent first)
        self._others: dict[str, float] = {}  # hold meter → the other replicas' part, as last seen

    @property
    def up(self) -> bool:
        return self.link.up is not False

    def pending(self) -> int:
        return len(self._pending) + (len(self._unacked[1]) if self._unacked else 0) + len(self._later)

    def kick(self) -> None:
        """Send the draws and settlements waiting for a round trip (at most ``KICK_S`` after the first of them
        began to wait; the fairness sync's tick and shutdown call it too)."""
        if self._kick is not None:
            self._kick.cancel()
            self._kick = None
        if not self._later:
            return
        later, self._later = self._later, []
        if time.monotonic() < self._retry_at:  # Redis failed a moment ago: kept for its return, as any operation
            for op in later:
                if not op.done.done():
                    op.done.set_result(NOT_SENT)
            return
        self._queue = later + self._queue
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.ensure_future(self._pump())

    async def flush(self) -> None:
        """Every operation waiting or on its way sent (at shutdown, before the connection closes)."""
        self.kick()
        while self._pump_task is not None and not self._pump_task.done():
            await asyncio.shield(self._pump_task)
            self.kick()

    async def _call(self, op: _Op, later: bool = False):
        """The group's answer (``[1, used…]`` or ``[0, index, used]``), ``NOT_SENT``, or ``UNKNOWN``; ``later``:
        it waits for the next round trip (``kick``)."""
        if time.monotonic() < self._retry_at:
            return NOT_SENT
        loop = asyncio.get_running_loop()
        op.done = loop.create_future()
        if later:
            self._later.append(op)
            if self._kick is None:  # (it does not depend on the fairness sync running)
                self._kick = loop.call_later(self.KICK_S, self.kick)
        else:
            self._queue.append(op)
            if self._pump_task is None or self._pump_task.done():
                self._pump_task = asyncio.ensure_future(self._pump())
        return await asyncio.shield(op.done)  # (a caller cancelled still gets its operation settled)

    async def _pump(self) -> None:
        while self._queue:
            if self._later:  # (what waited rides along with a reservation, first)
                self._queue, self._later = self._later + self._queue, []
            batch, self._queue = self._queue[:self.MAX_BATCH], self._queue[self.MAX_BATCH:]
            try:
                results = await self._send(batch)
            except Exception:  # noqa: BLE001 — a bug must not leave admissions waiting for good
                log.exception("limits and budgets: a batch failed")
                results = [NOT_SENT] * len(batch)
            for op, result in zip(batch, results):
                if op.op == "reserve" and op.outcome is None:  # (booked here, before the next batch's counts
                    op.outcome = self._book(op, result)  # are taken, not when its caller resumes)
                if not op.done.done():
                    op.done.set_result(result)

    def _args(self, batch_no: int, mode: str, groups: list[_Op]) -> tuple[list, list]:
        keys: list = [self.tag + ":replicas", self.tag + ":q:batches"]
        args: list = [self.replica, int(self.live_s * 1000), batch_no, mode]
        own: dict[str, float] = {}  # a concurrency or hold meter's count here, as the batch's groups go (a
        # settlement is in the local book already; a reservation is counted with its group)
        for g in groups:
            checks, amounts = _as_spend(g.checks, g.amounts)
            keys += [f"{self.tag}:q:{c.key}" for c in checks]
            args += [g.op, int(g.now * 1000), len(checks)]
            place = {c.key: i for i, c in enumerate(checks, 1)}
            for c, amount in zip(checks, amounts):
                mine, held = 0.0, c.key.startswith(HELD)
                if c.kind == INFLIGHT or held:
                    mine = own.get(c.key, self.local.used(c.key, 0.0, g.now)) + (amount if g.op == "reserve" else 0)
                    own[c.key] = mine
                elif g.op == "seed":
                    mine = g.floor
                elif c.kind == BUDGET:
                    mine = place.get(HELD + c.key, 0)
                args += ["h" if held else KIND[c.kind], repr(float(self.holds_s * 1000 if held else c.cap)),
                         repr(c.rate / 1000.0),
                         repr(float(amount)), int(c.ttl_s * 1000), repr(max(0.0, mine))]
        if mode == "status":
            args += ["", int(time.time() * 1000)]  # (the status reads ARGV[6] as now)
        return keys, args

    async def _reconcile(self) -> None:
        """What became of the batch whose reply was lost: settle the difference with what the replica did."""
        batch_no, ops = self._unacked
        keys, args = self._args(batch_no, "status", [])
        got = await self._script(keys=keys, args=args)
        ran = got[1] in (b"ran", "ran")
        flags = (got[2].decode() if isinstance(got[2], bytes) else got[2]) if ran else ""
        fix: list[_Op] = []
        for i, op in enumerate(ops):
            redis_did = ran and i < len(flags) and flags[i] == "1"
            if op.op == "reserve":
                if redis_did and not op.local_ok:  # Redis reserved what the replica refused: give it back
                    fix.append(_Op("apply", op.checks, [-a for a in op.amounts], op.now))
                elif not redis_did and op.local_ok:
                    fix.append(_Op("apply", op.checks, op.amounts, op.now))
            elif op.op == "apply" and not redis_did:
                fix.append(op)
        self._unacked = None
        for op in fix:
            self._keep(op.checks, op.amounts, op.now)

    async def _send(self, batch: list[_Op]) -> list:
        """One EVALSHA for the batch, led by what Redis missed while it was away (once)."""
        try:
            if self._unacked is not None:
                await self._reconcile()
        except ERRORS as e:
            self._failed(e)
            return [NOT_SENT] * len(batch)
        now = max(op.now for op in batch)  # (the callers' clock: wall seconds)
        pending, self._pending = self._pending, {}
        lead = [_Op("apply", [], [], now)] if pending else []  # (one group: any number of meters)
        for c, amount, since in pending.values():
            if c.kind == RATE and amount > 0:  # less what its meter would have drained since, at this replica's share
                amount = max(0.0, amount - c.rate * self.local.cap_scale * max(0.0, now - since))
            lead[0].checks.append(c)
            lead[0].amounts.append(amount)
        groups = lead + batch
        self._batch += 1
        keys, args = self._args(self._batch, "run", groups)
        try:
            got = await self._script(keys=keys, args=args)
        except ERRORS as e:
            self._unacked = (self._batch, groups)
            self._failed(e)
            return [UNKNOWN] * len(batch)
        if pending:
            log.info("limits and budgets: %d meters applied in Redis after its outage", len(pending))
        self.link.worked()
        self.replicas = max(1, int(got[0]))
        self.local.cap_scale = 1.0 / self.replicas  # (its own use is kept against its share all along)
        self.batches += 1
        return got[3 + len(lead):]

    def _failed(self, e: BaseException) -> None:
        self.link.failed(e)
        self._retry_at = time.monotonic() + self.RETRY_S

    def _keep(self, checks: list[Check], amounts: list[float], now: float) -> None:
        for c, amount in zip(*_as_spend(checks, amounts)):
            if c.kind == INFLIGHT or c.key.startswith(HELD):
                amount = 0.0  # (its count is sent whole with the next operation on it)
            _, was, since = self._pending.get(c.key, (c, 0.0, now))
            self._pending[c.key] = (c, was + amount, since)

    # -- the store ------------------------------------------------------------------------------------------
    async def reserve(self, checks: list[Check], now: float,
                      amounts: list[float] | None = None) -> tuple[Refusal | None, list[float]]:
        if amounts is None:
            amounts = [c.amount for c in checks]
        op = _Op("reserve", checks, amounts, now)
        got = await self._call(op)
        if op.outcome is None:  # (never queued: Redis failed a moment ago)
            op.outcome = self._book(op, got)
        return op.outcome

    def _book(self, op: _Op, got) -> tuple[Refusal | None, list[float]]:
        """A reservation's outcome, booked in the local book: Redis's answer, or the local book's own when Redis
        did not answer (kept for its return when it was never sent)."""
        checks, amounts, now = op.checks, op.amounts, op.now
        if got is NOT_SENT or got is UNKNOWN:
            self.fallbacks += 1
            refusal, used = self.local.reserve(checks, now, amounts)
            op.local_ok = refusal is None
            if refusal is None and got is NOT_SENT:
                self._keep(checks, amounts, now)
            # (a hold meter in the book is this replica's part: with the others' as last seen, a refusal tells
            # a budget held by their requests from one spent)
            return refusal, [u + self._others.get(c.key, 0.0) for c, u in zip(checks, used)]
        if int(got[0]) == 0:
            i = int(got[1]) - 1
            return Refusal(checks[i], float(got[2]), amounts[i]), [float(x) for x in got[3:]] or [0.0] * len(checks)
        used = self._note(checks, got)
        own = [(c, a) for c, a in zip(checks, amounts) if c.kind != BUDGET or c.key.startswith(HELD)]
        self.local.apply(own, now)  # its own use
        for c, u in zip(checks, used):
            if c.kind != BUDGET:
                continue
            if not c.key.startswith(HELD):
                self.local.set(c, u, now)  # the fleet's
                continue
            _remember(self._others, c.key, max(0.0, u - self.local.used(c.key, 0.0, now)))
        return None, used

    def _note(self, checks: list[Check], got: list) -> list[float]:
        """A run group's use of each meter (``[1, used…, marks]``, as sent), and what it says of its budgets:
        the spend of each seeded one, less the holds it was reported with (as last seen), or that Redis lost
        one seen seeded before (``lost``)."""
        n = len(checks)
        used = [float(x) for x in got[1:1 + n]]
        marks = got[1 + n] if len(got) > 1 + n else b""
        place = {c.key: i for i, c in enumerate(checks)}
        for i, (c, mark) in enumerate(zip(checks, marks.decode() if isinstance(marks, bytes) else marks)):
            if c.kind != BUDGET or c.key.startswith(HELD):
                continue
            seen = self._seen.pop(c.key, None)
            if mark == "0":
                spend = used[i] - (used[place[HELD + c.key]] if HELD + c.key in place else 0.0)
                if seen is not None and spend < seen - 1e-9 * seen:  # a spend never falls: rolled back (a
                    _remember(self.lost, c.key, seen)  # snapshot restored, a failover to a replica behind)
                else:
                    _remember(self._seen, c.key, spend)
            elif seen is not None:  # seeded when last seen, not now: Redis lost it
                _remember(self.lost, c.key, seen)
        return used

    async def apply(self, deltas: list[tuple[Check, float]], now: float) -> None:
        deltas = [(c, a) for c, a in deltas if a]
        if not deltas:
            return
        self.local.apply(deltas, now)
        checks, amounts = [c for c, _ in deltas], [a for _, a in deltas]
        got = await self._call(_Op("apply", checks, amounts, now), later=self.deferred)
        if got is NOT_SENT:
            self.fallbacks += 1
            self._keep(checks, amounts, now)
        elif isinstance(got, list) and got and int(got[0]) == 1:  # (a settlement moves a budget's spend)
            self._note(_as_spend(checks, amounts)[0], got)

    async def seed(self, check: Check, amount: float, now: float, floor: float = 0.0) -> bool:
        """Whether Redis ran it (else the local book has it, and the next process or request to meet the meter
        seeds it again)."""
        self.local.seed(check, max(amount, floor), now)
        got = await self._call(_Op("seed", [check], [amount], now, floor=floor))
        return isinstance(got, list)
