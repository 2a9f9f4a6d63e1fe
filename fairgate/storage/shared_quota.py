"""Limits and budgets across replicas (policies/quota.py's meters, in Redis): one Lua script reserves a
request's amounts on all its meters at once, all or nothing, or applies draws and settlements — check and
write in one atomic step, so replicas racing for the last tokens of a minute cannot both win them.

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

import logging
import time

from fairgate.policies.quota import BUDGET, INFLIGHT, Check, QuotaBook, Refusal
from fairgate.storage.redis_client import ERRORS, Link

log = logging.getLogger("fairgate.quota")

QUOTA_LUA = """
-- fg1_quota: KEYS[1] = the replicas zset (shared state), KEYS[2..] = one meter per check
-- ARGV = op ('reserve' | 'apply'), now_ms, replica, live_ms, then per meter: kind ('r' | 'b' | 'i'), cap,
--        rate (per ms), amount, ttl_ms
-- reserve: if every meter stays within its cap with its amount added, add them all and return
-- {1, replicas, used...}; else change nothing and return {0, replicas, index, used}. apply: add them all.
local op, now, replica, live = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local n = #KEYS - 1
local function used(key, kind, rate)
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
local meters, out = {}, {}
for i = 1, n do
  local a = 4 + (i - 1) * 5
  local m = {key = KEYS[i + 1], kind = ARGV[a + 1], cap = tonumber(ARGV[a + 2]), rate = tonumber(ARGV[a + 3]),
             amount = tonumber(ARGV[a + 4]), ttl = tonumber(ARGV[a + 5])}
  m.used = used(m.key, m.kind, m.rate)
  meters[i] = m
end
local replicas = redis.call('ZCOUNT', KEYS[1], now - live, '+inf')
if op == 'reserve' then
  for i, m in ipairs(meters) do
    if m.used + m.amount > m.cap then return {0, replicas, i, tostring(m.used)} end
  end
end
for i, m in ipairs(meters) do
  local u = math.max(0, m.used + m.amount)
  if m.kind == 'i' then
    local mine = math.max(0, tonumber(redis.call('HGET', m.key, replica) or '0') + m.amount)
    redis.call('HSET', m.key, replica, mine)
  else
    redis.call('HSET', m.key, 'u', tostring(u), 't', now)
  end
  if redis.call('PTTL', m.key) < m.ttl then redis.call('PEXPIRE', m.key, m.ttl) end
  out[i] = tostring(u)
end
return {1, replicas, unpack(out)}
"""

KIND = {"rate": "r", BUDGET: "b", INFLIGHT: "i"}


class SharedQuotas:
    """``reserve`` and ``apply`` across replicas; ``now`` is wall-clock seconds (replicas on several hosts
    agree, NTP assumed)."""

    RETRY_S = 1.0  # after a failure, requests use the local book this long before Redis is tried again

    def __init__(self, redis, tag: str, replica: str, live_s: float = 10.0):
        self.redis, self.tag, self.replica, self.live_s = redis, tag, replica, live_s
        self._script = redis.register_script(QUOTA_LUA)
        self.local = QuotaBook()  # this replica's own use: its share while Redis is away
        self.replicas = 1  # live replicas, as Redis last said
        self._pending: dict[str, tuple[Check, float]] = {}  # applied here while Redis was away
        self._retry_at = 0.0
        self.link = Link("limits and budgets", log, "enforcing each limit at this replica's share")
        self.fallbacks = 0  # operations served by the local book

    @property
    def up(self) -> bool:
        return self.link.up is not False

    def _args(self, op: str, checks: list[Check], amounts: list[float], now: float) -> tuple[list, list]:
        keys = [self.tag + ":replicas"] + [f"{self.tag}:q:{c.key}" for c in checks]
        args: list = [op, int(now * 1000), self.replica, int(self.live_s * 1000)]
        for c, amount in zip(checks, amounts):
            args += [KIND[c.kind], repr(float(c.cap)), repr(c.rate / 1000.0), repr(float(amount)),
                     int(c.ttl_s * 1000)]
        return keys, args

    async def _call(self, op: str, checks: list[Check], amounts: list[float], now: float):
        if time.monotonic() < self._retry_at:
            return None
        try:
            if self._pending and not await self._flush(now):
                return None
            keys, args = self._args(op, checks, amounts, now)
            got = await self._script(keys=keys, args=args)
        except ERRORS as e:
            self._failed(e)
            return None
        self.link.worked()
        self.replicas = max(1, int(got[1]))
        return got

    def _failed(self, e: BaseException) -> None:
        self.link.failed(e)
        self._retry_at = time.monotonic() + self.RETRY_S
        self.local.cap_scale = 1.0 / self.replicas

    async def _flush(self, now: float) -> bool:
        """What this replica applied while Redis was away, applied there once."""
        pending, self._pending = self._pending, {}
        checks = [c for c, _ in pending.values()]
        keys, args = self._args("apply", checks, [a for _, a in pending.values()], now)
        try:
            await self._script(keys=keys, args=args)
        except ERRORS as e:
            for key, (c, a) in pending.items():  # (kept, with whatever was added since)
                was = self._pending.get(key, (c, 0.0))[1]
                self._pending[key] = (c, a + was)
            self._failed(e)
            return False
        log.info("limits and budgets: %d meters applied in Redis after its outage", len(checks))
        return True

    def _keep(self, deltas: list[tuple[Check, float]]) -> None:
        for c, amount in deltas:
            was = self._pending.get(c.key, (c, 0.0))[1]
            self._pending[c.key] = (c, was + amount)

    async def reserve(self, checks: list[Check], now: float) -> tuple[Refusal | None, list[float]]:
        got = await self._call("reserve", checks, [c.amount for c in checks], now)
        if got is None:
            self.fallbacks += 1
            refusal, used = self.local.reserve(checks, now)
            if refusal is None:
                self._keep([(c, c.amount) for c in checks])
            return refusal, used
        if int(got[0]) == 0:
            i = int(got[2]) - 1
            return Refusal(checks[i], float(got[3])), [0.0] * len(checks)
        self.local.apply([(c, c.amount) for c in checks], now)
        return None, [float(x) for x in got[2:]]

    async def apply(self, deltas: list[tuple[Check, float]], now: float) -> None:
        deltas = [(c, a) for c, a in deltas if a]
        if not deltas:
            return
        self.local.apply(deltas, now)
        got = await self._call("apply", [c for c, _ in deltas], [a for _, a in deltas], now)
        if got is None:
            self.fallbacks += 1
            self._keep(deltas)

    def pending(self) -> int:
        return len(self._pending)
