"""The console (docs/operations/console.md): a live page of the fleet's fairness, served on the operations
listener only (``ops_port``): ``GET /console`` (the page: plain HTML, CSS and JS in the package, with uPlot
vendored; no build step, no CDN) and ``GET /console/events`` (its data: server-sent events, one a second, for
the operations token when one is set; ``GET /console/access`` says whether one is). The API port has none of
them.

Each replica takes a snapshot of what it sees every ``PUBLISH_S`` — per tenant the service it received, its
weight, what it has waiting and for how long, its virtual counter and its refusals by reason; per backend its
load, KV use and prefix hits; per SLO class its attainment — and, when the fleet shares state through Redis,
publishes it there (``{namespace}:console:<replica>``, gone after ``FRESH_S``). A page on any replica reads every
replica's and merges them (``merge``), so each shows the whole fleet; ``assess`` turns two merged snapshots
``RATE_WINDOW_S`` apart into rates, each waiting tenant's service over its weight, Jain's index, the counter gap and one
plain sentence. A snapshot costs O(tenants with series + backends + waiting requests) a second; it holds at
most ``MAX_TENANTS`` tenants (the busiest), the rest summed as ``others``.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson

from fairgate.http.messages import Request, Response, StreamResponse
from fairgate.periodic import Periodic
from fairgate.proxy.errors import APIError

if TYPE_CHECKING:
    from fairgate.proxy.app import Gateway

PUBLISH_S = 1.0
FRESH_S = 5.0
RATE_WINDOW_S = 5.0  # rates and recent refusals are over the last few seconds (replicas publish out of phase)
MAX_TENANTS = 100
FAIR_JAIN = 0.9  # Jain's index of weighted service among waiting tenants at or above which the fleet is fair
REASONS = {  # a refusal's code, in plain words
    "rate_limit_exceeded": "over a rate limit (requests or tokens per minute, or requests in flight)",
    "insufficient_quota": "its budget is spent",
    "user_limit": "a user over its request rate, at a new interaction (FairServe)",
    "app_limit": "an app over its request rate, at a new interaction (FairServe)",
    "slo_unattainable": "shed: it would have missed its latency target",
    "tenant_queue_full": "its queue is full",
    "app_queue_full": "its app's queue is full",
    "stored_bytes_exceeded": "its stored responses reached their cap",
}
LIMITS = {"rpm": "requests-per-minute limit", "tpm": "tokens-per-minute limit", "concurrency": "limit on requests in "
          "flight", "budget_tokens": "token budget is spent", "budget_usd": "money budget is spent"}


def refusal_labels(m, call) -> tuple[str, str]:
    """The (tenant, reason) labels of a refused call: a tenant that already has its series (a refusal does not
    give one: made-up users would take them all), else ``other``; the limit that refused it, or a code of the
    gateway's own (a backend's 429 carries a code of the backend's choosing: ``other``)."""
    key = call.fairness_key or f"app:{call.app}"
    tenant = m.tenant(key) if m.has_series(key) else "other"
    reason = call.limit or (call.throttle_reason if call.throttle_reason in REASONS else "other")
    return tenant, reason


def reason_words(code: str) -> str:
    """A refusal's reason in plain words: a limit's (``app_rpm``: "over its app's requests-per-minute limit")
    or an error code's."""
    scope, _, kind = code.partition("_")
    if kind in LIMITS and scope in ("app", "user", "key"):
        return f"its {scope}'s {LIMITS[kind]}" if kind.startswith("budget") else f"over its {scope}'s {LIMITS[kind]}"
    return REASONS.get(code, code)
STATIC = resources.files("fairgate.proxy.control") / "console_static"
ASSETS = {"console.html": "text/html; charset=utf-8", "favicon.svg": "image/svg+xml", "console.js": "text/javascript; charset=utf-8",
          "console.css": "text/css; charset=utf-8", "uPlot.iife.min.js": "text/javascript; charset=utf-8",
          "uPlot.min.css": "text/css; charset=utf-8"}


def missing_assets() -> list[str]:
    """The page's files this installation lacks (a package built without its data files)."""
    return [name for name in ASSETS if not (STATIC / name).is_file()]


def _samples(metric) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for family in metric.collect() for s in family.samples if s.name.endswith("_total")]


