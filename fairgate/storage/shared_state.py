"""State shared by gateway replicas through Redis (docs/operations/replicas.md): virtual counters, who is
backlogged where, and (storage/kv_budgets.py) each replica's KV budget on each backend.

The policy is pure and synchronous, so it reads and writes a local mirror (``get``, ``add``, ``lift``). A
client's pending charges and lifts fold into one map c ← max(c + add, floor) (they compose in the max-plus
algebra), so what waits for Redis is one entry per client however long an outage lasts. Every ``interval_s``
a sync runs, side by side, ``fg5_sync`` on the namespace's slot (storage/sync_lua.py: the folds, once per
numbered batch — a batch whose answer was lost is sent again as it was, and skipped if it ran —, this
replica's backlog and heartbeat; it answers the counters of the clients this replica uses and the smallest
counter backlogged anywhere) and ``fg5_kv`` on the KV shards' slots. A gate that wants room it has no budget
for wakes the sync (``wake``): no sooner than a quarter of the interval, nor than keeps this replica's syncs
within ``SYNC_SHARE`` of Redis's time (the scripts measure their own).

If Redis is unreachable the replica keeps serving on its mirror; the others' view is kept for ``ttl_s``,
then dropped, and FairServe's per-request Redis reads are skipped while the sync fails. A Redis outage never
becomes a client error, but while the sync fails the replica is not ready (``problem`` says why) and the log
says so once: a replica on local counters is no longer fair with the others, and its operator must know.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fairgate.periodic import Periodic
from fairgate.storage.kv_budgets import KV_LUA, KVBudgets
from fairgate.storage.redis_client import (
    ERRORS,
    Link,
    NodeOfCluster,
    is_cluster,
    redacted,
    redis_client,
    single_at_cluster_node,
)
from fairgate.storage.sync_lua import SYNC_LUA

log = logging.getLogger("fairgate.shared")
NEG_INF = float("-inf")
SYNC_SHARE = 0.05  # the most of Redis's time one replica's syncs take when its gate wants room (wake)
IDLE_SYNCS = 5  # an idle replica (nothing queued, running or to send) syncs this many times less often, until
# its next charge or placement wakes it (docs/operations/replicas.md)
Fold = tuple[float, float]  # c ↦ max(c + add, floor)
NO_OP: Fold = (0.0, NEG_INF)


def compose(first: Fold, then: Fold) -> Fold:
    """``first`` then ``then``: max(max(c + a1, b1) + a2, b2) = max(c + (a1 + a2), max(b1 + a2, b2))."""
    (a1, b1), (a2, b2) = first, then
    return a1 + a2, max(b1 + a2, b2)


class SharedState:
    def __init__(self, url: str, namespace: str = "fairgate", replica: str | None = None,
                 interval_s: float = 0.02, ttl_s: float = 10.0):
        self.redis = redis_client(url, timeout_s=1.0)
        self.url = redacted(url)
        tag = "{" + namespace + "}"
        self.keys = [f"{tag}:counters", f"{tag}:backlog", f"{tag}:replicas", f"{tag}:applied", f"{tag}:listed:",
                     f"{tag}:inflight"]
        self.replica = replica or uuid.uuid4().hex[:12]
        self.kv = KVBudgets(namespace, self.replica)
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self._script = self.redis.register_script(SYNC_LUA)
        self._kv_script = self.redis.register_script(KV_LUA)
        self._per_shard = is_cluster(self.redis)  # one fg5_kv call per shard (a cluster), or one in all
        self._node_of_cluster = False  # a redis:// URL that names one node of a cluster
        self._base: dict[str, float] = {}  # authoritative values at the last sync
        self._value: dict[str, float] = {}  # each counter as the policy reads it (``_refresh``)
        self._fold: dict[str, Fold] = {}  # pending per client, not yet sent
        self._unacked: tuple[int, dict[str, Fold]] | None = None  # a batch sent whose answer was lost
        self._batch = 0
        self._last_sync = time.monotonic()
        self.global_min: tuple[str, float] | None = None  # (replica|client, counter) backlogged anywhere
        self.link = Link(f"shared state ({self.url})", log,
                         "serving on this replica's counters, not ready until Redis answers")
        self.backlog_source = lambda: []  # clients backlogged here (the dispatcher sets it)
        self.inflight_source = lambda: {}  # backend → (holds, requests, capacity, wants) of this replica
        self.on_sync: list = []
        # a replica whose gate wants room it has no budget for syncs sooner (wake): up to four times as often, as
        # long as its syncs keep Redis no more than SYNC_SHARE busy
        self._periodic = Periodic("shared-state-sync", interval_s, self.sync, soonest_s=interval_s / 4)
        self.syncs = self.failures = 0
        self._idle = False  # the last sync found nothing to do here (``touch``)
        self._touches = 0  # work that came (``touch``): a sync on its way when it came finds it busy
        self.script_s = 0.0  # what a sync's scripts cost Redis (a moving average)
        self.older = False  # replicas of fg4_sync share the namespace
        self.tag = tag
        self._offset = time.time() - time.monotonic()  # loop time → wall time (set again in start())
        self._windows = self._interactions = None
        # stores whose writes ride on the sync (the limits' meters: quota/redis_store.py, added by the gateway):
        # each is kicked as a sync begins and flushed at the stop
        self.riders: list = []

    @property
    def up(self) -> bool:
        """The last sync went through: counters, backlog and in-flight are the fleet's."""
        return self.link.up is True

    def wake(self) -> None:
        """Sync soon: this replica's gate wants room it has no budget for."""
        self._periodic.wake()

    def touch(self) -> None:
        """Work came (a request, a charge, a placement): an idle replica is back to every ``interval_s``, from
        soon; a sync on its way does not judge it idle."""
        self._touches += 1
        if self._idle:
            self._idle = False
            self._periodic.interval_s = self.interval_s
            self._periodic.wake()

    @property
    def problem(self) -> str | None:
        """Why the shared state is not in sync (None: it is)."""
        return None if self.up else self.link.reason

    # -- FairServe's shared state (storage/shared_fairserve.py) ------------------------------------
    def wall(self, now: float) -> float:
        return now + self._offset

    def stats(self):
        from fairgate.storage.shared_fairserve import SharedStats

        return SharedStats(self.redis, self.tag + ":")

    def windows(self, window_s: float):
        from fairgate.storage.shared_fairserve import SharedWindows

        if self._windows is None:
            self._windows = SharedWindows(self.redis, self.tag + ":w:", self.replica, window_s, self.wall)
        return self._windows

    def interactions(self, ttl_s: float = 300.0):
        from fairgate.storage.shared_fairserve import SharedInteractions

        if self._interactions is None:
            self._interactions = SharedInteractions(self.redis, self.tag + ":ix", ttl_s, self.wall)
        return self._interactions

    async def prepare(self, client: str, app: str, interaction: str | None, now: float, windows: bool) -> None:
        """Fetch, in parallel, what one admission decision reads: the interaction's state and, for a policy that
        throttles (``windows``), the user's and app's windows. Skipped while the sync fails (circuit breaker):
        the decision uses the last view and this replica's own hits."""
        if not self.up:
            return
        fetches = []
        if windows and self._windows is not None:
            fetches.append(self._windows.prefetch(["u:" + client, "a:" + app], now))
        if self._interactions is not None and interaction:
            fetches.append(self._interactions.prefetch([interaction]))
        await asyncio.gather(*fetches)

    # -- the policy's counter store interface -------------------------------------------------------
    def _refresh(self, client: str) -> float:
        """``client``'s counter from its parts (the last sync's value, the batch out, what is pending), kept in
        ``_value`` for ``get``: the policy reads counters several times a request, they change far less often."""
        sent = self._unacked[1].get(client, NO_OP) if self._unacked else NO_OP
        add, floor = compose(sent, self._fold.get(client, NO_OP))
        value = self._value[client] = max(self._base.get(client, 0.0) + add, floor)
        return value

    def get(self, client: str) -> float:
        return self._value.get(client, 0.0)

    def add(self, client: str, amount: float) -> float:
        if self._idle:
            self.touch()
        self._fold[client] = compose(self._fold.get(client, NO_OP), (amount, NEG_INF))
        return self._refresh(client)

    def lift(self, client: str, floor: float) -> float:
        if self._idle:
            self.touch()
        if self.get(client) < floor:
            self._fold[client] = compose(self._fold.get(client, NO_OP), (0.0, floor))
            return self._refresh(client)
        return self.get(client)

    def items(self):
        return ((c, self.get(c)) for c in set(self._base) | set(self._fold))

    @property
    def pending_ops(self) -> int:
        """Operations waiting for Redis: one per client, however many charges and lifts it had."""
        return len(self._fold) + (len(self._unacked[1]) if self._unacked else 0)

    # -- sync ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._offset = time.time() - asyncio.get_running_loop().time()
        # a redis:// URL at a cluster node: the KV shards are on every node's slots, so the sync is refused (the
        # replica is not ready, and the log and /ready say: use redis+cluster://)
        self._node_of_cluster = await single_at_cluster_node(self.redis)
        await self.sync()
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
        await self.sync()  # last charges out, if Redis is there
        for rider in self.riders:
            await rider.flush()  # (settlements that came after the limits' drain)
        await self.redis.aclose()

    async def sync(self) -> bool:
        for rider in self.riders:  # limits' draws and settlements go out beside the sync
            rider.kick()
        if self._unacked is None and self._fold:  # a batch whose answer was lost goes again as it was
            self._batch += 1
            self._unacked, self._fold = (self._batch, self._fold), {}
        batch, ops = self._unacked or (self._batch, {})
        backlog = list(self.backlog_source())
        # read back only what this replica is using: clients it charges or lifts, and clients queued here
        # (a decision never scans every client the fleet has seen)
        watch = sorted(set(ops) | set(self._fold) | set(backlog))
        args: list = [self.replica, int(self.ttl_s * 1000), batch, len(ops)]
        for client, (add, floor) in ops.items():
            args += [client, repr(add), "" if floor == NEG_INF else repr(floor)]
        args += [len(backlog), *backlog, len(watch), *watch]
        least = self.global_min[0].partition("|")[0] if self.global_min else ""
        touches, mine = self._touches, self.inflight_source()
        kv_calls, backends = self.kv.calls(mine, least, self.ttl_s, self._per_shard)
        try:
            if self._node_of_cluster:
                raise NodeOfCluster(f"redis_url {self.url} names one node of a Redis Cluster, whose slots the "
                                    "shared state spans: use redis+cluster://host:port[,host:port…]")
            if not self.up:  # (first, and after a failure: a cluster's new node may lack them)
                for script in (self._script, self._kv_script):
                    await self.redis.script_load(script.script)
            (watched, head, cost_us, older), *kv = await self._call(
                [(self._script, self.keys, args), *((self._kv_script, k, a) for k, a in kv_calls)])
        except ERRORS as e:
            self.failures += 1
            self.link.failed(e)  # logged once: serving on local state until Redis answers
            stale = time.monotonic() - self._last_sync > self.ttl_s  # the others' view is too old to hold on to
            self.kv.failed(stale)
            if stale:
                self.global_min = None
            return False
        cost_us += sum(answer[1] for answer in kv)
        self.script_s = 0.8 * self.script_s + 0.2 * max(0, cost_us) / 1e6
        self._periodic.soonest_s = min(self.interval_s, max(self.interval_s / 4, self.script_s / SYNC_SHARE))
        self.link.worked()
        self._unacked, self._last_sync = None, time.monotonic()
        self.syncs += 1
        for client, value in zip(watch, watched):
            self._base[client] = float(value)  # the batch is in it; what was charged since is in _fold
            self._refresh(client)  # (the batch's clients are all watched: no other counter moved)
        self.global_min = (head[0].decode(), float(head[1])) if head else None
        if bool(older) != self.older:  # (said once per change, as a rolling update from the curves begins and ends)
            self.older = bool(older)
            (log.warning if older else log.info)(
                "replicas of an earlier version (KV budget curves, fg4_sync) %s namespace %s: they share the "
                "counters but not the KV budgets, so backends may preempt until they are gone",
                "share" if older else "no longer share", self.tag)
        self.kv.renewed(backends, [answer[0] for answer in kv])
        # FairServe's writes (window hits, interaction opens and closes) go out with the state sync
        await asyncio.gather(*(x.flush() for x in (self._windows, self._interactions)
                               if x is not None))
        for callback in self.on_sync:
            callback()
        # idle: nothing charged, queued or running here, no room wanted; what it holds of the backends' KV is
        # its share at hand, which the others' wants take back at its next sync (at most IDLE_SYNCS later)
        self._idle = not (ops or self._fold or backlog or self._touches != touches
                          or any(h or n or w for h, n, _, w in mine.values()))
        # (never near the ttl after which the others count a replica gone)
        idle_s = max(self.interval_s, min(self.interval_s * IDLE_SYNCS, self.ttl_s / 4))
        self._periodic.interval_s = idle_s if self._idle else self.interval_s
        return True

    async def _call(self, calls: list) -> list:
        """Run ``calls`` (script, keys, args): on one server in one round trip; on a cluster side by side, each
        on its slot."""
        if self._per_shard:  # (redis-py's cluster pipelines refuse scripts)
            return await asyncio.gather(*(self.redis.evalsha(s.sha, len(k), *k, *a) for s, k, a in calls))
        async with self.redis.pipeline(transaction=False) as p:
            for script, keys, args in calls:
                p.evalsha(script.sha, len(keys), *keys, *args)
            return await p.execute()

    def is_mine(self, member: str) -> bool:
        return member.startswith(self.replica + "|")
