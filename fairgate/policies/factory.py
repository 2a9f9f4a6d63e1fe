"""Build scheduler objects by name: the simulator and the live gateway make theirs here."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from fairgate.accounting.app_stats import AppStats
from fairgate.accounting.cost import CostFunction
from fairgate.accounting.predictor import EMAPredictor
from fairgate.policies.aladdin import Aladdin
from fairgate.policies.dlpm import DLPM, LPM
from fairgate.policies.interactions import MemoryInteractions
from fairgate.policies.locality import ClientRoundRobin, DoubleQ, PrefixPlacement
from fairgate.policies.oit import OIT
from fairgate.policies.placement import PLACEMENTS, LeastLoad, Placement, RoundRobin
from fairgate.policies.power_of_two import PowerOfTwo
from fairgate.policies.scheduler import FCFS, RPM, Scheduler
from fairgate.policies.vtc import VTC
from fairgate.policies.vtc_variants import LCF, VTCPredict
from fairgate.policies.two_level import TwoLevel
from fairgate.policies.windows import MemoryWindows
from fairgate.policies.wsc import WSC, TokenWeights

SIM_POLICIES = ("fcfs", "rpm", "lcf", "vtc", "vtc-predict", "vtc-oracle", "vtc-range", "wsc", "fairserve", "lpm",
                "dlpm")
# oracle and ±50% read the true output length
LIVE_POLICIES = ("fcfs", "rpm", "lcf", "vtc", "vtc-predict", "wsc", "fairserve", "lpm", "dlpm")
# parameters ``--set NAME=VALUE`` may give, by policy or placement
POLICY_PARAMS = {"dlpm": ("quantum", "window"), "lpm": ("window",)}
PLACEMENT_PARAMS = {"d2lpm": ("client_quantum",), "prefix": ("ratio",), "aladdin": ("gamma", "theta", "pack"),
                    "power-of-two": ("seed",)}

Limit = Callable[[str], "int | None"]


@dataclass
class FairServeConfig:
    """WSC's token weights and charging, OIT's limits and window (docs/policies/fairserve.md#parameters)."""

    alpha: float = 1.0
    beta: float = 2.0
    gamma: float = 1.0
    charge: str = "admit"  # admit (expected cost at admission, settled at the finish) | finish (the paper's)
    window_s: float = 60.0
    interaction_ttl_s: float = 300.0  # an interaction idle this long is abandoned
    max_interaction_calls: int = 32  # an interaction's calls that are continuations, at most (WSC)
    user_limit: Limit = lambda _u: None  # T^r_g, per user (a global value or per-user overrides)
    app_limit: Limit = lambda _a: None  # T^r_a


VTC_FAMILY = ("lcf", "vtc", "vtc-predict", "vtc-oracle", "vtc-range")


def make_scheduler(name: str, cost: CostFunction, weights: Callable[[str], float], *,
                   rpm_limit: int | Callable[[str], int] = 20, seed: int = 0, counters=None,
                   stats: AppStats | None = None, fairserve: FairServeConfig | None = None,
                   interactions=None, windows=None, two_level: bool = False,
                   params: dict[str, float] | None = None) -> Scheduler:
    """``rpm:N`` sets the RPM limit inline; ``vtc-range`` is VTC(±50%) of App. B.3 (simulator only, as is
    ``vtc-oracle``: both read the true output length). ``wsc`` and ``fairserve`` (WSC + OIT) read the
    per-(app, stage) ``stats``; E_i = 1 / weight. ``two_level`` (fairness_key ``app>user``): a VTC-family
    policy over apps, and within each app over its users (``TwoLevel``); other policies are unchanged."""
    if two_level and name in VTC_FAMILY:
        return TwoLevel(lambda: make_scheduler(name, cost, weights, seed=seed), cost, weights, counters)
    if name.startswith("rpm:"):
        name, rpm_limit = "rpm", int(name.split(":", 1)[1])
    if name in ("wsc", "fairserve"):
        fs = fairserve or FairServeConfig()
        oit = None
        if name == "fairserve":
            oit = OIT(fs.user_limit, fs.app_limit, windows if windows is not None else MemoryWindows(fs.window_s))
        s = WSC(stats, weights, tokens=TokenWeights(fs.alpha, fs.beta, fs.gamma), counters=counters,
                interactions=interactions if interactions is not None else MemoryInteractions(fs.interaction_ttl_s),
                charge=fs.charge, oit=oit, max_calls=fs.max_interaction_calls)
        s.name = name
        return s
    params = check_params(name, params or {}, POLICY_PARAMS)
    if name == "dlpm":
        return DLPM(params.get("quantum", 4000.0), weights=weights, window=int(params.get("window", 32)), cost=cost)
    if name == "lpm":
        return LPM(weights=weights, window=int(params.get("window", 32)), cost=cost)
    if name == "fcfs":
        return FCFS(cost, weights)
    if name == "rpm":
        return RPM(rpm_limit, cost, weights)
    if name == "lcf":
        return LCF(cost, weights, counters)
    if name == "vtc":
        return VTC(cost, weights, counters)
    if name == "vtc-predict":
        ema = EMAPredictor()
        return VTCPredict(lambda r: ema.predict(r.client), lambda r, n: ema.observe(r.client, n), cost, weights,
                          counters)
    if name == "vtc-oracle":
        return VTCPredict(lambda r: r.true_output or 0, None, cost, weights, counters)
    if name == "vtc-range":
        rng = random.Random(seed)
        return VTCPredict(lambda r: (r.true_output or 0) * rng.uniform(0.5, 1.5), None, cost, weights, counters)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(SIM_POLICIES)} (rpm:N for a limit)")


