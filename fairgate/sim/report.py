"""The simulation's JSON document (keys in docs/simulator/index.md#outputs) and its figures."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from fairgate.accounting.cost import CostFunction
from fairgate.sim import fairness as F
from fairgate.sim import targets
from fairgate.sim.simulator import SimOutcome


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]


def _programs(mine) -> list[float]:
    """End-to-end time of each finished program (a ToT tree, a judge, a conversation: one interaction), from its
    first call's arrival to its last call's finish (the locality paper's per-program latency;
    docs/simulator/index.md#locality-metrics)."""
    progs: dict[str, list] = {}
    for r in mine:
        if r.interaction:
            progs.setdefault(r.interaction, []).append(r)
    return [max(r.finished for r in rs) - min(r.arrival for r in rs)
            for rs in progs.values() if all(r.finished is not None for r in rs)]


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def build(out: SimOutcome, policy: str, placement: str, cost: CostFunction) -> dict[str, Any]:
    doc = _build(out, policy, placement, cost)
    w = out.workload
    if w.interactions or w.abusive or w.timeout_s or out.scheduler is not None and out.scheduler.throttles:
        from fairgate.sim import interaction_metrics

        extra = interaction_metrics.build(out, out.stats)
        doc["throttled"] = extra.pop("throttled")
        doc.update(extra)
    return doc


def _build(out: SimOutcome, policy: str, placement: str, cost: CostFunction) -> dict[str, Any]:
    w, reqs = out.workload, out.requests
    clients = w.clients
    done = [r for r in reqs if r.finished is not None]
    tokens = sum(r.prompt_len + r.output_len for r in done)
    service = F.accumulated(reqs, clients, w.duration_s, cost)
    per_client: dict[str, Any] = {}
    for c in clients:
        mine = [r for r in reqs if r.client == c]
        fin = [r for r in mine if r.finished is not None]
        ttft = [r.first_token - r.arrival for r in fin if r.first_token is not None]
        latency = [r.finished - r.arrival for r in fin]
        per_client[c] = {
            "requests": len(mine), "finished": len(fin), "rejected": sum(r.rejected for r in mine),
            "weight": w.weights.get(c, 1.0), "service": service[c],
            # DLPM's actual service: 1 × extend (uncached input) + 2 × output tokens, whole run
            "actual_service": sum(r.prompt_len - r.cached + 2 * r.generated for r in mine if r.admitted is not None),
            "mean_ttft_s": statistics.fmean(ttft) if ttft else 0.0, "p50_ttft_s": _p50(ttft),
            "p99_ttft_s": _p99(ttft),
            "mean_latency_s": statistics.fmean(latency) if latency else 0.0,
            "p50_latency_s": _p50(latency), "p99_latency_s": _p99(latency),
            # the longest any call of the client waited to be admitted (starvation shows here, C6)
            "max_wait_s": max((r.admitted - r.arrival for r in mine if r.admitted is not None), default=0.0),
        }
        if w.slo_for(c) is not None:  # (None: every request of the client was refused by the context)
            judged = targets.summary(mine, w.slo_for)
            per_client[c]["slo_attainment"] = judged["attainment"] if judged["slos"] else None
        programs = _programs(mine)
        if programs:
            per_client[c].update(programs=len(programs), program_p50_s=_p50(programs), program_p99_s=_p99(programs))
    curve = F.abs_diff_curve(reqs, clients, w.duration_s, cost)
    diff = F.service_difference(reqs, clients, cost, horizon=w.duration_s)
    return {
        "workload": w.name, "policy": policy, "placement": placement, "mode": out.mode, "backends": out.backends,
        "cost": cost.name, "requests": len(reqs), "makespan_s": out.makespan,
        "throughput_tokens_per_s": tokens / out.makespan if out.makespan else 0.0,
        "throughput_at_horizon_tokens_per_s": out.horizon_tokens / w.duration_s if w.duration_s else 0.0,
        "fairness": {**diff, "max_abs_cum_diff": max((d for _, d in curve), default=0.0),
                     "abs_cum_diff_curve": curve,
                     "jain": F.jain([service[c] / w.weights.get(c, 1.0) for c in clients])},
        "clients": per_client,
        "cache": _cache(reqs),
        "slo": _slo(w, reqs, out.ttft_predictions),
        "throttled": {"interactions": 0, "wasted_tokens": 0},
    }


def _slo(w, reqs, predictions=None) -> dict[str, Any]:
    """Attainment over every request with targets, per priority band when the workload has bands, and how well
    the calibrated p90 TTFT predictions covered the first tokens (gateway mode)."""
    doc = targets.summary(reqs, w.slo_for)
    if predictions is not None:
        doc["ttft_p90"] = predictions.report()
    if w.bands:
        from fairgate.accounting.slo import BANDS

        doc["by_band"] = {name: targets.summary([r for r in reqs if w.bands.get(r.client, 1) == b], w.slo_for)
                          for b, name in enumerate(BANDS) if any(w.bands.get(c, 1) == b for c in w.clients)}
    return doc


def _cache(reqs) -> dict[str, Any]:
    """Prefill tokens served from a prefix cache / all prompt tokens admitted (SGLang's convention)."""
    admitted = [r for r in reqs if r.admitted is not None]
    prompt = sum(r.prompt_len for r in admitted)
    cached = sum(r.cached for r in admitted)
    return {"hit_rate": cached / prompt if prompt else 0.0, "cached_tokens": cached, "prompt_tokens": prompt}


def write(doc: dict[str, Any], out: SimOutcome, cost: CostFunction, directory: Path) -> list[Path]:
    """metrics.json and the paper's figures: service per client, accumulated difference, response time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "metrics.json"]
    paths[0].write_text(json.dumps(doc, indent=2))
    w, clients = out.workload, out.workload.clients
    shown = clients if len(clients) <= 8 else sorted(clients, key=lambda c: -doc["clients"][c]["requests"])[:8]
    title = f"{w.name} · {doc['policy']} · {doc['mode']} × {doc['backends']}"

    fig, ax = plt.subplots(figsize=(7, 4))
    for c, pts in F.service_curves(out.requests, shown, w.duration_s, cost).items():
        ax.plot([x for x, _ in pts], [y for _, y in pts], label=c)
    ax.set(xlabel="time (s)", ylabel="service (weighted tokens/s, 60 s window)", title=title)
    ax.legend(fontsize=7)
    paths.append(directory / "service.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")

    fig, ax = plt.subplots(figsize=(7, 4))
    curve = doc["fairness"]["abs_cum_diff_curve"]
    ax.plot([x for x, _ in curve], [y for _, y in curve], marker="o")
    ax.set(xlabel="time (s)", ylabel="max − min accumulated service", title=title)
    paths.append(directory / "abs_diff.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")

    fig, ax = plt.subplots(figsize=(7, 4))
    for c, pts in F.response_curves(out.requests, shown, w.duration_s).items():
        ax.plot([x for x, y in pts if y is not None], [y for _, y in pts if y is not None], label=c)
    ax.set(xlabel="time (s)", ylabel="mean time to first token (s)", title=title)
    ax.legend(fontsize=7)
    paths.append(directory / "response_time.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close("all")
    return paths
