"""The one Lua script a replica's sync runs (storage/shared_state.py explains what it keeps and why): the
counters' folded operations, the backlog, the heartbeats, and the KV budgets as curves over the future decode
steps (accounting/kv_curve.py; the grid is written into the script, so the script's hash names it).

A budget's arithmetic, per backend, in the script (so no other replica's budget moves meanwhile):

- the others' budgets, each aged by the decode steps the backend took since it was given: one step clock per
  backend (``step_clock``), a rate a replica measured from its streams, so every replica ages every budget
  alike (the budgets then hold together; a rate off the truth shifts them against the requests they cover:
  each is counted as the most it reaches within a quarter of the steps since it was given, and a gate reads
  its own as the least within that and a step, kv_gate.slack), as an upper bound on the grid;
- free F(e) = capacity − this replica's requests (the upper curve it sent) − the others' budgets, at each step;
- its budget as the others count it: its requests + α·F in each cell where F ≥ 0 throughout (α: its share of
  the free room, the rules in shared_state.py), and its requests alone elsewhere;
- what it may fill (what the script answers): the same, but in a cell not free throughout only what the
  others leave, its requests + min(F, 0) (a chord of it: below it, as min(F, 0) is concave).

So at every step what each may fill, and the others' budgets as it was counted against, add up to at most
the capacity. What the others count a replica to hold never falls below its requests: they run, whatever the
others were told (its curve is an upper bound of them, a little above them within a cell). Were it cut below
them where the others' budgets leave less than nothing, their next budgets would hand out KV those requests
hold, and the backend would preempt; were it allowed to fill what its curve counts above its requests, it
could fill KV the others were given.
"""

from __future__ import annotations

from fairgate.accounting.kv_curve import GRID

