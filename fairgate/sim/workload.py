"""Workloads: clients with arrival processes and token lengths (YAML or built-in), or a replayed trace.

Arrival generators follow the VTC artifact's `fair_bench/trace.py` (docs/simulator/index.md#arrivals):
``uniform`` is evenly spaced with a random phase, ``onoff`` drops arrivals in odd periods, ``poisson`` has
exponential gaps, ``ramp`` spaces arrivals by the inverse of a linearly changing rate; ``phases`` chains any
of them in time.

Interactions (FairServe §3.3): a client with ``interaction: {stages: [...], think_s}`` starts one interaction
per arrival; each stage is ``calls`` parallel calls (fan-out) with their own token lengths, and the next stage
is sent ``think_s`` after the last call of the previous one finishes. Only first calls have a static arrival;
the simulator releases the rest as stages finish. ``timeout_s`` gives up calls (and their interactions) not answered in time.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from fairgate.sim import programs
from fairgate.accounting.slo import BANDS
from fairgate.sim.targets import Slo, SloError, parse as parse_slo

TRACE_DIR = Path(__file__).resolve().parent / "traces"


@dataclass(slots=True)
class SimRequest:
    id: int
    client: str
    arrival: float
    prompt_len: int
    output_len: int
    app: str = ""
    user: str = ""  # the user it came from, where known (replay: its limits, sim/limits.py)
    interaction: str = ""  # "" for a one-call interaction
    stage: int = 0
    parent: int = -1  # a call sent when this one finishes (a ToT branch after its own parent), else -1
    system_len: int = 0  # of prompt_len, the system prompt (FairServe's L_S)
    final: bool = True  # the last stage of its interaction
    blocks: list[int] | None = None  # prompt block hashes (workloads with content: sim/programs.py)
    output_blocks: list[int] | None = None  # prompt + output block hashes (cached when it finishes)
    output_segment: tuple[int, int] = (0, 0)
    # filled by the simulator
    rejected: bool = False
    throttle_reason: str | None = None
    cancelled: bool = False  # never sent: its interaction was throttled or abandoned first
    abandoned: bool = False  # the client gave up on it (timeout) while it waited or ran
    generated: int = 0
    dispatched: float | None = None  # left the gateway queue (gateway mode) / admitted (engine mode)
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    backend: int = 0
    cached: int = 0  # prompt tokens served from the prefix cache


@dataclass
class Workload:
    name: str
    duration_s: float
    requests: list[SimRequest]
    weights: dict[str, float] = field(default_factory=dict)
    apps: dict[str, str] = field(default_factory=dict)
    engine: str | None = None
    # interaction id → its stages, each a list of request ids; think time between stages
    interactions: dict[str, list[list[int]]] = field(default_factory=dict)
    think_s: float = 0.0
    timeout_s: float | None = None  # a client gives up a call (and its interaction) unanswered this long
    history: list["SimRequest"] = field(default_factory=list)  # a warm-up slice: statistics and limits
    abusive: set[str] = field(default_factory=set)  # clients the scenario made abusive (for reports)
    limits: dict[str, Any] = field(default_factory=dict)  # {user_rpm, app_rpm: {app: n}} for OIT and RPM
    slo: Slo | None = None  # every client's latency targets (sim/targets.py), unless
    slos: dict[str, Slo] = field(default_factory=dict)  # a client names its own
    bands: dict[str, int] = field(default_factory=dict)  # client → its priority band (accounting/slo.py BANDS)
    min_shares: dict[int, float] = field(default_factory=dict)  # band → its minimum share of dispatches
    speeds: list[float] = field(default_factory=list)  # gateway mode: engine k runs speeds[k % len] × the profile
    open_loop: bool = False  # every call arrives at its own time, not when its stage before ends (a log's replay)

    def slo_for(self, client: str) -> Slo | None:
        return self.slos.get(client, self.slo)

    @property
    def clients(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.requests:
            seen.setdefault(r.client, None)
        return list(seen)


class WorkloadError(ValueError):
    pass


def _length(spec: Any, rng: random.Random) -> int:
    if isinstance(spec, (int, float)):
        return int(spec)
    if isinstance(spec, dict) and spec.get("dist") == "uniform":
        return rng.randint(int(spec["low"]), int(spec["high"]))
    raise WorkloadError(f"a length is a number or {{dist: uniform, low, high}}, not {spec!r}")


def arrivals(spec: dict[str, Any], start: float, end: float, rng: random.Random) -> list[float]:
    kind = spec.get("kind", "uniform")
    if kind == "phases":
        out: list[float] = []
        t0 = start
        for phase in spec["phases"]:
            t1 = min(end, float(phase["until"]))
            out += arrivals(phase, t0, t1, rng)
            t0 = t1
        return out
    if kind == "ramp":
        r0, r1 = float(spec["rate_start"]), float(spec["rate_end"])
        out, t = [], start
        while True:
            rate = r0 + (r1 - r0) * (t - start) / max(end - start, 1e-9)
            t += 1.0 / rate
            if t >= end:
                return out
            out.append(t)
    rate = float(spec["rate"])
    if rate <= 0:
        return []
    if kind == "poisson":
        out, t = [], start
        while (t := t + rng.expovariate(rate)) < end:
            out.append(t)
        return out
    if kind in ("uniform", "onoff"):
        n = int(rate * (end - start))
        phase = rng.random() / rate
        out = [start + phase + k / rate for k in range(n)]
        if kind == "onoff":
            period = float(spec.get("period_s", 60))
            out = [t for t in out if int(t // period) % 2 == 0]
        return out
    raise WorkloadError(f"unknown arrival kind {kind!r}")


def _client_requests(c: dict[str, Any], duration: float, rng: random.Random, out: list[SimRequest],
                     interactions: dict[str, list[list[int]]], content: "programs.Content") -> None:
    """Append a client's calls (ids are list positions, renumbered after sorting)."""
    cid, app = str(c["id"]), str(c.get("app", c["id"]))
    shape = c.get("interaction")
    times = arrivals(c.get("arrival", {}), 0.0, duration, rng)
    if programs.has_program(c):
        if shape:
            raise WorkloadError(f"client {cid}: interaction: cannot be combined with prefix/conversation/tree")

        def make(t: float, segs, output: int, stage: int, x: str, final: bool,
                 parent: SimRequest | None = None) -> SimRequest:
            out_seg = (content.fresh(), max(1, output))
            r = SimRequest(len(out), cid, t, max(1, sum(n for _, n in segs)), max(1, output), app, interaction=x,
                           stage=stage, final=final, parent=parent.id if parent is not None else -1,
                           blocks=programs.hashes(segs),
                           output_blocks=programs.hashes(segs + [out_seg]), output_segment=out_seg)
            if x:
                stages = interactions.setdefault(x, [])
                while len(stages) <= stage:
                    stages.append([])
                stages[stage].append(len(out))
            out.append(r)
            return r

        programs.client_programs(c, times, rng, content, _length, make)
        return
    for k, t in enumerate(times):
        if not shape:
            out.append(SimRequest(0, cid, t, _length(c.get("input_tokens", 256), rng),
                                  max(1, _length(c.get("output_tokens", 256), rng)), app,
                                  system_len=_length(c.get("system_tokens", 0), rng)))
            continue
        x = f"{cid}#{k}"
        stages = shape["stages"]
        interactions[x] = []
        for j, stage in enumerate(stages):
            ids = []
            for _ in range(int(stage.get("calls", 1))):
                system = _length(stage.get("system_tokens", c.get("system_tokens", 0)), rng)
                prompt = system + _length(stage.get("input_tokens", c.get("input_tokens", 256)), rng)
                ids.append(len(out))
                out.append(SimRequest(0, cid, t if j == 0 else math.inf, prompt,
                                      max(1, _length(stage.get("output_tokens", c.get("output_tokens", 256)), rng)),
                                      app, interaction=x, stage=j, system_len=system, final=j == len(stages) - 1))
            interactions[x].append(ids)


