"""The two Lua scripts of a replica's sync (storage/shared_state.py says what they keep and why).

``fg5_sync`` runs on the namespace's slot ``{<namespace>}``: the counters' folded operations, the backlog (each
replica's part of it listed in its own set, so replacing it costs what it holds, not the fleet's backlog) and
the heartbeats. ``fg5_kv`` runs on one KV shard's slot ``{<namespace>:kv:<shard>}`` (on a single server, on
every shard at once): for each backend it is given, this replica's KV budget there, in O(1) — a shard's hash
keeps the sums of the budgets, requests and wants of the replicas on each of its backends beside their
entries, kept up to date as each entry changes; once a second the replicas that stopped renewing for
``ttl_s`` have their entries taken out of the sums and dropped. A call reads the shard with one HMGET and
writes it with one HSET (a Lua ``redis.call`` costs more than a backend's arithmetic).
"""

from __future__ import annotations

SYNC_LUA = """
-- fg5_sync: KEYS = counters (hash), backlog (zset), replicas (zset), applied (hash), listed (prefix of the sets
--   of each replica's backlog members), inflight (hash: what replicas of fg4_sync, the budget curves, write)
-- ARGV = replica, ttl_ms, batch, n_ops, (client, add, floor)*, n_backlog, client*, n_watch, client*
-- An op is a client's pending charges and lifts folded into one map c <- max(c + add, floor) (floor '' is
-- none). A batch applies once: a replica that lost the answer sends it again with the same number.
local counters, backlog, replicas, applied, listed, older = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local replica, ttl, batch = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local began = redis.call('TIME')
local now = tonumber(began[1]) * 1000 + math.floor(tonumber(began[2]) / 1000)
local i = 4
local n = tonumber(ARGV[i]); i = i + 1
local fresh = batch > tonumber(redis.call('HGET', applied, replica) or '0')
for _ = 1, n do
  if fresh then  -- the add as HINCRBYFLOAT (exact decimal strings), then the lift
    local c = tonumber(redis.call('HINCRBYFLOAT', counters, ARGV[i], ARGV[i + 1]))
    local floor = tonumber(ARGV[i + 2])
    if floor and c < floor then redis.call('HSET', counters, ARGV[i], ARGV[i + 2]) end
  end
  i = i + 3
end
if fresh then redis.call('HSET', applied, replica, batch) end
local function unlist(r)  -- r's backlog members out of the backlog
  local set = listed .. r
  local members = redis.call('SMEMBERS', set)
  if #members > 0 then redis.call('ZREM', backlog, unpack(members)) end
  redis.call('DEL', set)
end
redis.call('ZADD', replicas, now, replica)  -- heartbeat; forget replicas that stopped beating
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', replicas, '-inf', now - ttl)) do
  redis.call('ZREM', replicas, dead)
  redis.call('HDEL', applied, dead)
  unlist(dead)
  for _, m in ipairs(redis.call('ZRANGE', backlog, 0, -1)) do  -- (and what a replica of fg4_sync left: rare)
    if string.sub(m, 1, #dead + 1) == dead .. '|' then redis.call('ZREM', backlog, m) end
  end
  for _, f in ipairs(redis.call('HKEYS', older)) do
    if string.sub(f, 1, #dead + 1) == dead .. '|' then redis.call('HDEL', older, f) end
  end
end
unlist(replica)  -- this replica's backlog, scored by the authoritative counters
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local member = replica .. '|' .. ARGV[i]
  redis.call('ZADD', backlog, tonumber(redis.call('HGET', counters, ARGV[i]) or '0'), member)
  redis.call('SADD', listed .. replica, member)
  i = i + 1
end
local watched = {}  -- answers: watched counters, the smallest backlogged counter (and whose), the script's cost,
-- and whether replicas of fg4_sync (whose KV budgets this version does not see) are here
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  watched[#watched + 1] = redis.call('HGET', counters, ARGV[i]) or '0'; i = i + 1
end
local ended = redis.call('TIME')
return {watched, redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES'),
        (tonumber(ended[1]) - tonumber(began[1])) * 1000000 + tonumber(ended[2]) - tonumber(began[2]),
        redis.call('HLEN', older)}
"""

