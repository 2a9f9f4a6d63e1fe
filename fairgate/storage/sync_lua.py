"""The two Lua scripts of a replica's sync (storage/shared_state.py says what they keep and why).

``fg5_sync`` runs on the namespace's slot ``{<namespace>}``: the counters' folded operations, the backlog (each
replica's part of it listed in its own set, so replacing it costs what it holds, not the fleet's backlog) and
the heartbeats. ``fg5_kv`` runs on one KV shard's slot ``{<namespace>:kv:<shard>}`` (on a single server, on
every shard at once): for each backend it is given, this replica's flat KV budget there, in O(1) — a backend
keeps the sum of the budgets, requests and wants of the replicas there beside their entries, kept up to date
as each entry changes, and recounted from the entries (dropping replicas that stopped renewing) once a second.
"""

from __future__ import annotations

SYNC_LUA = """
-- fg5_sync: KEYS = counters (hash), backlog (zset), replicas (zset), applied (hash), listed (prefix of the sets
--   of each replica's backlog members)
-- ARGV = replica, ttl_ms, batch, n_ops, (client, add, floor)*, n_backlog, client*, n_watch, client*
-- An op is a client's pending charges and lifts folded into one map c <- max(c + add, floor) (floor '' is
-- none). A batch applies once: a replica that lost the answer sends it again with the same number.
local counters, backlog, replicas, applied, listed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
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
end
unlist(replica)  -- this replica's backlog, scored by the authoritative counters
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local member = replica .. '|' .. ARGV[i]
  redis.call('ZADD', backlog, tonumber(redis.call('HGET', counters, ARGV[i]) or '0'), member)
  redis.call('SADD', listed .. replica, member)
  i = i + 1
end
local watched = {}  -- answers: watched counters, the smallest backlogged counter (and whose), the script's cost
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  watched[#watched + 1] = redis.call('HGET', counters, ARGV[i]) or '0'; i = i + 1
end
local ended = redis.call('TIME')
return {watched, redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES'),
        (tonumber(ended[1]) - tonumber(began[1])) * 1000000 + tonumber(ended[2]) - tonumber(began[2])}
"""

KV_LUA = """
-- fg5_kv: KEYS = one hash per backend: replica -> 'budget requests wants ms' (its entry), '=' -> 'budgets
--   requests replicas wanting recounted_ms' (the sums over the entries)
-- ARGV = replica, ttl_ms, least (the replica of the fleet's least-served backlogged client, or ''),
--   (holds, requests, capacity, wants)* one per key: what its requests there hold at their peak, how many they
--   are, the KV there (0: unknown), 1 if its gate wanted more room since its last sync
-- Returns per key {what it may fill, the others' budgets, the others' requests}, then the script's cost (µs).
local replica, ttl, least = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local began = redis.call('TIME')
local now = tonumber(began[1]) * 1000 + math.floor(tonumber(began[2]) / 1000)
local function numbers(s)  -- four or five whole numbers, or none
  local a, b, c, d, e = string.match(s or '', '^(%d+) (%d+) (%d+) (%d+) ?(%d*)$')
  return tonumber(a) or 0, tonumber(b) or 0, tonumber(c) or 0, tonumber(d) or 0, tonumber(e) or 0
end
local out = {}
for k, key in ipairs(KEYS) do
  local j = 3 + 4 * k
  local holds, requests = math.max(0, tonumber(ARGV[j - 3]) or 0), math.max(0, tonumber(ARGV[j - 2]) or 0)
  local capacity, wants = math.max(0, tonumber(ARGV[j - 1]) or 0), (ARGV[j] == '1') and 1 or 0
  local budgets, count, present, wanting, recounted = numbers(redis.call('HGET', key, '='))
  if recounted < now - 1000 then  -- recount, dropping the entries of replicas that stopped renewing
    budgets, count, present, wanting, recounted = 0, 0, 0, 0, now
    local all = redis.call('HGETALL', key)
    for e = 1, #all, 2 do
      if all[e] ~= '=' then
        local b, c, w, at = numbers(all[e + 1])
        if at < now - ttl then redis.call('HDEL', key, all[e])
        else budgets, count, present, wanting = budgets + b, count + c, present + 1, wanting + w end
      end
    end
  end
  local mine = redis.call('HMGET', key, replica, least)
  local b0, c0, w0 = numbers(mine[1])
  if not mine[1] then present = present + 1 end
  local others, others_wanting = budgets - b0, wanting - w0
  local free = capacity - others - holds
  -- its budget: what its requests hold, and of the KV no budget holds: all, if it queues the fleet's
  -- least-served client; an equal share with the others that want room, if that replica does not want
  -- room here; an equal share with every replica here, if none wants room; else none
  local share = 0
  if wants == 1 and least == replica then share = 1
  elseif wants == 1 and select(3, numbers(mine[2])) == 0 then share = 1 / (1 + others_wanting)
  elseif wants == 0 and others_wanting == 0 then share = 1 / present end
  local budget = holds + math.floor(share * math.max(free, 0))
  redis.call('HSET', key, replica, string.format('%d %d %d %d', budget, requests, wants, now),
             '=', string.format('%d %d %d %d %d', others + budget, count - c0 + requests, present,
                                others_wanting + wants, recounted))
  -- what it may fill: its budget, or what the others leave where its requests already pass that
  out[k] = {(capacity > 0 and free < 0) and capacity - others or budget, others, count - c0}
end
local ended = redis.call('TIME')
out[#out + 1] = (tonumber(ended[1]) - tonumber(began[1])) * 1000000 + tonumber(ended[2]) - tonumber(began[2])
return out
"""
