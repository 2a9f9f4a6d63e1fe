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
                                              "jsq (least-load), power-of-two, client-round-robin, prefix, d2lpm, aladdin; "
                                              "repeatable; NAME:KEY=NUMBER,… sets its parameters (e.g. "
                                              "aladdin:pack=1,theta=0.5, the paper's best fit)."),
         policy: str = typer.Option("vtc", "--policy", help="The gateway's scheduling policy."),
         target: float = typer.Option(0.99, "--target", help="SLO attainment to reach (0 < T ≤ 1)."),
         rates: list[float] = typer.Option(None, "--rate", help="Rescale the workload's arrivals to R "
                                           "requests/s; repeatable (3 or more: Eq. 7's line is fitted)."),
         engine: str = typer.Option(None, "--engine", help="Engine profile (default: the workload's, else "
                                    "a10g-llama2-7b)."),
         tp: str = typer.Option(None, "--tp", help="MODEL@GPU (e.g. llama2-13b@v100-32gb): first choose the "
                                "GPUs per worker by Eq. 6, the per-GPU throughput of each tensor-parallel degree "
                                "for the workload's mean lengths at its ATGT target (--slo-atgt or its slo:; "
                                "without one, 1.3× each worker's own unbatched step, Table 2's rule), then plan "
                                "the workers of that degree."),
         max_workers: int = typer.Option(64, "--max-workers", help="Search no further."),
         as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
         out: str = typer.Option(None, "--out", help="Write plan.json and, over three rates or more, "
                                 "workers-vs-rate.png into this directory.")):
    """The fewest workers meeting the target SLO attainment, per placement (gateway-mode simulations: the
    workers doubled until it is met, then bisected)."""
    from fairgate.accounting.cost import make_cost
    from fairgate.sim.catalog import load
    from fairgate.sim.planner import Plan, fewest_workers, plot, rate_of, rescale, scaling, with_slo
    from fairgate.engine.profiles import get_profile
    from fairgate.sim.setup import simulator_for
    from fairgate.sim.targets import OVER_CONTEXT, Slo
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
    specs = {spec: _placement(spec) for spec in placements}
    slo = None
    if slo_ttft is not None or slo_atgt is not None:
        slo = Slo(slo_ttft if slo_ttft is not None else math.inf, slo_atgt if slo_atgt is not None else math.inf)

    if from_usage is not None:
        from fairgate.sim.from_log import workload_from_log
        from fairgate.storage.usage_queries import served_rows

        logged = with_db(db, lambda s: served_rows(s, parse_time(from_usage), parse_time(until)))  # (as replay)

    def fresh(rate: float | None = None):  # a run fills in its workload (and releases later calls into it):
        w = with_slo(load(workload) if workload is not None else workload_from_log(logged), slo)  # its own
        return rescale(w, rate) if rate is not None else w

    if tp is not None and engine is not None:
        fail("--tp chooses the engine: give one of --tp and --engine")
    try:
        first = fresh()
        chosen = _choose_degree(tp, first, as_json) if tp is not None else None
        profile = get_profile(chosen["engine"] if chosen else engine or first.engine or "a10g-llama2-7b")
        cost = make_cost("weighted")
    except (WorkloadError, ValueError) as e:
        fail(str(e))
    if first.slo is None and not first.slos:
        fail("no latency targets: give --slo-ttft and/or --slo-atgt, or an slo: in the workload")
    rows, runs, started, over = [], 0, time.monotonic(), {}
    for rate in rates or [None]:
        for placement in placements:
            def run(workers: int, placement=placement, rate=rate):
                nonlocal runs
                runs += 1
                typer.echo(f"  [{runs} runs, {time.monotonic() - started:.0f} s] {placement} × {workers}"
                           + (f" at {rate:g} req/s" if rate is not None else "") + " …", err=True)
                w = fresh(rate)
                name, params = specs[placement]
                simulator_for(w, policy, name, profile, mode="gateway", backends=workers, cost=cost,
                              params=params).run()
                over[placement, rate] = sum(r.throttle_reason == OVER_CONTEXT for r in w.requests if not r.cancelled)
                return w

            try:
                workers, attained = fewest_workers(run, target, max_workers)
            except (WorkloadError, ValueError) as e:
                fail(str(e))
            rows.append(Plan(placement, workers, attained, rate_of(fresh(rate)), profile.gpus).row()
                        | {"over_context": over[placement, rate]})  # (sent, and refused by the engine's context)
    fits = {p: scaling([(r["rate"], r["workers"]) for r in rows if r["placement"] == p and r["workers"]])
            for p in placements} if rates and len(rates) >= 3 else {}
    if refused := max((r["over_context"] for r in rows), default=0):
        typer.echo(f"warning: {refused} of the requests have prompts of {profile.max_model_len:,} tokens or more, "
                   f"the context of {profile.name}: refused as vLLM would, and not judged (--engine for "
                   "another)", err=True)
    doc = {"rows": rows, "scaling": fits, **({"tp": chosen} if chosen else {})}
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
        gpus = f", {r['gpus']} GPUs" if profile.gpus > 1 and r["workers"] is not None else ""
        typer.echo(f"{r['placement']}: {met}{gpus} (attainment {r['attainment']:.3f} at {r['rate']:.2f} req/s, "
                   f"target {target:g})")
    for p, fit in fits.items():
        if fit is not None:
            typer.echo(f"{p}: workers ≈ {fit['k5']:.3f}·λ {fit['c5']:+.2f} (Eq. 7), R² {fit['r2']:.3f}")


