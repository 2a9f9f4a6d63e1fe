"""A workload from the gateway's own usage log (`fairgate plan --from-usage`): each request that was served, at
its arrival time, with its prompt and output lengths, its app and stage, its tenant (the fairness key it was
queued under) as the client. The lengths are the log's own, request by request, so their distributions per app
and stage and the arrival pattern are the platform's, not means. Pure: rows are plain dicts."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Iterable

from fairgate.sim.targets import Slo
from fairgate.sim.workload import SimRequest, Workload, WorkloadError


def when(value: Any) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(str(value))


def served_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows a workload replays, in arrival order: served (``ok``), with some prompt and some output. (A
    request cut mid-stream, cancelled or refused is not replayed: its output was not its length.)"""
    served = sorted((r for r in rows if r.get("status") == "ok" and (r.get("completion_tokens") or 0) > 0
                     and (r.get("prompt_tokens") or 0) > 0), key=lambda r: when(r["arrival"]))
    if not served:
        raise WorkloadError("the usage log holds no served request in that range")
    return served


def client_of(r: dict[str, Any]) -> str:
    """The tenant a row was queued as: its fairness key (older rows: app/user)."""
    return r.get("fairness_key") or f"{r['app']}/{r.get('user') or '-'}"


def log_slos(rows: Iterable[dict[str, Any]]) -> dict[str, Slo]:
    """Each tenant's latency targets, as its last row with an SLO class carried them (an app's class is the
    same for all its users; a class changed in the range counts as it was at the end)."""
    slos: dict[str, Slo] = {}
    for r in rows:
        ttft, atgt = r.get("slo_ttft_ms"), r.get("slo_atgt_ms")
        if ttft is not None or atgt is not None:
            slos[client_of(r)] = Slo(math.inf if ttft is None else ttft / 1000,
                                     math.inf if atgt is None else atgt / 1000)
    return slos


def workload_from_log(rows: Iterable[dict[str, Any]], name: str = "usage") -> Workload:
    """The served rows (``served_rows``) as requests, times from the first arrival, each in its interaction
    (the last of an interaction's rows is its final stage), each at its logged arrival (open loop). A row of n choices or batched prompts is replayed
    as one request of its whole output."""
    served = served_rows(rows)
    t0 = when(served[0]["arrival"])
    reqs, apps, last, interactions = [], {}, {}, {}
    for i, r in enumerate(served):
        client = client_of(r)
        apps[client] = r["app"]
        interaction = f"{client}|{r['interaction']}" if r.get("interaction") else ""
        reqs.append(SimRequest(i, client, (when(r["arrival"]) - t0).total_seconds(), int(r["prompt_tokens"]),
                               int(r["completion_tokens"]), app=r["app"], user=r.get("user") or "",
                               stage=int(r.get("stage") or 0),
                               interaction=interaction))
        if interaction:
            if interaction in last:
                reqs[last[interaction]].final = False
            last[interaction] = i
            interactions.setdefault(interaction, [[]])[0].append(i)  # (open loop: what a refusal cancels)
    duration = max(reqs[-1].arrival, 1.0)
    return Workload(name, duration, reqs, {}, apps, interactions=interactions, open_loop=True)
