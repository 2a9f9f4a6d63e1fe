"""`fairgate replay`: the usage log's requests through the simulator under other configurations, beside what
really happened (fairgate/sim/log_replay.py; docs/simulator/replay.md)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import typer

from fairgate.cli.common import TIME_HELP, fail, parse_sets, parse_time, with_db
from fairgate.printable import printable

MAX_ROWS = 5_000_000  # rows one replay reads (a day of a busy fleet is well within it)


def _tenants(db: str | None):
    """The database's tenants now (weights, limits, SLO classes), read once for the run."""
    from fairgate.proxy.control.tenants import Tenants

    async def read(sessions):
        tenants = Tenants(sessions, 60.0, None)
        await tenants.refresh()
        return tenants

    return with_db(db, read)


def _weights(path: Path | None, rows: list[dict[str, Any]], tenants) -> dict[str, float]:
    """Each tenant's weight: the file's (YAML or JSON: fairness key → weight), else the database's now."""
    from fairgate.sim.from_log import client_of

    if path is not None:
        import yaml

        try:
            given = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            fail(f"--weights {path}: {e}")
        if not isinstance(given, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  and 0 < v < math.inf for v in given.values()):
            fail("--weights holds a map of fairness key (user:app/name or app:name) to a positive weight")
        return {str(k): float(v) for k, v in given.items()}
    return {k: tenants.weight(k) for k in {client_of(r) for r in rows}}


def _bands(rows: list[dict[str, Any]], tenants) -> tuple[dict[str, int], dict[int, float]]:
    """Each tenant's priority band, by its app's SLO class in the database now, and the bands' minimum shares:
    as a gateway with those classes runs them (none while no class leaves the standard band or gives a share)."""
    from fairgate.accounting.slo import band_shares
    from fairgate.sim.from_log import client_of

    classes = tenants.slo_classes()
    if (shares := band_shares(classes.values())) is None:
        return {}, {}
    return {client_of(r): classes[r["app"]].rank for r in rows if r.get("app") in classes}, shares


def _limits(path: Path | None, tenants):
    """The apps' and users' limits to replay under: the file's (YAML or JSON: app:NAME or user:APP/NAME → its
    rpm, tpm, tpm_kind, concurrency, budget_tokens, budget_period), else the database's now (its money budgets
    left out, with a warning)."""
    from fairgate.sim.limits import LimitTable

    if path is not None:
        import yaml

        try:
            return LimitTable.parse(yaml.safe_load(path.read_text()))
        except (OSError, yaml.YAMLError, ValueError, TypeError) as e:
            fail(f"--limits {path}: {e}")
    quotas, rpm = tenants.quotas, tenants.request_limits()
    if money := sorted(t for t, q in quotas.items() if q.budget_usd is not None):
        typer.echo(f"warning: money budgets are not replayed ({', '.join(money[:5])}"
                   f"{', …' if len(money) > 5 else ''}): the replayed requests carry no model to price", err=True)
    return LimitTable({t: dataclasses.replace(q, budget_usd=None) for t, q in quotas.items()}, rpm)


def _profile(engine: str, params: dict[str, float]):
    """The engine profile with the ``--set`` values that name its fields, and the rest (the policy's and the
    placement's)."""
    from fairgate.engine.engine_profile import EngineProfile
    from fairgate.engine.profiles import get_profile

    fields = {f.name: f.type for f in dataclasses.fields(EngineProfile)}
    try:
        profile = get_profile(engine)
    except (KeyError, ValueError) as e:
        fail(f"--engine: {e}")
    profile = profile.with_overrides(**{k: int(v) if fields[k] in ("int", int) else v
                                        for k, v in params.items() if k in fields})
    return profile, {k: v for k, v in params.items() if k not in fields}


_LOG: list[dict[str, Any]] = []  # the rows, set before the workers fork: each inherits them, none is sent them


