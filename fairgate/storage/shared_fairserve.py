"""FairServe's state shared by replicas through Redis: OIT's rate windows, the open interactions, and the
per-(app, stage) token statistics.

The policy is pure and synchronous, so — as for the counters — it works on local mirrors with the same
interface as the memory stores. The dispatcher, which is async, ``prefetch``es what one request's decision
reads (its user's and app's windows, its interaction) just before asking the policy; what decisions write
(window hits, interaction opens and closes) goes out with the next state sync (20 ms), so a request costs
one Redis round trip, not two. Timestamps in Redis are wall-clock seconds, so replicas on different hosts
agree (NTP assumed). Every key carries the namespace's hash tag: one Redis Cluster slot, the counters', so
each pipeline and transaction runs on one node.

Statistics: observations are sent as they are (app, stage, tokens, wall time); one Lua script adds each into a
hash with the forward-decay weight 2^((t − landmark)/half_life) under the fleet's landmark, then the whole hash
is read back and replaces the local statistics. Sums add, so replicas' observations merge exactly.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

from fairgate.accounting.app_stats import CLASSES, AppStats
from fairgate.storage.redis_client import ERRORS


class SharedWindows:
    def __init__(self, redis, prefix: str, replica: str, window_s: float, wall: Callable[[float], float]):
        self.redis, self.prefix, self.replica, self.window_s, self.wall = redis, prefix, replica, window_s, wall
        self._seen: dict[str, list[float]] = {}  # wall times in the window, as last fetched (all replicas)
        self._pending: dict[str, list[float]] = {}  # this replica's hits not yet in Redis
        self._seq = itertools.count()

    def _trim(self, key: str, now: float) -> tuple[list[float], list[float]]:
        """The key's fetched and pending times still in the window (older ones are dropped here too, so a
        Redis outage does not grow them without bound)."""
        cutoff = self.wall(now) - self.window_s
        seen = self._seen[key] = [x for x in self._seen.get(key, ()) if x > cutoff]
        pending = self._pending[key] = [x for x in self._pending.get(key, ()) if x > cutoff]
        return seen, pending

    def hit(self, key: str, now: float) -> int:
        self._pending.setdefault(key, []).append(self.wall(now))
        return self.count(key, now)

    def count(self, key: str, now: float) -> int:
        seen, pending = self._trim(key, now)
        return len(seen) + len(pending)

    def retry_after(self, key: str, now: float, limit: int) -> float:
        seen, pending = self._trim(key, now)
        times = sorted(seen + pending)
        excess = len(times) - limit
        return 0.0 if excess < 0 else max(0.0, times[excess] + self.window_s - self.wall(now))

    async def prefetch(self, keys: list[str], now: float) -> None:
        t = self.wall(now)
        try:
            async with self.redis.pipeline(transaction=False) as p:
                for k in keys:
                    p.zremrangebyscore(self.prefix + k, "-inf", t - self.window_s)
                    p.zrange(self.prefix + k, 0, -1, withscores=True)
                out = await p.execute()
        except ERRORS:
            return  # keep the last view; the decision uses it and this replica's own hits
        for k, rows in zip(keys, out[1::2]):
            self._seen[k] = [score for _, score in rows]

    async def flush(self) -> None:
        pending, self._pending = {k: v for k, v in self._pending.items() if v}, {}
        if not pending:
            return
        try:
            async with self.redis.pipeline(transaction=False) as p:
                for k, times in pending.items():
                    p.zadd(self.prefix + k, {f"{self.replica}:{next(self._seq)}": x for x in times})
                    p.expire(self.prefix + k, int(self.window_s * 2) + 1)
                await p.execute()
        except ERRORS:
            for k, times in pending.items():  # keep them for the next flush
                self._pending.setdefault(k, []).extend(times)
            return
        for k, times in pending.items():
            self._seen.setdefault(k, []).extend(times)


class SharedInteractions:
    """Open interactions in one sorted set scored by last activity (wall time); expired ones are trimmed."""

    def __init__(self, redis, key: str, ttl_s: float, wall: Callable[[float], float]):
        self.redis, self.key, self.ttl_s, self.wall = redis, key, ttl_s, wall
        self._last: dict[str, float] = {}  # interaction → last activity (wall), as known here
        self._calls: dict[str, int] = {}  # interaction → its calls this replica admitted
        self._ops: list[tuple[str, str, float]] = []

    def is_open(self, interaction: str, now: float) -> bool:
        last = self._last.get(interaction)
        return last is not None and self.wall(now) - last <= self.ttl_s

    def calls(self, interaction: str) -> int:
        return self._calls.get(interaction, 0)

    def open(self, interaction: str, user: str, app: str, stage: int, now: float) -> None:
        self._calls[interaction] = self._calls.get(interaction, 0) + 1
        self.touch(interaction, now)

    def touch(self, interaction: str, now: float) -> None:
        self._last[interaction] = self.wall(now)
        self._ops.append(("t", interaction, self._last[interaction]))

    def close(self, interaction: str) -> None:
        self._last.pop(interaction, None)
        self._calls.pop(interaction, None)
        self._ops.append(("c", interaction, 0.0))

    def __len__(self) -> int:
        return len(self._last)

    async def prefetch(self, interactions: list[str]) -> None:
        try:
            scores = await self.redis.zmscore(self.key, interactions)
        except ERRORS:
            return
        for x, score in zip(interactions, scores):
            if score is not None:
                self._last[x] = max(self._last.get(x, 0.0), float(score))

    async def flush(self) -> None:
        ops, self._ops = self._ops, []
        cutoff = time.time() - self.ttl_s
        try:
            async with self.redis.pipeline(transaction=False) as p:
                for kind, x, t in ops:
                    if kind == "t":
                        p.zadd(self.key, {x: t}, gt=True)
                    else:
                        p.zrem(self.key, x)
                p.zremrangebyscore(self.key, "-inf", cutoff)
                await p.execute()
        except ERRORS:
            self._ops[:0] = ops
            return
        self._last = {x: t for x, t in self._last.items() if t > cutoff}
        self._calls = {x: n for x, n in self._calls.items() if x in self._last}


STATS_LUA = """
-- fg1_stats: KEYS = stats hash, landmark key; ARGV = half_life, landmark_if_new, n, (app, stage, i, s, o, t)*
local h, lk = KEYS[1], KEYS[2]
local half = tonumber(ARGV[1])
redis.call('SETNX', lk, ARGV[2])
local landmark = tonumber(redis.call('GET', lk))
local n = tonumber(ARGV[3])
local i = 4
local function bucket(x) return math.floor(4 * math.log(x + 1) / math.log(2)) end
for _ = 1, n do
  local app, stage = ARGV[i], ARGV[i + 1]
  local vals = {tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])}
  local w = 2 ^ ((tonumber(ARGV[i + 5]) - landmark) / half)
  i = i + 6
  for _, key in ipairs({app .. '|' .. stage, app .. '|-1', '|-1'}) do
    redis.call('HINCRBYFLOAT', h, key .. '|w', w)
    redis.call('HINCRBY', h, key .. '|n', 1)
    for c, cls in ipairs({'input', 'system', 'output'}) do
      redis.call('HINCRBYFLOAT', h, key .. '|sx|' .. cls, w * vals[c])
      redis.call('HINCRBYFLOAT', h, key .. '|h|' .. cls .. '|' .. bucket(vals[c]), w)
    end
  end
