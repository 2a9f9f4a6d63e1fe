"""Historical token statistics per (app, stage): FairServe's N̄_I, N̄_S, N̄_O (§4.1, Eq. 2;
docs/policies/fairserve.md#statistics), and request-rate histories from which throttling limits are suggested
(§4.2, ambiguity A7).

Every observation is kept with *forward decay* (Cormode et al., ICDE'09): an observation at time t weighs
2^((t − landmark) / half_life). Older observations weigh exponentially less relative to newer ones, and the
state is a set of plain sums, so two replicas' observations merge by addition (one Redis hash, HINCRBYFLOAT)
and a snapshot is just the sums. Each distribution keeps a decayed weighted sum (the mean) and a decayed
histogram on log-spaced buckets (4 per doubling, ≤ 19 % relative error), for the median or a high percentile.

Fallbacks for an unseen (app, stage): the app over all its stages, then all traffic, then a fixed default.
Pure: time is passed in.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

CLASSES = ("input", "system", "output")
APP_LEVEL = -1  # the stage key of an app's all-stage statistics
GLOBAL = ""  # the app key of all traffic
BUCKETS_PER_DOUBLING = 4
REBASE_EXPONENT = 512.0  # rebase the landmark before 2^x nears float overflow (2^1024)
STATISTICS = ("mean", "median", "p90", "p95", "p99", "max")


def bucket(x: float) -> int:
    return int(math.floor(BUCKETS_PER_DOUBLING * math.log2(x + 1.0)))


def bucket_value(b: int) -> float:
    """A bucket's representative value: its geometric middle."""
    return 2.0 ** ((b + 0.5) / BUCKETS_PER_DOUBLING) - 1.0


@dataclass
class Dist:
    """One decayed distribution of token counts (weights are forward-decayed)."""

    sum_wx: float = 0.0
    hist: dict[int, float] = field(default_factory=dict)

    def add(self, x: float, w: float, b: int) -> None:
        """An observation ``x`` of weight ``w``, in its bucket ``b`` (``bucket(x)``, computed once by the caller
        for the three entries an observation goes to)."""
        self.sum_wx += w * x
        self.hist[b] = self.hist.get(b, 0.0) + w

    def scale(self, f: float) -> None:
        self.sum_wx *= f
        for b in self.hist:
            self.hist[b] *= f

    def quantile(self, q: float, total: float) -> float:
        if total <= 0 or not self.hist:
            return 0.0
        target, acc = q * total, 0.0
        for b in sorted(self.hist):
            acc += self.hist[b]
            if acc >= target:
                return bucket_value(b)
        return bucket_value(max(self.hist))


@dataclass
class Entry:
    """The statistics of one (app, stage): total weight, raw count, and one distribution per token class."""

    w: float = 0.0
    n: int = 0  # raw observations (for the minimum-sample fallback)
    dists: dict[str, Dist] = field(default_factory=lambda: {c: Dist() for c in CLASSES})

    def value(self, cls: str, statistic: str) -> float:
        d = self.dists[cls]
        if self.w <= 0:
            return 0.0
        if statistic == "mean":
            return d.sum_wx / self.w
        if statistic == "max":
            return d.quantile(1.0, self.w)
        q = 0.5 if statistic == "median" else float(statistic[1:]) / 100.0
        return d.quantile(q, self.w)


@dataclass(frozen=True, slots=True)
class Expected:
    """N̄_I, N̄_S, N̄_O of one (app, stage), and where it came from (stage | app | global | default)."""

    input: float
    system: float
    output: float
    source: str


