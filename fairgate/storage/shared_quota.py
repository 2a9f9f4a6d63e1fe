"""Limits and budgets across replicas (accounting/quota.py's meters, in Redis): one Lua script reserves a
request's amounts on all its meters at once, all or nothing, or applies draws and settlements — check and
write in one atomic step, so replicas racing for the last tokens of a minute cannot both win them. Operations
that arrive while a call is on its way go together in the next (one round trip for all of them; none waits
when Redis is idle).

Meters are hashes {u: used, t: ms of that value}; a rate meter drains at its rate as it is read. A concurrency
meter is a hash replica → requests in flight there, summed over the replicas still beating in the shared
state's ``replicas`` set (a replica that died does not hold its slots for good). Keys carry the namespace's
hash tag: one Redis Cluster slot. Every meter expires ``ttl`` after its last change.

When Redis does not answer, the replica keeps enforcing every limit on its own book at its share of each cap
(the cap divided by the replicas it last saw), says so in /ready and the metrics, and keeps what it reserved
and settled meanwhile; when Redis answers again that is applied there, once, before anything else. The local
book mirrors every change this replica makes, so its share is counted from its own recent use, not from zero.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fairgate.accounting.quota import BUDGET, INFLIGHT, Check, QuotaBook, Refusal
from fairgate.storage.redis_client import ERRORS, Link

log = logging.getLogger("fairgate.quota")

QUOTA_LUA = """
-- fg2_quota: KEYS[1] = the replicas zset (shared state), KEYS[2..] = the meters of every group, in order
-- ARGV = replica, live_ms, then per group: op ('reserve' | 'apply' | 'seed'), now_ms, n, then per meter: kind
--        ('r' | 'b' | 'i'), cap, rate (per ms), amount, ttl_ms
-- Groups run in order, each on its own: reserve adds every amount if each meter stays within its cap, else
-- changes nothing; apply adds them all; seed raises each meter to at least its amount.
-- Returns {replicas, per group {1, used...} or {0, index, used}}.
local replica, live = ARGV[1], tonumber(ARGV[2])
local function used(key, kind, rate, now)
  if kind == 'i' then
    local total, all = 0, redis.call('HGETALL', key)
    for j = 1, #all, 2 do
      local r, v = all[j], tonumber(all[j + 1])
      local beat = r ~= replica and redis.call('ZSCORE', KEYS[1], r)
      if r == replica or (beat and tonumber(beat) >= now - live) then
        total = total + v
      else
        redis.call('HDEL', key, r)  -- a replica that stopped beating holds nothing
      end
    end
    return total
  end
  local v = redis.call('HMGET', key, 'u', 't')
  local u = tonumber(v[1]) or 0
  if rate > 0 and v[2] then u = math.max(0, u - rate * math.max(0, now - tonumber(v[2]))) end
  return u
