"""Helpers for the simulator tests: cached runs of built-in (or scaled) workloads."""

from __future__ import annotations

import statistics
from functools import lru_cache

from fairgate.accounting.cost import make_cost
from fairgate.sim import fairness as F
from fairgate.sim.builtin import BUILTIN, scaled
from fairgate.policies.factory import make_scheduler
from fairgate.engine.profiles import get_profile
from fairgate.sim.report import build
from fairgate.sim.simulator import Simulator
from fairgate.sim.workload import from_dict


@lru_cache(maxsize=None)
def run(workload: str, policy: str, mode: str = "engine", backends: int = 1, cost: str = "weighted",
        scale: float = 1.0, kv_tokens: int | None = None):
    data = scaled(workload, scale) if scale != 1.0 else BUILTIN[workload]
    w = from_dict(data, workload)
    c = make_cost(cost)
    s = make_scheduler(policy, c, lambda x: w.weights.get(x, 1.0))
    profile = get_profile(w.engine or "a10g-llama2-7b").with_overrides(kv_tokens=kv_tokens)
    out = Simulator(w, s, profile, mode=mode, backends=backends, cost=c).run()
    return out, build(out, policy, "least-load", c)


def steady_service(out, lo: float, hi: float, ticks: int = 30) -> dict[str, float]:
    """Mean windowed service per client over ticks in [lo, hi]."""
    w = out.workload
    curves = F.service_curves(out.requests, w.clients, w.duration_s, ticks=ticks)
    return {c: statistics.fmean(y for x, y in pts if lo <= x <= hi) for c, pts in curves.items()}


def mean_ttft(out, client: str, lo: float = 0.0, hi: float = 1e9) -> float:
    xs = [r.first_token - r.arrival for r in out.requests
          if r.client == client and r.first_token is not None and lo <= r.arrival < hi]
    return statistics.fmean(xs)


def write_usage_log(url: str, t0, sent: list[tuple[str, float, int, int]]) -> None:
    """A usage log as the gateway writes it, for replay: each (app, seconds after ``t0``, prompt, output) a
    served request of user ``u`` (queued as ``user:APP/u`` under vtc on ``gpu-0``), dispatched as it arrived and
    finished a second later."""
    import asyncio
    from datetime import timedelta

    from fairgate.storage.db import make_engine, sessionmaker, upgrade
    from fairgate.storage.models import UsageLog

    async def write() -> None:
        engine = make_engine(url)
        await upgrade(engine)
        async with sessionmaker(engine)() as s:
            for i, (app, at, prompt, output) in enumerate(sent):
                arrival = t0 + timedelta(seconds=at)
                s.add(UsageLog(request_id=f"{app}-{i}", user="u", app=app, interaction="", stage=0,
                               endpoint="chat", stream=True, prompt_tokens=prompt, completion_tokens=output,
                               estimated_prompt_tokens=prompt, arrival=arrival, dispatched_at=arrival,
                               finished_at=arrival + timedelta(seconds=1), status="ok", http_status=200,
                               attempts=1, fairness_key=f"user:{app}/u", policy="vtc", backend="gpu-0"))
            await s.commit()
        await engine.dispose()

    asyncio.run(write())