class AppStats:
    """Decayed per-(app, stage) token statistics with fallbacks. ``statistic``: mean (the paper's Eq. 2),
    median, p90/p95/p99, or max (§4.3's "maximum token limits" reading, ambiguity A2)."""

    def __init__(self, half_life_s: float = 86_400.0, statistic: str = "mean", min_samples: int = 5,
                 default: tuple[float, float, float] = (512.0, 0.0, 128.0), landmark: float = 0.0,
                 max_stages_per_app: int = 16):
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}")
        if half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        self.half_life_s, self.statistic, self.min_samples = half_life_s, statistic, min_samples
        self.default = default
        self.landmark = landmark
        # Statistics are kept for the stages an app really uses: past this many, the stage with the least
        # decayed weight (used least, and least lately) is dropped and its calls fall back to the app's own.
        self.max_stages_per_app = max_stages_per_app
        self.entries: dict[tuple[str, int], Entry] = defaultdict(Entry)
        self.version = 0  # bumps on every change (callers cache derived weights by it)

    # -- learning ------------------------------------------------------------------------------------
    def weight_at(self, now: float) -> float:
        exponent = (now - self.landmark) / self.half_life_s
        if exponent > REBASE_EXPONENT:
            self.rebase(now)
            exponent = 0.0
        return 2.0 ** exponent

    def rebase(self, now: float) -> None:
        f = 2.0 ** (-(now - self.landmark) / self.half_life_s)
        for e in self.entries.values():
            e.w *= f
            for d in e.dists.values():
                d.scale(f)
        self.landmark = now

    def observe(self, app: str, stage: int, input_tokens: int, system_tokens: int, output_tokens: int,
                now: float) -> None:
        """One finished call: ``input_tokens`` excludes the system prompt (counted in ``system_tokens``)."""
        w = self.weight_at(now)
        # each class's value and bucket once, added to the stage's, the app's and all traffic's entries
        xs = [(cls, x, bucket(x)) for cls, x in zip(CLASSES, (max(0.0, float(input_tokens)),
                                                               max(0.0, float(system_tokens)),
                                                               max(0.0, float(output_tokens))))]
        new_stage = (app, stage) not in self.entries
        for key in ((app, stage), (app, APP_LEVEL), (GLOBAL, APP_LEVEL)):
            e = self.entries[key]
            e.w += w
            e.n += 1
            for cls, x, b in xs:
                e.dists[cls].add(x, w, b)
        if new_stage:
            self._cap(app, keep=stage)
        self.version += 1

    def _cap(self, app: str, keep: int | None = None) -> None:
        stages = [k for k in self.entries if k[0] == app and k[1] != APP_LEVEL and k[1] != keep]
        while len(stages) + (keep is not None) > self.max_stages_per_app and stages:
            lightest = min(stages, key=lambda k: (self.entries[k].w, k[1]))
            del self.entries[lightest]
            stages.remove(lightest)

    # -- reading -------------------------------------------------------------------------------------
    def expected(self, app: str, stage: int) -> Expected:
        for key, source in (((app, stage), "stage"), ((app, APP_LEVEL), "app"), ((GLOBAL, APP_LEVEL), "global")):
            e = self.entries.get(key)
            if e is not None and e.n >= self.min_samples:
                return Expected(*(e.value(c, self.statistic) for c in CLASSES), source)
        return Expected(*self.default, "default")

    def interaction_calls(self, app: str, share: float = 0.01) -> int | None:
        """How many calls all but ``share`` of the app's interactions of two calls or more make: the first stage
        that fewer than that share of those reaching the second (stage 1) reach (stage s is an interaction's
        (s+1)-th call, as the gateway counts them where the client names no stage; where it names them, the
        stages it names). Stage 0 is not the base: calls outside any interaction are stage 0 too. None while
        the second stage has fewer than ``min_samples`` calls, or if the stages kept do not reach that far.
        O(stages kept)."""
        second = self.entries.get((app, 1))
        if second is None or second.n < self.min_samples:
            return None
        s = 2
        while (e := self.entries.get((app, s))) is not None and e.w > share * second.w:
            s += 1
        return s if s < self.max_stages_per_app else None

    def rows(self) -> list[dict]:
        """Every (app, stage) with its sample count and expected tokens, for `fairgate admin stats`."""
        out = []
        for (app, stage), e in sorted(self.entries.items()):
            out.append({"app": app or "*", "stage": "*" if stage == APP_LEVEL else stage, "samples": e.n,
                        **{f"{c}_{s}": round(e.value(c, s), 1) for c in CLASSES for s in ("mean", "p95")}})
        return out

    # -- persistence (SQL snapshot, Redis) -------------------------------------------------------------
    def dump(self) -> dict:
        return {"landmark": self.landmark, "half_life_s": self.half_life_s,
                "entries": [{"app": a, "stage": s, "w": e.w, "n": e.n,
                             "dists": {c: {"sum_wx": d.sum_wx, "hist": {str(b): v for b, v in d.hist.items()}}
                                       for c, d in e.dists.items()}}
                            for (a, s), e in self.entries.items()]}

    def load(self, state: dict) -> None:
        """Replace the statistics with a dump (rebased onto this object's decay if half-lives differ)."""
        self.entries.clear()
        self.landmark = float(state.get("landmark", 0.0))
        for row in state.get("entries", ()):
            e = Entry(float(row["w"]), int(row["n"]))
            for c, d in row["dists"].items():
                e.dists[c] = Dist(float(d["sum_wx"]), {int(b): float(v) for b, v in d["hist"].items()})
            self.entries[(row["app"], int(row["stage"]))] = e
        by_app: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for k in self.entries:
            if k[1] != APP_LEVEL:
                by_app[k[0]].append(k)
        for stages in by_app.values():
            stages.sort(key=lambda k: (-self.entries[k].w, k[1]))
            for k in stages[self.max_stages_per_app:]:
                del self.entries[k]
        self.version += 1


