"""The Lua script of the limits and budgets across replicas (quota/redis_store.py): one call reserves a
request's amounts on all its meters at once, all or nothing, or applies draws, settlements and seeds, with the
batch numbered per replica so a batch whose reply was lost is never run twice.
"""

from __future__ import annotations

QUOTA_LUA = """
-- fg3_quota: KEYS[1] = the replicas zset (shared state), KEYS[2] = last batch per replica (hash),
--            KEYS[3..] = the meters of every group, in order
-- ARGV = replica, live_ms, batch, mode ('run' | 'status'), then per group: op ('reserve' | 'apply' | 'seed'),
--        now_ms, n, then per meter: kind ('r' | 'b' | 'i' | 'h'), cap, rate (per ms), amount, ttl_ms, own
--        (own: a concurrency or hold meter's count for this replica; a budget's, its hold meter's place in
--        the group, 0 if none; a seed's, the spend it had when lost. A hold meter's cap is how long (ms) the
--        part of a replica that stopped beating is kept after it was written: it may still have requests
--        in flight, cut off from Redis)
-- status: {replicas, 'ran', flags} if this batch ran (flags: '1' or '0' per group), else {replicas, 'not'}.
-- run: groups in order, each on its own: reserve adds every amount if each meter stays within its cap, else
-- changes nothing; apply adds them all; seed raises each meter to at least its amount and ``own`` (the spend
-- it had when last seen; one not marked seeded, as Redis lost it: to at least what it holds plus that) and
-- marks it seeded (field 's'). A concurrency or hold meter's field for this replica is set to ``own`` (a
-- budget's hold meter: what this replica's requests in flight reserved of it; the budget meter is its spend,
-- and a reservation counts it with the holds of the replicas still beating). Returns {replicas, 'ran', flags,
-- per group {1, used..., marks} or {0, index, used, used...}} (marks: per meter '1' if it is a budget meter
-- not marked seeded, as after Redis lost it; a refusal: the refusing meter's use, then every meter's); a batch
-- number not above the last one run changes nothing.
local replica, live, batch, mode = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local last = redis.call('HGET', KEYS[2], replica)
local last_batch, last_flags = 0, ''
if last then
  local sep = string.find(last, ':')
  last_batch, last_flags = tonumber(string.sub(last, 1, sep - 1)), string.sub(last, sep + 1)
end
local function replicas(now) return redis.call('ZCOUNT', KEYS[1], now - live, '+inf') end
local function num(x) return string.format('%.17g', x) end  -- (tostring keeps 14 digits: nano-USD past $100k)
if mode == 'status' or batch <= last_batch then
  local now = tonumber(ARGV[6] or '0')
  if batch == last_batch then return {replicas(now), 'ran', last_flags} end
  return {replicas(now), 'not'}
end
local function used(key, kind, rate, now, keep)
  if kind == 'i' or kind == 'h' then
    local total, all = 0, redis.call('HGETALL', key)
    for j = 1, #all, 2 do
      local r, v, at = all[j], all[j + 1], 0
      if r ~= replica then
        local sep = string.find(v, ':', 1, true)  -- (a hold's part: 'amount:ms', when it was written)
        if sep then v, at = string.sub(v, 1, sep - 1), tonumber(string.sub(v, sep + 1)) end
        local beat = redis.call('ZSCORE', KEYS[1], r)
        if (beat and tonumber(beat) >= now - live) or (kind == 'h' and at >= now - keep) then
          total = total + tonumber(v)
        else
          redis.call('HDEL', key, r)  -- a replica that stopped beating holds nothing (a hold: once past keep)
        end
      end
    end
    return total  -- the others'
  end
  local v = redis.call('HMGET', key, 'u', 't', 's')
  local u = tonumber(v[1]) or 0
  if rate > 0 and v[2] then u = math.max(0, u - rate * math.max(0, now - tonumber(v[2]))) end
  return u, kind == 'b' and not v[3]
end
local results, flags, a, k, now = {}, {}, 5, 3, 0
local back = {}  -- per concurrency meter, what this run's refused reservations added to the later groups' own
while a <= #ARGV do
  local op, n = ARGV[a], tonumber(ARGV[a + 2])
  now = tonumber(ARGV[a + 1])
  a = a + 3
  local meters, refused = {}, nil
  for i = 1, n do
    local m = {key = KEYS[k], kind = ARGV[a], cap = tonumber(ARGV[a + 1]), rate = tonumber(ARGV[a + 2]),
               amount = tonumber(ARGV[a + 3]), ttl = tonumber(ARGV[a + 4]), own = tonumber(ARGV[a + 5])}
    if m.kind == 'i' or m.kind == 'h' then m.own = m.own - (back[m.key] or 0) end
    m.used, m.unseeded = used(m.key, m.kind, m.rate, now, m.cap)
    meters[i] = m
    a, k = a + 6, k + 1
  end
  local function holds(m)  -- what the requests in flight of the live replicas hold of a budget, with this one
    if m.kind ~= 'b' or m.own < 1 or op == 'seed' then return 0 end
    return meters[m.own].used + meters[m.own].own
  end
  local function before(m)  -- a meter's use as it stood (a reservation's own part not counted)
    if m.kind == 'i' or m.kind == 'h' then return m.used + m.own - (op == 'reserve' and m.amount or 0) end
    if m.kind == 'b' and m.own >= 1 and op ~= 'seed' then return m.used + before(meters[m.own]) end
    return m.used
  end
  for i, m in ipairs(meters) do
    local after = m.kind == 'i' and m.used + m.own or m.used + m.amount + holds(m)
    if op == 'reserve' and not refused and m.kind ~= 'h' and after > m.cap then
      refused = {0, i, num(before(m))}
    end
  end
  if refused then
    for _, m in ipairs(meters) do
      refused[#refused + 1] = num(m.kind == 'i' and m.used or before(m))  -- (every meter's, as it stood)
      if m.kind == 'i' or m.kind == 'h' then back[m.key] = (back[m.key] or 0) + m.amount end  -- (never taken)
    end
    results[#results + 1] = refused
    flags[#flags + 1] = '0'
  else
    local out, marks = {1}, {}
    for i, m in ipairs(meters) do
      local u
      if m.kind == 'i' or m.kind == 'h' then
        u = m.used + m.own
        redis.call('HSET', m.key, replica, m.kind == 'h' and num(m.own) .. ':' .. now or m.own)
      else
        u = math.max(0, m.used + m.amount)
        if op == 'seed' then  -- (lost: its spend when last seen added back; rolled back: at least that)
          u = m.unseeded and math.max(m.used + m.own, m.amount) or math.max(m.used, m.amount, m.own)
        end
        local t = tonumber(redis.call('HGET', m.key, 't') or '0')
        redis.call('HSET', m.key, 'u', num(u), 't', math.max(now, t))  -- (a clock behind does not re-drain)
        if op == 'seed' then redis.call('HSET', m.key, 's', '1') end  -- (its meter read from the usage log)
      end
      marks[i] = m.unseeded and '1' or '0'
      local ttl = m.ttl
      if m.rate > 0 then ttl = math.max(ttl, math.ceil(u / m.rate) + 60000) end  -- a debt outlives its drain
      if redis.call('PTTL', m.key) < ttl then redis.call('PEXPIRE', m.key, ttl) end
      out[i + 1] = num(u + holds(m))
    end
    out[#out + 1] = table.concat(marks)
    results[#results + 1] = out
    flags[#flags + 1] = '1'
  end
end
local f = table.concat(flags)
redis.call('HSET', KEYS[2], replica, batch .. ':' .. f)
return {replicas(now), 'ran', f, unpack(results)}
"""
