"""The backend pool: health checks, model discovery, vLLM metric scraping, and in-flight accounting."""

from __future__ import annotations

import math

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from fairgate.periodic import Periodic
from fairgate.policies.views import BackendView
from fairgate.proxy.config import BackendConfig

MAX_MODEL_LEN = 1 << 30  # tokens: a context a backend reports beyond this (or a bool) is ignored
log = logging.getLogger("fairgate.backends")
SLOW_PROBES_TO_DOWN = 3  # consecutive timed-out health probes that mark a backend down
FRESH_S = 0.5  # a request sent this recently may still wait for the engine's next step (``Backend.sent``)


@dataclass(eq=False)
class Backend:
    name: str
    url: str
    configured_models: list[str] | None = None
    kv_capacity: int | None = None
    max_num_seqs: int | None = None
    models: set[str] = field(default_factory=set)
    context: dict[str, int] = field(default_factory=dict)  # model → max_model_len, from /v1/models
    up: bool = False
    last_ok: float = 0.0
    last_error: str | None = None
    inflight: int = 0
    inflight_tokens: int = 0
    waiting: int = 0  # requests it queues on its own, as its last scrape said, less those just sent
    running: int = 0
    kv_usage: float = 0.0
    prefilling: int = 0  # prompt tokens the gateway sent it that have not had their first token yet
    failures: int = 0  # consecutive requests that failed before their first token
    slow_probes: int = 0  # consecutive health probes that timed out
    ejections: int = 0  # consecutive ejections (each lasts longer)
    ejected_until: float = 0.0  # monotonic time; outlier detection keeps it out of the pool until then
    fresh: deque = field(default_factory=deque)  # when the gateway sent its requests of the last FRESH_S

    def sent(self, now: float) -> None:
        """The gateway sent it a request at ``now`` (loop time)."""
        self.fresh.append(now)
        self._sent_since(now - FRESH_S)

    def scraped_waiting(self, waiting: int, now: float) -> None:
        """Its engine said ``waiting`` requests wait in its own queue. A request the gateway has just sent waits
        there until the engine's next step: that many are taken off (up to those of the last ``FRESH_S``), or
        a scrape that caught one would shut the gate (``kv_gate``: it queues on its own) until the next."""
        self.waiting = max(0, waiting - self._sent_since(now - FRESH_S))

    def _sent_since(self, since: float) -> int:
        """How many requests it was sent from ``since`` on; older ones are forgotten (O(1) amortised)."""
        while self.fresh and self.fresh[0] < since:
            self.fresh.popleft()
        return len(self.fresh)

    def view(self) -> BackendView:
        return BackendView(self.name, self.inflight, self.inflight_tokens, self.kv_capacity,
                           self.waiting, self.running, self.kv_usage)

    def acquire(self, kv_tokens: int) -> None:
        self.inflight += 1
        self.inflight_tokens += kv_tokens

    def grow(self, kv_tokens: int) -> None:
        """A request in flight holds ``kv_tokens`` more (a stream outlived its reservation)."""
        self.inflight_tokens += kv_tokens

    def release(self, kv_tokens: int) -> None:
        self.inflight -= 1
        self.inflight_tokens -= kv_tokens


def parse_vllm_metrics(text: str) -> dict[str, float | dict[str, str]]:
    """The few vLLM series the gateway uses, summed over engines; cache_config_info as its labels."""
    out: dict[str, float | dict[str, str]] = {}
    wanted = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:gpu_cache_usage_perc"}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in wanted:
                out[s.name] = float(out.get(s.name, 0.0)) + s.value  # type: ignore[arg-type]
            elif s.name == "vllm:cache_config_info":
                out[s.name] = dict(s.labels)
    return out


@dataclass
class OutlierConfig:
    """Outlier detection as Envoy does it: ``consecutive_failures`` requests failing before their first token
    eject a backend for ``ejection_s`` × its consecutive ejections (≤ 10×); never more than ``max_ejected``
    of the pool at once (so one backend alone is never ejected: its failed health checks still take it down)."""

    consecutive_failures: int = 3
    ejection_s: float = 10.0
    max_ejected: float = 0.5