def finalize(reqs: list[SimRequest], interactions: dict[str, list[list[int]]]) -> list[SimRequest]:
    """Sort by arrival (calls of later stages last) and renumber ids = positions, in the interactions too."""
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival, reqs[i].client, i))
    new_id = {old: new for new, old in enumerate(order)}
    out = [reqs[i] for i in order]
    for i, r in enumerate(out):
        r.id = i
        if r.parent >= 0:
            r.parent = new_id[r.parent]
    for x, stages in interactions.items():
        interactions[x] = [[new_id[i] for i in ids] for ids in stages]
    return out


def from_dict(data: dict[str, Any], name: str = "workload", base: Path | None = None) -> Workload:
    seed = int(data.get("seed", 42))
    duration = float(data.get("duration_s", 600))
    rng = random.Random(seed)
    try:
        default = parse_slo(data.get("slo"))
        slos = {str(c["id"]): slo for c in data.get("clients") or []
                if (slo := parse_slo(c.get("slo"), f"client {c['id']}: slo")) is not None}
    except SloError as e:
        raise WorkloadError(str(e)) from None
    bands, min_shares = _bands(data.get("clients") or [])
    speeds = parse_speeds(data.get("speeds"))
    if "trace" in data:
        w = _trace(data["trace"], name, duration, seed, base, data.get("engine"))
        w.slo, w.speeds = default, speeds
        return w
    reqs: list[SimRequest] = []
    interactions: dict[str, list[list[int]]] = {}
    weights, apps = {}, {}
    content = programs.Content()
    for c in data.get("clients") or []:
        cid = str(c["id"])
        weights[cid] = float(c.get("weight", 1))
        apps[cid] = str(c.get("app", cid))
        _client_requests(c, duration, rng, reqs, interactions, content)
    if not reqs:
        raise WorkloadError("the workload has no requests (give clients: or trace:)")
    reqs = finalize(reqs, interactions)
    think = max((float((c.get("interaction") or c.get("conversation") or {}).get("think_s", 0))
                 for c in data["clients"]), default=0.0)
    return Workload(name, duration, reqs, weights, apps, data.get("engine"), interactions, think,
                    data.get("timeout_s"), abusive={str(c["id"]) for c in data["clients"] if c.get("abusive")},
                    limits=data.get("limits") or {}, slo=default, slos=slos, bands=bands, min_shares=min_shares,
                    speeds=speeds)