KV_LUA = """
-- fg5_kv: KEYS = one hash per KV shard: 'backend' -> the sums over the replicas there (budgets, requests,
--   replicas, wanting), 'backend|replica' -> a replica's entry (budget, requests, wants), numbers as doubles
--   (struct '<dddd', '<ddd'); '@replica' -> when it last renewed (ms); '=' -> when replicas that stopped
--   renewing were last looked for (ms); '#' -> a value longer than a listpack holds (the hash stays a hash
--   table: O(1) lookups however many backends and replicas)
-- ARGV = replica, ttl_ms, least (the replica of the fleet's least-served backlogged client, or ''), then per
--   key: n, claims (n × struct '<dddd': what its requests there hold at their peak, how many they are, the KV
--   there (0: unknown), 1 if its gate wanted more room since its last sync), backend* n
-- Returns {per backend, in order, what it may fill, the others' budgets, the others' requests (struct '<ddd'
-- each, one string), the script's cost (µs)}.
local replica, ttl, least = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local began = redis.call('TIME')
local now = tonumber(began[1]) * 1000 + math.floor(tonumber(began[2]) / 1000)
local max, floor, pack, unpack_, sub = math.max, math.floor, struct.pack, struct.unpack, string.sub
local ONE, WIDE = pack('<d', 1), string.rep('-', 80)
local function forget_stopped(key)  -- take the entries of replicas that stopped renewing out of the sums
  local all, at, dead = redis.call('HGETALL', key), {}, {}
  for e = 1, #all, 2 do
    at[all[e]] = all[e + 1]
    if sub(all[e], 1, 1) == '@' and tonumber(all[e + 1]) < now - ttl then dead[sub(all[e], 2)] = true end
  end
  for e = 1, #all, 2 do
    local backend, r = string.match(all[e], '^(.*)|([^|]*)$')
    if r and dead[r] and at[backend] then
      local b, c, w = unpack_('<ddd', all[e + 1])
      local tb, tc, tp, tw = unpack_('<dddd', at[backend])
      at[backend] = pack('<dddd', tb - b, tc - c, max(0, tp - 1), tw - w)
      redis.call('HSET', key, backend, at[backend])
      redis.call('HDEL', key, all[e])
    end
  end
  for r in pairs(dead) do redis.call('HDEL', key, '@' .. r) end
  redis.call('HSET', key, '=', now, '#', WIDE)
end
local out, numbers, i = {}, {}, 4
for s = 1, #KEYS do
  local key, n, claims = KEYS[s], tonumber(ARGV[i]), ARGV[i + 1]
  if #claims ~= 32 * n then return redis.error_reply('fg5_kv: claims of ' .. n .. ' backends expected') end
  local fields, theirs_at, asks = {'='}, {}, least ~= '' and least ~= replica
  for k = 1, n do  -- (the least-served replica's entries where this one wants room)
    local backend = ARGV[i + 1 + k]
    fields[2 * k], fields[2 * k + 1] = backend, backend .. '|' .. replica
    if asks and sub(claims, 32 * k - 7, 32 * k) == ONE then  -- (its claim's wants, as packed)
      theirs_at[k] = #fields + 1
      fields[#fields + 1] = backend .. '|' .. least
    end
  end
  local got = redis.call('HMGET', key, unpack(fields))
  if tonumber(got[1] or '0') < now - 1000 then
    forget_stopped(key)
    got = redis.call('HMGET', key, unpack(fields))
  end
  local writes, w = {'@' .. replica, now}, 2
  for k = 1, n do
    local holds, requests, capacity, wants = unpack_('<dddd', claims, 32 * k - 31)  -- (whole, in [0, 2^52])
    local sums, own, theirs = got[2 * k], got[2 * k + 1], theirs_at[k] and got[theirs_at[k]]
    local budgets, count, present, wanting, b0, c0, w0 = 0, 0, 0, 0, 0, 0, 0
    if sums then budgets, count, present, wanting = unpack_('<dddd', sums) end
    if own then b0, c0, w0 = unpack_('<ddd', own) else present = present + 1 end
    local others, others_wanting = budgets - b0, wanting - w0
    local free = capacity - others - holds
    -- its budget: what its requests hold, and of the KV no budget holds: all, if it queues the fleet's
    -- least-served client; an equal share with the others that want room, if that replica does not want
    -- room here; an equal share with every replica here, if none wants room; else none
    local share = 0
    if wants == 1 and least == replica then share = 1
    elseif wants == 1 and not (theirs and select(3, unpack_('<ddd', theirs)) == 1) then
      share = 1 / (1 + others_wanting)
    elseif wants == 0 and others_wanting == 0 then share = 1 / present end
    local budget = holds + floor(share * max(free, 0))
    writes[w + 1], writes[w + 2] = fields[2 * k + 1], pack('<ddd', budget, requests, wants)
    writes[w + 3], writes[w + 4] = fields[2 * k],
      pack('<dddd', others + budget, count - c0 + requests, present, others_wanting + wants)
    w = w + 4
    -- what it may fill: its budget, or what the others leave where its requests already pass that
    numbers[3 * k - 2], numbers[3 * k - 1] = (capacity > 0 and free < 0) and capacity - others or budget, others
    numbers[3 * k] = count - c0
  end
  for k = 1, 3 * n, 600 do  -- (packed a few hundred at a time: Lua's stack holds a few thousand values)
    local m = math.min(3 * n, k + 599) - k + 1
    out[#out + 1] = pack('<' .. string.rep('d', m), unpack(numbers, k, k + m - 1))
  end
  redis.call('HSET', key, unpack(writes))
  i = i + 2 + n
end
local ended = redis.call('TIME')
return {table.concat(out),
        (tonumber(ended[1]) - tonumber(began[1])) * 1000000 + tonumber(ended[2]) - tonumber(began[2])}
"""
