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
--        (backend, count, capacity, wants, rate, curve)*, n_watch, client*
-- inflight: replica|backend -> 'budget count' (budget: the most its budget curve reaches; a fg3_sync replica
--   writes its flat budget there and no curve); wants: replica|backend, while its gate wants more room there;
-- curves: replica|backend -> 'clock_ms rate v s v s ...' (its budget over the future decode steps, on G)
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
local function decode(text)  -- 'v s v s ...': cells past the last continue its line
  local v, s = {}, {}
  for a, b in string.gmatch(text, '(%S+) (%S+)') do v[#v + 1] = tonumber(a); s[#s + 1] = tonumber(b) end
  if #v == 0 then v[1], s[1] = 0, 0 end
  return v, s
end
local function pad(v, s, n)
  local m = #v
  for k = m + 1, n do v[k] = v[m] + s[m] * (G[k] - G[m]); s[k] = s[m] end
end
local function encode(v, s)
  local n = #v
  while n > 1 and s[n] == s[n - 1] and math.abs(v[n] - (v[n - 1] + s[n - 1] * (G[n] - G[n - 1]))) < 1e-6 do
    n = n - 1
  end
  local out = {}
  for k = 1, n do out[#out + 1] = string.format('%.10g %.10g', v[k], s[k]) end
  return table.concat(out, ' ')
end
local function aged(v, s, d)  -- an upper bound of f(e + d) on the grid (d >= 0): in each cell the steepest
  local n, ov, os, j = #v, {}, {}, 1  -- slope it covers, through the highest of the pieces' first points
  for k = 1, n do
    local a = G[k] + d
    local b = (k < n) and (G[k + 1] + d) or math.huge
    while j < n and G[j + 1] <= a do j = j + 1 end
    local last, slope = j, s[j]
    while last < n and G[last + 1] < b do last = last + 1; if s[last] > slope then slope = s[last] end end
    local best = -math.huge
    for c = j, last do
      local x = (G[c] > a) and G[c] or a
      local y = v[c] + s[c] * (x - G[c]) - slope * (x - a)
      if y > best then best = y end
    end
    ov[k], os[k] = best, slope
  end
  return ov, os
end
local function budget_of(pv, ps, fv, fs, alpha, n)  -- requests + alpha * free where free >= 0 all the cell
  local bv, bs = {}, {}  -- (never less than its requests: they are there; a cell free only in part adds none)
  for k = 1, n do
    local free
    if k < n then free = fv[k] >= 0 and fv[k] + fs[k] * (G[k + 1] - G[k]) >= 0
    else free = fv[k] >= 0 and fs[k] >= 0 end
    if free then bv[k], bs[k] = pv[k] + alpha * fv[k], ps[k] + alpha * fs[k]
    else bv[k], bs[k] = pv[k], ps[k] end
  end
  return bv, bs
end
local function most(v, s, capacity)  -- the most a curve reaches (within the capacity, if known)
  local n, top = #v, v[#v]
  if capacity <= 0 then capacity = math.huge end
  if s[n] > 0 then return capacity end
  for k = 1, n - 1 do top = math.max(top, v[k], v[k] + s[k] * (G[k + 1] - G[k])) end
  return math.max(0, math.min(capacity, top))
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
    local pv, ps = decode(ARGV[i + 5])
    local bv, bs = pv, ps
    if capacity > 0 then
      local least_wants = least and least ~= replica and wants_more[least .. '|' .. backend]
      local alpha = 0
      if want == '1' and least == replica then alpha = 1  -- it serves the least-served client: all that is free
      elseif want == '1' and not least_wants then alpha = 1 / (1 + (wanting[backend] or 0))
      elseif want ~= '1' and not wanting[backend] then alpha = 1 / (1 + (others[backend] or 0)) end
      local held, len = {}, #pv
      for _, entry in ipairs(held_by[backend] or {}) do
        local hv, hs
        local text = saved[entry[1]]
        if text then
          local at, their_rate, body = string.match(text, '^(%S+) (%S+) ?(.*)$')
          local steps = tonumber(their_rate) * math.max(0, clock - tonumber(at)) / 1000  -- (as that replica does)
          steps = math.floor(steps + 0.5)  -- (a whole number of steps: the one-step cells shift without smear)
          local v, s = decode(body)
          hv, hs = aged(v, s, steps)
        else  -- a fg3_sync replica: a flat budget
          hv, hs = {tonumber(string.match(entry[2], '^%S+') or '') or 0}, {0}
        end
        held[#held + 1] = {hv, hs}
        if #hv > len then len = #hv end
      end
      pad(pv, ps, len)
      local fv, fs = {}, {}
      for k = 1, len do fv[k], fs[k] = capacity - pv[k], -ps[k] end
      for _, h in ipairs(held) do
        pad(h[1], h[2], len)
        for k = 1, len do fv[k], fs[k] = fv[k] - h[1][k], fs[k] - h[2][k] end
      end
      bv, bs = budget_of(pv, ps, fv, fs, alpha, len)
    end
    local body = encode(bv, bs)
    local field = replica .. '|' .. backend
    redis.call('HSET', curves, field, string.format('%.3f %.6g %s', clock, rate, body))
    redis.call('HSET', inflight, field, string.format('%d %s', math.min(math.floor(most(bv, bs, capacity)), 2^52), count))
    if want == '1' then redis.call('HSET', wants, field, 1) else redis.call('HDEL', wants, field) end
    mine[#mine + 1] = backend
    mine[#mine + 1] = body
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