def parse_speeds(spec: Any) -> list[float]:
    """``speeds: [1, 1, 0.5, 0.5]``: each engine's speed against the profile (a heterogeneous pool)."""
    if spec is None:
        return []
    if not isinstance(spec, list) or not spec or len(spec) > 4096 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0.01 <= v <= 100 for v in spec):
        raise WorkloadError(f"speeds: a list of numbers in [0.01, 100], one per engine, got {spec!r}")
    return [float(v) for v in spec]


def _bands(clients: list[dict[str, Any]]) -> tuple[dict[str, int], dict[int, float]]:
    """Each client's ``band:`` (interactive | standard | batch) and its band's ``min_share:``, if given."""
    bands, shares = {}, {}
    for c in clients:
        band, share = c.get("band", "standard"), c.get("min_share")
        if band not in BANDS:
            raise WorkloadError(f"client {c['id']}: band is one of {', '.join(BANDS)}, not {band!r}")
        bands[str(c["id"])] = BANDS.index(band)
        if share is not None:
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
                raise WorkloadError(f"client {c['id']}: min_share is a fraction in (0, 1)")
            shares[BANDS.index(band)] = max(shares.get(BANDS.index(band), 0.0), float(share))
    if all(b == BANDS.index("standard") for b in bands.values()) and not shares:
        return {}, {}
    return bands, shares


def _trace(spec: dict[str, Any], name: str, duration: float, seed: int, base: Path | None,
           engine: str | None) -> Workload:
    path = Path(spec["path"])
    for candidate in (path, (base or Path.cwd()) / path, TRACE_DIR / path.name):
        if candidate.exists():
            path = candidate
            break
    else:
        raise WorkloadError(f"trace not found: {spec['path']}")
    fmt = spec.get("format", "vtc")
    rows: list[tuple[float, str, int, int]] = []
    blocks: dict[int, list[int]] = {}  # row → prompt block hashes (Mooncake's 512-token block ids)
    if fmt == "vtc":
        with path.open() as f:
            for r in csv.DictReader(f):
                rows.append((float(r["req_time_s"]), r["client"].rsplit("-", 1)[-1], int(r["prompt_len"]),
                             int(r["output_len"])))
    else:
        rng = random.Random(seed)
        n_clients = int(spec.get("clients", 10))
        shares = [1 / (k + 1) for k in range(n_clients)]  # Zipf-like skew, seeded draw per request
        limit = spec.get("limit")
        if fmt == "azure":
            with path.open() as f:
                for r in csv.DictReader(f):
                    rows.append((r["TIMESTAMP"], "", int(r["ContextTokens"]), int(r["GeneratedTokens"])))
            from datetime import datetime

            t0 = datetime.fromisoformat(rows[0][0][:26])
            rows = [((datetime.fromisoformat(t[:26]) - t0).total_seconds(), c, p, o) for t, c, p, o in rows]
        elif fmt == "mooncake":
            with path.open() as f:
                for line in f:
                    r = json.loads(line)
                    n_in = int(r["input_length"])
                    ids = r.get("hash_ids") or []
                    segs = [(int(h) + 1, min(512, n_in - 512 * k)) for k, h in enumerate(ids) if n_in > 512 * k]
                    blocks[len(rows)] = programs.hashes(segs)
                    rows.append((r["timestamp"] / 1000.0, "", n_in, int(r["output_length"])))
        else:
            raise WorkloadError(f"unknown trace format {fmt!r}: vtc | azure | mooncake")
        rows = [(t, f"c{rng.choices(range(n_clients), shares)[0]}", p, o) for t, _, p, o in rows[:limit]]
    order = sorted((r for r in enumerate(rows) if r[1][0] <= duration), key=lambda r: r[1])
    reqs = [SimRequest(i, c, t, max(1, p), max(1, o), c, blocks=blocks.get(k))
            for i, (k, (t, c, p, o)) in enumerate(order)]
    return Workload(name, duration, reqs, {}, {}, engine)
