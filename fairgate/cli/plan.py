"""`fairgate plan`: how many workers a workload needs to meet its latency targets, per placement."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import typer

from fairgate.cli.common import TIME_HELP, DatabaseOption, fail, parse_time, with_db
from fairgate.sim.catalog import builtin_names


def plan(workload: str = typer.Option(None, "--workload", help="A YAML file or a built-in: "
                                      f"{', '.join(builtin_names())}."),
         from_usage: str = typer.Option(None, "--from-usage", help="Instead of --workload: the gateway's usage "
                                        f"log from this time on (its requests as they came). {TIME_HELP}"),
         until: str = typer.Option(None, "--until", help="With --from-usage: up to this time."),
         db: str = DatabaseOption,
         slo_ttft: float = typer.Option(None, "--slo-ttft", help="TTFT target (s), arrival to first token, for "
                                        "every client (default: the workload's slo:)."),
         slo_atgt: float = typer.Option(None, "--slo-atgt", help="ATGT target (s), the average time per token "
                                        "after the first."),
         placements: list[str] = typer.Option(["least-load"], "--placement", help="round-robin, least-load, "
                                              "client-round-robin, prefix, d2lpm, aladdin; repeatable."),
         policy: str = typer.Option("vtc", "--policy", help="The gateway's scheduling policy."),
         target: float = typer.Option(0.99, "--target", help="SLO attainment to reach (0 < T ≤ 1)."),
         rates: list[float] = typer.Option(None, "--rate", help="Rescale the workload's arrivals to R "
                                           "requests/s; repeatable (3 or more: Eq. 7's line is fitted)."),
         engine: str = typer.Option(None, "--engine", help="Engine profile (default: the workload's, else "
                                    "a10g-llama2-7b)."),
         max_workers: int = typer.Option(64, "--max-workers", help="Search no further."),
         as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
         out: str = typer.Option(None, "--out", help="Write plan.json and, over three rates or more, "
                                 "workers-vs-rate.png into this directory.")):
    """The fewest workers meeting the target SLO attainment, per placement (gateway-mode simulations: the
    workers doubled until it is met, then bisected)."""
    from fairgate.accounting.cost import make_cost
    from fairgate.sim.catalog import load
    from fairgate.sim.plan import Plan, fewest_workers, plot, rate_of, rescale, scaling, with_slo
    from fairgate.sim.profiles import get_profile
    from fairgate.sim.setup import simulator_for
    from fairgate.sim.slo import Slo
    from fairgate.sim.workload import WorkloadError

    if (workload is None) == (from_usage is None):
        fail("give one of --workload and --from-usage")
    if until is not None and from_usage is None:
        fail("--until goes with --from-usage")
    if not 0 < target <= 1:
        fail("--target is an attainment between 0 (excluded) and 1")
    if not 1 <= max_workers <= 4096:
        fail("--max-workers is between 1 and 4096")
    for name, value in (("--slo-ttft", slo_ttft), ("--slo-atgt", slo_atgt), *(("--rate", r) for r in rates or ())):
        if value is not None and not 0 < value < math.inf:
            fail(f"{name} must be a positive number")
    slo = None
    if slo_ttft is not None or slo_atgt is not None:
        slo = Slo(slo_ttft if slo_ttft is not None else math.inf, slo_atgt if slo_atgt is not None else math.inf)

    if from_usage is not None:
        from fairgate.sim.from_log import workload_from_log
        from fairgate.storage.usage_queries import rows as usage_rows

        logged = with_db(db, lambda s: usage_rows(s, parse_time(from_usage), parse_time(until)))

    def fresh(rate: float | None = None):  # a run fills in its workload (and releases later calls into it):
        w = with_slo(load(workload) if workload is not None else workload_from_log(logged), slo)  # its own
        return rescale(w, rate) if rate is not None else w

    try:
        first = fresh()
        profile = get_profile(engine or first.engine or "a10g-llama2-7b")
        cost = make_cost("weighted")
    except (WorkloadError, ValueError) as e:
        fail(str(e))
    if first.slo is None and not first.slos:
        fail("no latency targets: give --slo-ttft and/or --slo-atgt, or an slo: in the workload")
    rows, runs, started = [], 0, time.monotonic()
    for rate in rates or [None]:
        for placement in placements:
            def run(workers: int, placement=placement, rate=rate):
                nonlocal runs
                runs += 1
                typer.echo(f"  [{runs} runs, {time.monotonic() - started:.0f} s] {placement} × {workers}"
                           + (f" at {rate:g} req/s" if rate is not None else "") + " …", err=True)
                w = fresh(rate)
                simulator_for(w, policy, placement, profile, mode="gateway", backends=workers, cost=cost).run()
                return w

            try:
                workers, attained = fewest_workers(run, target, max_workers)
            except (WorkloadError, ValueError) as e:
                fail(str(e))
            rows.append(Plan(placement, workers, attained, rate_of(fresh(rate))).row())
    fits = {p: scaling([(r["rate"], r["workers"]) for r in rows if r["placement"] == p and r["workers"]])
            for p in placements} if rates and len(rates) >= 3 else {}
    doc = {"rows": rows, "scaling": fits}
    if out is not None:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "plan.json"), "w") as f:
            json.dump(doc, f, indent=1)
        if fits:
            plot(rows, fits, os.path.join(out, "workers-vs-rate.png"))
    if as_json:
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    for r in rows:
        met = (f"{r['workers']} workers" if r["workers"] is not None
               else f"not met with {max_workers} workers")
        typer.echo(f"{r['placement']}: {met} (attainment {r['attainment']:.3f} at {r['rate']:.2f} req/s, "
                   f"target {target:g})")
    for p, fit in fits.items():
        if fit is not None:
            typer.echo(f"{p}: workers ≈ {fit['k5']:.3f}·λ {fit['c5']:+.2f} (Eq. 7), R² {fit['r2']:.3f}")