def snapshot(g: Gateway, now: float) -> dict[str, Any]:
    """What this replica sees now (``now``: wall time, to compare with other replicas')."""
    m, scheduler, d = g.metrics, g.scheduler, g.dispatcher
    m.fold()
    waiting = scheduler.waiting_by_client()
    oldest = d.oldest_waiting()
    loop_now = d.now()
    tenants: dict[str, dict[str, Any]] = {}
    # (a waiting tenant past the metrics labels' cap is shown by its name all the same: one tenant cycling
    # through names must not hide another's queue)
    for key, label in list(m.tenants()) + [(k, m.name(k)) for k in waiting]:
        if label in tenants:
            continue
        tenants[label] = {"service": g.service.get(label, 0.0), "weight": g.tenants.weight(key),
                          "queued": waiting.get(key, 0), "counter": scheduler.counter(key),
                          "oldest_wait_s": round(loop_now - oldest[key], 3) if key in oldest else 0.0, "refused": {}}
    for labels, value in _samples(m.tenant_refusals):
        t = tenants.setdefault(labels["tenant"], {"service": 0.0, "weight": 1.0, "queued": 0, "counter": 0.0,
                                                  "oldest_wait_s": 0.0, "refused": {}})
        t["refused"][labels["reason"]] = value
    if len(tenants) > MAX_TENANTS:  # the busiest kept by name, the others summed
        ranked = sorted(tenants, key=lambda n: (tenants[n]["queued"], tenants[n]["service"]), reverse=True)
        others = {"service": 0.0, "weight": 1.0, "queued": 0, "counter": 0.0, "oldest_wait_s": 0.0, "refused": {}}
        for name in ranked[MAX_TENANTS:]:
            t = tenants.pop(name)
            others["service"] += t["service"]
            others["queued"] += t["queued"]
            others["oldest_wait_s"] = max(others["oldest_wait_s"], t["oldest_wait_s"])
        tenants["others"] = others
    prefix: dict[str, dict[str, float]] = {}
    for labels, value in _samples(m.prefix_tokens):
        prefix.setdefault(labels["backend"], {})[labels["kind"]] = value
    backends = {b.name: {"up": b.up, "inflight": b.inflight, "kv_use": b.kv_usage,
                         "kv_committed": d.gate.committed(b), "kv_capacity": b.kv_capacity or 0,
                         "prompt": prefix.get(b.name, {}).get("prompt", 0.0),
                         "cached": prefix.get(b.name, {}).get("cached", 0.0)} for b in g.pool.backends}
    slo: dict[str, dict[str, float]] = {}
    for labels, value in _samples(m.slo_requests):
        c = slo.setdefault(labels["slo_class"], {"met": 0.0, "all": 0.0})
        c["all"] += value
        c["met"] += value if labels["met"] == "true" else 0.0
    return {"replica": g.shared.replica if g.shared is not None else "this", "at": now,
            "policy": g.config.policy, "tenants": tenants, "backends": backends, "slo": slo}


