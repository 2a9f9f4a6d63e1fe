"""`fairgate admin fairserve …` and `fairgate admin stats …`: FairServe's settings, applied live by running
gateways (each change audited), and the per-(app, stage) token statistics with suggested limits."""

from __future__ import annotations

import time

import typer

from fairgate.cli.common import (ActorOption, DatabaseOption, JsonOption, emit, fail, parse_time, run_admin,
                                 with_db)
from fairgate.cli.live import ConfigOption, show, unset
from fairgate.proxy.control.settings import FAIRSERVE_SETTINGS
from fairgate.storage.identity import Admin

fairserve = typer.Typer(help="FairServe (wsc, fairserve): token weights, E_i, limits, overload.",
                        no_args_is_help=True)
stats = typer.Typer(help="Per-(app, stage) token statistics and suggested limits.", invoke_without_command=True)


@fairserve.command("set")
def fairserve_set(alpha: float = typer.Option(None, "--alpha", help="Weight of input tokens (α)."),
                  beta: float = typer.Option(None, "--beta", help="Weight of system-prompt tokens (β)."),
                  gamma: float = typer.Option(None, "--gamma", help="Weight of output tokens (γ)."),
                  user_rpm: int = typer.Option(None, "--user-rpm", help="T_user: requests per window for users "
                                               "without a limit of their own."),
                  kv_threshold: float = typer.Option(None, "--kv-threshold", help="Overload: pool KV load (0-1]."),
                  queue_threshold: int = typer.Option(None, "--queue-threshold", help="Overload: requests waiting "
                                                      "for headroom (0 disables this signal)."),
                  charge: str = typer.Option(None, "--charge", help="admit | finish"),
                  user: str = typer.Option(None, "--user", help="With --e: that user's priority factor."),
                  e: float = typer.Option(None, "--e", help="E_i of --user: its charge multiplier (< 1 favours "
                                          "it); stored as the user's weight 1/E."),
                  json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Change FairServe's settings; running gateways apply them within seconds."""
    given = {"alpha": alpha, "beta": beta, "gamma": gamma, "user_rpm": user_rpm, "kv_threshold": kv_threshold,
             "queue_threshold": queue_threshold, "charge": charge}
    given = {k: v for k, v in given.items() if v is not None}
    if any(given.get(k, 0) < 0 for k in ("alpha", "beta", "gamma", "user_rpm", "queue_threshold")):
        fail("alpha, beta, gamma, --user-rpm and --queue-threshold must be ≥ 0")
    if kv_threshold is not None and not 0 < kv_threshold <= 1:
        fail("--kv-threshold is a fraction in (0, 1]")
    if charge is not None and charge not in ("admit", "finish"):
        fail("--charge is admit or finish")
    if (user is None) != (e is None):
        fail("give --user and --e together")
    if e is not None and e <= 0:
        fail("--e must be positive")
    if not given and e is None:
        fail("nothing to set")

    async def run(admin: Admin):
        out = {}
        if e is not None:  # first: an unknown user changes nothing
            row = await admin.set_field("user", user, "weight", 1.0 / e)
            out.update(user=row["name"], e=e, weight=row["weight"])
        for k, v in given.items():
            await admin.set_setting(f"fairserve.{k}", str(v))
            out[k] = v
        return out

    emit(run_admin(db, actor, run), json_)


@fairserve.command("show")
def fairserve_show(config: str = ConfigOption, json_: bool = JsonOption, db: str = DatabaseOption):
    """FairServe's settings in force, and where each comes from (default, file, environment, database)."""
    show(("policy", *(f"fairserve.{k}" for k in FAIRSERVE_SETTINGS)), config, db, json_, "FairServe")


@fairserve.command("unset")
def fairserve_unset(fields: list[str] = typer.Argument(None, help=f"Of {', '.join(FAIRSERVE_SETTINGS)}; none: "
                                                       "all of them."),
                    json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Remove settings made with `fairserve set`: running gateways return to their configured values."""
    unset(fields, {k: f"fairserve.{k}" for k in FAIRSERVE_SETTINGS}, "FairServe", db, actor, json_)


@stats.callback()
def stats_show(ctx: typer.Context, since: str = typer.Option("7d", "--since", help="Rate history from here."),
               quantile: float = typer.Option(0.99, "--quantile", help="Of normal per-minute counts."),
               json_: bool = JsonOption, db: str = DatabaseOption):
    """Expected input/system/output tokens per (app, stage) (the last snapshot), and the limits the usage
    log's request rates suggest."""
    if ctx.invoked_subcommand is not None:
        return
    from fairgate.storage import app_stats_store

    if not 0 < quantile < 1:
        fail("--quantile is in (0, 1)")
    doc = with_db(db, lambda sessions: app_stats_store.report(sessions, parse_time(since), quantile))
    if json_:
        emit(doc, True)
        return
    emit(doc["stats"], False, ["app", "stage", "samples", "input_mean", "system_mean", "output_mean",
                               "input_p95", "output_p95"], title="expected tokens per (app, stage)")
    s = doc["suggested"]
    emit([{"limit": "user (T_user)", "rpm": s["user_rpm"]}]
         + [{"limit": f"app {a}", "rpm": n} for a, n in sorted(s["app_rpm"].items())], False,
         title=f"suggested limits (p{100 * quantile:g} of normal minutes; users over: {len(s['users_over'])})")


@stats.command("rebuild")
def stats_rebuild(since: str = typer.Option(..., "--since", help="Recompute from the usage log from here."),
                  json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Recompute the statistics from the usage log's finished calls; running gateways reload them."""
    from fairgate.accounting.app_stats import AppStats
    from fairgate.proxy.control.fairserve import GENERATION
    from fairgate.storage import app_stats_store

    async def run(sessions):
        st = AppStats()
        n = await app_stats_store.rebuild(sessions, st, parse_time(since))
        await Admin(sessions, actor).set_setting(GENERATION, str(time.time()))
        return {"calls": n, "entries": len(st.entries)}

    emit(with_db(db, run), json_)
