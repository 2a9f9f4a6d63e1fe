"""The Lua script of a replica's sync on the namespace's slot ``{<namespace>}`` (storage/shared_state.py;
the KV budgets' own script is in storage/kv_budgets.py): the counters' folded operations, the backlog (each
replica's part of it listed in its own set, so replacing it costs what it holds, not the fleet's backlog)
and the heartbeats.
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