end
local results, a, k, now = {}, 3, 2, 0
while a <= #ARGV do
  local op, n = ARGV[a], tonumber(ARGV[a + 2])
  now = tonumber(ARGV[a + 1])
  a = a + 3
  local meters, refused = {}, nil
  for i = 1, n do
    local m = {key = KEYS[k], kind = ARGV[a], cap = tonumber(ARGV[a + 1]), rate = tonumber(ARGV[a + 2]),
               amount = tonumber(ARGV[a + 3]), ttl = tonumber(ARGV[a + 4])}
    m.used = used(m.key, m.kind, m.rate, now)
    if op == 'reserve' and not refused and m.used + m.amount > m.cap then refused = {0, i, tostring(m.used)} end
    meters[i] = m
    a, k = a + 5, k + 1
  end
  if refused then
    results[#results + 1] = refused
  else
    local out = {1}
    for i, m in ipairs(meters) do
      local u = math.max(0, m.used + m.amount)
      if op == 'seed' then u = math.max(m.used, m.amount) end
      if m.kind == 'i' then
        local mine = math.max(0, tonumber(redis.call('HGET', m.key, replica) or '0') + m.amount)
        redis.call('HSET', m.key, replica, mine)
      else
        redis.call('HSET', m.key, 'u', tostring(u), 't', now)
      end
      if redis.call('PTTL', m.key) < m.ttl then redis.call('PEXPIRE', m.key, m.ttl) end
      out[i + 1] = tostring(u)
    end
    results[#results + 1] = out
  end
end
return {redis.call('ZCOUNT', KEYS[1], now - live, '+inf'), results}
"""

KIND = {"rate": "r", BUDGET: "b", INFLIGHT: "i"}


class SharedQuotas:
    """``reserve`` and ``apply`` across replicas; ``now`` is wall-clock seconds (replicas on several hosts
    agree, NTP assumed)."""

    synchronous = False
    RETRY_S = 1.0  # after a failure, requests use the local book this long before Redis is tried again
    MAX_BATCH = 256  # operations in one round trip

    def __init__(self, redis, tag: str, replica: str, live_s: float = 10.0):
        self.redis, self.tag, self.replica, self.live_s = redis, tag, replica, live_s
        self._script = redis.register_script(QUOTA_LUA)
        self.local = QuotaBook()  # this replica's own use: its share while Redis is away
        self.replicas = 1  # live replicas, as Redis last said
        self._pending: dict[str, tuple[Check, float]] = {}  # applied here while Redis was away
        self._retry_at = 0.0
        self._queue: list = []  # (op, checks, amounts, now, future) waiting for the next round trip
        self._sending = False
        self.batches = 0  # round trips that went through
        self.link = Link("limits and budgets", log, "enforcing each limit at this replica's share")
        self.fallbacks = 0  # operations served by the local book

    @property
    def up(self) -> bool:
        return self.link.up is not False

    # -- one round trip for every operation that arrived while the last was on its way ------------------------
    async def _call(self, op: str, checks: list[Check], amounts: list[float], now: float):
        """The group's answer (``[1, used…]`` or ``[0, index, used]``), or None if Redis did not answer."""
        if time.monotonic() < self._retry_at:
            return None
        done = asyncio.get_running_loop().create_future()
        self._queue.append((op, checks, amounts, now, done))
        if not self._sending:
            self._sending = True
            asyncio.ensure_future(self._pump())
        return await asyncio.shield(done)  # (a caller cancelled still gets its operation applied)

    async def _pump(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[:self.MAX_BATCH], self._queue[self.MAX_BATCH:]
                results = await self._send(batch)
                for item, result in zip(batch, results):
                    if not item[4].done():
                        item[4].set_result(result)
        finally:
            self._sending = False

    async def _send(self, batch: list) -> list:
        """One EVALSHA for the batch, led by what was applied here while Redis was away (once)."""
        pending, self._pending = self._pending, {}
        groups = ([("apply", [c for c, _ in pending.values()], [a for _, a in pending.values()], batch[0][3])]
                  if pending else []) + [item[:4] for item in batch]
        keys: list = [self.tag + ":replicas"]
        args: list = [self.replica, int(self.live_s * 1000)]
        for op, checks, amounts, now in groups:
            keys += [f"{self.tag}:q:{c.key}" for c in checks]
            args += [op, int(now * 1000), len(checks)]
            for c, amount in zip(checks, amounts):
                args += [KIND[c.kind], repr(float(c.cap)), repr(c.rate / 1000.0), repr(float(amount)),
                         int(c.ttl_s * 1000)]
        try:
            replicas, results = await self._script(keys=keys, args=args)
        except ERRORS as e:
            self._keep([(c, a) for c, a in pending.values()])  # (kept, with whatever was added since)
            self.link.failed(e)
            self._retry_at = time.monotonic() + self.RETRY_S
            return [None] * len(batch)
        if pending:
            log.info("limits and budgets: %d meters applied in Redis after its outage", len(pending))
        self.link.worked()
        self.replicas = max(1, int(replicas))
        self.local.cap_scale = 1.0 / self.replicas  # (its own use is kept against its share all along)
        self.batches += 1
        return results[1:] if pending else results

    def _keep(self, deltas: list[tuple[Check, float]]) -> None:
        for c, amount in deltas:
            was = self._pending.get(c.key, (c, 0.0))[1]
            self._pending[c.key] = (c, was + amount)

    async def reserve(self, checks: list[Check], now: float,
                      amounts: list[float] | None = None) -> tuple[Refusal | None, list[float]]:
        if amounts is None:
            amounts = [c.amount for c in checks]
        got = await self._call("reserve", checks, amounts, now)
        if got is None:
            self.fallbacks += 1
            refusal, used = self.local.reserve(checks, now, amounts)
            if refusal is None:
                self._keep(list(zip(checks, amounts)))
            return refusal, used
        if int(got[0]) == 0:
            i = int(got[1]) - 1
            return Refusal(checks[i], float(got[2]), amounts[i]), [0.0] * len(checks)
        used = [float(x) for x in got[1:]]
        self.local.apply([(c, a) for c, a in zip(checks, amounts) if c.kind != BUDGET], now)  # its own use
        for c, u in zip(checks, used):
            if c.kind == BUDGET:
                self.local.set(c, u, now)  # the fleet's
        return None, used

    async def apply(self, deltas: list[tuple[Check, float]], now: float) -> None:
        deltas = [(c, a) for c, a in deltas if a]
        if not deltas:
            return
        self.local.apply(deltas, now)
        got = await self._call("apply", [c for c, _ in deltas], [a for _, a in deltas], now)
        if got is None:
            self.fallbacks += 1
            self._keep(deltas)

    async def seed(self, check: Check, amount: float, now: float) -> None:
        self.local.seed(check, amount, now)
        await self._call("seed", [check], [amount], now)  # (away: the local meter has it; the spend it then adds
        # reaches Redis on return, where the next process to meet the meter seeds it from the rows again)

    def pending(self) -> int:
        return len(self._pending)
