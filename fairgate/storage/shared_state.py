"""State shared by gateway replicas through Redis: virtual counters, who is backlogged where, and how much of
each backend the replicas have in flight.

The policy is pure and synchronous, so it reads and writes a local mirror (the ``counters`` interface:
``get``, ``add``, ``lift``). Every ``interval_s`` one Lua script (``fg1_sync``; the version is in the name so
a rolling upgrade can run two versions side by side) applies this replica's pending operations in order —
charges as ``HINCRBYFLOAT``, counter lifts as ``max(c, floor)`` computed *inside* Redis, never
check-then-write — publishes this replica's backlogged clients with their counters, its in-flight tokens per
backend and a heartbeat, drops replicas that stopped beating, and returns the authoritative counters, the
smallest counter backlogged anywhere, and every backend's in-flight total. All keys share the hash tag
``{<namespace>}`` so the script runs on one Redis Cluster slot.

If Redis is unreachable the replica keeps serving on its mirror: pending operations accumulate (folded per
client) and are applied when Redis returns; the cross-replica view (global backlog minimum, the others'
in-flight) is the last one seen. A Redis outage never becomes a client error.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fairgate.periodic import Periodic

log = logging.getLogger("fairgate.shared")

SCRIPT_NAME = "fg1_sync"
SYNC_LUA = """
-- fg1_sync: KEYS = counters (hash), backlog (zset), inflight (hash), replicas (zset)
-- ARGV = replica, now_ms, ttl_ms, n_ops, (kind, client, value)*, n_backlog, client*, n_inflight,
--        (backend, tokens, count)*, n_watch, client*
local counters, backlog, inflight, replicas = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local replica, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local i = 4
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local kind, client, value = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]); i = i + 3
  if kind == 'd' then
    redis.call('HINCRBYFLOAT', counters, client, value)
  else  -- counter lift: c <- max(c, floor), atomically here
    local cur = tonumber(redis.call('HGET', counters, client) or '0')
    if cur < value then redis.call('HSET', counters, client, value) end
  end