def _run(weights: dict[str, float], bands: tuple[dict[str, int], dict[int, float]], setup, engine: str,
         speed: float, params: dict[str, float], limits=None, epoch0: float = 0.0) -> dict[str, Any]:
    """One configuration (in a process of its own, forked with the log in ``_LOG``); ``limits`` met on the log's
    clock from ``epoch0``, its first served arrival; ``bands``: the tenants' priority bands and the bands' shares."""
    from fairgate.sim.from_log import log_slos, workload_from_log
    from fairgate.sim.log_replay import replay

    profile, sim_params = _profile(engine, params)
    w = workload_from_log(_LOG)
    w.weights, w.slos = weights, log_slos(_LOG)
    w.bands, w.min_shares = bands
    return replay(w, setup, profile, speed, params=sim_params, limits=limits, epoch0=epoch0).row()


def replay_command(
        since: str = typer.Option(None, "--since", help="The log from this time on. " + TIME_HELP),
        from_: str = typer.Option(None, "--from", help="Same as --since."),
        to: str = typer.Option(None, "--to", help="The log up to this time."),
        policies: list[str] = typer.Option([], "--policy", help="A policy to replay under (repeatable): fcfs, "
                                           "vtc, wsc, fairserve, dlpm, …; default: the one the log was recorded "
                                           "under."),
        placements: list[str] = typer.Option([], "--placement", help="A placement (repeatable; default "
                                             "least-load)."),
        backends: list[int] = typer.Option([], "--backends", help="Backends in the pool (repeatable; default: "
                                           "as many as served the log)."),
        engine: str = typer.Option("a10g-llama2-7b", "--engine", help="The backends' engine profile."),
        speed: str = typer.Option("fit", "--speed", help="How much faster than the profile the logged backends "
                                  "ran, or 'fit': fitted to the log (its requests' time from arrival to "
                                  "finish under the recorded policy)."),
        sets: list[str] = typer.Option([], "--set", help="NAME=VALUE, a parameter of the engine profile "
                                       "(kv_tokens, max_num_seqs, …), the policy or the placement (repeatable)."),
        weights_file: Path = typer.Option(None, "--weights", help="YAML or JSON: fairness key → weight "
                                          "(default: the database's weights now)."),
        limits_file: Path = typer.Option(None, "--limits", help="YAML or JSON: app:NAME or user:APP/NAME → its "
                                         "rpm, tpm, tpm_kind, concurrency, budget_tokens, budget_period "
                                         "(default: the database's limits now)."),
        max_wait: float = typer.Option(None, "--max-wait", help="With several --backends: the fewest that keep "
                                       "every tenant's p99 queue wait within this many seconds."),
        out: Path = typer.Option(None, "--out", help="Write replay.json, the figure and report.html here."),
        as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
        db: str = typer.Option(None, "--database-url", help="The usage log's database (default: the "
                                                            "gateway's)."),
):
    """Replay the usage log under other policies, placements and pool sizes, beside what really happened."""
    from rich.console import Console
    from rich.progress import Progress

    from fairgate.sim.from_log import served_rows as replayed_rows
    from fairgate.sim.from_log import when
    from fairgate.sim.log_replay import Setup, logged, summary
    from fairgate.sim.workload import WorkloadError
    from fairgate.storage.usage_queries import refused_interactions, served_rows

    fitted = False

    if since is not None and from_ is not None:
        fail("give one of --since and --from")
    start, end = parse_time(since or from_), parse_time(to)
    try:
        nominal = 1.0 if speed == "fit" else float(speed)
    except ValueError:
        nominal = 0.0
    if not 0 < nominal < 1e6:
        fail("--speed is a positive number, or fit")
    if any(not 1 <= n <= 4096 for n in backends):
        fail("--backends is between 1 and 4096")
    if max_wait is not None and not 0 <= max_wait < math.inf:
        fail("--max-wait is a number of seconds")
    params = parse_sets(sets)
    rows = with_db(db, lambda s: served_rows(s, start, end, limit=MAX_ROWS))
    refused = with_db(db, lambda s: refused_interactions(s, start, end))
    if len(rows) >= MAX_ROWS:
        typer.echo(f"warning: the window holds more than {MAX_ROWS:,} served requests: the first {MAX_ROWS:,} "
                   "are replayed (narrow it with --from and --to)", err=True)
    try:
        real = logged(rows)
    except WorkloadError as e:
        fail(str(e))
    by_policy = collections.Counter(r["policy"] for r in rows if r.get("policy"))
    recorded = by_policy.most_common(1)[0][0] if by_policy else "vtc"
    pool = len({r["backend"] for r in rows if r.get("backend")}) or 1
    setups = [Setup(p, pl, n) for p, pl, n in itertools.product(policies or [recorded], placements or ["least-load"],
                                                                  backends or [pool])]
    tenants = _tenants(db)
    weights = _weights(weights_file, rows, tenants)
    limits = _limits(limits_file, tenants) or None
    bands = _bands(rows, tenants)
    epoch0 = when(replayed_rows(rows)[0]["arrival"]).timestamp() if limits else 0.0  # (the log's first served)
    profile, sim_params = _profile(engine, params)
    if speed == "fit":
        from fairgate.sim.from_log import log_slos, workload_from_log
        from fairgate.sim.log_replay import fitted_speed

        slos = log_slos(rows)

        def fresh():
            w = workload_from_log(rows)
            w.weights, w.slos = weights, dict(slos)
            w.bands, w.min_shares = bands
            return w

        fitted = any(r.finished is not None for r in real)
        nominal = fitted_speed(real, fresh, Setup(recorded, "least-load", pool), profile, params=sim_params)
    results: dict[Setup, dict[str, Any]] = {}
    with Progress(transient=True, console=Console(stderr=True)) as progress:
        task = progress.add_task(f"replaying {len(real):,} requests under {len(setups)} configuration(s)",
                                 total=len(setups))
        _LOG[:] = rows
        with ProcessPoolExecutor(max_workers=min(len(setups), os.cpu_count() or 1),
                                 mp_context=multiprocessing.get_context("fork")) as ex:
            futures = {ex.submit(_run, weights, bands, s, engine, nominal, params, limits, epoch0): s for s in setups}
            happened = summary(f"what happened ({recorded})", real, weights).row()  # (while they run)
            for done in as_completed(futures):
                try:
                    results[futures[done]] = done.result()
                except (WorkloadError, ValueError, KeyError) as e:
                    fail(f"{futures[done].name}: {e}")
                progress.advance(task)
    doc = {"requests": len(real), "recorded_policy": recorded, "backends": pool, "engine": engine,
           "speed": round(nominal, 4), "speed_fitted": fitted,
           "real": happened | {"refused_interactions": refused},
           "replays": [results[s] for s in setups]}
    if max_wait is not None:
        from fairgate.sim.log_replay import fewest_backends

        doc["fewest_backends"] = fewest_backends([(s, results[s]) for s in setups], max_wait)
        doc["max_wait_s"] = max_wait
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_text(json.dumps(doc, indent=2))
        _plot(doc, out)
        (out / "report.html").write_text(_report(doc, (out / "replay.png").read_bytes()))
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    _print(doc)