def merge(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """The fleet's view from each replica's: service, queues and refusals summed; waits, counters and a
    backend's own KV use at their largest."""
    tenants: dict[str, dict[str, Any]] = {}
    backends: dict[str, dict[str, Any]] = {}
    slo: dict[str, dict[str, float]] = {}
    for s in snaps:
        for name, t in s["tenants"].items():
            into = tenants.setdefault(name, {"service": 0.0, "weight": t["weight"], "queued": 0, "counter": 0.0,
                                             "oldest_wait_s": 0.0, "refused": {}})
            into["service"] += t["service"]
            into["queued"] += t["queued"]
            into["counter"] = max(into["counter"], t["counter"])
            into["oldest_wait_s"] = max(into["oldest_wait_s"], t["oldest_wait_s"])
            for reason, n in t["refused"].items():
                into["refused"][reason] = into["refused"].get(reason, 0.0) + n
        for name, b in s["backends"].items():
            into = backends.setdefault(name, {"up": False, "inflight": 0, "kv_use": 0.0, "kv_committed": 0,
                                              "kv_capacity": 0, "prompt": 0.0, "cached": 0.0})
            into["up"] = into["up"] or b["up"]
            for k in ("inflight", "kv_committed", "prompt", "cached"):
                into[k] += b[k]
            for k in ("kv_use", "kv_capacity"):
                into[k] = max(into[k], b[k])
        for name, c in s["slo"].items():
            into = slo.setdefault(name, {"met": 0.0, "all": 0.0})
            into["met"] += c["met"]
            into["all"] += c["all"]
    return {"at": max((s["at"] for s in snaps), default=time.time()), "replicas": len(snaps),
            "policy": snaps[0]["policy"] if snaps else "", "tenants": tenants, "backends": backends, "slo": slo}


def assess(now: dict[str, Any], changed: tuple[dict[str, Any], dict[str, Any]] | None) -> dict[str, Any]:
    """``now`` (the fleet's merged view) with what changed over ``changed`` — the same replicas' merged views
    now and a few seconds before —: each tenant's service rate and its rate over its weight, its refusals since;
    among the tenants waiting, Jain's index of their weighted rates and the counter gap; and a sentence saying
    whether the fleet is fair right now, who waits and why."""
    then, before = changed if changed else (now, None)
    dt = max(1e-3, then["at"] - before["at"]) if before else None
    old = before["tenants"] if before else {}
    tenants = {}
    for name, t in now["tenants"].items():
        was, cur = old.get(name), then["tenants"].get(name, t)
        rate = max(0.0, cur["service"] - was["service"]) / dt if (dt and was) else 0.0
        recent = {r: n - (was["refused"].get(r, 0.0) if was else n) for r, n in cur["refused"].items()}
        tenants[name] = {**t, "rate": rate, "share": rate / max(t["weight"], 1e-9),
                         "refused_now": {r: n for r, n in recent.items() if n > 0}}
    waiting = {n: t for n, t in tenants.items() if t["queued"] > 0 and n not in ("others", "other")}  # (a sum of
    # many tenants is no tenant's share)
    shares = [t["share"] for t in waiting.values()]
    jain = (sum(shares) ** 2 / (len(shares) * sum(x * x for x in shares))) if any(shares) else 1.0
    counters = [t["counter"] for t in waiting.values()]
    codes = {code for t in tenants.values() for code in t["refused"]}
    return {**now, "tenants": tenants, "headline": headline(tenants, waiting, jain),
            "reasons": {code: reason_words(code) for code in codes},
            "fairness": {"waiting": len(waiting), "jain": round(jain, 3),
                         "counter_gap": (max(counters) - min(counters)) if counters else 0.0}}


def headline(tenants: dict[str, dict[str, Any]], waiting: dict[str, dict[str, Any]], jain: float) -> str:
    """One sentence for someone who never read the papers."""
    refused = sorted(((sum(t["refused_now"].values()), name, max(t["refused_now"], key=t["refused_now"].get))
                      for name, t in tenants.items() if t.get("refused_now")), reverse=True)
    tail = ""
    if refused:
        n, name, reason = refused[0]
        tail = (f" {name} was refused {n:.0f} time{'s' if n != 1 else ''} in the last few seconds: "
                f"{reason_words(reason)}.")
    if not waiting:
        return "Nothing is waiting: every request is served as it comes." + tail
    longest = max(waiting, key=lambda n: waiting[n]["oldest_wait_s"])
    wait = f"{len(waiting)} tenant{'s' if len(waiting) != 1 else ''} waiting; the longest wait is " \
           f"{waiting[longest]['oldest_wait_s']:.1f} s ({longest})."
    if len(waiting) < 2 or jain >= FAIR_JAIN:
        return f"Fair right now: each waiting tenant gets its weighted share (Jain's index {jain:.2f}). {wait}" + tail
    most = max(waiting, key=lambda n: waiting[n]["share"])
    least = min(waiting, key=lambda n: waiting[n]["share"])
    ratio = waiting[most]["share"] / max(waiting[least]["share"], 1e-9)
    ratio_text = f"{ratio:.1f}×" if ratio < 100 else "far more than"
    return (f"Not fair right now: {most} gets {ratio_text} the weighted service of {least} "
            f"(Jain's index {jain:.2f}). {wait}") + tail


class Console:
    """A component of ``Gateway``: publishes this replica's snapshot, and serves the page and its events."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.latest: dict[str, Any] | None = None  # this replica's last snapshot
        self._periodic = Periodic("console-snapshot", PUBLISH_S, self.publish)
        self._stopping = False
        self._assets: dict[str, bytes] = {}  # each file of the page, read once

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        self._stopping = True  # (the pages' streams end: the drain need not wait for them)
        await self._periodic.stop()

    def _keys(self) -> tuple[str, str]:
        tag = self.gateway.shared.tag
        return f"{tag}:console", f"{tag}:console:"

    async def publish(self) -> None:
        """This replica's snapshot, kept and (with Redis) published for the other replicas' pages."""
        self.latest = snapshot(self.gateway, time.time())
        shared = self.gateway.shared
        if shared is None or not shared.up:
            return
        members, prefix = self._keys()
        async with shared.redis.pipeline(transaction=False) as p:
            p.set(prefix + shared.replica, orjson.dumps(self.latest), px=int(FRESH_S * 1000))
            p.zadd(members, {shared.replica: self.latest["at"]})
            p.zremrangebyscore(members, "-inf", self.latest["at"] - FRESH_S)
            await p.execute()

    async def fleet(self) -> list[dict[str, Any]]:
        """Every live replica's snapshot (this replica's alone without Redis, or while it fails); one that does
        not read as a snapshot is left out."""
        own = snapshot(self.gateway, time.time())
        shared = self.gateway.shared
        if shared is None or not shared.up:
            return [own]
        members, prefix = self._keys()
        try:
            names = await shared.redis.zrangebyscore(members, time.time() - FRESH_S, "+inf")
            others = [n.decode() for n in names if n.decode() != shared.replica][:256]
            got = await shared.redis.mget([prefix + n for n in others]) if others else []
        except Exception:  # noqa: BLE001 — the sync says Redis is away; this page shows this replica alone
            return [own]
        snaps = [own]
        for raw in got:
            try:
                snap = orjson.loads(raw) if raw else None
                merge([snap])  # (it reads as one: a replica of another version may not)
            except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                continue
            snaps.append(snap)
        return snaps

    def _authorised(self, request: Request) -> None:
        token = self.gateway.config.ops_token
        if token is None:
            return  # (the operations listener is the monitoring network's)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())):
            raise APIError(401, "the console needs the operations token: 'Authorization: Bearer <ops_token>'",
                           code="invalid_api_key")
        request.trust()

    async def page(self, request: Request) -> Response:
        """The page and its assets (the page itself holds no data: it asks for the token)."""
        name = request.match_info.get("asset") or "console.html"
        if name not in ASSETS:
            raise APIError(404, f"no console asset {name[:80]!r}", code="not_found")
        body = self._assets.get(name)
        if body is None:
            body = self._assets[name] = (STATIC / name).read_bytes()
        return Response(body=body, content_type=ASSETS[name],
                        headers={"cache-control": "no-cache", "x-content-type-options": "nosniff",
                                 "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                                                            "frame-ancestors 'none'",  # (never inside another page)
                                 "x-frame-options": "DENY"})

    async def access(self, request: Request) -> Response:
        """Whether the page must ask for the operations token (it asks before it connects)."""
        return Response(body=orjson.dumps({"token": self.gateway.config.ops_token is not None}),
                        content_type="application/json", headers={"cache-control": "no-cache"})

    async def events(self, request: Request) -> StreamResponse:
        """The fleet's view, assessed, every ``PUBLISH_S`` as a server-sent event, until the page goes."""
        self._authorised(request)
        response = StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await response.prepare(request)
        seen: collections.deque = collections.deque()  # (at, {replica: snapshot}) of the last RATE_WINDOW_S
        try:
            while not self._stopping:
                snaps = await self.fleet()
                now = {s["replica"]: s for s in snaps}
                at = max(s["at"] for s in snaps)
                while len(seen) > 1 and at - seen[1][0] >= RATE_WINDOW_S:
                    seen.popleft()
                # rates from the replicas that reported both times (one that joined or left is no burst)
                before = seen[0][1] if seen else {}
                common = [r for r in now if r in before]
                view = assess(merge(snaps), (merge([now[r] for r in common]), merge([before[r] for r in common]))
                              if common else None)
                seen.append((at, now))
                await asyncio.wait_for(response.write(b"data: " + orjson.dumps(view) + b"\n\n"),
                                       self.gateway.config.write_timeout_s)
                await asyncio.sleep(PUBLISH_S)
        except (ConnectionResetError, asyncio.TimeoutError):
            pass
        return response
