"""The one Lua script a replica's sync runs (storage/shared_state.py explains what it keeps and why): the
counters' folded operations, the backlog, the heartbeats, and the KV budgets as curves over the future decode
steps (policies/kv_curve.py; the grid is written into the script, so the script's hash names it).

A budget's arithmetic, per backend, in the script (so no other replica's budget moves meanwhile):

- the others' budgets, each aged by the decode steps taken since it was given (the step rate it was sent with
  times the time since: as its replica ages it), as an upper bound on the grid;
- free F(e) = capacity − this replica's requests (the upper curve it sent) − the others' budgets, at each step;
- its budget = its requests + α·F in each cell where F ≥ 0 throughout (α: its share of the free room, the
  rules in shared_state.py), and its requests alone elsewhere.

So wherever there is room the budgets add up to at most the capacity (B_r ≤ requests + F = capacity − the
others). A budget never falls below the replica's own requests: they run, whatever the others were told. Were
it cut below them where the others' budgets, aged with some error, leave less than nothing, the next budgets
of the others would hand out KV those requests hold, and the backend would preempt.
"""

from __future__ import annotations

from fairgate.policies.kv_curve import GRID

SCRIPT_NAME = "fg4_sync"
_LUA = """
-- fg4_sync: KEYS = counters (hash), backlog (zset), inflight (hash), replicas (zset), applied (hash), wants (hash),
--        curves (hash)
-- ARGV = replica, now_ms, ttl_ms, batch, n_ops, (client, add, floor)*, n_backlog, client*, n_inflight,
--        (backend, count, capacity, wants, rate, curve)*, n_watch, client*  (returns its budgets as
--        backend, [v, s, ...] pairs)
-- inflight: replica|backend -> 'budget count' (budget: the most its budget curve reaches; a fg3_sync replica
--   writes its flat budget there and no curve); wants: replica|backend, while its gate wants more room there;
-- curves: replica|backend -> msgpack [clock_ms, rate, v, s, v, s, ...] (its budget over the future decode steps,
--   on the grid G, in whole tokens; the curve a replica sends is msgpack [v, s, ...])
-- An op is a client's pending charges and lifts folded into one map c <- max(c + add, floor) (floor '' is
-- none). A batch applies once: a replica that lost the answer sends it again with the same number.
local counters, backlog, inflight, replicas, applied, wants, curves =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local G = {@GRID@}
local function split(field)  -- replica|backend
  local bar = string.find(field, '|', 1, true)
  if not bar then return field, '' end
  return string.sub(field, 1, bar - 1), string.sub(field, bar + 1)
end
local function cell(c, from, n, k)  -- cell k of the curve c[from..] = v, s, v, s, ... (n cells; past them the
  if k <= n then return c[from + 2 * k - 2], c[from + 2 * k - 1] end  -- last one's line goes on)
  local v, s = c[from + 2 * n - 2], c[from + 2 * n - 1]
  return v + s * (G[k] - G[n]), s
end
local function take_aged(fv, fs, c, from, d, len)  -- f -= an upper bound of c(e + d) on the grid (d >= 0): in each
  local n, j = (#c - from + 1) / 2, 1  -- cell the steepest slope it covers, through the highest first point
  for k = 1, len do
    local a = G[k] + d
    local b = (k < len) and (G[k + 1] + d) or math.huge
    while j < n and G[j + 1] <= a do j = j + 1 end
    local last, slope = j, c[from + 2 * j - 1]
    while last < n and G[last + 1] < b do
      last = last + 1
      if c[from + 2 * last - 1] > slope then slope = c[from + 2 * last - 1] end
    end
    local best = -math.huge
    for q = j, last do
      local x = (G[q] > a) and G[q] or a
      local y = c[from + 2 * q - 2] + c[from + 2 * q - 1] * (x - G[q]) - slope * (x - a)
      if y > best then best = y end
    end
    fv[k], fs[k] = fv[k] - best, fs[k] - slope
  end
end
local replica, now, ttl, batch = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local i = 5
local n = tonumber(ARGV[i]); i = i + 1
local fresh = batch > tonumber(redis.call('HGET', applied, replica) or '0')
for _ = 1, n do
  local client, floor = ARGV[i], tonumber(ARGV[i + 2])
  if fresh then  -- the add as HINCRBYFLOAT (exact decimal strings), then the lift
    local c = tonumber(redis.call('HINCRBYFLOAT', counters, client, ARGV[i + 1]))
    if floor and c < floor then redis.call('HSET', counters, client, ARGV[i + 2]) end
  end
  i = i + 3
end
if fresh then redis.call('HSET', applied, replica, batch) end
-- heartbeat; forget replicas that stopped beating (their backlog, in-flight and budgets)
redis.call('ZADD', replicas, now, replica)
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', replicas, '-inf', now - ttl)) do
  redis.call('ZREM', replicas, dead)
  redis.call('HDEL', applied, dead)
  for _, m in ipairs(redis.call('ZRANGE', backlog, 0, -1)) do
    if string.sub(m, 1, #dead + 1) == dead .. '|' then redis.call('ZREM', backlog, m) end
  end
  for _, key in ipairs({inflight, wants, curves}) do
    for _, f in ipairs(redis.call('HKEYS', key)) do
      if string.sub(f, 1, #dead + 1) == dead .. '|' then redis.call('HDEL', key, f) end
    end
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
-- this replica's KV budget curve per backend: its requests, and its share of the room no budget holds
local mine = {}
n = tonumber(ARGV[i]); i = i + 1
if n > 0 then
  local t = redis.call('TIME')
  local clock = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
  local first = redis.call('ZRANGE', backlog, 0, 0)[1]
  local least = first and (split(first))  -- the replica whose backlogged client is the least served
  local others, wanting, wants_more, held_by, saved = {}, {}, {}, {}, {}
  for _, f in ipairs(redis.call('HKEYS', wants)) do wants_more[f] = true end
  local kept = redis.call('HGETALL', curves)
  for j = 1, #kept, 2 do saved[kept[j]] = kept[j + 1] end
  local all = redis.call('HGETALL', inflight)
  for j = 1, #all, 2 do
    local r, b = split(all[j])
    if r ~= replica then
      others[b] = (others[b] or 0) + 1
      if wants_more[all[j]] then wanting[b] = (wanting[b] or 0) + 1 end
      held_by[b] = held_by[b] or {}
      table.insert(held_by[b], {all[j], all[j + 1]})
    end
  end
  for _ = 1, n do
    local backend, count, capacity, want = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
    local rate = tonumber(ARGV[i + 4])
    local own = cmsgpack.unpack(ARGV[i + 5])
    local np = math.max(1, math.floor(#own / 2))
    if #own < 2 then own = {0, 0} end
    local bv, bs, len = {}, {}, np
    for k = 1, np do bv[k], bs[k] = own[2 * k - 1], own[2 * k] end
    if capacity > 0 then
      local least_wants = least and least ~= replica and wants_more[least .. '|' .. backend]
      local alpha = 0
      if want == '1' and least == replica then alpha = 1  -- it serves the least-served client: all that is free
      elseif want == '1' and not least_wants then alpha = 1 / (1 + (wanting[backend] or 0))
      elseif want ~= '1' and not wanting[backend] then alpha = 1 / (1 + (others[backend] or 0)) end
      local held = {}
      for _, entry in ipairs(held_by[backend] or {}) do
        local c = saved[entry[1]] and cmsgpack.unpack(saved[entry[1]])  -- [clock_ms, rate, v, s, ...]
        if not c or #c < 4 then  -- a fg3_sync replica: a flat budget
          c = {0, 0, tonumber(string.match(entry[2], '^%S+') or '') or 0, 0}
        end
        held[#held + 1] = c
        len = math.max(len, math.floor((#c - 2) / 2))
      end
      local fv, fs = {}, {}
      for k = 1, len do
        local v, s = cell(own, 1, np, k)
        bv[k], bs[k], fv[k], fs[k] = v, s, capacity - v, -s
      end
      for _, c in ipairs(held) do  -- aged by the steps taken since (a whole number: one-step cells shift exactly)
        take_aged(fv, fs, c, 3, math.floor(c[2] * math.max(0, clock - c[1]) / 1000 + 0.5), len)
      end
      for k = 1, len do  -- its requests, and alpha * free where free >= 0 all the cell (a cell free only in part
        local free  -- adds none; never less than its requests: they are there)
        if k < len then free = fv[k] >= 0 and fv[k] + fs[k] * (G[k + 1] - G[k]) >= 0
        else free = fv[k] >= 0 and fs[k] >= 0 end
        if free then bv[k], bs[k] = bv[k] + alpha * fv[k], bs[k] + alpha * fs[k] end
      end
    end
    local n, floor = len, math.floor  -- stored in whole tokens, rounded down (the budget is what is stored)
    while n > 1 and bs[n] == bs[n - 1] and math.abs(bv[n] - (bv[n - 1] + bs[n - 1] * (G[n] - G[n - 1]))) < 1e-6 do
      n = n - 1
    end
    local stored, top = {clock, rate}, bv[n]  -- (top: the most the budget reaches, for fg3_sync replicas)
    for k = 1, n do
      stored[2 * k + 1], stored[2 * k + 2] = floor(bv[k]), floor(bs[k])
      if k < n then top = math.max(top, bv[k], bv[k] + bs[k] * (G[k + 1] - G[k])) end
    end
    if capacity > 0 and (bs[n] > 0 or top > capacity) then top = capacity elseif bs[n] > 0 then top = 2^52 end
    local field = replica .. '|' .. backend
    redis.call('HSET', curves, field, cmsgpack.pack(stored))
    redis.call('HSET', inflight, field, string.format('%d %s', math.max(0, math.min(floor(top), 2^52)), count))
    if want == '1' then redis.call('HSET', wants, field, 1) else redis.call('HDEL', wants, field) end
    mine[#mine + 1] = backend
    mine[#mine + 1] = stored
    i = i + 6
  end
end
-- answers: watched counters, the smallest backlogged counter (and whose), everyone's in-flight, its budgets
local watched = {}
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  watched[#watched + 1] = redis.call('HGET', counters, ARGV[i]) or '0'; i = i + 1
end
local head = redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES')
return {watched, head, redis.call('HGETALL', inflight), mine}
"""
SYNC_LUA = _LUA.replace("@GRID@", ",".join(str(int(g)) for g in GRID))
