"""One scheduling decision, for every policy the gateway runs, as the waiting queues deepen: the cost a tenant
filling its queue could put on everyone else's dispatch (the target: at most 100 µs with 1,000
backlogged clients × 100 waiting × 8 backends, and within 1.5× of the cost with 2 waiting).

    .venv/bin/python bench/decisions.py [--clients 1000] [--backends 8] [--waiting 2 100] [--decisions 3000]

A decision is what the dispatcher does per dispatch (bench/scheduler.py, bench/locality.py): the pick, the
pop, one generated token, the finish, and the client's next request arriving — for DLPM also the prefix
index's insert of the dispatched prompt; ``d2lpm`` adds D²LPM's routing of the arrival over the backends.
DLPM's first ``--warm`` decisions are not timed: they match every queue on every backend once, and each
client's prefix lands on the backends that did not hold it (a landing re-matches that client's window once:
O(window), whatever the depth of its queue); ``--warm 0`` times them too.
"""

from __future__ import annotations

import argparse

from locality import d2lpm_route, dlpm_decision
from scheduler import decision_cost, fairserve_decision_cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--backends", type=int, default=8)
    ap.add_argument("--waiting", type=int, nargs="+", default=[2, 100])
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--warm", type=int, default=1000)
    a = ap.parse_args()
    policies = {
        "vtc": lambda w: decision_cost(a.clients, a.decisions, w),
        "wsc": lambda w: fairserve_decision_cost(a.clients, a.decisions, w, policy="wsc"),
        "fairserve": lambda w: fairserve_decision_cost(a.clients, a.decisions, w),
        "dlpm": lambda w: dlpm_decision(a.clients, a.backends, w, a.decisions, a.warm)[0],
        "d2lpm": lambda w: dlpm_decision(a.clients, a.backends, w, a.decisions, a.warm)[0]
        + d2lpm_route(a.clients, a.backends, a.decisions),
    }
    print(f"one decision, {a.clients:,} backlogged clients, {a.backends} backends (µs):")
    print(f"{'policy':10s}" + "".join(f"{w:>10} waiting" for w in a.waiting) + "   deepest / shallowest")
    for name, cost in policies.items():
        us = [cost(w) * 1e6 for w in a.waiting]
        print(f"{name:10s}" + "".join(f"{u:18.1f}" for u in us) + f"   {us[-1] / us[0]:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