# -- request-rate histories and suggested limits (OIT's T_user and T_app) ------------------------------------
# (the limits' quantile and window: docs/policies/fairserve.md#ambiguity-a7)
def quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def per_window_counts(arrivals: Iterable[tuple[float, str, str]], window_s: float = 60.0
                      ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Requests per window (user-active and app-active windows only) from (time, user, app) arrivals."""
    users: dict[tuple[str, int], int] = defaultdict(int)
    apps: dict[tuple[str, int], int] = defaultdict(int)
    for t, user, app in arrivals:
        k = int(t // window_s)
        users[(user, k)] += 1
        apps[(app, k)] += 1
    by_user: dict[str, list[int]] = defaultdict(list)
    by_app: dict[str, list[int]] = defaultdict(list)
    for (u, _), n in users.items():
        by_user[u].append(n)
    for (a, _), n in apps.items():
        by_app[a].append(n)
    return dict(by_user), dict(by_app)


@dataclass(frozen=True, slots=True)
class SuggestedLimits:
    user_rpm: int  # T^r_g: one limit for every user, a high percentile of users' per-minute counts
    app_rpm: dict[str, int]  # T^r_a: each app's high percentile of its per-minute counts
    user_p: dict[str, float]  # each user's own high percentile (for `admin stats`)
    q: float


def suggest_limits(arrivals: Iterable[tuple[float, str, str]], q: float = 0.99, window_s: float = 60.0,
                   app_headroom: float = 1.0) -> SuggestedLimits:
    """Limits at the ``q`` quantile of normal behaviour (Fig. 8c: throttle only users well above their normal
    range): the global user limit over all (user, active minute) counts; each app's over its active minutes,
    times ``app_headroom`` (an app limit is for app-wide floods, not for its busiest normal minute)."""
    by_user, by_app = per_window_counts(arrivals, window_s)
    every = [n for counts in by_user.values() for n in counts]
    return SuggestedLimits(
        user_rpm=max(1, math.ceil(quantile(every, q))),
        app_rpm={a: max(1, math.ceil(quantile(c, q) * app_headroom)) for a, c in by_app.items()},
        user_p={u: quantile(c, q) for u, c in by_user.items()}, q=q)