def check_params(name: str, params: dict[str, float], known: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """Only parameters the named policy or placement has (a typo is an error, not a silent default)."""
    allowed = known.get(name, ())
    bad = [k for k in params if k not in allowed]
    if bad:
        raise ValueError(f"{name} has no parameter {', '.join(map(repr, bad))}"
                         + (f"; it has {', '.join(allowed)}" if allowed else "; it takes none"))
    return params


def make_placement(name: str, match=None, params: dict[str, float] | None = None, weights=None, *,
                   models=None, lengths=None, progress=None, read_max_tokens: bool = True) -> Placement:
    """``match(view, backend)``: the prompt tokens a backend probably caches (``prefix``, ``d2lpm`` and
    ``aladdin`` use it); ``models(backend)``: its latency model, and ``lengths``: the output lengths seen
    (``aladdin``: the live fits and the gateway's OutputLengths, which it reads and its owner feeds);
    ``progress(request_id)``: the output a running request has streamed (``aladdin``'s ledger);
    ``read_max_tokens``: whether a request's max_tokens caps its predicted length (``aladdin``,
    ``power-of-two``; not in the simulator, whose requests carry their true length there)."""
    params = check_params(name, params or {}, PLACEMENT_PARAMS)
    if name == "prefix":
        return PrefixPlacement(match or (lambda _v, _b: 0), params.get("ratio", 0.5))
    if name == "d2lpm":
        return DoubleQ(match or (lambda _v, _b: 0), params.get("client_quantum", 20_000.0), weights=weights)
    if name == "aladdin":
        if models is None:
            raise ValueError("the aladdin placement needs the backends' latency models")
        return Aladdin(models, match=match, lengths=lengths, progress=progress, read_max_tokens=read_max_tokens,
                       **params)
    if name == "power-of-two":
        return PowerOfTwo(lengths=lengths, read_max_tokens=read_max_tokens, **params)
    simple = {"round-robin": RoundRobin, "least-load": LeastLoad, "jsq": LeastLoad,
              "client-round-robin": ClientRoundRobin}
    if name not in simple:
        raise ValueError(f"unknown placement {name!r}; known: {', '.join(PLACEMENTS)}")
    return simple[name]()