end
return {redis.call('GET', lk), redis.call('HGETALL', h)}
"""


class SharedStats:
    def __init__(self, redis, prefix: str):
        self.redis, self.key, self.landmark_key = redis, prefix + "stats", prefix + "stats_landmark"
        self._script = redis.register_script(STATS_LUA)
        self._pending: list[tuple] = []

    def observe(self, app: str, stage: int, input_tokens: int, system_tokens: int, output_tokens: int,
                wall: float) -> None:
        self._pending.append((app, stage, input_tokens, system_tokens, output_tokens, wall))

    async def start(self, stats: AppStats) -> None:
        if not await self._exists():
            await self.replace(stats)  # the first replica seeds Redis with its SQL snapshot
        await self.sync(stats)

    async def _exists(self) -> bool:
        try:
            return bool(await self.redis.exists(self.key))
        except ERRORS:
            return True  # unknown: do not overwrite

    async def sync(self, stats: AppStats) -> bool:
        pending, self._pending = self._pending, []
        args: list = [stats.half_life_s, stats.landmark if stats.entries else time.time(), len(pending)]
        for obs in pending:
            args += list(obs)
        try:
            landmark, flat = await self._script(keys=[self.key, self.landmark_key], args=args)
        except ERRORS:
            self._pending[:0] = pending
            return False
        stats.load(_state(float(landmark), flat))
        return True

    async def replace(self, stats: AppStats) -> None:
        """Make Redis hold exactly ``stats`` (after a rebuild, or to seed an empty fleet)."""
        dump = stats.dump()
        mapping: dict[str, float] = {}
        for e in dump["entries"]:
            key = f"{e['app']}|{e['stage']}"
            mapping[key + "|w"], mapping[key + "|n"] = e["w"], e["n"]
            for cls, d in e["dists"].items():
                mapping[f"{key}|sx|{cls}"] = d["sum_wx"]
                for b, v in d["hist"].items():
                    mapping[f"{key}|h|{cls}|{b}"] = v
        try:
            async with self.redis.pipeline(transaction=True) as p:
                p.delete(self.key)
                p.set(self.landmark_key, repr(dump["landmark"] if dump["entries"] else time.time()))
                if mapping:
                    p.hset(self.key, mapping=mapping)
                await p.execute()
        except ERRORS:
            pass


def _state(landmark: float, flat: list) -> dict:
    entries: dict[tuple[str, int], dict] = {}
    for field, value in zip(flat[::2], flat[1::2]):
        parts = field.decode().split("|")
        app, stage, kind = parts[0], int(parts[1]), parts[2]
        e = entries.setdefault((app, stage), {"app": app, "stage": stage, "w": 0.0, "n": 0,
                                              "dists": {c: {"sum_wx": 0.0, "hist": {}} for c in CLASSES}})
        v = float(value)
        if kind == "w":
            e["w"] = v
        elif kind == "n":
            e["n"] = int(v)
        elif kind == "sx":
            e["dists"][parts[3]]["sum_wx"] = v
        else:
            e["dists"][parts[3]]["hist"][parts[4]] = v
    return {"landmark": landmark, "entries": list(entries.values())}