def _placement(spec: str) -> tuple[str, dict[str, float]]:
    """``NAME`` or ``NAME:KEY=NUMBER,…`` → the placement and its parameters (a bad one fails the command)."""
    from fairgate.policies.factory import PLACEMENT_PARAMS

    name, _, rest = spec.partition(":")
    name = name.strip()
    params: dict[str, float] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            eq = ""
        if not eq or not key.strip() or not math.isfinite(number):
            fail(f"--placement takes NAME or NAME:KEY=NUMBER,…, not {spec!r}")
        params[key.strip()] = number
    if unknown := set(params) - set(PLACEMENT_PARAMS.get(name, ())):
        fail(f"--placement {spec!r}: {name} has no parameter {', '.join(sorted(unknown))}")
    return name, params


def _choose_degree(spec: str, w, quiet: bool) -> dict:
    """Eq. 6 for ``spec`` (MODEL@GPU) over ``w``'s mean lengths, at the tightest ATGT target ``w`` is judged by
    (Table 2's rule if it has none): the table (on stderr under --json) and the chosen degree's engine."""
    import math

    from fairgate.sim.planner import mean_lengths
    from fairgate.engine.tensor_parallel import GPUS, MODELS, best_degree

    model_name, _, gpu_name = spec.partition("@")
    model, gpu = MODELS.get(model_name), GPUS.get(gpu_name)
    if model is None or gpu is None:
        raise ValueError(f"--tp takes MODEL@GPU with MODEL one of {', '.join(MODELS)} and GPU one of "
                         f"{', '.join(GPUS)}, not {spec!r}")
    mean_in, mean_out = mean_lengths(w)
    targets = [s.atgt_s for s in (w.slo, *w.slos.values()) if s is not None and math.isfinite(s.atgt_s)]
    atgt_s = min(targets) if targets else None
    rows, best = best_degree(model, gpu, atgt_s, mean_in, mean_out)
    rule = f"ATGT {atgt_s * 1000:g} ms" if atgt_s is not None else "ATGT 1.3× each worker's unbatched step"
    echo = (lambda line: typer.echo(line, err=True)) if quiet else typer.echo
    echo(f"{spec}, mean prompt {mean_in:.0f} and output {mean_out:.0f} tokens, {rule} (Eq. 6, tokens/s per GPU):")
    echo(f"{'GPUs':>5} {'KV tokens':>10} {'T_dec ms':>8} {'KV batch':>8} {'SLO batch':>9} {'KV-bound':>9} "
         f"{'SLO-bound':>9} {'T_max':>7}")
    for d in rows:
        echo(f"{d.tp:>5} {d.kv_tokens:>10,} {d.atgt_s * 1000:>8.1f} {d.kv_batch:>8.1f} {d.slo_batch:>9.1f} "
             f"{d.kv_bound:>9.0f} {d.slo_bound:>9.0f} {d.per_gpu:>7.0f}" + ("  ←" if d is best else ""))
    if best is None:
        raise ValueError(f"no tensor-parallel degree of {spec} serves {rule}")
    return {"engine": f"{spec}:tp{best.tp}", "gpus_per_worker": best.tp, "mean_in": mean_in, "mean_out": mean_out,
            "degrees": [{"gpus": d.tp, "kv_tokens": d.kv_tokens, "atgt_s": d.atgt_s, "kv_batch": d.kv_batch,
                         "slo_batch": d.slo_batch, "kv_bound": d.kv_bound, "slo_bound": d.slo_bound,
                         "per_gpu": d.per_gpu} for d in rows]}