_LUA = """
-- fg4_sync: KEYS = counters (hash), backlog (zset), inflight (hash), replicas (zset), applied (hash), wants (hash),
--        curves (hash), clocks (hash)
-- ARGV = replica, now_ms, ttl_ms, batch, n_ops, (client, add, floor)*, n_backlog, client*, n_inflight,
--        (backend, count, capacity, wants, rate, curve)*, n_watch, client*  (returns its budgets as
--        backend, msgpack [step, rate, v, s, ...] pairs: the rate its step clock counts at)
-- inflight: replica|backend -> 'budget count' (budget: the most its budget curve reaches; a fg3_sync replica
--   writes its flat budget there and no curve); wants: replica|backend, while its gate wants more room there;
-- curves: replica|backend -> msgpack [step, rate, v, s, v, s, ...] (its budget over the future decode steps from
--   the backend's step ``step``, on the grid G; the curve a replica sends is msgpack [v, s, ...] in whole tokens);
-- clocks: backend -> msgpack [t0_ms, s0, rho] (the backend's step clock: step_clock)
-- An op is a client's pending charges and lifts folded into one map c <- max(c + add, floor) (floor '' is
-- none). A batch applies once: a replica that lost the answer sends it again with the same number.
local counters, backlog, inflight, replicas, applied, wants, curves, clocks =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local G = {@GRID@}
local floor, min, max, abs, huge = math.floor, math.min, math.max, math.abs, math.huge
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
local function packed_curve(v, s, n, head)  -- head .. v, s, ... up to the last cell that does not continue the
  while n > 1 and s[n] == s[n - 1] and abs(v[n] - (v[n - 1] + s[n - 1] * (G[n] - G[n - 1]))) < 1e-6 do
    n = n - 1  -- line before it; and the most the curve reaches (2^52: for ever)
  end
  local out, m, top = head, #head, v[n]
  for k = 1, n do
    out[m + 2 * k - 1], out[m + 2 * k] = v[k], s[k]
    if k < n then top = max(top, v[k], v[k] + s[k] * (G[k + 1] - G[k])) end
  end
  if s[n] > 0 then top = 2^52 end
  return out, top
end
local function take_aged(fv, fs, c, from, d, w, len)  -- f -= an upper bound on the grid of the most c reaches
  local n, j = min(#G, floor((#c - from + 1) / 2)), 1  -- within w steps of e + d (d >= 0: the steps since it was
  for k = 1, len do  -- given; w: how far the clock may be off the backend since): in each cell, the most within
    local lo, mid = max(0, G[k] + d - w), G[k] + d + w  -- reach of its first step, then the steepest rise after
    local hi = (k < len) and (G[k + 1] + d + w) or huge
    while j < n and G[j + 1] <= lo do j = j + 1 end
    local slope, q = 0, j
    while q <= n and (q == j or G[q] < hi) do
      if (q < n and G[q + 1] or huge) > mid and c[from + 2 * q - 1] > slope then slope = c[from + 2 * q - 1] end
      q = q + 1
    end
    local best = -huge
    for p = j, q - 1 do
      local v, s, start, stop = c[from + 2 * p - 2], c[from + 2 * p - 1], max(G[p], lo), (p < n) and G[p + 1] or huge
      if start <= mid then
        best = max(best, v + s * (start - G[p]), v + s * (min(stop, mid) - G[p]))
      else
        best = max(best, v + s * (start - G[p]) - slope * (start - mid))
      end
    end
    fv[k], fs[k] = fv[k] - best, fs[k] - slope
  end
end
local replica, now, ttl, batch = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local began = redis.call('TIME')
local clock = tonumber(began[1]) * 1000 + tonumber(began[2]) / 1000  -- (ms)
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
local function step_clock(backend, rate, clock)  -- the backend's decode steps so far, as every replica counts them,
  -- and the clock's rate: steps = s0 + rho * (clock - t0) / 1000, rho a replica's measured rate, set again when
  -- one measures another
  -- more than a fifth off, at most once a second and by a fifth at most (so a budget ages alike for all: by
  -- steps, not by time)
  local c = redis.call('HGET', clocks, backend)
  c = c and cmsgpack.unpack(c) or {clock, 0, 0}
  local t0, s0, rho = c[1], c[2], c[3]
  local now = s0 + rho * max(0, clock - t0) / 1000
  if rate > 0 and (rho <= 0 or abs(rate - rho) > 0.2 * rho and clock - t0 > 1000) then
    if rho > 0 then rate = min(max(rate, 0.8 * rho), 1.2 * rho) end  -- (a fifth at a time: a replica that ages
    t0, s0, rho = clock, now, rate  -- its budget at the rate it last heard is then off by less than kv_gate.slack)
    redis.call('HSET', clocks, backend, cmsgpack.pack({t0, s0, rho}))
  end
  return now, rho
end
n = tonumber(ARGV[i]); i = i + 1
if n > 0 then
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
    local rate = tonumber(ARGV[i + 4]) or 0
    if rate ~= rate or rate < 0 or rate > 1e6 then rate = 0 end  -- (nan, or absurd: unknown)
    local steps, rho = step_clock(backend, rate, clock)
    local own = cmsgpack.unpack(ARGV[i + 5])
    if type(own) ~= 'table' or #own < 2 then own = {0, 0} end
    local np = min(#G, floor(#own / 2))
    local bv, bs, uv, us, len = {}, {}, {}, {}, np
    for k = 1, np do bv[k], bs[k] = own[2 * k - 1], own[2 * k]; uv[k], us[k] = bv[k], bs[k] end
    if capacity > 0 then
      local least_wants = least and least ~= replica and wants_more[least .. '|' .. backend]
      local alpha = 0
      if want == '1' and least == replica then alpha = 1  -- it serves the least-served client: all that is free
      elseif want == '1' and not least_wants then alpha = 1 / (1 + (wanting[backend] or 0))
      elseif want ~= '1' and not wanting[backend] then alpha = 1 / (1 + (others[backend] or 0)) end
      local held = {}
      for _, entry in ipairs(held_by[backend] or {}) do
        local c = saved[entry[1]] and cmsgpack.unpack(saved[entry[1]])  -- [step, rate, v, s, ...]
        if type(c) ~= 'table' or #c < 4 then  -- a fg3_sync replica: a flat budget
          c = {steps, 0, tonumber(string.match(entry[2], '^%S+') or '') or 0, 0}
        end
        held[#held + 1] = c
        len = min(#G, max(len, floor((#c - 2) / 2)))
      end
      local fv, fs = {}, {}
      for k = 1, len do
        local v, s = cell(own, 1, np, k)
        bv[k], bs[k], fv[k], fs[k] = v, s, capacity - v, -s
      end
      for _, c in ipairs(held) do  -- aged by the steps the backend's clock counted since it was given
        local d = max(0, steps - c[1])  -- (a clock off the backend by a fifth, re-anchored a fifth at a time:
        take_aged(fv, fs, c, 3, d, 0.25 * d, len)  -- within a quarter of the steps since: kv_gate.slack)
      end
      for k = 1, len do  -- what the others count it to hold: its requests, and alpha * free in each cell free all
        local w = (k < len) and (G[k + 1] - G[k]) or nil  -- through; and what it may fill: the same, but in a
        local f1 = w and fv[k] + fs[k] * w  -- cell not free all through only what the others leave (a chord of
        if fv[k] >= 0 and (w and f1 >= 0 or not w and fs[k] >= 0) then  -- its requests + min(free, 0)): never
          bv[k], bs[k] = bv[k] + alpha * fv[k], bs[k] + alpha * fs[k]  -- less than its requests for the others
          uv[k], us[k] = bv[k], bs[k]  -- (they are there), never more than the others leave for itself
        elseif w then
          local h0, h1 = min(fv[k], 0), min(f1, 0)
          uv[k], us[k] = bv[k] + h0, bs[k] + (h1 - h0) / w
        else uv[k], us[k] = bv[k] + min(fv[k], 0), bs[k] + min(fs[k], 0) end  -- (under min(F, 0) for ever)
      end
    end
    local stored, top = packed_curve(bv, bs, len, {steps, rho})
    if capacity > 0 and top > capacity then top = capacity end
    local field = replica .. '|' .. backend
    redis.call('HSET', curves, field, cmsgpack.pack(stored))
    redis.call('HSET', inflight, field, string.format('%d %s', max(0, min(floor(top), 2^52)), count))
    if want == '1' then redis.call('HSET', wants, field, 1) else redis.call('HDEL', wants, field) end
    mine[#mine + 1] = backend
    mine[#mine + 1] = cmsgpack.pack((packed_curve(uv, us, len, {steps, rho})))
    i = i + 6
  end
end
-- answers: watched counters, the smallest backlogged counter (and whose), everyone's in-flight, its budgets,
-- and the script's own time
local watched = {}
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  watched[#watched + 1] = redis.call('HGET', counters, ARGV[i]) or '0'; i = i + 1
end
local head = redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES')
local ended = redis.call('TIME')  -- (and what the script cost Redis, µs)
return {watched, head, redis.call('HGETALL', inflight), mine,
        (tonumber(ended[1]) - tonumber(began[1])) * 1000000 + tonumber(ended[2]) - tonumber(began[2])}
"""
SYNC_LUA = _LUA.replace("@GRID@", ",".join(str(int(g)) for g in GRID))
