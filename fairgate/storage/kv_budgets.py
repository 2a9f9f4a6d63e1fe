"""KV budgets across replicas: each replica gates a backend against its *budget* there, never against the
others' last word alone (two replicas that both saw the same free KV would both fill it, and a backend that
admits as vLLM does would preempt). Synced by storage/shared_state.py; read by the gate (pipeline/kv_gate.py);
why and what it costs: docs/operations/replicas.md.

A budget is the most this replica's requests on a backend may hold at any future decode step. At each sync,
inside ``fg5_kv`` (so the others' budgets cannot move meanwhile), it becomes what they hold at their peak
plus, of the KV no replica's budget holds: all of it if its gate wanted room and it queues the fleet's
least-served client; else, if it wanted room and that replica does not, an equal share with the others that
want room; else, if none wants room, an equal share with every replica there; else nothing. So the budgets
on a backend add up to at most its capacity (once every replica has synced once; a budget never falls below
the requests a replica has).

A backend keeps the sums of its replicas' budgets, requests and wants beside their entries, so a renewal
costs Redis the same however many replicas there are, and every sync renews every backend. Each backend is in
one of six shards by the hash of its name; a shard is one hash, on its own slot (``kv_shards``), read with
one HMGET and written with one HSET a call (a Lua ``redis.call`` costs more than a backend's arithmetic):
what must be atomic, a backend's sums with its entries, is in one slot.

While a sync's answer is on its way a replica holds itself to what it claimed its requests hold (``holding``:
its old budget may be going to others, its new one is no less than that; the gate claims a little more than
they hold, to keep placing requests meanwhile: pipeline/kv_gate.py, ``claims``); a sync that fails leaves its
budget as it was, held to what it said at the first failure (``kept``).
"""

from __future__ import annotations

import struct
import zlib

from redis.crc import key_slot

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


def kv_shards(namespace: str, shards: int = 6) -> list[str]:
    """The hash tags of the KV shards: ``<namespace>:kv:<i>:<j>``, j the first whose slot is near the middle of
    the i-th sixth of the slot space (a cluster of 2, 3 or 6 nodes holding equal ranges of slots, as
    ``redis-cli --cluster create`` makes it, gets equal numbers of shards)."""
    tags = []
    for i in range(shards):
        j, middle = 0, (2 * i + 1) * 16384 // (2 * shards)
        while abs(key_slot(f"{namespace}:kv:{i}:{j}".encode()) - middle) > 16384 // (8 * shards):
            j += 1
        tags.append(f"{namespace}:kv:{i}:{j}")
    return tags


Claim = tuple[int, int, int, bool]  # what its requests hold at their peak, how many, the KV there (0: unknown),
# whether its gate wanted more room since its last sync


class KVBudgets:
    """This replica's KV budgets, and the others' budgets and requests, per backend."""

    def __init__(self, namespace: str, replica: str):
        self.shards = kv_shards(namespace)
        self.replica = replica
        self.budget: dict[str, int] = {}  # backend → the KV this replica's requests may hold there
        self.inflight: dict[str, tuple[int, int]] = {}  # backend → (budgets, requests) of the *other* replicas
        self.holding: dict[str, int] = {}  # what it said its requests hold, while that is out
        self.kept: dict[str, int] = {}  # what it said at the first sync that failed since it was last renewed

    def key(self, shard: int) -> str:
        return "{" + self.shards[shard] + "}"

    def calls(self, mine: dict[str, Claim], least: str, ttl_s: float, per_shard: bool) -> tuple[list, list[str]]:
        """``fg5_kv``'s (keys, args) for every backend of ``mine`` (one call per shard, or one in all; a replica
        not heard from for ``ttl_s`` is dropped), and the backends their answers are for, in order; until the
        answers, it holds itself to what it says."""
        self.holding = {b: claim[0] for b, claim in mine.items()}
        shards: dict[int, list[str]] = {}
        for backend in mine:
            shards.setdefault(zlib.crc32(backend.encode()) % len(self.shards), []).append(backend)
        calls, order = [], []
        for group in ([[s] for s in shards] if per_shard else [list(shards)]):
            keys, args = [], [self.replica, int(ttl_s * 1000), least]
            for shard in group:
                claims = [float(min(max(0, int(x)), 1 << 52)) for b in shards[shard] for x in mine[b]]
                keys.append(self.key(shard))
                args += [len(shards[shard]), struct.pack(f"<{len(claims)}d", *claims), *shards[shard]]
                order += shards[shard]
            calls.append((keys, args))
        return calls, order

    def renewed(self, order: list[str], answers: list[bytes]) -> None:
        numbers = struct.unpack(f"<{3 * len(order)}d", b"".join(answers))
        for k, backend in enumerate(order):
            fill, others, count = numbers[3 * k: 3 * k + 3]
            self.budget[backend], self.inflight[backend] = int(fill), (int(others), int(count))
            self.kept.pop(backend, None)  # (renewed: what it holds itself to is its budget again)
        self.holding = {}

    def failed(self, stale: bool) -> None:
        """A sync failed: its budgets stand, and so does what it said at the first try that failed (had the script
        run and the answer been lost, the others may hold what its budget was cut by; a later try that ran and
        was lost too is not covered: rare, and bounded by the next sync or the ttl). ``stale``: the others'
        view is too old to hold on to."""
        for backend, held in self.holding.items():
            self.kept.setdefault(backend, held)
        self.holding = {}
        if stale:
            self.budget, self.inflight, self.kept = {}, {}, {}
