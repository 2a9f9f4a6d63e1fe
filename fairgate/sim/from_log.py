"""A workload from the gateway's own usage log (`fairgate plan --from-usage`): each request that was served, at
its arrival time, with its prompt and output lengths, its app and stage, its tenant (the fairness key it was
queued under) as the client. The lengths are the log's own, request by request, so their distributions per app
and stage and the arrival pattern are the platform's, not means. Pure: rows are plain dicts."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Iterable

from fairgate.sim.workload import SimRequest, Workload, WorkloadError


def _when(value: Any) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(str(value))


def workload_from_log(rows: Iterable[dict[str, Any]], name: str = "usage") -> Workload:
    """The served rows (``ok``, some output, some prompt) as requests, times from the first arrival. (A request
    cut mid-stream, cancelled or refused is not replayed: its output was not its length. A row of n choices or
    batched prompts is replayed as one request of its whole output.)"""
    served = sorted((r for r in rows if r.get("status") == "ok" and (r.get("completion_tokens") or 0) > 0
                     and (r.get("prompt_tokens") or 0) > 0), key=lambda r: _when(r["arrival"]))
    if not served:
        raise WorkloadError("the usage log holds no served request in that range")
    t0 = _when(served[0]["arrival"])
    reqs, apps = [], {}
    for i, r in enumerate(served):
        client = r.get("fairness_key") or f"{r['app']}/{r.get('user') or '-'}"
        apps[client] = r["app"]
        reqs.append(SimRequest(i, client, (_when(r["arrival"]) - t0).total_seconds(), int(r["prompt_tokens"]),
                               int(r["completion_tokens"]), app=r["app"], stage=int(r.get("stage") or 0)))
    duration = max(reqs[-1].arrival, 1.0)
    return Workload(name, duration, reqs, {}, apps)
