"""`fairgate simulate`: run a policy over a workload in virtual time."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from fairgate.cli.common import fail, parse_sets
from fairgate.sim.catalog import builtin_names


def simulate(workload: str = typer.Option(..., "--workload", help="A YAML file or a built-in: "
                                          f"{', '.join(builtin_names())}."),
             policy: str = typer.Option("vtc", "--policy", help="fcfs, rpm[:N], lcf, vtc, vtc-predict, "
                                        "vtc-oracle, vtc-range, wsc, fairserve, lpm, dlpm"),
             placement: str = typer.Option("least-load", "--placement", help="round-robin, least-load, "
                                           "jsq (least-load), power-of-two, client-round-robin, prefix, "
                                           "d2lpm, aladdin (gateway mode)"),
             sets: list[str] = typer.Option([], "--set", help="NAME=VALUE, a policy's or placement's parameter "
                                            "(quantum, window, client_quantum, ratio); repeatable."),
             backends: int = typer.Option(1, "--backends", help="Engines in the pool."),
             engine: str = typer.Option(None, "--engine", help="Engine profile (default: the workload's, "
                                        "else a10g-llama2-7b)."),
             mode: str = typer.Option("engine", "--mode", help="engine | gateway"),
             cost: str = typer.Option("weighted", "--cost", help="tokens | weighted | profile"),
             charge: str = typer.Option("admit", "--charge", help="wsc/fairserve: admit (expected cost at "
                                        "admission, settled at the finish) | finish (the paper's)"),
             kv_tokens: int = typer.Option(None, "--kv-tokens", help="Override the profile's KV capacity."),
             artifact_quirks: bool = typer.Option(False, "--artifact-quirks", help="Charge as the VTC artifact "
                                                  "does (free prefill token, double charge on finishing steps)."),
             sweep_spec: str = typer.Option(None, "--sweep", help="NAME=V1,V2,…: run once per value and draw "
                                            "the Pareto plot (throughput against Jain) beside the schedulers the "
                                            "parameter interpolates between, in --out."),
             as_json: bool = typer.Option(False, "--json", help="Print the metrics document."),
             out: Path = typer.Option(None, "--out", help="Write metrics.json and figures here.")):
    """Simulate a workload under a policy, with the same policy objects the gateway runs."""
    from rich.progress import Progress

    from fairgate.accounting.cost import make_cost
    from fairgate.sim import report
    from fairgate.sim.catalog import load
    from fairgate.engine.profiles import get_profile
    from fairgate.sim.setup import simulator_for
    from fairgate.sim.workload import WorkloadError

    params = parse_sets(sets)
    try:
        w = load(workload)
        profile = get_profile(engine or w.engine or "a10g-llama2-7b").with_overrides(kv_tokens=kv_tokens)
        cost_fn = make_cost(cost)
    except (WorkloadError, ValueError) as e:
        fail(str(e))

    def run(pol: str, plc: str, prm: dict[str, float]):
        started = time.monotonic()
        if not sys.stderr.isatty():  # no bar to draw (a log, CI): a line when a run starts and ends
            typer.echo(f"simulating {w.name} · {pol}/{plc} × {backends} ({mode}) {_params(prm)}…", err=True)
        with Progress(transient=True, disable=not sys.stderr.isatty()) as bar:
            task = bar.add_task(f"{w.name} · {pol}", total=1.0)
            try:  # a run releases later calls of programs into its workload: each run gets a fresh one
                sim = simulator_for(load(workload), pol, plc, profile, mode=mode, backends=backends, cost=cost_fn,
                                    charge=charge, params=prm, artifact_quirks=artifact_quirks,
                                    progress=lambda f: bar.update(task, completed=f))
            except (WorkloadError, ValueError) as e:
                fail(str(e))
            outcome = sim.run()
        if not sys.stderr.isatty():
            typer.echo(f"  done in {time.monotonic() - started:.1f} s", err=True)
        return outcome, report.build(outcome, pol, plc, cost_fn)

    if sweep_spec is not None:
        from fairgate.sim import sweep

        if out is None:
            fail("--sweep draws its plot in --out DIR")
        try:
            name, values = sweep.parse(sweep_spec)
        except ValueError as e:
            fail(str(e))
        result = sweep.sweep(name, values, policy, placement, params, lambda *a: run(*a)[1])
        for p in sweep.write(result, out, f"{w.name} · {policy}/{placement} × {backends}: {name}"):
            typer.echo(f"wrote {p}", err=True)
        sys.stdout.write(json.dumps(result) + "\n" if as_json else sweep.table(result) + "\n")
        return
    outcome, doc = run(policy, placement, params)
    if out is not None:
        for p in report.write(doc, outcome, cost_fn, out):
            typer.echo(f"wrote {p}", err=True)
    if as_json:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        f = doc["fairness"]
        typer.echo(f"{w.name} · {policy} · {mode} × {backends}: throughput {doc['throughput_tokens_per_s']:.0f} "
                   f"tok/s, makespan {doc['makespan_s']:.0f} s, max/avg diff {f['max_diff']:.1f} / "
                   f"{f['avg_diff']:.1f}, max |ΔW| {f['max_abs_cum_diff']:.0f}, Jain {f['jain']:.3f}")
        if "interactions" in doc:
            t, i, u = doc["throttled"], doc["interactions"], doc["users"]
            typer.echo(f"  interactions {i['completed']}/{i['total']} completed; throttled {t['interactions']} "
                       f"{t['by_reason']}; wasted {t['wasted_tokens']} tokens; users delayed "
                       f"{100 * u['delayed_share']:.1f} %; WSC spread among delayed {doc['wsc']['spread_delayed']:.2f}")


def _params(params: dict[str, float]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in params.items()) + (" " if params else "")