end
-- heartbeat; forget replicas that stopped beating (their backlog and in-flight)
redis.call('ZADD', replicas, now, replica)
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', replicas, '-inf', now - ttl)) do
  redis.call('ZREM', replicas, dead)
  for _, m in ipairs(redis.call('ZRANGE', backlog, 0, -1)) do
    if string.sub(m, 1, #dead + 1) == dead .. '|' then redis.call('ZREM', backlog, m) end
  end
  for _, f in ipairs(redis.call('HKEYS', inflight)) do
    if string.sub(f, 1, #dead + 1) == dead .. '|' then redis.call('HDEL', inflight, f) end
  end
end
-- this replica's backlog, scored by the authoritative counters
for _, m in ipairs(redis.call('ZRANGE', backlog, 0, -1)) do
  if string.sub(m, 1, #replica + 1) == replica .. '|' then redis.call('ZREM', backlog, m) end
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local client = ARGV[i]; i = i + 1
  redis.call('ZADD', backlog, tonumber(redis.call('HGET', counters, client) or '0'), replica .. '|' .. client)
end
-- this replica's in-flight per backend (absolute values)
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('HSET', inflight, replica .. '|' .. ARGV[i], ARGV[i + 1] .. ' ' .. ARGV[i + 2]); i = i + 3
end
-- answers: watched counters, the smallest backlogged counter (and whose), everyone's in-flight
local watched = {}
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  watched[#watched + 1] = redis.call('HGET', counters, ARGV[i]) or '0'; i = i + 1
end
local head = redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES')
return {watched, head, redis.call('HGETALL', inflight)}
"""


class SharedState:
    def __init__(self, url: str, namespace: str = "fairgate", replica: str | None = None,
                 interval_s: float = 0.02, ttl_s: float = 10.0):
        self.redis = aioredis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        tag = "{" + namespace + "}"
        self.keys = [f"{tag}:counters", f"{tag}:backlog", f"{tag}:inflight", f"{tag}:replicas"]
        self.replica = replica or uuid.uuid4().hex[:12]
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self._script = self.redis.register_script(SYNC_LUA)
        self._base: dict[str, float] = {}  # authoritative values at the last sync
        self._ops: list[tuple[str, str, float]] = []  # pending, in order
        self._pending: dict[str, float] = {}  # pending deltas per client (for reads between syncs)
        self._lift: dict[str, float] = {}  # pending lift floors per client
        self.global_min: tuple[str, float] | None = None  # (replica|client, counter) backlogged anywhere
        self.inflight: dict[str, tuple[int, int]] = {}  # backend → (tokens, requests) of the *other* replicas
        self.up = False
        self.backlog_source = lambda: []  # clients backlogged here (the dispatcher sets it)
        self.inflight_source = lambda: {}  # backend → (tokens, requests) of this replica
        self.on_sync: list = []
        self._periodic = Periodic("shared-state-sync", interval_s, self.sync)
        self.syncs = self.failures = 0
        self._tag = tag
        self._offset = time.time() - time.monotonic()  # loop time → wall time (set again in start())
        self._windows = self._interactions = None

    # -- FairServe's shared state (storage/shared_fairserve.py) ------------------------------------
    def wall(self, now: float) -> float:
        return now + self._offset

    def stats(self):
        from fairgate.storage.shared_fairserve import SharedStats

        return SharedStats(self.redis, self._tag + ":")

    def windows(self, window_s: float):
        from fairgate.storage.shared_fairserve import SharedWindows

        if self._windows is None:
            self._windows = SharedWindows(self.redis, self._tag + ":w:", self.replica, window_s, self.wall)
        return self._windows

    def interactions(self, ttl_s: float = 300.0):
        from fairgate.storage.shared_fairserve import SharedInteractions

        if self._interactions is None:
            self._interactions = SharedInteractions(self.redis, self._tag + ":ix", ttl_s, self.wall)
        return self._interactions

    async def prepare(self, client: str, app: str, interaction: str | None, now: float, windows: bool) -> None:
        """Fetch, in parallel, what one admission decision reads: the interaction's state and, for a policy that
        throttles (``windows``), the user's and app's windows."""
        fetches = []
        if windows and self._windows is not None:
            fetches.append(self._windows.prefetch(["u:" + client, "a:" + app], now))
        if self._interactions is not None and interaction:
            fetches.append(self._interactions.prefetch([interaction]))
        await asyncio.gather(*fetches)

    # -- the policy's counter store interface -------------------------------------------------------
    def get(self, client: str) -> float:
        value = self._base.get(client, 0.0)
        if client in self._lift:
            value = max(value, self._lift[client])
        return value + self._pending.get(client, 0.0)

    def add(self, client: str, amount: float) -> float:
        last = self._ops[-1] if self._ops else None
        if last is not None and last[0] == "d" and last[1] == client:  # fold a run of charges (per chunk)
            self._ops[-1] = ("d", client, last[2] + amount)
        else:
            self._ops.append(("d", client, amount))
        self._pending[client] = self._pending.get(client, 0.0) + amount
        return self.get(client)

    def lift(self, client: str, floor: float) -> float:
        if self.get(client) < floor:
            self._ops.append(("l", client, floor))
            # locally: the lift replaces everything before it
            self._lift[client] = floor
            self._pending[client] = 0.0
            self._base[client] = floor
        return self.get(client)

    def items(self):
        return ((c, self.get(c)) for c in set(self._base) | set(self._pending))

    # -- sync ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._offset = time.time() - asyncio.get_running_loop().time()
        await self.sync()
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
        await self.sync()  # last charges out, if Redis is there
        await self.redis.aclose()

    async def sync(self) -> bool:
        ops, self._ops = self._ops, []
        sent_pending, sent_lift = dict(self._pending), dict(self._lift)
        backlog = list(self.backlog_source())
        mine = self.inflight_source()
        # read back only what this replica is using: clients it charges or lifts, and clients queued here
        # (a decision never scans every client the fleet has seen)
        watch = sorted(set(self._pending) | set(self._lift) | set(backlog))
        args: list = [self.replica, int(time.time() * 1000), int(self.ttl_s * 1000), len(ops)]
        for op in ops:
            args += list(op)
        args += [len(backlog), *backlog, len(mine)]
        for backend, (tokens, count) in mine.items():
            args += [backend, tokens, count]
        args += [len(watch), *watch]
        try:
            watched, head, inflight = await self._script(keys=self.keys, args=args)
        except (RedisError, OSError) as e:
            self._ops[:0] = ops  # keep them, in order, for when Redis returns
            self.failures += 1
            if self.up:
                log.warning("Redis unreachable (%s): serving on local state until it returns", e)
            self.up = False
            return False
        if not self.up:
            log.info("Redis reachable: shared state in sync")
        self.up = True
        self.syncs += 1
        for client, value in zip(watch, watched):
            self._base[client] = float(value)
            if client in self._lift and self._lift[client] != sent_lift.get(client):
                continue  # lifted again while the script ran: that lift (and what followed) is still pending
            # deltas charged while the script ran stay pending; the ones it applied are now in the base
            self._pending[client] = self._pending.get(client, 0.0) - sent_pending.get(client, 0.0)
            if self._pending[client] == 0.0:
                del self._pending[client]
            if self._lift.get(client) == sent_lift.get(client):
                self._lift.pop(client, None)
        self.global_min = (head[0].decode(), float(head[1])) if head else None
        others: dict[str, list[int]] = {}
        for field, value in zip(inflight[::2], inflight[1::2]):
            replica, _, backend = field.decode().partition("|")
            if replica == self.replica:
                continue
            tokens, count = (int(x) for x in value.split())
            acc = others.setdefault(backend, [0, 0])
            acc[0] += tokens
            acc[1] += count
        self.inflight = {b: (t, c) for b, (t, c) in others.items()}
        # FairServe's writes (window hits, interaction opens and closes) go out with the state sync
        await asyncio.gather(*(x.flush() for x in (self._windows, self._interactions) if x is not None))
        for callback in self.on_sync:
            callback()
        return True

    def is_mine(self, member: str) -> bool:
        return member.startswith(self.replica + "|")