def _attainment(run: dict[str, Any]) -> str:
    return "no SLO class" if run.get("slo_attainment") is None else f"{run['slo_attainment']:.1%}"


def _busiest(run: dict[str, Any]) -> str:
    shares = run.get("backend_shares") or []
    return f"{shares[0]:.1%} of {len(shares)}" if shares else "-"


def _gap(run: dict[str, Any]) -> str:
    return f"{run.get('max_diff', 0):,.0f} / {run.get('avg_diff', 0):,.0f}"


SUMS = (("service gap, max / mean (VTC's Max Diff)", _gap), ("SLO attainment (apps with a class)", _attainment),
        ("busiest backend's share of tokens", _busiest))


def _print(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    runs = [doc["real"], *doc["replays"]]
    console = Console()
    console.print(f"{doc['requests']:,} requests replayed ({doc['engine']} at {doc['speed']:g}× its speed"
                  f"{', fitted to the log' if doc['speed_fitted'] else ''}); service is "
                  "what each tenant received while requests arrived, in the policy's cost")
    table = Table(title="per tenant: service / p90 queue wait")
    table.add_column("tenant", overflow="fold")
    for run in runs:
        table.add_column(run["name"], justify="right", overflow="fold")
    for tenant in sorted(doc["real"]["tenants"]):
        table.add_row(Text(printable(tenant)), *(f"{run['tenants'].get(tenant, {}).get('service', 0):,.0f} / "
                                f"{run['tenants'].get(tenant, {}).get('p90_wait_s', 0):.2f} s" for run in runs))
    table.add_row("Jain (service over weight)", *(f"{run['jain']:.3f}" for run in runs), end_section=True)
    table.add_row("throughput, tokens/s", *(f"{run['throughput_tokens_per_s']:,.0f}" for run in runs))
    table.add_row("interactions refused", *(f"{run['refused_interactions']:,}" for run in runs))
    for label, value in SUMS:
        table.add_row(label, *(value(run) for run in runs))
    console.print(table)
    for key, n in doc.get("fewest_backends", {}).items():
        console.print(f"{key}: " + (f"{n} backends keep every tenant's p99 queue wait within "
                                    f"{doc['max_wait_s']:g} s" if n is not None else
                                    f"no pool replayed keeps every tenant's p99 queue wait within {doc['max_wait_s']:g} s"))


def _plot(doc: dict[str, Any], out: Path) -> None:
    """Per tenant, service and p90 wait under each configuration beside what happened."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [doc["real"], *doc["replays"]]
    tenants = sorted(doc["real"]["tenants"])[:20]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(runs)
    for k, run in enumerate(runs):
        xs = [i + k * width for i in range(len(tenants))]
        for ax, field in zip(axes, ("service", "p90_wait_s")):
            ax.bar(xs, [run["tenants"].get(t, {}).get(field, 0) for t in tenants], width, label=run["name"])
    for ax, title in zip(axes, ("service while requests arrived (policy's cost)", "p90 queue wait (s)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tenants))],
                      [printable(t).replace("$", r"\$") for t in tenants],  # (a name, never mathtext)
                      rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "replay.png", dpi=110)
    plt.close(fig)


def _report(doc: dict[str, Any], figure: bytes) -> str:
    """One self-contained HTML page (the figure inlined, no script) to attach to a ticket."""
    import base64
    from html import escape

    runs = [doc["real"], *doc["replays"]]
    head = "".join(f"<th>{escape(run['name'])}</th>" for run in runs)
    body = "".join(
        f"<tr><td>{escape(t)}</td>" + "".join(
            f"<td>{run['tenants'].get(t, {}).get('service', 0):,.0f} / "
            f"{run['tenants'].get(t, {}).get('p90_wait_s', 0):.2f} s</td>" for run in runs) + "</tr>"
        for t in sorted(doc["real"]["tenants"]))
    for label, key, fmt in (("Jain (service over weight)", "jain", "{:.3f}"),
                            ("throughput, tokens/s", "throughput_tokens_per_s", "{:,.0f}"),
                            ("interactions refused", "refused_interactions", "{:,}")):
        body += f"<tr class=sum><td>{label}</td>" + "".join(f"<td>{fmt.format(run[key])}</td>" for run in runs) + "</tr>"
    for label, value in SUMS:
        body += f"<tr class=sum><td>{escape(label)}</td>" + "".join(f"<td>{escape(value(run))}</td>" for run in runs) \
            + "</tr>"
    speed = f"{doc['speed']:g}× its speed" + (", fitted to the log" if doc["speed_fitted"] else "")
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>fairgate replay</title>
<style>body{{font:15px/1.45 system-ui,sans-serif;max-width:1100px;margin:24px auto;color:#1d2330}}
table{{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}}td,th{{padding:4px 8px;
border-bottom:1px solid #d9dde5;text-align:right}}td:first-child,th:first-child{{text-align:left}}
tr.sum td{{font-weight:600}}img{{max-width:100%}}</style></head><body>
<h1>fairgate replay</h1>
<p>{doc['requests']:,} requests of the usage log (recorded under {escape(doc['recorded_policy'])} on
{doc['backends']} backend(s)) replayed on {escape(doc['engine'])} at {escape(speed)}. Per tenant: the
service it received while requests arrived (the policy's cost) / its p90 queue wait.</p>
<table><thead><tr><th>tenant</th>{head}</tr></thead><tbody>{body}</tbody></table>
<p><img alt="service and p90 wait per tenant" src="data:image/png;base64,{base64.b64encode(figure).decode()}"></p>
</body></html>
"""