class BackendPool:
    def __init__(self, configs: list[BackendConfig], session: aiohttp.ClientSession, interval_s: float = 2.0,
                 outlier: OutlierConfig | None = None):
        self.session = session
        self.interval_s = interval_s
        self.outlier = outlier or OutlierConfig()
        self.backends = [Backend(name=c.name or c.url.rstrip("/").split("//")[-1], url=c.url.rstrip("/"),
                                 configured_models=c.models, kv_capacity=c.kv_tokens, max_num_seqs=c.max_num_seqs)
                         for c in configs]
        self._periodic = Periodic("backend-health", interval_s, self.refresh)
        self.on_refresh: list = []  # callbacks after every refresh (the dispatcher re-pumps)
        self._known: set[str] = set()
        self._known_key: tuple | None = None

    async def start(self) -> None:
        await self.refresh()
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()

    async def refresh(self) -> None:
        await asyncio.gather(*(self.probe(b) for b in self.backends))
        for callback in self.on_refresh:
            callback()

    async def probe(self, b: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.interval_s))
        try:
            async with self.session.get(b.url + "/v1/models", timeout=timeout) as r:
                r.raise_for_status()
                data = orjson.loads(await r.read())
            cards = data.get("data", [])
            b.models = set(b.configured_models or [m["id"] for m in cards])
            b.context = {m["id"]: n for m in cards  # clamped: a backend's word is shown to every client
                         if type(n := m.get("max_model_len")) is int and 0 < n <= MAX_MODEL_LEN}
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                async with self.session.get(b.url + "/metrics", timeout=timeout) as r:
                    if r.status == 200:
                        metrics = parse_vllm_metrics(await r.text())
                        self._apply_metrics(b, metrics, asyncio.get_running_loop().time())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as e:
            reason = str(e) or type(e).__name__
            if isinstance(e, asyncio.TimeoutError) and b.up and b.slow_probes + 1 < SLOW_PROBES_TO_DOWN:
                # a loaded server (a CPU vLLM running its batch) can answer a probe late and still serve: a
                # refused connection or an error takes it out at once, a late answer only when it persists
                b.slow_probes += 1
                log.info("backend %s answered no probe within %.1f s (%d in a row)", b.name, timeout.total,
                         b.slow_probes)
                return
            if b.up:
                log.warning("backend %s is down: %s", b.name, reason)
            b.up, b.last_error = False, reason
            return
        if not b.up:
            log.info("backend %s is up, serving %s", b.name, sorted(b.models))
        b.up, b.last_ok, b.last_error, b.slow_probes = True, time.time(), None, 0

    @staticmethod
    def _apply_metrics(b: Backend, m: dict, now: float = 0.0) -> None:
        def gauge(name: str, default: float, top: float) -> float:  # a backend's number, clamped (NaN: default)
            try:
                v = float(m.get(name, default))  # type: ignore[arg-type]
            except (TypeError, ValueError):
                return default
            return min(max(v, 0.0), top) if math.isfinite(v) else default

        b.running = int(gauge("vllm:num_requests_running", 0, 1e6))
        b.scraped_waiting(int(gauge("vllm:num_requests_waiting", 0, 1e6)), now)
        b.kv_usage = gauge("vllm:kv_cache_usage_perc", gauge("vllm:gpu_cache_usage_perc", 0.0, 1.0), 1.0)
        info = m.get("vllm:cache_config_info")
        if isinstance(info, dict) and b.max_num_seqs is None:
            b.max_num_seqs = _count(info.get("max_num_seqs"))
        if isinstance(info, dict) and b.kv_capacity is None:
            b.kv_capacity = _count(info.get("kv_cache_size_tokens"))
            if b.kv_capacity is None and (blocks := _count(info.get("num_gpu_blocks"))) is not None \
                    and (size := _count(info.get("block_size"))) is not None:
                b.kv_capacity = _count(blocks * size)

    def failed(self, b: Backend, reason: str) -> None:
        """A request failed on ``b`` before its first token (the request itself goes elsewhere). One failure
        is that request's bad luck; ``consecutive_failures`` in a row eject the backend for a while."""
        b.failures += 1
        b.last_error = reason
        now = time.monotonic()
        if b.failures < self.outlier.consecutive_failures or now < b.ejected_until:
            return
        ejected = sum(now < x.ejected_until for x in self.backends)
        if ejected + 1 > self.outlier.max_ejected * len(self.backends):
            return
        b.ejections += 1
        b.failures = 0
        b.ejected_until = now + self.outlier.ejection_s * min(b.ejections, 10)
        log.warning("backend %s ejected for %.0f s after %d consecutive failures: %s", b.name,
                    b.ejected_until - now, self.outlier.consecutive_failures, reason)

    def succeeded(self, b: Backend) -> None:
        """A request got its first token from ``b``."""
        b.failures = b.ejections = 0

    def candidates(self, model: str, exclude: set[str] = frozenset()) -> list[Backend]:
        now = time.monotonic()
        return [b for b in self.backends
                if b.up and now >= b.ejected_until and model in b.models and b.name not in exclude]

    def models(self) -> dict[str, list[Backend]]:
        out: dict[str, list[Backend]] = {}
        for b in self.backends:
            if b.up:
                for m in b.models:
                    out.setdefault(m, []).append(b)
        return out

    def context_limit(self, model: str) -> int | None:
        """The longest context (prompt + output tokens) any backend serving ``model`` accepts, if known."""
        limits = [b.context[model] for b in self.backends if model in b.context]
        return max(limits) if limits else None

    def known_models(self) -> set[str]:
        """Every model any backend has served, up or not (so a down pool gives 503, not 404). Asked twice a
        request: rebuilt only when a backend's model set is replaced (each probe assigns a new one) or
        resized."""
        key = tuple((id(b.models), len(b.models), id(b.configured_models)) for b in self.backends)
        if key != self._known_key:
            self._known = {m for b in self.backends for m in (b.models or b.configured_models or [])}
            self._known_key = key
        return self._known


def _count(value, top: int = 1 << 40) -> int | None:
    """A positive count a backend reports (a label's text), or None if it is not one within reason."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return int(v) if math.isfinite(v) and 1 <= v <= top else None
