"""FairServe's metrics (docs/simulator/index.md#fairserve-metrics) from a simulation: throttled interactions,
wasted tokens, users delayed, served users and interactions, per-app throughput and TTFT, and the
WSC-normalised spread."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from fairgate.accounting.app_stats import AppStats
from fairgate.policies.wsc import TokenWeights
from fairgate.sim.simulator import SimOutcome
from fairgate.sim.targets import OVER_CONTEXT

REFUSED = ("too_large", OVER_CONTEXT)  # refused as any backend refuses them, not throttled

DELAY_S = 1.0  # a user "saw queueing delay" if some call of theirs waited longer than this for a slot


def _tokens_spent(r) -> int:
    return (r.prompt_len if r.admitted is not None else 0) + r.generated


def build(out: SimOutcome, stats: AppStats | None, delay_s: float = DELAY_S) -> dict[str, Any]:
    w, reqs = out.workload, out.requests
    sent = [r for r in reqs if not r.cancelled]
    # interactions: one-call ones are their own
    inter: dict[str, list] = defaultdict(list)
    for r in reqs:
        inter[r.interaction or f"#{r.id}"].append(r)
    completed = {x for x, rs in inter.items() if all(r.finished is not None for r in rs)}
    failed = set(inter) - completed
    throttled = {x for x, rs in inter.items() if any(r.rejected and r.throttle_reason not in REFUSED for r in rs)}
    wasted = sum(_tokens_spent(r) for x in failed for r in inter[x])
    benign_throttled = {x for x in throttled if inter[x][0].client not in w.abusive}
    # throttled after some of its calls had run: the interaction's earlier work is lost (RPM's flaw, §3.4)
    mid = {x for x in throttled if any(r.admitted is not None for r in inter[x])}
    reasons: dict[str, int] = defaultdict(int)
    for x in sorted(throttled):  # (in a stable order: the report's keys with it)
        reasons[next(r.throttle_reason for r in inter[x] if r.rejected)] += 1
    # users
    users = w.clients
    waited = defaultdict(float)
    for r in sent:
        start = r.admitted if r.admitted is not None else r.dispatched  # waited for a slot in the engine
        if start is not None:
            waited[r.client] = max(waited[r.client], start - r.arrival)
        elif r.abandoned:
            waited[r.client] = max(waited[r.client], w.timeout_s or 0.0)
    benign = [u for u in users if u not in w.abusive]
    delayed = [u for u in benign if waited[u] > delay_s]
    served_users = {r.client for r in reqs if r.finished is not None}
    # per app
    span = out.makespan or 1.0
    apps: dict[str, Any] = {}
    for app in sorted({r.app for r in reqs}):
        mine = [r for r in sent if r.app == app]
        fin = [r for r in mine if r.finished is not None]
        ttft = [r.first_token - r.arrival for r in fin if r.first_token is not None]
        xs = {r.interaction or f"#{r.id}" for r in mine}
        apps[app] = {"requests": len(mine), "finished": len(fin),
                     "prompt_tps": sum(r.prompt_len for r in fin) / span,
                     "decode_tps": sum(r.output_len for r in fin) / span,
                     "mean_ttft_s": statistics.fmean(ttft) if ttft else 0.0,
                     "interactions": len(xs), "completed_interactions": len(xs & completed)}
    # WSC-normalised service per benign user (E = 1, the paper's α, β, γ), and its spread among the users
    # who had to wait (those the scheduler actually arbitrated between)
    norm: dict[str, float] = defaultdict(float)
    paper = TokenWeights()
    if stats is not None:
        for r in reqs:
            if r.finished is not None:
                e = stats.expected(r.app, r.stage)
                norm[r.client] += paper.of(r.prompt_len - r.system_len, r.system_len, r.output_len) / max(
                    1e-9, paper.of(e.input, e.system, e.output))
    contested = [norm[u] for u in delayed if u in norm] or [0.0]
    return {
        "throttled": {"interactions": len(throttled), "benign_interactions": len(benign_throttled),
                      "mid_interaction": len(mid), "by_reason": dict(reasons), "wasted_tokens": wasted,
                      "abuser_tokens": sum(r.prompt_len + r.output_len for r in reqs
                                           if r.client in w.abusive and r.finished is not None)},
        "interactions": {"total": len(inter), "completed": len(completed), "failed": len(failed),
                         "completed_share": len(completed) / max(1, len(inter)),
                         "multi_call": sum(1 for rs in inter.values() if len(rs) > 1)},
        "users": {"total": len(users), "benign": len(benign), "delayed_share": len(delayed) / max(1, len(benign)),
                  "delay_threshold_s": delay_s, "served_share": len(served_users) / max(1, len(users))},
        "apps": apps,
        "wsc": {"normalised_service": dict(norm),
                "spread_delayed": (max(contested) - min(contested)) / max(1e-9, statistics.fmean(contested))},
    }
